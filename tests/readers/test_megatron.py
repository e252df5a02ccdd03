"""Megatron checkpoints written by the real Megatron-Core 0.16.1 (4 processes on CPUs; committed under
tests/fixtures/data/megatron/, made by tests/fixtures/megatron.py): a legacy TP 2 x PP 2 one, a
torch_dist TP 2 x PP 2 one with tied embeddings, and a legacy TP 2 x EP 2 mixture of experts. Each
merges to exactly the TP 1 model whose weights every layout was loaded from (`MODEL.reference`), and
`--to hf` gives what transformers loads with Megatron's own logits. The whole matrix (TP 1/2, PP 1/2,
virtual pipeline chunks, EP 2, tied, untied, q/k/v biases, both layouts) runs in `make test-megatron`
(tests/megatron/)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import DATA, assert_clean, assert_refused, assert_same, cli, load_output, patch_pickle, run

FIXTURES = DATA / "megatron"
COMMITTED = ["legacy-untied-tp2-pp2", "dist-tied-tp2-pp2", "legacy-moe-tp2-pp1-ep2"]


def model_of(name: str) -> str:
    return name.split("-")[1]


def reference(name, root=FIXTURES) -> dict:
    """The TP 1 model's state dict (Megatron names, global layers), as Megatron saved it."""
    return load_file(root / f"{model_of(name)}.reference.safetensors")


def check_merged(out: Path, name, root=FIXTURES):
    """OUT holds exactly the reference's tensors, bit for bit."""
    want, got = reference(name, root), load_output(out)
    assert sorted(got) == sorted(want)
    for k, v in got.items():
        assert_same(v, want[k], k)


