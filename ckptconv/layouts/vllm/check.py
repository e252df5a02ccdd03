"""What vLLM reads at the top of a `--target vllm` output, checked against the rank directories: the
parts it loads are the ranks' shards (the very bytes, by digest), and the model files rank 0's."""
from pathlib import Path

from ...errors import BadInput
from ...formats.manifest import INDEX_SUFFIX
from ...formats.mesh import MESH, rank_dir, rank_number
from ..scan import _checked_manifest
from .names import PART, part_name


def top_parts(path: Path, ranks: int):
    """{`model-rank-R-part-P.safetensors`: (rank R's shard P, its digest in rank R's manifest)} of a
    --target vllm output; None when a rank's manifest cannot be read (reported with its directory)."""
    expected = {}
    for r in range(ranks):
        try:
            files = _checked_manifest(path / rank_dir(r)).get("files", {})
        except (BadInput, OSError):
            return None
        if not isinstance(files, dict):
            return None
        shards = sorted(n for n in files if n.endswith(".safetensors"))
        expected.update({part_name(r, p): (f"{rank_dir(r)}/{n}", (files[n] or {}).get("sha256")
                                                if isinstance(files[n], dict) else None)
                         for p, n in enumerate(shards)})
    return expected


def check_top(path: Path, expected: dict, entries: dict, sums: dict, report):
    """What vLLM reads at the top of a --target vllm output is what the rank directories hold: each
    `model-rank-R-part-P.safetensors` is rank R's shard P (its digest in SHA256SUMS is the one rank R's
    manifest records), parts 0..n-1 and no others, and the model files are rank 0's."""
    try:
        rank0 = _checked_manifest(path / rank_dir(0)).get("files", {})
    except (BadInput, OSError):
        return
    rank0 = rank0 if isinstance(rank0, dict) else {}
    for name in sorted(rank0):   # (vLLM reads config.json and the tokenizer beside the parts)
        if not name.endswith((".safetensors", INDEX_SUFFIX)) and name not in sums and name not in entries:
            report.add(path / name, f"is missing (vLLM reads it beside the parts: it is {rank_dir(0)}/{name})",
                       "missing")
    for name in sorted(entries):
        if PART.fullmatch(name) and name not in expected:
            report.add(path / name, "is not a part of any rank's shards", "unlisted")
    for name, (shard, digest) in expected.items():
        if name not in entries:
            report.add(path / name, f"is missing (vLLM loads it: it is {shard})", "missing")
        elif sums.get(name) != digest:
            report.add(path / name, f"differs from {shard}, which it must be", "digest")
    for name in sorted(sums):
        if name in rank0 and not name.endswith(".safetensors") and isinstance(rank0[name], dict) \
                and sums[name] != rank0[name].get("sha256"):
            report.add(path / name, f"differs from {rank_dir(0)}/{name}", "digest")
        elif name != MESH and name not in expected and name not in rank0 and rank_number(name) is None:
            report.add(path / name, f"is listed in SHA256SUMS, but is neither a part vLLM loads nor a model file of "
                                    f"{rank_dir(0)}", "unlisted")
