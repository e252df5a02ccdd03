"""`reshard --target vllm` on the CPU, without vLLM (tests/vllm/ loads the outputs in vLLM itself):
each rank's fused tensors against references built here from the source with torch, the padded
vocabulary, per-expert and stacked MoE sources giving the same bytes, the MoE block computed per
rank and summed equal to the unsplit block, what is refused, and verify on the output."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import bits, run

HEADS, KV, HD = 8, 2, 8


def vllm_rank(out, rank) -> dict:
    got = {}
    for f in sorted(out.glob(f"model-rank-{rank}-part-*.safetensors")):
        got.update(load_file(f))
    return got


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_rank_files_against_a_torch_reference(hf_llama, tmp_path, tp):
    src, state = hf_llama["dir"], hf_llama["state"]
    out = tmp_path / "out"
    r = run("reshard", src, out, "--tp", tp, "--target", "vllm", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    q_per, kv_of = HEADS // tp, lambda r: (r * KV // tp if KV < tp else None)
    for rank in range(tp):
        got = vllm_rank(out, rank)
        for i in range(2):
            p = f"model.layers.{i}."
            q = state[p + "self_attn.q_proj.weight"][rank * q_per * HD:(rank + 1) * q_per * HD]
            if KV >= tp:
                k_rows = slice(rank * KV // tp * HD, (rank + 1) * KV // tp * HD)
            else:
                k_rows = slice(kv_of(rank) * HD, (kv_of(rank) + 1) * HD)
            k, v = state[p + "self_attn.k_proj.weight"][k_rows], state[p + "self_attn.v_proj.weight"][k_rows]
            assert bits(got[p + "self_attn.qkv_proj.weight"]) == bits(torch.cat([q, k, v]))
            inter = state[p + "mlp.gate_proj.weight"].shape[0] // tp
            rows = slice(rank * inter, (rank + 1) * inter)
            assert bits(got[p + "mlp.gate_up_proj.weight"]) == bits(
                torch.cat([state[p + "mlp.gate_proj.weight"][rows], state[p + "mlp.up_proj.weight"][rows]]))
            assert bits(got[p + "mlp.down_proj.weight"]) == bits(state[p + "mlp.down_proj.weight"][:, rows])
            cols = slice(rank * 64 // tp, (rank + 1) * 64 // tp)
            assert bits(got[p + "self_attn.o_proj.weight"]) == bits(state[p + "self_attn.o_proj.weight"][:, cols])
            for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
                assert got[p + "self_attn.attn." + s].dtype == torch.float32 and got[p + "self_attn.attn." + s] == 1.0
        assert not any("q_proj" in k or "k_proj" in k or "gate_proj" in k for k in got)
    assert run("verify", out, "--against", src).exit_code == 0


def test_vocab_padded_to_64_and_tied_embeddings_written_once(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    src = tmp_path / "src"
    LlamaForCausalLM(config).save_pretrained(src)
    embed = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    out = tmp_path / "out"
    assert run("reshard", src, out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    for rank in range(2):
        got = vllm_rank(out, rank)
        assert "model.embed_tokens.weight" not in got          # tied: the name vLLM keeps
        want = torch.cat([embed, torch.zeros(28, 32)])[rank * 64:(rank + 1) * 64]
        assert bits(got["lm_head.weight"]) == bits(want)
    assert run("verify", out, "--against", src).exit_code == 0


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral saved per expert (save_pretrained) and as its in-memory state dict (stacked)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(2)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(config)
    d = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(d / "per_expert")
    (d / "stacked").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "stacked" / "model.safetensors")
    shutil.copy(d / "per_expert" / "config.json", d / "stacked" / "config.json")
    return d, model


def test_moe_per_expert_and_stacked_give_the_same_rank_files(mixtral, tmp_path):
    d, _ = mixtral
    assert any(".experts.0.w1." in k for k in load_file(d / "per_expert" / "model.safetensors"))
    for form in ("per_expert", "stacked"):
        r = run("reshard", d / form, tmp_path / form, "--tp", 2, "--target", "vllm", "--quiet")
        assert r.exit_code == 0, r.stderr
        assert run("verify", tmp_path / form, "--against", d / form).exit_code == 0
    for rank in range(2):
        a, b = vllm_rank(tmp_path / "per_expert", rank), vllm_rank(tmp_path / "stacked", rank)
        assert sorted(a) == sorted(b) and all(bits(a[k]) == bits(b[k]) for k in a)
        assert a["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"].shape == (4, 48, 32)
        assert a["model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight"].shape == (4, 32, 24)
        assert "model.layers.0.block_sparse_moe.gate.weight" in a


def test_moe_block_per_rank_sums_to_the_whole(mixtral, tmp_path):
    """Each rank's w13/w2 pieces run the experts' MLPs on their slice of the intermediate axis; the
    partial outputs summed over ranks (the all-reduce) equal the unsplit experts, for every expert."""
    d, model = mixtral
    out = tmp_path / "out"
    assert run("reshard", d / "stacked", out, "--tp", 4, "--target", "vllm", "--quiet").exit_code == 0
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    sd = model.state_dict()
    full_w13 = sd["model.layers.0.mlp.experts.gate_up_proj"].numpy()
    full_w2 = sd["model.layers.0.mlp.experts.down_proj"].numpy()

    def experts(w13, w2):
        inter = w13.shape[1] // 2
        h = np.einsum("th,eih->eti", x, w13)
        act = h[..., :inter] / (1 + np.exp(-h[..., :inter])) * h[..., inter:]
        return np.einsum("eti,ehi->eth", act, w2)

    parts = 0
    for rank in range(4):
        got = vllm_rank(out, rank)
        base = "model.layers.0.block_sparse_moe.experts.routed_experts."
        parts = parts + experts(got[base + "w13_weight"].numpy(), got[base + "w2_weight"].numpy())
    np.testing.assert_allclose(parts, experts(full_w13, full_w2), rtol=1e-4, atol=1e-5)


def test_what_the_vllm_target_refuses(hf_llama, mixtral, tmp_path):
    src = hf_llama["dir"]
    r = run("reshard", mixtral[0] / "stacked", tmp_path / "o", "--tp", 2, "--ep", 2, "--target", "vllm")
    assert r.exit_code == 2 and "expert-parallel" in r.stderr
    r = run("reshard", src, tmp_path / "o", "--tp", 2, "--target", "vllm", "--preset", "llama")
    assert r.exit_code == 2 and "do not apply" in r.stderr
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(src, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    r = run("reshard", gpt2, tmp_path / "o", "--tp", 2, "--target", "vllm")
    assert r.exit_code == 2 and "model_type 'gpt2'" in r.stderr
    assert not (tmp_path / "o").exists()


def test_verify_catches_a_replaced_vllm_file(hf_llama, tmp_path):
    out = tmp_path / "out"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    f = out / "model-rank-1-part-0.safetensors"
    tensors = load_file(f)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name].flip(0).contiguous()
    f.unlink()   # a new file under the name (the rank directory keeps the original)
    save_file(tensors, f)
    r = run("verify", out, "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and {(p["kind"], p["file"]) for p in problems} == {("digest", str(f))}


def _llama_dir(d, sd, **config):
    d.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32,
                                               "vocab_size": 64, **config}))
    return d


def _llama_state(g=torch.Generator().manual_seed(5)):
    w = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    p = "model.layers.0."
    return {"model.embed_tokens.weight": w(64, 32), p + "self_attn.q_proj.weight": w(32, 32),
            p + "self_attn.k_proj.weight": w(16, 32), p + "self_attn.v_proj.weight": w(16, 32),
            p + "self_attn.o_proj.weight": w(32, 32), p + "mlp.gate_proj.weight": w(48, 32),
            p + "mlp.up_proj.weight": w(48, 32), p + "mlp.down_proj.weight": w(32, 48),
            "model.norm.weight": w(32), "lm_head.weight": w(64, 32)}


@pytest.mark.parametrize("case,fragment", [
    ("already fused", "become vLLM's 'model.layers.0.self_attn.qkv_proj.weight'"),
    ("gate and up differ", "fused, they must match"),
    ("k and v differ", "kv_heads x head_dim"),
    ("untied without lm_head", "no lm_head.weight"),
    ("tie as a string", "tie_word_embeddings must be true or false"),
    ("pad-vocab", "--pad-vocab do not apply"),
    ("no config", "needs the model's config.json"),
])
def test_what_does_not_fit_vllm_is_refused(tmp_path, case, fragment):
    sd, config, extra = _llama_state(), {}, []
    p = "model.layers.0."
    if case == "already fused":
        sd[p + "self_attn.qkv_proj.weight"] = torch.zeros(64, 32)
    elif case == "gate and up differ":
        sd[p + "mlp.up_proj.weight"] = torch.zeros(40, 32)
    elif case == "k and v differ":
        sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"] = torch.zeros(24, 32), torch.zeros(8, 32)
    elif case == "untied without lm_head":
        del sd["lm_head.weight"]
    elif case == "tie as a string":
        config["tie_word_embeddings"] = "true"
    elif case == "pad-vocab":
        extra = ["--pad-vocab"]
    src = _llama_dir(tmp_path / "src", sd, **config)
    if case == "no config":
        (src / "config.json").unlink()
    r = run("reshard", src, tmp_path / "out", "--tp", 2, "--target", "vllm", *extra)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and fragment in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_tied_embeddings_come_from_embed_tokens(tmp_path):
    """Tied, with a lm_head.weight that differs: transformers and vLLM both use embed_tokens."""
    sd = _llama_state()
    src = _llama_dir(tmp_path / "src", sd, tie_word_embeddings=True)
    out = tmp_path / "out"
    assert run("reshard", src, out, "--tp", 1, "--target", "vllm", "--quiet").exit_code == 0
    assert bits(vllm_rank(out, 0)["lm_head.weight"]) == bits(sd["model.embed_tokens.weight"])
    assert run("verify", out, "--against", src).exit_code == 0


def test_stacked_experts_that_do_not_fit_are_refused(mixtral, tmp_path):
    d, _ = mixtral
    sd = load_file(d / "stacked" / "model.safetensors")
    sd["model.layers.0.mlp.experts.down_proj"] = sd["model.layers.0.mlp.experts.down_proj"][:3].contiguous()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(sd, bad / "model.safetensors")
    shutil.copy(d / "stacked" / "config.json", bad / "config.json")
    r = run("reshard", bad, tmp_path / "out", "--tp", 2, "--target", "vllm")
    assert r.exit_code == 2 and "are not [E, 2I, H] and [E, H, I]" in r.stderr, r.stderr


def test_verify_ties_the_top_files_to_the_rank_shards(hf_llama, tmp_path):
    """A top-level file vLLM loads replaced by another rank's, with SHA256SUMS updated to match: the
    rank directories are intact, but vLLM would load the wrong rank; verify says so."""
    import hashlib
    out = tmp_path / "out"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    top = out / "model-rank-0-part-0.safetensors"
    top.unlink()
    shutil.copy(out / "model-rank-1-part-0.safetensors", top)
    sums = (out / "SHA256SUMS").read_text().replace(
        next(l for l in (out / "SHA256SUMS").read_text().splitlines() if top.name in l).split()[0],
        hashlib.sha256(top.read_bytes()).hexdigest())
    (out / "SHA256SUMS").write_text(sums)
    shutil.copy(out / "model-rank-1-part-0.safetensors", out / "model-rank-1-part-1.safetensors")
    r = run("verify", out, "--json")
    problems = {(p["kind"], p["file"].rsplit("/", 1)[1]) for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1
    assert ("digest", "model-rank-0-part-0.safetensors") in problems
    assert ("unlisted", "model-rank-1-part-1.safetensors") in problems


def test_dtype_cast_before_the_layout(hf_llama, tmp_path):
    """--dtype bf16: every floating tensor in the serving dtype (the scales stay float32, as vLLM holds
    them), config.json says so at the top and in every rank directory, and verify --against casts the
    source the same way before laying it out."""
    src, out = hf_llama["dir"], tmp_path / "out"
    assert run("reshard", src, out, "--tp", 2, "--target", "vllm", "--dtype", "bf16", "--quiet").exit_code == 0
    got = vllm_rank(out, 1)
    assert {str(t.dtype) for k, t in got.items() if "_scale" not in k} == {"torch.bfloat16"}
    assert {str(t.dtype) for k, t in got.items() if "_scale" in k} == {"torch.float32"}
    want = hf_llama["state"]["model.layers.1.self_attn.o_proj.weight"][:, 32:].to(torch.bfloat16)
    assert bits(got["model.layers.1.self_attn.o_proj.weight"]) == bits(want)
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout
    src = _llama_dir(tmp_path / "named", _llama_state(), torch_dtype="float32")
    assert run("reshard", src, tmp_path / "o2", "--tp", 2, "--target", "vllm", "--dtype", "bf16").exit_code == 0
    for d in (tmp_path / "o2", tmp_path / "o2" / "rank-00000"):
        assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert run("verify", tmp_path / "o2", "--against", src).exit_code == 0


def test_verify_reads_the_linked_parts_once(hf_llama, tmp_path, monkeypatch):
    """The top-level parts are the rank shards' inodes: verify hashes the bytes with the rank
    directories, not a second time for SHA256SUMS; a shard changed in place (so both names change)
    is still caught."""
    import importlib
    out = tmp_path / "out"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    hashed = []
    real = importlib.import_module("ckptconv.layouts.scan")._sha256_regular
    for user in ("layouts.sharded.check", "layouts.mesh.check", "jobs.verify.against"):   # (those that hash whole files)
        monkeypatch.setattr(importlib.import_module(f"ckptconv.{user}"), "_sha256_regular",
                            lambda p: hashed.append(p.name) or real(p))
    assert run("verify", out).exit_code == 0
    assert not any(n.startswith("model-rank-") for n in hashed) and "config.json" in hashed
    shard = out / "rank-00001" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    with open(shard, "r+b") as f:   # in place: the top-level part is the same file
        f.write(data)
    r = run("verify", out, "--json")
    problems = {(p["kind"], p["file"]) for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1 and ("digest", str(shard)) in problems, problems


def test_one_check_of_expert_numbering_for_every_mode_that_groups_experts(mixtral, tmp_path):
    """Experts 0, 1, 2, 5 of 4 (issue 28): `reshard --ep 2` put 2 and 5 in group 1 while `--target
    vllm` refused; both now refuse with the same words (tp/intervals.expert_numbers)."""
    d, _ = mixtral
    src = tmp_path / "renumbered"
    shutil.copytree(d / "per_expert", src)
    from safetensors.torch import load_file
    files = sorted(src.glob("*.safetensors"))
    for f in files:
        sd = {k.replace(".experts.3.", ".experts.5."): v for k, v in load_file(f).items()}
        save_file(sd, f)
    index = src / "model.safetensors.index.json"
    if index.exists():
        index.write_text(index.read_text().replace(".experts.3.", ".experts.5."))
    for extra in (["--ep", "2"], ["--target", "vllm"]):
        r = run("reshard", src, tmp_path / f"out{extra[0]}", "--tp", "1", *extra)
        assert r.exit_code == 2 and "are numbered 0, 1, 2, 5, not 0..3" in r.stderr, r.stderr


def test_the_vllm_target_needs_every_layer_config_json_has(tmp_path):
    sd = _llama_state()
    sd.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in sd.items() if ".layers.0." in k})
    src = _llama_dir(tmp_path / "two", sd, num_hidden_layers=2)
    assert run("reshard", src, tmp_path / "ok", "--tp", "2", "--target", "vllm").exit_code == 0
    r = run("reshard", src, tmp_path / "only", "--tp", "2", "--target", "vllm", "--only", "model.layers.0.",
            "--only", "model.embed_tokens", "--only", "model.norm", "--only", "lm_head")
    assert r.exit_code == 2 and "config.json has 2 layers; the source lacks layer(s) 1" in r.stderr, r.stderr
    r = run("reshard", src, tmp_path / "mlp", "--tp", "2", "--target", "vllm", "--only", "model.layers.0.",
            "--only", "model.layers.1.self_attn", "--only", "model.layers.1.input", "--only", "model.layers.1.post",
            "--only", "model.embed_tokens", "--only", "model.norm", "--only", "lm_head")
    assert r.exit_code == 2 and "layer 1 has no MLP weights" in r.stderr, r.stderr


def test_a_vllm_target_this_version_would_not_write_is_still_checked_as_vllm(hf_llama, tmp_path):
    """The top level of a vLLM output is checked by the vLLM layout whenever mesh.json's target names
    the engine (a model type this version does not know included), and the one line about the
    target is the one the ranks' manifests disagree with."""
    import hashlib
    out = tmp_path / "out"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    mesh = json.loads((out / "mesh.json").read_text())
    mesh["source"]["target"]["model_type"] = "nosuch"
    (out / "mesh.json").write_text(json.dumps(mesh))
    sums = (out / "SHA256SUMS").read_text().splitlines()
    digest = hashlib.sha256((out / "mesh.json").read_bytes()).hexdigest()
    (out / "SHA256SUMS").write_text("".join(f"{digest}  mesh.json\n" if line.endswith(" mesh.json") else line + "\n"
                                            for line in sums))
    r = run("verify", out, "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and len(problems) == 1, problems
    assert "source.target" in problems[0]["message"]


def test_a_layer_count_from_a_file_costs_what_the_layers_present_cost():
    """config.json's (or a recorded target's) layer count is compared with the layers present, never
    made into a range (10**12 made a set of that many: killed at 24 GB): what the check holds does
    not grow with the count."""
    import tracemalloc
    from ckptconv.errors import BadInput
    from ckptconv.layouts.vllm import names
    present = {"model.layers.0.self_attn.q_proj.weight": None, "model.layers.0.mlp.up_proj.weight": None}
    tracemalloc.start()
    try:
        with pytest.raises(BadInput, match="lacks layer"):
            names._check_layers(present, 10**7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak   # (a set of 10**7 layer numbers is over 500 MB)
    with pytest.raises(BadInput, match="beyond"):
        names._check_layers({**present, "model.layers.5.mlp.up_proj.weight": None}, 1)
    names._check_layers(present, 1)


def test_the_top_of_a_vllm_output_is_complete_and_a_forged_target_is_named(hf_llama, tmp_path):
    """vLLM reads config.json beside the parts: one missing from the top (and from SHA256SUMS) is a
    problem; a target no layout writes, recorded alike everywhere, is one too; an unreadable rank
    manifest does not turn the parts into 'no such file' lines."""
    import hashlib
    import shutil
    out = tmp_path / "out"
    assert run("reshard", hf_llama["dir"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0

    def resign_top(d):
        names = sorted(p.name for p in d.iterdir() if p.is_file() and p.name != "SHA256SUMS")
        (d / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {n}\n"
                                              for n in names))

    a = tmp_path / "a"
    shutil.copytree(out, a)
    (a / "config.json").unlink()
    resign_top(a)
    r = run("verify", a, "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and [(p["kind"], p["file"]) for p in problems] == [("missing", str(a / "config.json"))], \
        problems
    b = tmp_path / "b"
    shutil.copytree(out, b)
    (b / "rank-00001" / "manifest.json").unlink()
    r = run("verify", b, "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and not any("writes no such file" in p["message"] for p in problems), problems
    c = tmp_path / "c"
    shutil.copytree(out, c)
    mesh = json.loads((c / "mesh.json").read_text())
    mesh["source"]["target"] = {"engine": "vllm"}
    (c / "mesh.json").write_text(json.dumps(mesh))
    resign_top(c)
    r = run("verify", c, "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and any("is not a layout ckptconv writes" in p["message"] for p in problems), problems