def check_logits(out: Path, name, root=FIXTURES, dtype=torch.float32):
    """transformers' from_pretrained(OUT) gives Megatron's own logits (its forward of the TP 1 model on
    the same ids, run when the fixtures were made) over the real vocabulary."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    saved = load_file(root / f"{model_of(name)}.logits.safetensors")
    with torch.no_grad():
        logits = model(saved["ids"]).logits.float()
    want = saved["logits"][..., :logits.shape[-1]]
    assert logits.shape == want.shape, (logits.shape, want.shape)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    return model


@pytest.mark.parametrize("name", COMMITTED)
def test_every_layout_merges_to_the_tp1_model_bit_for_bit(name, tmp_path):
    r = run("convert", FIXTURES / name, tmp_path / "out", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_merged(tmp_path / "out", name)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    src = manifest["source"]
    assert src["format"] == "megatron" and src["iteration"] == "iter_0000001"
    assert src["layout"] == ("torch_dist" if name.startswith("dist") else "legacy")
    assert (src["tp"], src["pp"], src["ep"]) == tuple(int(x[2:]) for x in (name.split("-")[2:] + ["ep1"])[:3])
    assert manifest["extras"]["args"]["__class__"] == "argparse.Namespace"
    from ckptconv.readers import open_checkpoint   # Megatron's order: embedding, layers in order, the rest
    names = [t.name for t in open_checkpoint(FIXTURES / name).tensors]
    layers = [int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")]
    assert names[0] == "embedding.word_embeddings.weight" and layers == sorted(layers)


def test_extra_state_and_the_tied_copy_are_left_out_and_listed(tmp_path):
    r = run("convert", FIXTURES / "legacy-untied-tp2-pp2", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    dropped = {d["name"]: d["reason"] for d in summary["dropped"]}
    assert "decoder.layers.*.self_attention.linear_qkv._extra_state" in dropped
    assert {s["name"] for s in summary["skipped_files"]} >= {"latest_checkpointed_iteration.txt"}
    # the iteration directory itself reads the same
    r = run("convert", FIXTURES / "legacy-untied-tp2-pp2" / "iter_0000001", tmp_path / "iter", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_merged(tmp_path / "iter", "legacy-untied-tp2-pp2")


@pytest.mark.parametrize("name", COMMITTED)
def test_to_hf_loads_in_transformers_with_megatrons_logits(name, tmp_path):
    out = tmp_path / "hf"
    r = run("convert", FIXTURES / name, out, "--to", "hf", "--quiet")
    assert r.exit_code == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 60 and config["num_key_value_heads"] == 2 and config["head_dim"] == 8
    assert config["architectures"] == [{"untied": "LlamaForCausalLM", "tied": "LlamaForCausalLM",
                                        "moe": "MixtralForCausalLM"}[model_of(name)]]
    model = check_logits(out, name)
    assert ("lm_head.weight" in load_output(out)) == (model_of(name) != "tied")
    if model_of(name) == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    r = run("verify", out, "--against", FIXTURES / name)   # the source laid out the same way again
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr


def test_to_hf_splits_q_k_v_per_group_and_gate_up_halves(tmp_path):
    name = "legacy-untied-tp2-pp2"
    assert run("convert", FIXTURES / name, tmp_path / "hf", "--to", "hf", "--quiet").exit_code == 0
    got, ref = load_output(tmp_path / "hf"), reference(name)
    qkv = ref["decoder.layers.1.self_attention.linear_qkv.weight"].reshape(2, 4, 8, 32)   # groups, q q k v, hd
    layer = "model.layers.1."
    assert_same(got[layer + "self_attn.q_proj.weight"], qkv[:, :2].reshape(32, 32))
    assert_same(got[layer + "self_attn.k_proj.weight"], qkv[:, 2].reshape(16, 32))
    assert_same(got[layer + "self_attn.v_proj.weight"], qkv[:, 3].reshape(16, 32))
    fc1 = ref["decoder.layers.1.mlp.linear_fc1.weight"]
    assert_same(got[layer + "mlp.gate_proj.weight"], fc1[:48])
    assert_same(got[layer + "mlp.up_proj.weight"], fc1[48:])
    assert_same(got["model.embed_tokens.weight"], ref["embedding.word_embeddings.weight"][:60])


def test_inspect_plan_verify_and_dtype(tmp_path):
    src = FIXTURES / "legacy-moe-tp2-pp1-ep2"
    r = run("inspect", src, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "megatron"
    assert run("plan", src, "--json").exit_code == 0
    assert run("convert", src, tmp_path / "out", "--dtype", "bf16", "--quiet").exit_code == 0
    got, want = load_output(tmp_path / "out"), reference("legacy-moe-tp2-pp1-ep2")
    for k, v in got.items():
        assert_same(v, want[k].to(torch.bfloat16), k)
    r = run("verify", tmp_path / "out", "--against", src)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr
    r = run("verify", tmp_path / "out", "--against", FIXTURES / "legacy-untied-tp2-pp2")
    assert r.exit_code == 1


def test_reshard_straight_from_megatron(tmp_path):
    """TP 2 x PP 2 to TP 4 without writing the merged model: each rank holds what Megatron's own TP 4
    rank would (whole query groups; its gate rows, then its up rows), and the pieces join back."""
    src = FIXTURES / "legacy-untied-tp2-pp2"
    r = run("reshard", src, tmp_path / "tp2", "--tp", 2, "--quiet")
    assert r.exit_code == 0, r.stderr
    mesh = json.loads((tmp_path / "tp2" / "mesh.json").read_text())
    assert mesh["rules"]["name"] == "megatron"
    ref = reference("legacy-untied-tp2-pp2")
    ranks = [load_file(tmp_path / "tp2" / f"rank-0000{i}" / "model.safetensors") for i in range(2)]
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    assert_same(torch.cat([ranks[0][fc1][:24], ranks[1][fc1][:24], ranks[0][fc1][24:], ranks[1][fc1][24:]]), ref[fc1])
    assert run("verify", tmp_path / "tp2", "--against", src).exit_code == 0
    # a group-of-heads split cannot go past the query groups: refused, as Megatron itself cannot
    r = run("reshard", src, tmp_path / "tp4", "--tp", 4)
    assert r.exit_code == 2 and "linear_qkv" in r.stderr and not (tmp_path / "tp4").exists(), r.stderr
    r = run("reshard", src, tmp_path / "vllm", "--tp", 2, "--to", "hf", "--target", "vllm", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", tmp_path / "vllm", "--against", src).exit_code == 0


def test_two_workers_write_what_one_does(tmp_path):
    from tests.e2e.test_distributed import same_tree
    src = FIXTURES / "dist-tied-tp2-pp2"
    r = run("convert", src, tmp_path / "two", "--max-shard-size", "20KB", "--to", "hf", "--quiet", "--workers", 2)
    assert r.exit_code == 0, r.stderr
    assert run("convert", src, tmp_path / "one", "--max-shard-size", "20KB", "--to", "hf", "--quiet",
               "--workers", 1).exit_code == 0
    same_tree(tmp_path / "two", tmp_path / "one")


# --- Refusals: exit 2, one line naming the rank and what disagrees, nothing written -----------------

def _refused(r, out: Path, *fragments):
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: "), r.stderr
    assert_clean(r.stderr)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert not out.exists() and not (out.parent / f".{out.name}.ckptconv-tmp").exists()


def _copy(tmp_path, name="legacy-untied-tp2-pp2") -> Path:
    src = tmp_path / name
    shutil.copytree(FIXTURES / name, src)
    return src


def test_a_missing_rank_is_refused_naming_it(tmp_path):
    src = _copy(tmp_path)
    shutil.rmtree(src / "iter_0000001" / "mp_rank_01_001")
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "rank (tp 1, pp 1, ep 0) is missing",
             "mp_rank_01_001/model_optim_rng.pt", "tp 2 x pp 2 x ep 1")


def test_a_rank_twice_or_outside_the_mesh_is_refused(tmp_path):
    src = _copy(tmp_path)
    it = src / "iter_0000001"
    shutil.copytree(it / "mp_rank_01_001", it / "mp_rank_001_001")
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "rank (tp 1, pp 1, ep 0)", "mp_rank_01_001")
    shutil.rmtree(it / "mp_rank_001_001")
    shutil.copytree(it / "mp_rank_01_001", it / "mp_rank_02_001")
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "mp_rank_02_001", "outside the mesh")


def test_ranks_of_another_run_are_refused(tmp_path):
    src = _copy(tmp_path)
    moe = FIXTURES / "legacy-moe-tp2-pp1-ep2" / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt"
    shutil.copy(moe, src / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt")
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "mp_rank_01_001", "rank (tp 1, pp 1, ep 0)",
             "files of different runs")


def _a_later_save(b: bytes) -> bytes:
    """Iteration 1 -> 2 where Megatron records it: beside the model (`iteration`, memoized after
    args'), in args (`iteration`) and in the scheduler (`num_steps`)."""
    for old, new in ((b"iterationq<K\x01", b"iterationq<K\x02"), (b"h<K\x01", b"h<K\x02"),
                     (b"num_stepsr{\x01\x00\x00K\x01", b"num_stepsr{\x01\x00\x00K\x02")):
        assert b.count(old) == 1
        b = b.replace(old, new)
    return b


@pytest.mark.parametrize("edit, fragment", [
    (_a_later_save, "iteration 2, rank (tp 0, pp 0, ep 0)'s 1"),
    (lambda b: b.replace(b"/checkpoints/run", b"/checkpoints/ruN"), "args (sha256)"),
])
def test_ranks_of_different_saves_are_refused(tmp_path, edit, fragment):
    """One rank file of a later save (or whose args differ: another run's) beside the others: the
    rule DeepSpeed's rank files are held to (readers.one_save)."""
    src = _copy(tmp_path)
    patch_pickle(src / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt", edit)
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "mp_rank_01_001/model_optim_rng.pt: rank (tp 1, "
             "pp 1, ep 0): ", fragment, "files of different saves")


def test_a_truncated_rank_file_is_refused_naming_it(tmp_path):
    src = _copy(tmp_path)
    f = src / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:5000])
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "mp_rank_00_001/model_optim_rng.pt")


