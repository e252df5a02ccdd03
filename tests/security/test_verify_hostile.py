"""verify against hostile outputs: whatever an output's files say, verify answers with problem lines
(exit 1) or one error line (exit 2), never a crash, never reads outside OUT, never follows a link or
blocks on a FIFO, and never lets a count from a file decide how much memory or time it takes.

Every case starts from a real output (convert / reshard of a torch.save checkpoint, by the CLI) and
tampers with it; a "careful forger" case re-signs what it touched so only the check under test can
catch it."""
import hashlib
import json
import os
import shutil
import struct
import subprocess

import pytest
import torch

from ckptconv.formats.sums import format_sums, parse_sums, unsafe_name
from ckptconv.jobs.verify import total_bytes
from tests.helpers import run
from tests.helpers import assert_clean as clean, assert_refused, cli

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """A small Llama-shaped torch.save checkpoint (GQA, so `ranges` appear), converted to several
    shards and resharded for tp 2."""
    d = tmp_path_factory.mktemp("hostile")
    src = d / "src"
    src.mkdir()
    torch.manual_seed(0)
    heads, kv, hd, vocab, inter = 4, 2, 4, 32, 24
    dim = heads * hd
    state = {"model.embed_tokens.weight": torch.randn(vocab, dim), "lm_head.weight": torch.randn(vocab, dim),
             "model.norm.weight": torch.randn(dim)}
    p = "model.layers.0."
    state.update({p + "self_attn.q_proj.weight": torch.randn(heads * hd, dim),
                  p + "self_attn.k_proj.weight": torch.randn(kv * hd, dim),
                  p + "self_attn.v_proj.weight": torch.randn(kv * hd, dim),
                  p + "self_attn.o_proj.weight": torch.randn(dim, heads * hd),
                  p + "mlp.gate_proj.weight": torch.randn(inter, dim),
                  p + "mlp.up_proj.weight": torch.randn(inter, dim),
                  p + "mlp.down_proj.weight": torch.randn(dim, inter),
                  p + "input_layernorm.weight": torch.randn(dim)})
    torch.save(state, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": heads,
                                                 "num_key_value_heads": kv, "head_dim": hd, "hidden_size": dim}))
    r = run("convert", src, d / "conv", "--max-shard-size", "2KB", "--quiet")
    assert r.exit_code == 0, r.stderr
    r = run("reshard", src, d / "tp2", "--tp", "2", "--quiet")
    assert r.exit_code == 0, r.stderr
    r = run("reshard", src, d / "tp2-sharded", "--tp", "2", "--max-shard-size", "1KB", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert len(list((d / "conv").glob("*.safetensors"))) > 2
    assert not (d / "tp2" / "rank-00000" / INDEX).exists() and (d / "tp2-sharded" / "rank-00000" / INDEX).exists()
    return d


@pytest.fixture
def copy(outputs, tmp_path):
    def make(name):
        shutil.copytree(outputs / name, tmp_path / name, symlinks=True)
        return tmp_path / name
    return make


def verify(out, *args):
    """(exit status, stdout lines, stderr) of an in-process `ckptconv verify`."""
    r = run("verify", out, *args)
    clean(r.stdout + r.stderr)
    if r.exit_code == 2:
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("ckptconv: error: "), r.stderr
    return r.exit_code, r.stdout.splitlines(), r.stderr


def problem(lines, *parts):
    """The one report line holding every part."""
    hits = [line for line in lines if all(p in line for p in parts)]
    assert hits, (parts, lines)
    return hits[0]


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sign_top(out):
    """Re-sign a reshard output's top level (as a careful forger would after editing mesh.json)."""
    names = [p.name for p in out.iterdir() if p.is_file() and not p.is_symlink() and p.name != "SHA256SUMS"]
    (out / "SHA256SUMS").write_bytes(format_sums({n: sha(out / n) for n in names}))


class Whole:
    """An edit's result that replaces the whole document (other results, e.g. of dict.pop, are ignored)."""

    def __init__(self, value):
        self.value = value


def edit_json(path, change):
    obj = json.loads(path.read_text())
    result = change(obj)
    obj = result.value if isinstance(result, Whole) else obj
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def edit_mesh(out, change, sign=True):
    edit_json(out / "mesh.json", change)
    if sign:
        sign_top(out)


def sign_sums(out):
    """Rewrite an output dir's SHA256SUMS over its regular files."""
    names = [p.name for p in out.iterdir() if p.is_file() and not p.is_symlink() and p.name != "SHA256SUMS"]
    (out / "SHA256SUMS").write_bytes(format_sums({n: sha(out / n) for n in names}))


def resign_dir(out):
    """Recompute an output dir's manifest file digests and SHA256SUMS after an edit."""
    manifest = json.loads((out / "manifest.json").read_text())
    for f, info in manifest["files"].items():
        info.update(sha256=sha(out / f), size=(out / f).stat().st_size)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    sign_sums(out)


def shards(out):
    return sorted(out.glob("model*.safetensors"))


def verify_subprocess(out, tmp_path, *args, timeout=120):
    """`ckptconv verify` in a fresh process capped at 1.5 GB of address space, recording every file
    Python opens (audit hook). Returns (exit status, stdout lines, stderr, opened paths)."""
    r = cli("verify", out, "--quiet", *args, timeout=timeout)
    clean(r.stdout + r.stderr)
    return r.returncode, r.stdout.splitlines(), r.stderr, r.opened


# ------------------------------------------------------------------------------------------------
# SHA256SUMS, the format


def test_sha256sums_format_and_parser():
    data = format_sums({"b.json": "1" * 64, "a.safetensors": "f" * 64})
    assert data == f"{'f' * 64}  a.safetensors\n{'1' * 64}  b.json\n".encode()  # what writer.py writes
    assert parse_sums(data) == ({"a.safetensors": "f" * 64, "b.json": "1" * 64}, [])
    sums, problems = parse_sums(b"%s  ../x\n%s  /etc/passwd\n%s  ok\n%s  ok\nnot a line\n%s  a\x00b\n%s  tail"
                                % ((b"0" * 64,) * 4 + (b"1" * 64,) * 2))
    assert sums == {"ok": "0" * 64, "tail": "1" * 64}
    assert len(problems) == 6 and "does not end with a newline" in problems[0]
    for bad in ("../x", "/etc/passwd", "a/b", "..", ".", "", "a\nb", "a\x00b", "a\x7fb", 5, None):
        assert unsafe_name(bad) is not None, bad
    # no file has a name over 255 bytes: refused before anything else looks at it (an index naming a
    # 150 MB "shard" took 13 s of character-by-character checks)
    assert unsafe_name("x" * 255) is None and unsafe_name("\u00e9" * 127) is None
    for long in ("x" * 256, "\u00e9" * 128, "\udcff" * 86, "/" + "x" * 10**7):
        assert unsafe_name(long) == "longer than the 255 bytes of a file name"
    with pytest.raises(Exception, match="cannot be listed"):
        format_sums({"../x": "0" * 64})


# ------------------------------------------------------------------------------------------------
# (a) the top level of a reshard output is covered by SHA256SUMS and accounted for


def test_reshard_output_has_a_top_level_sha256sums(outputs):
    out = outputs / "tp2"
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "mesh.json", "rank-00000", "rank-00001"]
    sums, problems = parse_sums((out / "SHA256SUMS").read_bytes())
    assert not problems and sums == {"mesh.json": sha(out / "mesh.json")}
    for d in (out, out / "rank-00000", out / "rank-00001"):
        subprocess.run(["sha256sum", "--quiet", "--strict", "-c", "SHA256SUMS"], cwd=d, check=True)
    code, lines, _ = verify(out)
    assert code == 0 and lines[-1].endswith("OK: 2 shard files, 22 tensors, 14.16 KB hashed"), lines


