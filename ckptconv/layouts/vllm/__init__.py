"""vLLM's pre-sharded layout (`reshard --target vllm`), all of it in this package: a reshard output
(layouts/mesh: rank directories, mesh.json, manifests, SHA256SUMS, so verify and the mesh reader
work on it) whose top level is also what vLLM's `load_format="sharded_state"` reads: each rank's
shard files as `model-rank-{r}-part-{p}.safetensors` and the model files (config.json, generation
config, tokenizer). The rank files are hard links to the rank directories' shards: the same bytes,
written once. The tensors are vLLM's own (names.py), the recipe's last step; what verify checks at
the top is check.py; the `vllm` preset splits such an output again. Layout: docs/reshard.md#vllm.
"""
from dataclasses import dataclass, field

from ...errors import BadInput, UsageError, brief
from ...formats import mesh as fmt
from ...tp.presets import STATED, MeshSpec, model_params, preset, stated
from ...tp.rules import RuleSet, read_config
from ..base import ResultError, RunFacts, is_digest, register
from ..files import Written, copy_files
from ...storage import files as storage
from ...storage.targets import as_target
from ..mesh import MeshDirectory
from ..mesh.write import MeshResult
from . import check
from .names import MODEL_TYPES, TARGET, check_model_type, part_name, to_vllm, vllm_rules


def _links(shards: dict) -> dict:
    """{vLLM's name for each rank shard (a link to it): its digest} of a result's `shards`."""
    return {part_name(rank, part): digest for rank, files in shards.items() for part, (_, digest) in enumerate(files)}


@preset(TARGET)
def vllm_names(cfg: dict) -> RuleSet:
    """vLLM's own tensor names (a `reshard --target vllm` output, resharded again): fused qkv and
    gate_up, stacked experts (names.py)."""
    return vllm_rules(cfg)


@dataclass
class VllmResult(MeshResult):
    """A mesh result and the top-level links this process made to its rank shards, name -> sha256."""

    linked: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**super().to_json(), "linked": self.linked}

    @classmethod
    def from_json(cls, data) -> "VllmResult":
        base = MeshResult.from_json(data)
        linked = data.get("linked")
        if not (isinstance(linked, dict) and all(isinstance(n, str) and is_digest(d) for n, d in linked.items())):
            raise ResultError("its links are not name: sha256")
        return cls(base.global_digests, base.global_at, base.shards, linked)