def test_a_tracker_that_names_no_iteration_is_refused(tmp_path):
    src = _copy(tmp_path)
    (src / "latest_checkpointed_iteration.txt").write_text("../../etc")
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "latest_checkpointed_iteration.txt",
             "not an iteration number")
    (src / "latest_checkpointed_iteration.txt").write_text("7")
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "iter_0000007", "not a directory")


def test_a_torch_dist_directory_of_another_backend_or_without_common_pt_is_refused(tmp_path):
    src = _copy(tmp_path, "dist-tied-tp2-pp2")
    it = src / "iter_0000001"
    meta = json.loads((it / "metadata.json").read_text())
    (it / "metadata.json").write_text(json.dumps({**meta, "sharded_backend": "zarr"}))
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "metadata.json", "'zarr'")
    (it / "metadata.json").write_text(json.dumps(meta))
    (it / "common.pt").unlink()
    _refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "without common.pt")


def test_to_hf_refuses_what_the_llama_family_lacks():
    from ckptconv.errors import UsageError
    from ckptconv.tp import megatron as mt
    args = {"num_attention_heads": 4, "hidden_size": 32, "num_layers": 2, "padded_vocab_size": 64,
            "normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute"}
    with pytest.raises(UsageError) as e:
        mt.hf_config(mt.arch(args, "args"))
    assert "RMSNorm" in str(e.value) and "SwiGLU" in str(e.value) and "rotary" in str(e.value)


class Unknown:   # a class of no allowlist, pickled by name into args
    pass


def _tiny_legacy(root: Path, tp=1, pp=1, qkv=(24, 8), **args):
    """A one-file legacy checkpoint written here with torch.save: args as given, one 1-layer stage."""
    import argparse
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, padded_vocab_size=16, normalization="RMSNorm",
                swiglu=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = {"embedding.word_embeddings.weight": torch.zeros(16, 8),
             "decoder.layers.0.input_layernorm.weight": torch.ones(8),
             "decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(qkv)}
    f = root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    f.parent.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**{**base, **args}), "checkpoint_version": 3.0, "iteration": 1,
                "model": model}, f)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def test_sizes_args_claims_cost_nothing_beyond_the_files(tmp_path):
    """args is input: 2**40 ranks, layers or experts are refused in steps bounded by the files present."""
    for i, claim in enumerate([dict(tensor_model_parallel_size=2**40), dict(num_layers=2**40),
                               dict(num_experts=2**40)]):
        src = _tiny_legacy(tmp_path / f"c{i}", **claim)
        r = run("convert", src, tmp_path / "out")
        _refused(r, tmp_path / "out", str(src))
    r = run("convert", _tiny_legacy(tmp_path / "neg", num_layers=-3), tmp_path / "out")
    _refused(r, tmp_path / "out", "args.num_layers is -3")