def test_emptied_mesh_and_overwritten_headers_are_caught(copy):
    out = copy("tp2")
    edit_mesh(out, lambda m: m.update(ranks=0, tensors={}), sign=False)
    for shard in shards(out / "rank-00000"):
        data = bytearray(shard.read_bytes())
        data[8:24] = b"X" * 16
        shard.write_bytes(bytes(data))
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "mesh.json: sha256 differs from SHA256SUMS")
    problem(lines, "mesh.json", "'ranks' must be a whole number of at least 1, not 0")
    problem(lines, "rank-00000/model.safetensors", "not valid JSON")
    sign_top(out)  # a careful forger: ranks 0 is still refused, and the shards still fail
    code, lines, _ = verify(out)
    assert code == 1 and not any("SHA256SUMS" in line for line in lines)
    problem(lines, "'ranks' must be a whole number")


def test_top_level_sha256sums_is_required_and_checked(copy):
    out = copy("tp2")
    (out / "SHA256SUMS").unlink()
    code, lines, _ = verify(out)
    assert code == 1 and problem(lines, "SHA256SUMS: SHA256SUMS is missing")
    (out / "SHA256SUMS").write_bytes(format_sums({}))
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "SHA256SUMS: does not list mesh.json")
    problem(lines, "mesh.json: file is not listed in SHA256SUMS")
    sign_top(out)
    edit_mesh(out, lambda m: m["tensors"]["model.norm.weight"].update(rule="anything"), sign=False)
    code, lines, _ = verify(out)
    assert lines[:-1] == [f"{out / 'mesh.json'}: sha256 differs from SHA256SUMS"] and code == 1


def test_tensor_dropped_from_or_added_to_mesh_json(copy):
    out = copy("tp2")
    edit_mesh(out, lambda m: m["tensors"].pop("model.norm.weight"))
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "mesh.json: tensor 'model.norm.weight' is on ranks [0, 1] but not in mesh.json")
    edit_mesh(out, lambda m: m["tensors"].update({"model.ghost.weight": {
        "shape": [4], "dtype": "F32", "axis": None, "rule": "replicate", "sha256": "0" * 64}}))
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "tensor 'model.ghost.weight' is in mesh.json but in no rank directory")


