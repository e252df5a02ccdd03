"""What the fourth round of outside trials found (real files and an attack): one shard of an indexed
set, ensembles, messages a person can act on, large non-tensor state, recorded facts verify holds.
Inputs come from the real producers (huggingface_hub, transformers, torch.save)."""
import hashlib
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import load_output, run


def _refused(r, *fragments):
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr
    for f in fragments:
        assert f in r.stderr, (f, r.stderr)


# -- 2. one shard of an indexed set --------------------------------------------------------------------

def _safetensors_shards(d):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(d, max_shard_size="8KB")
    return d


def test_one_shard_of_an_indexed_set_is_refused_naming_the_index(hf_llama, tmp_path):
    st = _safetensors_shards(tmp_path / "st")
    shard = sorted(st.glob("model-0000*-of-*.safetensors"))[1]
    r = run("convert", shard, tmp_path / "out")
    _refused(r, str(shard), "model.safetensors.index.json", f"give the directory {st}", "--one-shard")
    assert not (tmp_path / "out").exists()
    binary = sorted(hf_llama["dir"].glob("pytorch_model-0000*.bin"))[0]
    _refused(run("inspect", binary), "pytorch_model.bin.index.json", "--one-shard")
    # asked for: that shard alone, and verify --against reads the source the same way
    r = run("convert", shard, tmp_path / "one", "--one-shard")
    assert r.exit_code == 0, r.stderr
    from safetensors.torch import load_file
    assert load_output(tmp_path / "one").keys() == load_file(shard).keys()
    r = run("verify", tmp_path / "one", "--against", shard)
    assert r.exit_code == 0 and "--one-shard" in r.stdout, r.stdout
    # the whole directory, and a file with an index of itself alone, are not one shard of a set
    assert run("convert", st, tmp_path / "all").exit_code == 0
    lone = tmp_path / "lone"
    lone.mkdir()
    save_file({"w": torch.ones(2)}, lone / "model.safetensors")
    (lone / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    assert run("convert", lone / "model.safetensors", tmp_path / "l").exit_code == 0


# -- 4. an ensemble of whole models ----------------------------------------------------------------------

def test_independent_weight_files_in_one_directory_are_named(tmp_path):
    d = tmp_path / "ensemble"
    d.mkdir()
    for i in range(4):
        save_file({"encoder.weight": torch.full((2, 2), float(i)), "head.weight": torch.ones(3)},
                  d / f"member{i}.safetensors")
    r = run("convert", d, tmp_path / "out")
    _refused(r, "member0.safetensors and member1.safetensors both hold 'encoder.weight'", "2 of 2 names in common",
             "give one file as SRC (ensemble/member0.safetensors)", "index")
    assert run("convert", d / "member0.safetensors", tmp_path / "one").exit_code == 0


# -- 5. messages -------------------------------------------------------------------------------------------

def test_no_reader_recognises_it_in_one_short_line(tmp_path):
    (tmp_path / "notes.pt").write_text("hello\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    d = tmp_path / "configs"
    d.mkdir()
    shutil.copy(tmp_path / "config.json", d)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    cases = [("notes.pt", "a text file of 6 bytes, named like a torch file, which is a torch.save file"),
             ("config.json", "a JSON object of 41 bytes (a model config), not a shapes description"),
             ("configs", "a directory of 1 entry (config.json), none named like a weights file"),
             ("empty.safetensors", "an empty file, named like a safetensors file")]
    for name, said in cases:
        r = run("inspect", tmp_path / name)
        _refused(r, said, "`ckptconv inspect --formats`")
        line = r.stderr.strip().removeprefix("ckptconv: error: ").replace(str(tmp_path / name), "SRC")
        assert len(line) <= 220, line
    r = run("inspect", "--formats")
    assert r.exit_code == 0
    assert "torch: torch.save files" in r.stdout and "recognised by:" in r.stdout
    from ckptconv.readers import readers
    assert [f["name"] for f in json.loads(run("inspect", "--formats", "--json").stdout)["formats"]] == list(readers())


def test_the_skip_unsupported_hint_never_leads_nowhere(tmp_path):
    torch.save({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "only.pt")
    r = run("convert", tmp_path / "only.pt", tmp_path / "out")
    _refused(r, "'z'", "complex64", "no tensor safetensors can store is left")
    assert "--skip-unsupported" not in r.stderr
    torch.save({"z": torch.zeros(2, dtype=torch.complex64), "y": torch.zeros(1, dtype=torch.complex128),
                "w": torch.ones(2)}, tmp_path / "mixed.pt")
    r = run("convert", tmp_path / "mixed.pt", tmp_path / "out")
    _refused(r, "(and 1 more tensor it cannot store)", "--skip-unsupported leaves it out")
    r = run("convert", tmp_path / "mixed.pt", tmp_path / "out", "--skip-unsupported")
    assert r.exit_code == 0 and list(load_output(tmp_path / "out")) == ["w"]
    np.savez(tmp_path / "c.npz", c=np.ones(2, np.complex64))
    r = run("convert", tmp_path / "c.npz", tmp_path / "out2")
    _refused(r, "member 'c.npy'", "no tensor safetensors can store is left")


def test_against_another_plain_checkpoint_is_differences_not_a_flag(tmp_path):
    lin = torch.nn.Linear(3, 2)
    torch.save({"model_state_dict": lin.state_dict(),
                "optimizer_state_dict": torch.optim.SGD(lin.parameters(), lr=0.1).state_dict()}, tmp_path / "w.pt")
    torch.save({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, tmp_path / "plain.pt")
    assert run("convert", tmp_path / "w.pt", tmp_path / "out").exit_code == 0
    r = run("verify", tmp_path / "out", "--against", tmp_path / "plain.pt")
    assert r.exit_code == 1, r.stderr
    assert "made from the entry 'model_state_dict' of its source" in r.stdout
    assert "tensor 'weight' differs from the source" in r.stdout
    assert "ckptconv: error" not in r.stderr


def test_the_check_command_printed_pastes_into_a_shell(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    out = tmp_path / "it's a dir"
    r = run("convert", tmp_path / "m.pt", out)
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("identity:"))
    command = line.split("(check with: ", 1)[1].removesuffix(")")
    assert shlex.split(command)[:3] == ["ckptconv", "verify", str(out)]
    assert shlex.quote(str(out)) in command


def test_verify_help_lists_only_what_verify_uses():
    text = run("verify", "--help").stdout
    for unused in ("--only", "--skip-unsupported", "--one-shard", "--max-shard-size", "--max-extras"):
        assert unused not in text, unused
    for used in ("--against", "--device", "--expect", "--state-dict", "--from", "--allow-global"):
        assert used in text, used


# -- 6. large non-tensor state ---------------------------------------------------------------------------

@pytest.mark.slow   # (make test-slow: a check of scale)
def test_large_extras_are_summarised_by_size_and_digest(tmp_path):
    vocab = {f"tok{i}": i for i in range(60000)}
    table = [[i, f"x{i}"] for i in range(40000)]
    torch.save({"state_dict": {"w": torch.ones(4)}, "vocab": vocab, "table": table, "epoch": 3}, tmp_path / "t.pt")
    r = run("convert", tmp_path / "t.pt", tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert "extras summarised in the manifest (past --max-extras): vocab (60000 entries" in r.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (tmp_path / "out" / "manifest.json").stat().st_size < 10_000
    assert manifest["extras"]["epoch"] == 3
    # the digest is of the entries as the manifest would have held them, sorted and compact: made here
    # from torch.load's own values, not from ckptconv's
    flat = {f"vocab.{k}": v for k, v in torch.load(tmp_path / "t.pt", weights_only=False)["vocab"].items()}
    data = json.dumps(flat, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["extras"]["vocab"] == {"__summarised__": {
        "type": "object", "entries": 60000, "json_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    assert manifest["extras"]["table"]["__summarised__"]["type"] == "array"
    assert run("verify", tmp_path / "out", "--against", tmp_path / "t.pt").exit_code == 0
    vocab["tok5"] = 6   # another source with the same shape of state: the summary tells them apart
    torch.save({"state_dict": {"w": torch.ones(4)}, "vocab": vocab, "table": table, "epoch": 3}, tmp_path / "u.pt")
    r = run("verify", tmp_path / "out", "--against", tmp_path / "u.pt")
    assert r.exit_code == 1 and "extras 'vocab'" in r.stdout, r.stdout
    r = run("convert", tmp_path / "t.pt", tmp_path / "whole", "--max-extras", "100MB")
    assert r.exit_code == 0 and "summarised" not in r.stdout
    assert json.loads((tmp_path / "whole" / "manifest.json").read_text())["extras"]["vocab.tok7"] == 7


# -- 9. recorded facts ----------------------------------------------------------------------------------------

def _resign(d):
    names = sorted(p.name for p in d.iterdir() if p.is_file() and p.name != "SHA256SUMS")
    (d / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


def test_a_plain_output_claiming_an_engine_target_is_a_problem(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    assert run("convert", tmp_path / "m.pt", tmp_path / "out").exit_code == 0
    path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["source"]["target"] = {"engine": "vllm", "model_type": "llama", "tied": False,
                                    "params": {"heads": 2, "kv_heads": 2, "head_dim": 8}}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _resign(tmp_path / "out")
    r = run("verify", tmp_path / "out")
    assert r.exit_code == 1 and "a convert output records no engine's target" in r.stdout, r.stdout


def test_a_vllm_output_edited_to_claim_another_model_type_fails_against(hf_llama, tmp_path):
    out = tmp_path / "out"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    assert run("verify", out, "--against", hf_llama["dir"]).exit_code == 0
    for doc in [out / "mesh.json", *sorted(out.glob("rank-*/manifest.json"))]:
        data = json.loads(doc.read_text())
        data["source"]["target"]["model_type"] = "mistral"
        data["source"]["target"]["params"]["layers"] = 7
        doc.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        _resign(doc.parent)
    r = run("verify", out)
    assert r.exit_code == 0, r.stdout   # consistent everywhere: only the source can tell
    r = run("verify", out, "--against", hf_llama["dir"])
    assert r.exit_code == 1, r.stdout
    assert "target model_type is 'mistral', the source gives 'llama'" in r.stdout
    assert "target params.layers is 7, the source's config.json gives 2" in r.stdout


def test_a_class_pickled_by_every_rank_is_listed_once_with_its_count(hf_llama, tmp_path):
    from tests.readers.test_megatron import Unknown
    d = tmp_path / "bin"
    shutil.copytree(hf_llama["dir"], d)
    shards = sorted(d.glob("pytorch_model-*.bin"))
    for s in shards:   # each shard gets the same record beside its weights (torch.save re-saves it)
        state = torch.load(s, weights_only=True)
        torch.save({**state, "tokenizer_info": Unknown()}, s)
    r = run("inspect", d)
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("classes on no allowlist"))
    assert line.endswith(f": tests.readers.test_megatron.Unknown (x{len(shards)})"), line


def test_sha256sum_checks_a_summarised_output(tmp_path):
    torch.save({"w": torch.ones(2), "vocab": {f"t{i}": i for i in range(80000)}}, tmp_path / "t.pt")
    assert run("convert", tmp_path / "t.pt", tmp_path / "out").exit_code == 0
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path / "out", capture_output=True).returncode == 0


# -- what the outside attack on these fixes found ------------------------------------------------------

def test_a_shared_huge_integer_or_long_name_costs_what_the_file_justifies(tmp_path):
    """One 1 MiB integer referenced 300 times (629 MB of JSON before), one 200,000-character key in a dict
    shared 2000 times (1.2 GB of names before): each reference is charged, refused in one line."""
    import struct
    from tests.security.test_trust import _u, torch_file
    big = ((1 << (8 * 1024 * 1024 - 9)) + 12345).to_bytes(1024 * 1024, "little", signed=True)
    body = _u("ints") + b"]" + b"\x8b" + struct.pack("<I", len(big)) + big + b"q\x010" + b"(" + b"h\x01" * 300 + b"e"
    r = run("convert", torch_file(tmp_path / "int.pt", body), tmp_path / "o1")
    _refused(r, "int.pt", "expands far beyond")
    shared = {"x" * 200_000: torch.ones(1)}
    torch.save({f"m{j}": shared for j in range(2000)}, tmp_path / "names.pt")
    _refused(run("convert", tmp_path / "names.pt", tmp_path / "o2"), "names.pt", "naming its tensors expands")
    leaf = torch.nn.Module()
    leaf.register_parameter("x" * 200_000, torch.nn.Parameter(torch.ones(1)))
    parent = torch.nn.Module()
    for j in range(2000):
        parent.add_module(f"m{j}", leaf)
    torch.save(parent, tmp_path / "mods.pt")
    _refused(run("convert", tmp_path / "mods.pt", tmp_path / "o3"), "mods.pt", "naming its tensors expands")


def test_verify_against_a_source_with_tensors_safetensors_cannot_store(tmp_path):
    torch.save({"x": torch.ones(2, dtype=torch.complex64), "y": torch.ones(2)}, tmp_path / "mix.pt")
    torch.save({"y": torch.ones(2)}, tmp_path / "plain.pt")
    assert run("convert", tmp_path / "mix.pt", tmp_path / "skip", "--skip-unsupported").exit_code == 0
    r = run("verify", tmp_path / "skip", "--against", tmp_path / "mix.pt")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert run("convert", tmp_path / "plain.pt", tmp_path / "plain").exit_code == 0
    r = run("verify", tmp_path / "plain", "--against", tmp_path / "mix.pt")
    assert r.exit_code == 1 and "source.skipped" in r.stdout, r.stdout + r.stderr


def test_a_quantized_module_s_packed_weights_are_listed_as_left_out(tmp_path):
    model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)),
                                                   {torch.nn.Linear}, dtype=torch.qint8)
    torch.save(model, tmp_path / "q.pt")
    r = run("convert", tmp_path / "q.pt", tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert "left out: 0._packed_params._packed_params (tensors outside the module's state dict" in r.stdout
    dropped = json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]["dropped"]
    assert [d["name"] for d in dropped] == ["0._packed_params._packed_params"]


def test_many_small_extras_are_one_summary(tmp_path):
    torch.save({"w": torch.ones(2), **{f"k{i}": i for i in range(100_000)}}, tmp_path / "flat.pt")
    r = run("convert", tmp_path / "flat.pt", tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("extras summarised"))
    assert "(all extras) (100000 entries" in line and len(line) < 300
    assert (tmp_path / "out" / "manifest.json").stat().st_size < 4096
    assert run("verify", tmp_path / "out", "--against", tmp_path / "flat.pt").exit_code == 0


def test_non_finite_floats_and_their_names_as_text_stay_apart(tmp_path):
    torch.save({"w": torch.ones(1), "a": float("nan"), "b": "nan", "c": float("-inf")}, tmp_path / "f.pt")
    assert run("convert", tmp_path / "f.pt", tmp_path / "out").exit_code == 0
    extras = json.loads((tmp_path / "out" / "manifest.json").read_text())["extras"]
    assert extras == {"a": {"__float__": "nan"}, "b": "nan", "c": {"__float__": "-inf"}}
    torch.save({"w": torch.ones(1), "a": "nan", "b": "nan", "c": float("-inf")}, tmp_path / "g.pt")
    assert run("verify", tmp_path / "out", "--against", tmp_path / "g.pt").exit_code == 1


def test_the_check_command_pastes_for_names_a_shell_reads_otherwise(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    for name in ("-dash", "--help", "new\nline", "esc\x1b[31m", "tab\there"):
        out = tmp_path / name
        r = run("convert", tmp_path / "m.pt", out)
        assert r.exit_code == 0, (name, r.stderr)
        line = next(x for x in r.stdout.splitlines() if x.startswith("identity:"))
        command = line.split("(check with: ", 1)[1].removesuffix(")").replace("ckptconv ", "", 1)
        shown = subprocess.run(["bash", "-c", f"printf '%s\\n' {command.split(' --expect ')[0].removeprefix('verify ')}"],
                               capture_output=True)
        assert shown.stdout == (str(out) + "\n").encode(), (name, command, shown.stdout)


def test_a_directory_shard_holds_only_the_metadata_ckptconv_writes(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file as save
    torch.save({"w": torch.ones(2), "v": torch.zeros(3)}, tmp_path / "m.pt")
    assert run("convert", tmp_path / "m.pt", tmp_path / "out").exit_code == 0
    shard = tmp_path / "out" / "model.safetensors"
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save(tensors, shard, metadata={"format": "np", "note": "x"})
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
                                              "size": shard.stat().st_size}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _resign(tmp_path / "out")
    r = run("verify", tmp_path / "out")
    assert r.exit_code == 1 and "__metadata__ is {'format': 'np', 'note': 'x'}" in r.stdout, r.stdout


def test_rank_files_named_past_what_is_accepted_are_refused_not_ignored(tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "data" / "deepspeed" / "z1-fp32-mlp", src)
    tag = src / "global_step2"
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag / f"zero_pp_rank_{'9' * 23}_mp_rank_00_optim_states.pt")
    _refused(run("convert", src, tmp_path / "o"), "does not spell its ranks as DeepSpeed does")
    meg = tmp_path / "meg"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "data" / "megatron" / "legacy-untied-tp2-pp2", meg)
    it = next(p for p in meg.iterdir() if p.name.startswith("iter_"))
    shutil.copytree(it / "mp_rank_00_000", it / "mp_rank_99999999_000")
    _refused(run("convert", meg, tmp_path / "o"), "mp_rank_99999999_000", "numbers of 2 to 6 digits")


def test_a_reshard_output_s_recorded_head_counts_are_the_source_s(hf_llama, tmp_path):
    out = tmp_path / "mesh"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--quiet").exit_code == 0
    mesh = json.loads((out / "mesh.json").read_text())
    mesh["rules"]["params"] = {**mesh["rules"]["params"], "kv_heads": 1}
    (out / "mesh.json").write_text(json.dumps(mesh, indent=2, sort_keys=True) + "\n")
    _resign(out)
    r = run("verify", out, "--against", hf_llama["dir"])
    assert r.exit_code == 1, r.stdout
    assert "rules.params.kv_heads is 1, the source's config.json gives 2" in r.stdout
    assert "rules of preset 'llama' are not those its recorded params" in r.stdout