def _tiny_dist(root: Path, stacked, **args):
    """A torch_dist checkpoint written here with torch's DCP (one process): common.pt's args as
    given, the embedding and one stacked layer tensor of shape `stacked`."""
    import argparse
    import warnings
    import torch.distributed.checkpoint as dcp
    it = root / "iter_0000001"
    it.mkdir(parents=True)
    base = dict(num_layers=stacked[0], hidden_size=8, num_attention_heads=2, padded_vocab_size=16,
                normalization="RMSNorm", swiglu=True)
    torch.save({"args": argparse.Namespace(**{**base, **args}), "checkpoint_version": 3.0, "iteration": 1},
               it / "common.pt")
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                  "common_backend": "torch", "common_backend_version": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (no process group: one process saves)
        dcp.save({"embedding.word_embeddings.weight": torch.zeros(16, 8),
                  "decoder.layers.input_layernorm.weight": torch.ones(stacked)}, checkpoint_id=str(it), no_dist=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def test_counts_args_claims_are_bounded_by_the_elements_present(tmp_path):
    """A count from args is looked at only as far as the tensors it cuts hold elements: 2**40 layers
    stacked in a torch_dist tensor of none, 2**38 query groups cut out of an empty linear_qkv (--to
    hf) were each a MemoryError; now one line, in a process whose memory is capped."""
    src = _tiny_dist(tmp_path / "dist", (2**40, 0))
    r = cli("convert", src, tmp_path / "out")
    assert_refused(r, tmp_path / "out", "decoder.layers.input_layernorm.weight", "stacks 1099511627776 layers of no "
                   "elements")
    groups = 2**38
    src = _tiny_legacy(tmp_path / "hf", qkv=(3 * groups, 0), num_attention_heads=groups, group_query_attention=True,
                       num_query_groups=groups, kv_channels=1, position_embedding_type="rope", add_bias_linear=False)
    r = cli("convert", src, tmp_path / "out", "--to", "hf")
    assert_refused(r, tmp_path / "out", "linear_qkv.weight", f"not {groups} query groups")
    assert run("convert", src, tmp_path / "out", "--quiet").exit_code == 0   # (Megatron's names: nothing is cut)


def test_a_class_of_no_allowlist_in_args_is_recorded_as_data_naming_it(tmp_path):
    # (issue 30: state that is not a tensor never blocks weights; it becomes an inert record)
    src = _tiny_legacy(tmp_path / "c", tokenizer=Unknown())
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert "tests.readers.test_megatron.Unknown (x1)" in r.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["extras"]["args"]["tokenizer"]["__class__"] == "tests.readers.test_megatron.Unknown"
    assert manifest["source"]["placeholders"] == [{"global": "tests.readers.test_megatron.Unknown", "count": 1}]



@pytest.mark.parametrize("version", ["0.13.1", "0.15.3"])
def test_megatron_core_0_13_to_0_15_torch_dist_reads_without_allow_global(tmp_path, version):
    """Megatron-Core 0.13-0.15 pickle their planner's MCoreSavePlan into .metadata (planner_data), and
    0.15 its MCoreMetadata as the whole file: inert records, as torch's SavePlan and Metadata are. The
    same model saved by 0.13.1 and 0.15.3 (committed beside 0.16.1's) merges to the same TP 1 weights,
    and --to hf gives the same files as from 0.16.1's save."""
    name = f"dist-tied-tp2-pp2-mcore{version}"
    out, hf, hf16 = tmp_path / "out", tmp_path / "hf", tmp_path / "hf16"
    r = run("convert", FIXTURES / name, out)
    assert r.exit_code == 0, r.stderr
    check_merged(out, name)
    assert run("convert", FIXTURES / name, hf, "--to", "hf", "--quiet").exit_code == 0
    assert run("convert", FIXTURES / "dist-tied-tp2-pp2", hf16, "--to", "hf", "--quiet").exit_code == 0
    assert load_file(hf / "model.safetensors").keys() == load_file(hf16 / "model.safetensors").keys()
    assert (hf / "model.safetensors").read_bytes() == (hf16 / "model.safetensors").read_bytes()