def test_pieces_where_mesh_json_does_not_put_them(copy):
    out = copy("tp2")  # k_proj: 2 kv heads over 2 ranks; say rank 1 holds nothing
    name = "model.layers.0.self_attn.k_proj.weight"
    edit_mesh(out, lambda m: m["tensors"][name].update(ranges=[[[0, 8]], []]))
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, f"tensor {name!r} has pieces on ranks [0, 1], mesh.json puts them on ranks [0]")


def test_rank_directories_must_be_exactly_those_of_mesh_json(copy, tmp_path):
    out = copy("tp2")
    shutil.copytree(out / "rank-00001", out / "rank-00002")
    code, lines, _ = verify(out)
    assert code == 1 and problem(lines, "mesh.json says 2 ranks", "holds 3 rank directories")
    shutil.rmtree(out / "rank-00002")
    shutil.rmtree(out / "rank-00001")
    code, lines, _ = verify(out)
    assert code == 1 and problem(lines, "mesh.json says 2 ranks", "holds 1 rank directories")
    shutil.copytree(out / "rank-00000", out / "rank-00005")
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "rank-00005: rank directory beyond the 2 ranks of mesh.json")
    problem(lines, "rank-00001: rank directory is missing")
    # and the reader that convert/reshard use refuses it too, with one line
    r = run("convert", out, tmp_path / "again", "--quiet")
    assert r.exit_code == 2 and "rank directories are not rank-00000 to rank-00001" in r.stderr
    clean(r.stderr)


def test_nothing_unaccounted_at_the_top_of_a_reshard_output(copy, tmp_path):
    out = copy("tp2")
    (out / "notes.txt").write_text("hi\n")
    (out / "extra").mkdir()
    (out / "rank-0001").mkdir()  # not the rank-XXXXX spelling
    os.symlink(out / "rank-00001", out / "rank-00003")
    os.symlink(tmp_path, out / "elsewhere")
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "notes.txt: file is not listed in SHA256SUMS")
    problem(lines, "extra: is a directory")
    problem(lines, "rank-0001: is a directory")
    problem(lines, "rank-00003: is a symbolic link", "not followed")
    problem(lines, "elsewhere: is a symbolic link")
    sign_top(out)  # notes.txt listed now: still no file a reshard writes there (issue 28)
    code, lines, _ = verify(out)
    problem(lines, "notes.txt: is listed in SHA256SUMS, but reshard writes no such file here")
    problem(lines, "extra: is a directory")


# ------------------------------------------------------------------------------------------------
# (b) names in metadata never lead outside OUT; only regular files are opened


def test_sha256sums_lines_pointing_outside_are_problems_and_never_opened(copy, tmp_path):
    out = copy("conv")
    secret = tmp_path / "secret.txt"
    secret.write_text("the password\n")
    with open(out / "SHA256SUMS", "a") as f:
        f.write(f"{sha(secret)}  ../secret.txt\n{sha(secret)}  {secret}\n")
    code, lines, _, opened = verify_subprocess(out, tmp_path)
    assert code == 1
    problem(lines, "SHA256SUMS: line", "'../secret.txt'", "not a plain file name", "not opened")
    problem(lines, "SHA256SUMS: line", repr(str(secret)), "an absolute path")
    assert str(secret) not in opened and any(p.endswith("SHA256SUMS") for p in opened)


def test_index_and_manifest_paths_pointing_outside_are_never_opened(copy, tmp_path):
    out = copy("conv")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(shards(out)[0], outside)
    name = next(iter(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]))
    edit_json(out / "model.safetensors.index.json", lambda i: i["weight_map"].update({name: str(outside)}))

    def manifest(m):
        m["files"]["../outside.safetensors"] = {"sha256": sha(outside), "size": outside.stat().st_size}
        m["tensors"][name]["file"] = "../outside.safetensors"
    edit_json(out / "manifest.json", manifest)
    resign_dir(out)
    code, lines, _, opened = verify_subprocess(out, tmp_path)
    assert code == 1
    problem(lines, "model.safetensors.index.json", f"tensor {name!r} is listed in", "an absolute path", "not opened")
    problem(lines, "manifest.json: files lists '../outside.safetensors'", "not opened")
    problem(lines, f"manifest.json: tensor {name!r}: file '../outside.safetensors' is not a plain file name")
    assert str(outside) not in opened


def test_proc_pagemap_in_sha256sums_does_not_hang(copy, tmp_path):
    out = copy("conv")
    with open(out / "SHA256SUMS", "a") as f:
        f.write(f"{'0' * 64}  /proc/self/pagemap\n")
    code, lines, _, opened = verify_subprocess(out, tmp_path, timeout=60)
    assert code == 1 and problem(lines, "'/proc/self/pagemap'", "an absolute path", "not opened")
    assert "/proc/self/pagemap" not in opened


