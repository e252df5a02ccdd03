"""A checkpoint cut short where only entries that are not written lie (docs/dcp.md, "A damaged
checkpoint"): DCP's .metadata records every entry's file, offset and length, so the damage is found
from the files' sizes alone, said in one stderr line (file, first entry, bytes present of bytes
needed) and in --json, the written tensors still whole and the run still exit 0; verify --against
says it as a note. A cut in what is written stays exit 2. DeepSpeed and Megatron's legacy rank files
are torch zips, whose central directory is at the end: cut short anywhere, they stay refused.

The damaged sources are the committed real saves (tests/fixtures/data/training_dcp/fsdp1, dcp/single
and fsdp2: their optimizer state or extras lie at the end of a rank's file), cut at an offset found
in their .metadata as torch's own reader reads it, and one torch.distributed.checkpoint save whose
second file holds only optimizer state (FileSystemWriter(thread_count=2), Adafactor)."""
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.helpers import DATA, assert_same, load_output, run, split_all_rules

FSDP1 = DATA / "training_dcp" / "fsdp1"


def places(src) -> list:
    """(file, fqn, start, stop) of every storage entry, as torch's own FileSystemReader reads .metadata."""
    md = dcp.FileSystemReader(str(src)).read_metadata()
    return sorted((i.relative_path, k.fqn, i.offset, i.offset + i.length) for k, i in md.storage_data.items())