@register(TARGET)
class VllmDirectory(MeshDirectory):
    Result = VllmResult
    order = 21
    records_target = True
    target = ("a mesh output whose top level is also vLLM's load_format=\"sharded_state\" "
              "(model-rank-R-part-P.safetensors with vLLM's own tensor names; docs/reshard.md#vllm)")

    @classmethod
    def detect(cls, path) -> bool:
        return False   # (found as a mesh output: its mesh.json's target names this layout, mesh/check.py)

    @classmethod
    def engine(cls, ckpt, spec: MeshSpec) -> tuple:
        """(what the output records of the target, as the recipe applies it: vLLM's global tensors;
        the rules that split them)."""
        if spec.ep > 1:
            raise UsageError("--target vllm with --ep: vLLM's expert-parallel layout is not written; vLLM's "
                             "pre-sharded files hold every expert on every tp rank (use --tp only)")
        if spec.rules_file or spec.preset or spec.pad_vocab:
            raise UsageError("--target vllm: the layout is vLLM's own (it pads the vocabulary itself); --rules, "
                             "--preset and --pad-vocab do not apply")
        config = read_config(ckpt.model_files, ckpt.made) or {}
        model_type = check_model_type(config)
        params = model_params(config, {k: v for k, v in spec.heads.items() if v})
        missing = [k for k in ("heads", "kv_heads", "head_dim") if k not in params]
        if missing:
            raise UsageError(f"--target vllm: config.json lacks {', '.join(missing)} (give --heads/--kv-heads/"
                             "--head-dim)")
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise BadInput(f"config.json: tie_word_embeddings must be true or false, not {brief(tied, 60)}")
        params = {k: params[k] for k in ("heads", "kv_heads", "head_dim")}
        layers = config.get("num_hidden_layers")
        if type(layers) is int and layers > 0:
            params["layers"] = layers   # (vLLM builds that many: every one must be here, names._check_layers)
        return {"engine": TARGET, "model_type": model_type, "tied": tied, "params": params}, vllm_rules(params)

    @classmethod
    def accepts_target(cls, record) -> bool:
        params = record.get("params") if isinstance(record, dict) else None
        return (isinstance(record, dict) and record.get("engine") == TARGET
                and record.get("model_type") in MODEL_TYPES and isinstance(record.get("tied"), bool)
                and isinstance(params, dict) and all(type(params.get(k)) is int and params[k] > 0
                                                     for k in ("heads", "kv_heads", "head_dim"))
                and (params.get("layers") is None or (type(params["layers"]) is int and params["layers"] > 0)))

    @classmethod
    def to_target(cls, tensors, record) -> list:
        return to_vllm(tensors, record["model_type"], record["tied"], record["params"])

    @classmethod
    def target_differences(cls, ckpt, record) -> list:
        """The target as `engine` makes it from the source's config.json today, compared field by
        field: the model type, tied embeddings, the layer count, and each head count config.json
        states itself (one --heads/--kv-heads/--head-dim supplied, or derived, is the record's)."""
        config = read_config(ckpt.model_files, ckpt.made) or {}
        flags = {k: record["params"][k] for k in ("heads", "kv_heads", "head_dim")}
        try:
            fresh, _ = cls.engine(ckpt, MeshSpec(tp=1, heads=flags))
        except (UsageError, BadInput) as e:
            return [f"the recorded target {brief(record, 120)} cannot be made from the source: {e}"]
        out = [f"target {key} is {brief(record.get(key), 60)}, the source gives {brief(fresh[key], 60)}"
               for key in ("model_type", "tied") if record.get(key) != fresh[key]]
        for key in STATED:
            theirs, ours = stated(config, key), record["params"].get(key)
            if theirs is not None and ours != theirs:
                out.append(f"target params.{key} is {brief(ours, 60)}, the source's config.json gives {theirs}")
        return out

    @classmethod
    def top_parts(cls, path, ranks: int) -> dict | None:
        return check.top_parts(storage.place(path), ranks)

    @classmethod
    def check_top(cls, path, parts: dict, entries: dict, sums: dict, report):
        check.check_top(storage.place(path), parts, entries, sums, report)

    def write(self, units, tmp, progress=None, share=(0, 1)):
        done = super().write(units, tmp, progress, share)
        target = as_target(tmp)
        for rank, shards in done.shards.items():
            for part, (name, digest) in enumerate(shards):   # (hard links; copies made by the store in one)
                target.link(f"{fmt.rank_dir(rank)}/{name}", part_name(rank, part))
        return VllmResult(done.global_digests, done.global_at, done.shards, _links(done.shards))

    def accepts(self, result, units, tmp) -> str | None:
        """(see MeshDirectory.accepts) and its links are its rank shards', named as vLLM names them."""
        why = super().accepts(result, units, tmp)
        if why is None and result.linked != _links(result.shards):
            return "its links are not its rank shards'"
        return why

    def known_digests(self, results) -> dict:
        """The links are the rank shards, hashed as they were written: SHA256SUMS lists them without
        reading 2 x the model again; the model files, hashed as they were copied."""
        return {**{name: digest for r in results for name, digest in r.linked.items()},
                **{name: info["sha256"] for name, info in self._top.files.items()}}

    def finish(self, tmp, results) -> RunFacts:
        self._top = Written()
        copy_files(tmp, self.content.model_files, self._top, self.content.edited, self.content.added)
        return super().finish(tmp, results)