def test_symlinks_fifos_and_devices_are_not_followed_or_opened(copy, tmp_path):
    out = copy("conv")
    shard = shards(out)[1]
    outside = tmp_path / "outside.safetensors"
    shutil.move(shard, outside)
    os.symlink(outside, shard)  # byte for byte what was there, but a link
    os.remove(out / "config.json")
    os.mkfifo(out / "config.json")  # a FIFO would block a reader forever
    os.symlink("/dev/zero", out / "zeros.safetensors")
    code, lines, _, opened = verify_subprocess(out, tmp_path, timeout=60)
    assert code == 1
    problem(lines, f"{shard}: is a symbolic link", "not followed")
    problem(lines, "config.json: is a FIFO")
    problem(lines, "zeros.safetensors: is a symbolic link")
    assert not {str(outside), str(shard), str(out / "config.json"), "/dev/zero"} & opened
    # a symlinked mesh.json is refused by the reader without being read
    top = copy("tp2")
    (top / "mesh.json").rename(tmp_path / "mesh.json")
    os.symlink(tmp_path / "mesh.json", top / "mesh.json")
    code, lines, _ = verify(top)
    assert code == 1 and problem(lines, "mesh.json: is a symbolic link")
    r = run("convert", top, tmp_path / "c", "--quiet")
    assert r.exit_code == 2 and "symbolic link" in r.stderr
    clean(r.stderr)


def test_problem_lines_stay_one_line(copy):
    out = copy("conv")
    (out / "evil\nOK: 0 shard files").write_text("x")
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "evil\\nOK: 0 shard files: file is not listed")
    assert not any(line.startswith("OK") for line in lines)


@pytest.mark.parametrize("said, shown", [({"shape": [10 ** 4000]}, "the manifest says F32[<int of 13288 bits>]"),
                                         ({"shape": [1] * 100_000}, "the manifest says F32[1, 1, 1, 1, 1, 1, 1, 1, ...]"),
                                         ({"dtype": "F" * 1_000_000}, "the manifest says 'FFFFFFFFFFFFFFFF'..."),
                                         ({"shape": [3, 2]}, "the manifest says F32[3, 2]")])
def test_what_a_manifest_says_of_a_tensor_is_shown_bounded(copy, said, shown):
    """A manifest's dtype and shape are shown as written where a tensor could have them, else bounded:
    a problem line does not run to megabytes because a file says so."""
    out = copy("conv")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tensors"]["model.norm.weight"].update(said)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    resign_dir(out)
    code, lines, _ = verify(out)
    assert code == 1
    line = problem(lines, "tensor 'model.norm.weight' is F32[16]", shown)
    assert len(line) < 400


def test_a_manifest_file_size_is_shown_bounded(copy):
    out = copy("conv")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][shards(out)[0].name]["size"] = 10 ** 4000
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    sign_sums(out)
    code, lines, _ = verify(out)
    assert code == 1 and len(problem(lines, "the manifest says <int of 13288 bits> (truncated?)")) < 400


# ------------------------------------------------------------------------------------------------
# (c) every entry of a plain output is accounted for


def test_plain_output_subdirectory_and_unlisted_files(copy):
    out = copy("conv")
    (out / "sub").mkdir()
    shutil.copy(shards(out)[0], out / "sub" / "model-00001-of-00001.safetensors")
    shutil.copy(shards(out)[0], out / "stray.safetensors")
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, f"{out / 'sub'}: is a directory")
    problem(lines, "stray.safetensors: file is not listed in SHA256SUMS or the manifest")
    assert not any("sub/model" in line for line in lines)  # reported, not walked


def test_manifest_and_sha256sums_must_list_the_same_files(copy):
    out = copy("conv")
    sums, _ = parse_sums((out / "SHA256SUMS").read_bytes())
    sums.pop("config.json")
    (out / "SHA256SUMS").write_bytes(format_sums(sums))
    code, lines, _ = verify(out)
    assert code == 1 and problem(lines, "config.json: listed in manifest.json but not in SHA256SUMS")


# ------------------------------------------------------------------------------------------------
# (d) counts in metadata are bounded by what is on disk


def test_a_hundred_million_ranks_is_one_line_in_bounded_memory(copy, tmp_path):
    out = copy("tp2")
    edit_mesh(out, lambda m: m.update(ranks=10**8, tp=10**8))
    code, lines, _, _ = verify_subprocess(out, tmp_path, timeout=120)
    assert code == 1
    assert lines[:-1] == [f"{out / 'mesh.json'}: mesh.json says 100000000 ranks, {out} holds 2 rank directories"]
    assert_refused(cli("convert", out, tmp_path / "c", "--quiet"), tmp_path / "c", "mesh.json says 100000000 ranks")


# ------------------------------------------------------------------------------------------------
# (e) types are checked before use: a problem line (verify) or one error line (readers), never a crash

def _tensor(m, name="model.layers.0.self_attn.k_proj.weight"):
    return m["tensors"][name]