def cut(src, file, written) -> dict:
    """Cut `file` of `src` in the middle of an entry that is not written, past every entry that is;
    the record convert should give of it (readers/damage.py)."""
    mine = [p for p in places(src) if p[0] == file]
    end_written = max(stop for _, fqn, _, stop in mine if written(fqn))
    after = [p for p in mine if not written(p[1]) and p[2] >= end_written]
    assert len(after) >= 3, after   # (the fixture keeps its unwritten state at the end of the file)
    target = after[len(after) // 2]
    at = (target[2] + target[3]) // 2
    os.truncate(src / file, at)
    return {"file": file, "has": at, "needs": max(p[3] for p in mine),
            "entries": sum(1 for p in mine if p[3] > at),
            "first": {"entry": target[1], "start": target[2], "stop": target[3]}}


def line(src, r, more="") -> str:
    first = r["first"]
    return (f"{src}/{r['file']}: damaged: holds {r['has']} of the {r['needs']} bytes its entries need: {r['entries']} "
            f"entries cut short or absent (first {first['entry']!r}, bytes {first['start']}..{first['stop']}), none "
            f"of them written; the tensors written are whole{more}")


def model(fqn) -> bool:
    return fqn.startswith("model.")


def test_a_cut_in_the_optimizers_part_converts_whole_and_says_where(tmp_path):
    src = tmp_path / "fsdp1"
    shutil.copytree(FSDP1, src)
    record = cut(src, "__0_0.distcp", model)
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    assert r.stderr == f"ckptconv: warning: {line(src, record)}\n"
    want = load_file(DATA / "training_dcp" / "fsdp1.reference.safetensors")
    got = load_output(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert_same(got[name], t, name)
    assert json.loads((out / "manifest.json").read_text())["source"]["damaged"] == [record]

    r = run("convert", src, tmp_path / "again", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["damaged"] == [record]
    assert r.stderr == f"ckptconv: warning: {line(src, record)}\n"

    # verify --against: the output is whole and matches; the source's damage is a note (exit 0)
    v = run("verify", out, "--against", src)
    assert v.exit_code == 0, v.stdout
    assert f"note: {line(src, record)}" in v.stdout.splitlines() and "OK" in v.stdout.splitlines()[-1]
    v = run("verify", out, "--against", src, "--json")
    report = json.loads(v.stdout)
    assert v.exit_code == 0 and report["ok"] and line(src, record) in report["notes"]

    # inspect says it too
    i = run("inspect", src, "--json")
    assert i.exit_code == 0 and json.loads(i.stdout)["source"]["damaged"] == [record]
    assert i.stderr == f"ckptconv: warning: {line(src, record)}\n"


def test_a_source_damaged_after_its_conversion_still_verifies(tmp_path):
    """The manifest records the source whole; the source is cut later: its tensors still match, and
    the damage is a note, not a difference in what the reader says of the source (exit 0)."""
    src = tmp_path / "fsdp1"
    shutil.copytree(FSDP1, src)
    out = tmp_path / "out"
    assert run("convert", src, out, "--quiet").exit_code == 0
    assert "damaged" not in json.loads((out / "manifest.json").read_text())["source"]
    record = cut(src, "__1_0.distcp", model)
    v = run("verify", out, "--against", src)
    assert v.exit_code == 0, v.stdout
    assert f"note: {line(src, record)}" in v.stdout.splitlines()


def test_every_damaged_file_is_counted_in_the_one_line(tmp_path):
    src = tmp_path / "fsdp1"
    shutil.copytree(FSDP1, src)
    first, second = cut(src, "__0_0.distcp", model), cut(src, "__1_0.distcp", model)
    r = run("convert", src, tmp_path / "out", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["damaged"] == [first, second]
    assert r.stderr == f"ckptconv: warning: {line(src, first, '; 1 more damaged file alike: __1_0.distcp')}\n"


def test_reshard_says_it_too(tmp_path):
    src = tmp_path / "fsdp1"
    shutil.copytree(FSDP1, src)
    record = cut(src, "__1_0.distcp", model)
    r = run("reshard", src, tmp_path / "out", "--tp", "2", "--rules", split_all_rules(tmp_path), "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["damaged"] == [record]
    assert r.stderr == f"ckptconv: warning: {line(src, record)}\n"


def test_names_outside_only_are_not_read_and_their_damage_is_said(tmp_path):
    """dcp/single is no training state (its extras hold tensors): everything is written, so a cut in
    its extras is refused as before; with --only model. they are not read, and the cut is a warning."""
    src = tmp_path / "single"
    shutil.copytree(DATA / "dcp" / "single", src)
    record = cut(src, "__0_0.distcp", model)
    r = run("convert", src, tmp_path / "all")
    assert r.exit_code == 2 and r.stderr.startswith(f"ckptconv: error: {src}/__0_0.distcp: ")
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "all").exists()
    r = run("convert", src, tmp_path / "model", "--only", "model.")
    assert r.exit_code == 0 and r.stderr == f"ckptconv: warning: {line(src, record)}\n"
    assert sorted(load_output(tmp_path / "model")) == ["model.0.bias", "model.0.weight", "model.2.bias",
                                                       "model.2.weight"]


@pytest.mark.parametrize("fixture", [FSDP1, DATA / "dcp" / "fsdp2"])
def test_a_cut_in_what_is_written_is_refused_as_before(fixture, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture, src)
    file = max({p[0] for p in places(src)})
    end_written = max(p[3] for p in places(src) if p[0] == file and model(p[1]))
    os.truncate(src / file, end_written - 10)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and r.stderr.startswith(f"ckptconv: error: {src}/{file}: ")
    assert len(r.stderr.splitlines()) == 1 and "truncated" in r.stderr and not (tmp_path / "out").exists()


@pytest.fixture
def adafactor(tmp_path):
    """A single-process torch DCP save of a model and its Adafactor state with two files per rank
    (FileSystemWriter(thread_count=2)): the model's one large tensor fills the first, the factored
    moments (and half the param_groups) the second, which holds no model entry."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64, bias=False)
    opt = torch.optim.Adafactor(net.parameters())
    net(torch.ones(2, 64)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(net, opt)
    src = tmp_path / "adafactor"
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(src), thread_count=2))
    second = [p for p in places(src) if p[0] == "__0_1.distcp"]
    assert second and not any(model(p[1]) for p in second), second
    return src, second, msd["weight"]


def test_a_missing_file_of_optimizer_state_only_is_said(adafactor, tmp_path):
    src, second, weight = adafactor
    (src / "__0_1.distcp").unlink()
    out = tmp_path / "out"
    r = run("convert", src, out, "--json")
    assert r.exit_code == 0, r.stderr
    first = min(second, key=lambda p: p[2])
    record = {"file": "__0_1.distcp", "has": None, "needs": max(p[3] for p in second), "entries": len(second),
              "first": {"entry": first[1], "start": first[2], "stop": first[3]}}
    assert json.loads(r.stdout)["damaged"] == [record]
    assert r.stderr == (f"ckptconv: warning: {src}/__0_1.distcp: damaged: missing, and {len(second)} entries lie "
                        f"in it (first {first[1]!r}, bytes {first[2]}..{first[3]}), none of them written; the "
                        "tensors written are whole\n")
    got = load_output(out)
    assert list(got) == ["weight"]
    assert_same(got["weight"], weight, "weight")


def test_a_file_leading_out_of_the_checkpoint_is_not_looked_at(adafactor, tmp_path):
    """A rank file of unread entries only, linked to a short file elsewhere: never followed, so no
    size of it is taken (nor anything said of it); the written tensors convert as before."""
    src, _, weight = adafactor
    (tmp_path / "elsewhere").write_bytes(b"x" * 10)
    (src / "__0_1.distcp").unlink()
    os.symlink(tmp_path / "elsewhere", src / "__0_1.distcp")
    r = run("convert", src, tmp_path / "out", "--json")
    assert r.exit_code == 0 and r.stderr == "" and "damaged" not in json.loads(r.stdout)
    assert_same(load_output(tmp_path / "out")["weight"], weight, "weight")


# --- torch zip rank files: the central directory is at the end --------------------------------------

@pytest.mark.parametrize("fixture, name", [
    (DATA / "deepspeed" / "z2-fp32-mlp", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    (DATA / "deepspeed" / "z1-bf16-pipe-dp2", "global_step2/layer_02-model_states.pt"),
    (DATA / "megatron" / "legacy-untied-tp2-pp2", "iter_0000001/mp_rank_01_001/model_optim_rng.pt")])
def test_a_torch_zip_rank_file_cut_in_what_is_not_written_is_refused(fixture, name, tmp_path):
    """A cut anywhere in a torch zip loses its central directory (the sizes it records are at its
    end, as torch.load needs them too): the file is refused in one line, as before."""
    import zipfile
    src = tmp_path / "src"
    shutil.copytree(fixture, src)
    with zipfile.ZipFile(src / name) as z:
        last = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.header_offset)
    os.truncate(src / name, last.header_offset + 30 + len(last.filename) + last.file_size // 2)   # (its last storage)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"ckptconv: error: {src / name}: ") and "truncated" in r.stderr
    assert not (tmp_path / "out").exists()