MESH_EDITS = {
    "ranks a string": lambda m: m.update(ranks="2"),
    "ranks a bool": lambda m: m.update(ranks=True),
    "tp a float": lambda m: m.update(tp=2.0),
    "tp x ep wrong": lambda m: m.update(ep=2),
    "tensors a list": lambda m: m.update(tensors=[]),
    "entry a string": lambda m: m["tensors"].update({"model.norm.weight": "F32"}),
    "no shape": lambda m: _tensor(m).pop("shape"),
    "shape of strings": lambda m: _tensor(m).update(shape=["8", "16"]),
    "no dtype": lambda m: _tensor(m).pop("dtype"),
    "dtype a list": lambda m: _tensor(m).update(dtype=["F32"]),
    "unknown dtype": lambda m: _tensor(m).update(dtype="F128"),
    "no axis": lambda m: _tensor(m).pop("axis"),
    "axis out of range": lambda m: _tensor(m).update(axis=5),
    "axis negative": lambda m: _tensor(m).update(axis=-1),
    "axis a string": lambda m: _tensor(m).update(axis="0"),
    "sha256 an int": lambda m: _tensor(m).update(sha256=5),
    "ranges a dict": lambda m: _tensor(m).update(ranges={}),
    "ranges too short": lambda m: _tensor(m).update(ranges=[[[0, 8]]]),
    "ranges reversed": lambda m: _tensor(m).update(ranges=[[[4, 0]], [[4, 8]]]),
    "ranges past the end": lambda m: _tensor(m).update(ranges=[[[0, 4]], [[4, 10**20]]]),
    "ranges of strings": lambda m: _tensor(m).update(ranges=[["0-4"], ["4-8"]]),
    "ranges a triple": lambda m: _tensor(m).update(ranges=[[[0, 4, 1]], [[4, 8]]]),
    "uneven split without ranges": lambda m: _tensor(m, "model.layers.0.mlp.gate_proj.weight").update(
        shape=[13, 16]),
    "padded_shape on a replicated tensor": lambda m: _tensor(m, "model.norm.weight").update(padded_shape=[16]),
    "padded_shape smaller": lambda m: _tensor(m, "lm_head.weight").update(padded_shape=[2, 16]),
    "rules missing": lambda m: m.pop("rules"),
    "source a list": lambda m: m.update(source=[]),
    "rules a list": lambda m: m.update(rules=[]),
    "rule not an object": lambda m: m["rules"]["rules"].insert(0, "x"),
    "rule pattern an int": lambda m: m["rules"]["rules"].insert(0, {"pattern": 5, "kind": "row"}),
    "rule bad regex": lambda m: m["rules"]["rules"].insert(0, {"pattern": "(", "kind": "row"}),
    "rule unknown kind": lambda m: m["rules"]["rules"].insert(0, {"pattern": "x", "kind": "diagonal"}),
    "not an object": lambda m: Whole([m]),
    "format wrong": lambda m: m.update(format="ckptconv.mesh/9"),
    "boxes in a /1 file": lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 16]}], [{"0": [4, 8], "1": [0, 16]}]], "1"),
    "boxes with ranges": lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 16]}], [{"0": [4, 8], "1": [0, 16]}]],
                                          keep_ranges=True),
    "boxes naming one axis": lambda m: _boxes(m, [[{"0": [0, 4]}], [{"0": [4, 8]}]]),
    "boxes naming other axes": lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 16]}], [{"0": [4, 8], "2": [0, 1]}]]),
    "box key not an axis": lambda m: _boxes(m, [[{"0": [0, 4], "x": [0, 16]}], [{"0": [4, 8], "x": [0, 16]}]]),
    "box key not canonical": lambda m: _boxes(m, [[{"0": [0, 4], "01": [0, 16]}], [{"0": [4, 8], "01": [0, 16]}]]),
    "box past the shape": lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 17]}], [{"0": [4, 8], "1": [0, 16]}]]),
    "boxes a dict": lambda m: _boxes(m, {}),
    "boxes of a rank a dict": lambda m: _boxes(m, [{}, []]),
    "boxes that do not join": lambda m: _boxes(m, [[{"0": [0, 2], "1": [0, 8]}, {"0": [2, 4], "1": [8, 16]}],
                                                   [{"0": [4, 8], "1": [0, 16]}]]),
    "a box twice on one rank": lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 16]}, {"0": [0, 4], "1": [0, 16]}],
                                                     [{"0": [4, 8], "1": [0, 16]}]]),
    "an interval twice on one rank": lambda m: _tensor(m).update(ranges=[[[0, 4], [0, 4]], [[4, 8]]]),
    "ranges longer than the piece": lambda m: _tensor(m).update(ranges=[[[0, 4], [4, 8]], [[4, 8]]]),
    "shape of 33 axes": lambda m: _tensor(m).update(shape=[8, 16] + [1] * 31),
    "boxes that do not tile": lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 9]}], [{"0": [4, 8], "1": [8, 16]}]]),
}


def _boxes(m, boxes, version="2", keep_ranges=False):
    """k_proj [8, 16] (split on axis 0) recorded with `boxes` instead of its ranges."""
    entry = _tensor(m)
    entry.pop("ranges", None)
    if keep_ranges:
        entry["ranges"] = [[[0, 4]], [[4, 8]]]
    entry["boxes"] = boxes
    m["format"] = f"ckptconv.mesh/{version}"


@pytest.mark.parametrize("edit", sorted(MESH_EDITS))
def test_hostile_mesh_json(copy, tmp_path, edit):
    out = copy("tp2")
    edit_mesh(out, MESH_EDITS[edit])  # signed: only the validation can catch it
    code, lines, _ = verify(out)
    assert code == 1 and any(f"{out / 'mesh.json'}: " in line for line in lines), lines
    for job in (("convert", out, tmp_path / "c"), ("reshard", out, tmp_path / "r", "--tp", "1")):
        r = run(*job, "--quiet")
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "mesh.json" in r.stderr, (job, r.stderr)
        clean(r.stderr)


def _first(d):
    return next(iter(d))


DIR_EDITS = {  # (file, edit) on a plain output, or on a rank directory of a reshard output
    "weight_map value a list": ("model.safetensors.index.json",
                                lambda i: i["weight_map"].update({_first(i["weight_map"]): ["x"]})),
    "weight_map value null": ("model.safetensors.index.json",
                              lambda i: i["weight_map"].update({_first(i["weight_map"]): None})),
    "weight_map a list": ("model.safetensors.index.json", lambda i: i.update(weight_map=[])),
    "index a list": ("model.safetensors.index.json", lambda i: Whole([i])),
    "files entry an int": ("manifest.json", lambda m: m["files"].update({_first(m["files"]): 5})),
    "files entry without size": ("manifest.json", lambda m: m["files"][_first(m["files"])].pop("size")),
    "files a list": ("manifest.json", lambda m: m.update(files=[])),
    "tensors entry without fields": ("manifest.json", lambda m: m["tensors"].update({_first(m["tensors"]): {}})),
    "tensors entry shape of strings": ("manifest.json",
                                       lambda m: m["tensors"][_first(m["tensors"])].update(shape=["1"])),
    "tensors entry dtype a list": ("manifest.json",
                                   lambda m: m["tensors"][_first(m["tensors"])].update(dtype=["F32"])),
    "tensors a string": ("manifest.json", lambda m: m.update(tensors="all of them")),
    "manifest a number": ("manifest.json", lambda m: Whole(5)),
    "source a list": ("manifest.json", lambda m: m.update(source=[])),
}


@pytest.mark.parametrize("edit,where", [(e, w) for w in ("conv", "tp2", "tp2-sharded") for e in sorted(DIR_EDITS)
                                        if w != "tp2" or DIR_EDITS[e][0] != INDEX])   # (tp2's ranks: one shard, no index)
def test_hostile_index_and_manifest(outputs, copy, edit, where):
    out = copy(where)
    d = out / "rank-00000" if where != "conv" else out
    name, change = DIR_EDITS[edit]
    edit_json(d / name, change)
    resign_dir(d) if name == "model.safetensors.index.json" else sign_sums(d)  # signed: only validation catches it
    code, lines, _ = verify(out)
    if edit == "source a list" and where != "conv":   # rank 0 says another source than rank 1 (issue 28)
        assert code == 1 and any("source: not what rank-00000's manifest records" in line for line in lines), lines
        return
    if edit == "source a list":  # not what ckptconv records: --against says so (issue 28), and nothing more
        code, lines, _ = verify(out, "--against", outputs / "src")
        assert code == 1 and "source is [], not the object ckptconv records" in lines[0], lines
        return
    assert code == 1 and any(str(d / name) in line for line in lines), lines


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b"[" * 100000 + b"]" * 100000, b"", b"{}"])
def test_unreadable_metadata_files(copy, content):
    out = copy("conv")
    for name in ("model.safetensors.index.json", "manifest.json", "SHA256SUMS"):
        (out / name).write_bytes(content)
    code, lines, _ = verify(out)
    assert code == 1 and lines


# ------------------------------------------------------------------------------------------------
# (f) the safetensors library must see what we see


def rewrite_header(path, change):
    """Apply `change` to a shard's header JSON and write it back (same data, header re-padded)."""
    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_output_the_safetensors_library_cannot_load(copy):
    """A tensor name holding a lone UTF-16 surrogate (`\\ud800` in the JSON): Python's JSON parser,
    and so ours, takes it, and everything re-signed agrees, but the safetensors library (serde)
    refuses the header, so no consumer can load the file."""
    out = copy("conv")
    old = "model.norm.weight"
    new = old + "\ud800"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard = out / index[old]

    def rename(d):
        d[new] = d.pop(old)
    rewrite_header(shard, rename)
    edit_json(out / "model.safetensors.index.json", lambda i: rename(i["weight_map"]))
    edit_json(out / "manifest.json", lambda m: rename(m["tensors"]))
    resign_dir(out)
    code, lines, _ = verify(out)
    assert code == 1 and len(lines) == 2, lines
    assert lines[0].startswith(f"{shard}: the safetensors library cannot open it: ") and "JSON" in lines[0]


def test_a_shard_replaced_before_the_library_reads_it_is_named(copy, monkeypatch):
    """The library's check comes after verify's own pass: a shard swapped in between (another valid
    header) is reported as changed, not passed because the library agrees with the new file."""
    import importlib
    shards = importlib.import_module("ckptconv.layouts.shardcheck")   # (where _library_view calls it)
    out = copy("conv")
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    real = shards._library

    def swapped(path, view):
        if path == shard:
            rewrite_header(shard, lambda h: h.__setitem__("renamed", h.pop("lm_head.weight")))
        return real(path, view)
    monkeypatch.setattr(shards, "_library", swapped)
    code, lines, _ = verify(out)
    assert code == 1 and lines[:-1] == [f"{shard}: changed while verify read it: its header is not the one checked "
                                        "(verify again)"], lines


def test_a_library_view_that_changes_between_its_reads_is_named(copy, monkeypatch):
    """The library's digest differs from ours, yet its second read (to name the differences) finds
    none: the file changed between the two, and that is what is reported."""
    import importlib
    shards = importlib.import_module("ckptconv.layouts.shardcheck")   # (where _library_view calls it)
    out = copy("conv")
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    real, calls = shards._library, []

    def flaky(path, view):
        seen = real(path, view)
        if path == shard and not calls:   # its first read: as if another header had been there
            calls.append(path)
            return b"x" * 32
        return seen
    monkeypatch.setattr(shards, "_library", flaky)
    code, lines, _ = verify(out)
    assert code == 1 and lines[:-1] == [f"{shard}: changed while verify read it: the safetensors library saw another "
                                        "header (verify again)"], lines


def test_a_single_file_replaced_before_the_library_reads_it_is_named(tmp_path, monkeypatch, outputs):
    """A single-file output is re-read too when the library's view differs: the change is named,
    not blamed on the library."""
    import importlib
    shards = importlib.import_module("ckptconv.layouts.shardcheck")   # (where _library_view calls it)
    one = tmp_path / "one.safetensors"
    assert run("convert", outputs / "conv", one).exit_code == 0
    real = shards._library

    def swapped(path, view):
        if path == one and not swapped.done:
            swapped.done = True
            rewrite_header(one, lambda h: h.__setitem__("renamed", h.pop("lm_head.weight")))
        return real(path, view)
    swapped.done = False
    monkeypatch.setattr(shards, "_library", swapped)
    code, lines, _ = verify(one)
    assert code == 1 and f"{one}: changed while verify read it: its header is not the one checked (verify again)" \
        in lines, lines


def test_a_problem_line_names_a_path_holding_a_colon(copy, tmp_path):
    """A problem's text drops exactly the "PATH: " its error starts with, whatever the path holds."""
    out = copy("conv").rename(tmp_path / "co: lon")
    (out / "manifest.json").write_text("[]")
    code, lines, _ = verify(out)
    assert code == 1 and f"{out}/manifest.json: manifest.json is not a JSON object" in lines, lines


def test_differences_of_two_row_streams_in_name_order():
    """The name-by-name comparison on plain rows: names on one side only, at either end or between,
    and a row that differs; equal rows say nothing."""
    import importlib
    differences = importlib.import_module("ckptconv.layouts.shardcheck")._differences
    ours = [("a", "F32", [2]), ("c", "F32", [1]), ("d", "I8", [3])]
    theirs = [("b", "F32", [2]), ("c", "F32", [2]), ("d", "I8", [3]), ("e", "BOOL", [])]
    assert list(differences(ours, theirs)) == [("a", None, ("F32", [2])), ("b", ("F32", [2]), None),
                                               ("c", ("F32", [2]), ("F32", [1])), ("e", ("BOOL", []), None)]
    assert list(differences(ours, ours)) == [] and list(differences([], [])) == []
    assert list(differences([], theirs[:1])) == [("b", ("F32", [2]), None)]


def test_library_view_matches_on_good_outputs(outputs):
    code, lines, _ = verify(outputs / "conv")
    assert code == 0, lines


def test_what_the_library_sees_differently_is_named(copy, monkeypatch):
    """The library's view is compared as one digest, after the rest; where it differs from ours,
    the header is read again and every difference named: a tensor only we see, one only it sees
    (in another dtype), and other metadata (the library stood in for, as no real file makes the two
    disagree)."""
    import safetensors
    out = copy("conv")
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    real = safetensors.safe_open

    class Skewed:   # what the library sees of `shard`: lm_head.weight as "theirs", in F16
        def __init__(self, path, framework):
            self.f, self.skew = real(path, framework=framework), path == str(shard)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return [{"lm_head.weight": "theirs"}.get(k, k) if self.skew else k for k in self.f.keys()]

        def get_slice(self, name):
            if name != "theirs":
                return self.f.get_slice(name)
            shape = self.f.get_slice("lm_head.weight").get_shape()
            return type("Piece", (), {"get_dtype": lambda _: "F16", "get_shape": lambda _: shape})()

        def metadata(self):
            return {**self.f.metadata(), **({"x": "y"} if self.skew else {})}

    monkeypatch.setattr(safetensors, "safe_open", Skewed)
    code, lines, _ = verify(out)
    assert code == 1 and lines[:-1] == [
        f"{shard}: tensor 'lm_head.weight': the safetensors library sees None, ckptconv ('F32', [32, 16])",
        f"{shard}: tensor 'theirs': the safetensors library sees ('F16', [32, 16]), ckptconv None",
        f"{shard}: the safetensors library sees different __metadata__"], lines


# ------------------------------------------------------------------------------------------------
# (g) no walk follows a symlink


def test_total_bytes_does_not_follow_symlinks(copy, tmp_path):
    out = copy("tp2")
    want = sum(p.stat().st_size for p in out.rglob("*.safetensors"))
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(10**12)  # sparse: a terabyte the progress bar must not count
    os.symlink(big, out / "big.safetensors")
    os.symlink(big, out / "rank-00000" / "big.safetensors")
    os.symlink(out, out / "rank-00001" / "loop")
    os.symlink(out, out / "loop")
    assert total_bytes(out) == want
    code, lines, _ = verify(out)
    assert code == 1 and problem(lines, "big.safetensors: is a symbolic link")


# ------------------------------------------------------------------------------------------------
# a multi-process verify --device: every process checks the files whole and finds the same


def test_hostile_outputs_on_two_processes(copy):
    from tests.e2e.test_distributed import launch, wait_all
    mesh = copy("tp2")
    edit_mesh(mesh, lambda m: m.update(ranks=10**8, tp=10**8))
    plain = copy("conv")
    edit_json(plain / "model.safetensors.index.json", lambda i: i["weight_map"].update(
        {_first(i["weight_map"]): ["x"], "zz": "/etc/passwd"}))
    for out, want in ((mesh, "mesh.json says 100000000 ranks"), (plain, "'zz' is listed in '/etc/passwd'")):
        results = wait_all(launch(["verify", out, "--device", "cpu", "--quiet"]))
        assert [rc for rc, _, _ in results] == [1, 1], results
        for _, stdout, stderr in results:
            clean(stdout + stderr)
        problem(results[0][1].splitlines(), want)


def test_boxes_that_describe_the_split_verify(copy):
    """The same cut written as boxes (mesh.json /2) is read and verified as the ranges were."""
    out = copy("tp2")
    edit_mesh(out, lambda m: _boxes(m, [[{"0": [0, 4], "1": [0, 16]}], [{"0": [4, 8], "1": [0, 16]}]]))
    code, lines, _ = verify(out)
    assert code == 0, lines


@pytest.mark.parametrize("engine", ["sharded", "single", "foreign", "mesh", "nosuch", 7])
def test_a_recorded_target_naming_no_engine_layout_is_a_problem_not_a_crash(copy, outputs, engine):
    """mesh.json's and a manifest's recorded target name a layout by its "engine" (layouts/base
    .engine_of): one that records no target, or none at all, picks nothing; verify reports it."""
    out = copy("tp2")
    edit_mesh(out, lambda m: m["source"].__setitem__("target", {"engine": engine}))
    code, lines, _ = verify(out)
    assert code == 1
    problem(lines, "mesh.json", "source.target")   # (the ranks' manifests record none)
    conv = copy("conv")
    edit_json(conv / "manifest.json", lambda m: m["source"].__setitem__("target", {"engine": engine}))
    resign_dir(conv)
    for asked in ((), ("--against", outputs / "src")):   # (a convert output records no target at all: row 26)
        code, lines, _ = verify(conv, *asked)
        assert code == 1
        problem(lines, "source.target", "a convert output records no engine's target")


@pytest.mark.parametrize("key, value, said", [
    ("extras", "ab", "extras is 'ab', not the object"), ("extras", [{}], "extras is [{}], not the object"),
    ("skipped_files", 5, None), ("skipped_files", [{"name": ["a"]}], None), ("format", [1], None),
    ("format", {"a": 1}, None)])
def test_a_manifest_field_of_another_type_is_a_problem_for_against(copy, outputs, key, value, said):
    """--against reads what a manifest records of its source as untrusted: a field of another type
    than ckptconv writes is a problem line (or read as absent), never an exception."""
    conv = copy("conv")
    if key == "extras":
        edit_json(conv / "manifest.json", lambda m: m.__setitem__("extras", value))
    else:
        edit_json(conv / "manifest.json", lambda m: m["source"].__setitem__(key, value))
    resign_dir(conv)
    code, lines, err = verify(conv, "--against", outputs / "src")
    assert code in (0, 1) and not err, err
    if said:
        problem(lines, said)
