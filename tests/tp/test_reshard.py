"""reshard: per-rank pieces checked against independent per-head references, a numerical TP forward
pass in numpy, round trips through tp 8 -> 4 -> 1, quantized scales, expert parallelism, errors."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.fixtures import grok as gf
from tests.helpers import output_files, run, split_all_rules


def rank_tensors(out, rank) -> dict:
    d = Path(out) / f"rank-{rank:05d}"
    got = {}
    for f in sorted(set(output_files(d).values())):
        got.update(load_file(d / f))
    return got


def reshard(src, out, *extra):
    r = run("reshard", src, out, "--quiet", *extra)
    assert r.exit_code == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def llama_state(hf_llama):
    return {k: v.numpy() for k, v in hf_llama["state"].items()}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_pieces_match_per_head_reference(hf_llama, llama_state, tmp_path, tp):
    out = reshard(hf_llama["dir"], tmp_path / "out", "--tp", tp)
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["tp"] == tp and mesh["ranks"] == tp and mesh["rules"]["name"] == "llama"
    H, KV, hd = 8, 2, 8
    ranks = [rank_tensors(out, r) for r in range(tp)]
    for name, full in llama_state.items():
        entry = mesh["tensors"][name]
        assert entry["shape"] == list(full.shape) and entry["dtype"] == "F32"
        pieces = [ranks[r][name] for r in range(tp)]
        if "k_proj" in name or "v_proj" in name:
            heads = full.reshape(KV, hd, -1)
            for r, piece in enumerate(pieces):
                mine = range(r * KV // tp, (r + 1) * KV // tp) if KV >= tp else [r * KV // tp]
                assert np.array_equal(piece, heads[list(mine)].reshape(-1, full.shape[1])), (name, r)
            continue
        if "q_proj" in name:
            heads = full.reshape(H, hd, -1)
            for r, piece in enumerate(pieces):
                assert np.array_equal(piece, heads[r * H // tp:(r + 1) * H // tp].reshape(-1, full.shape[1]))
        axis = entry["axis"]
        if axis is None:
            assert all(np.array_equal(p, full) for p in pieces), name
        else:
            assert "ranges" not in entry
            assert all(p.shape[axis] == full.shape[axis] // tp for p in pieces)
            assert np.array_equal(np.concatenate(pieces, axis=axis), full), name
    expected_axis = {"o_proj": 1, "down_proj": 1, "gate_proj": 0, "embed_tokens": 0, "lm_head": 0, "norm": None}
    for key, axis in expected_axis.items():
        assert all(e["axis"] == axis for n, e in mesh["tensors"].items() if key in n), key
    if tp > KV:
        assert "ranges" in mesh["tensors"]["model.layers.0.self_attn.k_proj.weight"]


def _attention(x, q, k, v, o, heads, kv_heads, hd):
    """Causal multi-head attention without positional encoding, GQA by repeating kv heads."""
    t = x.shape[0]
    Q = (x @ q.T).reshape(t, heads, hd).transpose(1, 0, 2)
    K = (x @ k.T).reshape(t, kv_heads, hd).transpose(1, 0, 2)
    V = (x @ v.T).reshape(t, kv_heads, hd).transpose(1, 0, 2)
    rep = heads // kv_heads
    K, V = np.repeat(K, rep, axis=0), np.repeat(V, rep, axis=0)
    s = Q @ K.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((t, t), -1e9), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ V).transpose(1, 0, 2).reshape(t, heads * hd) @ o.T


def _mlp(x, gate, up, down):
    g = x @ gate.T
    return ((g / (1 + np.exp(-g))) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_forward_matches_unsplit(hf_llama, llama_state, tmp_path, tp):
    out = reshard(hf_llama["dir"], tmp_path / "out", "--tp", tp)
    H, KV, hd = 8, 2, 8
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float64)
    p = "model.layers.1."
    full = {k: llama_state[p + k].astype(np.float64) for k in
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]}
    want_attn = _attention(x, *(full[f"self_attn.{n}_proj.weight"] for n in "qkvo"), H, KV, hd)
    want_mlp = _mlp(x, full["mlp.gate_proj.weight"], full["mlp.up_proj.weight"], full["mlp.down_proj.weight"])
    attn = mlp = 0
    for r in range(tp):
        w = {k: v.astype(np.float64) for k, v in rank_tensors(out, r).items() if k.startswith(p)}
        local_kv = w[p + "self_attn.k_proj.weight"].shape[0] // hd
        attn = attn + _attention(x, *(w[p + f"self_attn.{n}_proj.weight"] for n in "qkvo"), H // tp, local_kv, hd)
        mlp = mlp + _mlp(x, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    np.testing.assert_allclose(attn, want_attn, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mlp, want_mlp, rtol=1e-9, atol=1e-12)


def test_round_trip_8_4_1_equals_source(hf_llama, llama_state, tmp_path):
    tp8 = reshard(hf_llama["dir"], tmp_path / "tp8", "--tp", 8)
    tp4 = reshard(tp8, tmp_path / "tp4", "--tp", 4)
    tp1 = reshard(tp4, tmp_path / "tp1", "--tp", 1)
    direct4 = tmp_path / "direct4"
    reshard(hf_llama["dir"], direct4, "--tp", 4)
    for r in range(4):  # resharding 8 -> 4 gives what a direct tp 4 gives, file for file
        for f in sorted((direct4 / f"rank-{r:05d}").iterdir()):
            if f.name not in ("manifest.json", "SHA256SUMS"):
                assert (tp4 / f"rank-{r:05d}" / f.name).read_bytes() == f.read_bytes(), f.name
    got = rank_tensors(tp1, 0)
    assert set(got) == set(llama_state)
    for name, full in llama_state.items():
        assert np.array_equal(got[name], full), name
    mesh8 = json.loads((tp8 / "mesh.json").read_text())["tensors"]
    mesh1 = json.loads((tp1 / "mesh.json").read_text())["tensors"]
    assert {n: e["sha256"] for n, e in mesh8.items()} == {n: e["sha256"] for n, e in mesh1.items()}
    import hashlib
    assert mesh1["lm_head.weight"]["sha256"] == hashlib.sha256(llama_state["lm_head.weight"].tobytes()).hexdigest()
    assert mesh1["model.layers.0.self_attn.o_proj.weight"]["sha256"] == \
        hashlib.sha256(llama_state["model.layers.0.self_attn.o_proj.weight"].tobytes()).hexdigest()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    d = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(d)
    return d, {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_fused_qkv_per_head(gpt2_dir, tmp_path, tp):
    src, state = gpt2_dir
    out = reshard(src, tmp_path / "out", "--tp", tp)
    mesh = json.loads((out / "mesh.json").read_text())["tensors"]
    ranks = [rank_tensors(out, r) for r in range(tp)]
    names = set(ranks[0])
    wname = next(n for n in names if n.endswith("h.0.attn.c_attn.weight"))
    full = state["transformer.h.0.attn.c_attn.weight"]  # Conv1D: [in, 3 * hidden], q | k | v
    H, hd = 4, 16
    for r in range(tp):
        heads = range(r * H // tp, (r + 1) * H // tp)
        want = np.concatenate([full[:, part * 64 + h * hd: part * 64 + (h + 1) * hd] for part in range(3) for h in heads],
                              axis=1)
        assert np.array_equal(ranks[r][wname], want)
    assert mesh[wname]["axis"] == 1 and "ranges" in mesh[wname]
    proj = next(n for n in names if n.endswith("h.0.attn.c_proj.weight"))
    assert mesh[proj]["axis"] == 0  # row-parallel in [in, out] layout
    bias = next(n for n in names if n.endswith("h.0.attn.c_proj.bias"))
    assert mesh[bias]["axis"] is None
    fc_bias = next(n for n in names if n.endswith("h.0.mlp.c_fc.bias"))
    assert mesh[fc_bias]["axis"] == 0


def test_grok_quantized_scales_follow_weights(tmp_path):
    params = gf.make_params(1, seed=2)
    src = gf.write_dir(tmp_path / "src", params)
    out = reshard(src, tmp_path / "out", "--tp", 2, "--heads", 4, "--kv-heads", 2, "--head-dim", 32)
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["rules"]["name"] == "grok-1"
    ranks = [rank_tensors(out, r) for r in range(2)]
    for path, value in params.items():
        if not isinstance(value, gf.QuantizedWeight8bit):
            continue
        name = path.replace("/", ".")
        entry = mesh["tensors"][name + ".weight"]
        axis = entry["axis"]
        assert axis is not None, name
        dense = [gf.dequantize_ref(gf.QuantizedWeight8bit(ranks[r][name + ".weight"], ranks[r][name + ".scales"]),
                                   np.float32) for r in range(2)]
        assert np.array_equal(np.concatenate(dense, axis=axis), gf.dequantize_ref(value, np.float32)), name
    # attention output is row-parallel on its grouped K axis: its 8 scale groups split 4 + 4
    o = "transformer.decoder_layer_0.multi_head_attention.linear.w"
    assert mesh["tensors"][o + ".weight"]["axis"] == 0 and mesh["tensors"][o + ".scales"]["axis"] == 0
    assert ranks[0][o + ".scales"].shape == (4, 64)


def test_group_straddling_ranks_refused(tmp_path):
    params = gf.make_params(1, seed=2)
    src = gf.write_dir(tmp_path / "src", params)
    rules = tmp_path / "rules.toml"  # linear_1 [E, F=256, D] has 8 groups of 32 rows on F: tp 16 cuts them
    rules.write_text('layout = "jax"\n[[rule]]\npattern = ".*moe\\\\.linear_1\\\\.w\\\\.weight"\nkind = "row"\n')
    r = run("reshard", src, tmp_path / "out", "--tp", 16, "--rules", rules)
    assert r.exit_code == 2 and "straddle" in r.stderr and "--dequantize" in r.stderr
    assert not (tmp_path / "out").exists()
    r = run("reshard", src, tmp_path / "out", "--tp", 8, "--rules", rules, "--allow-replicate", ".*")
    assert r.exit_code == 0, r.stderr
    r = run("reshard", src, tmp_path / "out2", "--tp", 16, "--heads", 4, "--kv-heads", 2, "--head-dim", 32)
    assert r.exit_code == 2 and "4 query heads cannot be split over tp=16" in r.stderr


def test_expert_parallel_grok(tmp_path):
    """--ep 2 --tp 2: each expert group on its two tp ranks, each expert's ffn axis split between them
    (mesh.json boxes), the 8-bit scales cut with their weights; verify and a reshard back to tp 1
    reassemble the source exactly."""
    params = gf.make_params(1, seed=3)
    src = gf.write_dir(tmp_path / "src", params)
    out = reshard(src, tmp_path / "out", "--tp", 2, "--ep", 2, "--heads", 4, "--kv-heads", 2, "--head-dim", 32)
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["ranks"] == 4 and mesh["format"] == "ckptconv.mesh/2"
    moe = "transformer.decoder_layer_0.moe.linear.w.weight"
    w = params["transformer/decoder_layer_0/moe/linear/w"]
    ffn = w.weight.shape[2]
    assert mesh["tensors"][moe]["boxes"][3] == [{"0": [2, 4], "2": [ffn // 2, ffn]}]
    assert np.array_equal(rank_tensors(out, 3)[moe], w.weight[2:4, :, ffn // 2:])
    assert np.array_equal(rank_tensors(out, 3)[moe.replace("weight", "scales")], w.scales[2:4, :, ffn // 2:])
    down = params["transformer/decoder_layer_0/moe/linear_1/w"]   # [E, ffn, emb], 8 groups of scales on ffn
    name = "transformer.decoder_layer_0.moe.linear_1.w."
    assert np.array_equal(rank_tensors(out, 1)[name + "scales"], down.scales[0:2, 4:8])
    assert np.array_equal(rank_tensors(out, 2)[name + "weight"], down.weight[2:4, :ffn // 2])
    q = "transformer.decoder_layer_0.multi_head_attention.query.w.weight"
    assert np.array_equal(rank_tensors(out, 2)[q], rank_tensors(out, 0)[q])  # same tp rank in another group
    assert run("verify", out, "--against", src).exit_code == 0
    back = reshard(out, tmp_path / "tp1", "--tp", 1, "--heads", 4, "--kv-heads", 2, "--head-dim", 32)
    assert np.array_equal(rank_tensors(back, 0)[name + "weight"], down.weight)
    assert run("verify", back, "--against", src).exit_code == 0


def test_indivisible_dimension_named(hf_llama, tmp_path):
    r = run("reshard", hf_llama["dir"], tmp_path / "out", "--tp", 3)
    assert r.exit_code == 2 and "tp=3" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_no_preset_fits_exits_2(torch_fixtures, tmp_path):
    r = run("reshard", torch_fixtures["train"], tmp_path / "out", "--tp", 2)
    assert r.exit_code == 2 and "no partition preset fits" in r.stderr


def test_rules_file(torch_fixtures, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('layout = "torch"\n[[rule]]\npattern = "model\\\\.0\\\\.weight"\nkind = "column"\n'
                     '[[rule]]\npattern = "model\\\\.2\\\\.weight"\naxis = 1\n')
    out = reshard(torch_fixtures["train"], tmp_path / "out", "--tp", 1, "--rules", rules, "--only", "model")
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["tensors"]["model.0.weight"]["axis"] == 0 and mesh["tensors"]["model.2.weight"]["axis"] == 1
    assert mesh["tensors"]["model.0.bias"]["axis"] is None
    assert "model\\\\.0" in mesh["rules"]["params"]["file"]


@pytest.mark.parametrize("rule, why", [
    ('pattern = ".*"\naxis = "replicate"', "a rule's axis must be an integer, not 'replicate'"),
    ('pattern = ".*"\naxis = 1.5', "a rule's axis must be an integer, not 1.5"),
    ('pattern = ".*"\naxis = true', "a rule's axis must be an integer, not True"),
    ("pattern = 3\naxis = 0", "a rule's pattern must be a string, not 3"),
    ('pattern = ".*"\nkind = "qkv"\nheads = "4"\nkv_heads = 2\nhead_dim = 8', "a rule's heads must be an integer"),
    ('pattern = ".*"\nkind = "qkv"\nheads = 0\nkv_heads = 2\nhead_dim = 8', "heads must be positive, not 0"),
    ('pattern = ".*"\naxis = 0\nexperts = "yes"', "a rule's experts must be true or false, not 'yes'"),
    # what a file says is shown bounded (a 4,000-digit count, a long pattern), and an integer Python
    # will not read (4,300 digits or more) is the file's fault, not an unexpected error
    ('pattern = ".*"\nkind = "qkv"\nheads = -' + "9" * 4000 + '\nkv_heads = 2\nhead_dim = 8',
     "heads must be positive, not <int of 13288 bits>"),
    ('pattern = ".*"\naxis = ' + "9" * 5000, "cannot read TOML: Exceeds the limit"),
    ('pattern = "(' + "a" * 10_000 + '"\naxis = 0', "rule '(aaaa"),
])
def test_a_rules_file_of_the_wrong_types_is_a_usage_error(torch_fixtures, tmp_path, rule, why):
    """A value of the wrong type in a rules file is one clear line (it was an unexpected TypeError)."""
    rules = tmp_path / "rules.toml"
    rules.write_text(f'layout = "torch"\n[[rule]]\n{rule}\n')
    r = run("reshard", torch_fixtures["train"], tmp_path / "out", "--tp", 2, "--rules", rules)
    assert r.exit_code == 2 and why in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert len(r.stderr) < 400 and "unexpected" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("body", ["rule = [1]", "rule = 5", 'rule = "x"'])
def test_rules_that_are_not_tables_are_a_usage_error(torch_fixtures, tmp_path, body):
    rules = tmp_path / "rules.toml"
    rules.write_text(f'layout = "torch"\n{body}\n')
    r = run("reshard", torch_fixtures["train"], tmp_path / "out", "--tp", 2, "--rules", rules)
    assert r.exit_code == 2 and "'rule' must be [[rule]] tables" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_dry_run_explains_plan(hf_llama, tmp_path):
    r = run("reshard", hf_llama["dir"], "--tp", 4, "--dry-run")
    assert r.exit_code == 0
    assert "llama rules" in r.stdout and "column(kv_heads=2, head_dim=8)" in r.stdout and "replicated:" in r.stdout
    r = run("reshard", hf_llama["dir"], "--tp", 4, "--dry-run", "--json")
    plan = json.loads(r.stdout)
    assert plan["ranks"] == 4 and plan["split"] == 16 and len(plan["replicated"]) == 5


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             intermediate_size=128, vocab_size=96, bos_token_id=0, eos_token_id=0))
    d = tmp_path_factory.mktemp("neox")
    model.save_pretrained(d)
    return d, {k: v.numpy() for k, v in model.state_dict().items()}


def test_gpt_neox_fused_qkv_keeps_whole_heads(neox_dir, tmp_path):
    src, state = neox_dir
    out = reshard(src, tmp_path / "out", "--tp", 2)
    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["rules"]["name"] == "gpt-neox"
    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    full = state[name]  # [heads x (q, k, v) x head_dim, hidden]: a rank's heads are contiguous rows
    per_head = full.reshape(4, 3 * 16, 64)
    for r in range(2):
        assert np.array_equal(rank_tensors(out, r)[name], per_head[2 * r:2 * r + 2].reshape(-1, 64))
    assert mesh["tensors"]["gpt_neox.layers.0.attention.dense.weight"]["axis"] == 1


@pytest.mark.parametrize("preset", ["llama", "gpt2", "gpt-neox", "grok-1"])
def test_dry_run_for_every_preset(preset, hf_llama, gpt2_dir, neox_dir, tmp_path):
    if preset == "grok-1":
        src = gf.write_dir(tmp_path / "grok", gf.make_params(1, seed=4))
        extra = ["--heads", 4, "--kv-heads", 2, "--head-dim", 32]
    else:
        src, extra = {"llama": hf_llama["dir"], "gpt2": gpt2_dir[0], "gpt-neox": neox_dir[0]}[preset], []
    r = run("reshard", src, "--tp", 2, "--dry-run", *extra)
    assert r.exit_code == 0, r.stderr
    assert f"plan: {preset} rules" in r.stdout and "totals:" in r.stdout
    assert not any(tmp_path.glob("*/mesh.json"))


def test_pad_vocab(tmp_path):
    """A vocabulary that does not divide by tp is refused, or zero-padded with --pad-vocab."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    src = tmp_path / "src"
    model.save_pretrained(src)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    r = run("reshard", src, tmp_path / "refused", "--tp", 4)
    assert r.exit_code == 2 and "130" in r.stderr and "tp=4" in r.stderr
    out = reshard(src, tmp_path / "tp4", "--tp", 4, "--pad-vocab")
    mesh = json.loads((out / "mesh.json").read_text())["tensors"]["model.embed_tokens.weight"]
    assert mesh["shape"] == [130, 64] and mesh["padded_shape"] == [132, 64] and "ranges" not in mesh
    pieces = [rank_tensors(out, r)["model.embed_tokens.weight"] for r in range(4)]
    assert all(p.shape == (33, 64) for p in pieces)
    assert np.array_equal(np.concatenate(pieces)[:130], state["model.embed_tokens.weight"])
    assert not pieces[3][-2:].any()
    assert run("verify", out, "--against", src).exit_code == 0
    back = reshard(out, tmp_path / "tp1", "--tp", 1)
    assert np.array_equal(rank_tensors(back, 0)["lm_head.weight"], state["lm_head.weight"])


def test_reshard_takes_convert_selection_flags(tmp_path):
    """docs/dcp.md's example: a training state whose model names carry the wrapper's prefix (kept whole:
    `--state-dict auto` would unwrap `model` itself)."""
    g = torch.Generator().manual_seed(3)
    model = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g),
             "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=g)}
    src = tmp_path / "train.pt"
    torch.save({"model": model, "optim": {"state": {0: {"exp_avg": torch.zeros(3)}}}}, src)
    out = tmp_path / "tp2"
    r = run("reshard", src, out, "--tp", "2", "--state-dict", "none", "--only", "model.", "--strip-prefix", "model",
            "--preset", "llama", "--heads", "2", "--kv-heads", "2", "--head-dim", "2", "--quiet")
    assert r.exit_code == 0, r.stderr
    mesh = json.loads((out / "mesh.json").read_text())
    assert sorted(mesh["tensors"]) == sorted(model)          # "model." once, the optimizer left out
    assert mesh["tensors"]["model.layers.0.mlp.up_proj.weight"]["axis"] == 0
    r = run("verify", out, "--against", src)                 # the recorded --only and prefix are applied
    assert r.exit_code == 0, r.stdout


def stacked_moe_state(layers=1, experts=4, hidden=16, inter=8, vocab=32):
    """Llama-like attention and experts stacked under names no preset knows (a custom MoE block)."""
    g = torch.Generator().manual_seed(7)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (8, hidden)),
                            ("self_attn.v_proj.weight", (8, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate.weight", (experts, hidden)),
                            ("mlp.moe.w_in", (experts, 2 * inter, hidden)),
                            ("mlp.moe.w_out", (experts, hidden, inter))]:
            sd[p + name] = torch.randn(*shape, generator=g)
    sd["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    return sd


def test_no_silent_replication(tmp_path):
    """A stacked-expert MoE read with rules that do not know it: the experts would be whole on every
    rank. Refused, naming them and their bytes per rank, whether the preset was guessed from names or
    config.json named a family whose rules leave them out; --allow-replicate is the way to ask."""
    src = tmp_path / "moe.pt"
    torch.save(stacked_moe_state(), src)
    heads = ["--heads", 4, "--kv-heads", 2, "--head-dim", 4]
    r = run("reshard", src, tmp_path / "out", "--tp", 2, *heads)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model.layers.0.mlp.moe.w_in (4.10 KB per rank)" in r.stderr and "guessed" in r.stderr
    assert "mlp.gate.weight" not in r.stderr            # the router: a rule says replicate
    assert not (tmp_path / "out").exists()
    d = tmp_path / "with_config"
    d.mkdir()
    torch.save(stacked_moe_state(), d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "head_dim": 4, "hidden_size": 16}))
    r = run("reshard", d, tmp_path / "out", "--tp", 2)
    assert r.exit_code == 2 and "more than 1% of the model" in r.stderr and "mlp.moe.w_out" in r.stderr
    r = run("reshard", d, tmp_path / "out", "--tp", 2, "--dry-run")
    assert r.exit_code == 0 and "a run would stop:" in r.stdout and "whole on every rank" in r.stdout
    r = run("reshard", d, tmp_path / "out", "--tp", 2, "--allow-replicate", r".*\.moe\..*", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", tmp_path / "out", "--against", d).exit_code == 0


def test_global_digests_of_small_and_large_split_tensors(tmp_path):
    """A tensor whose every rank piece is small has its global digest taken in the writing thread
    (layouts/files.InlineTap); a larger one through the hash threads. mesh.json records, for both,
    the SHA-256 of the whole tensor's bytes, and verify reassembles the pieces against it."""
    import hashlib
    g = torch.Generator().manual_seed(1)
    state = {"small": torch.randn(64, 4, generator=g), "large": torch.randn(512, 64, generator=g),
             "edge": torch.randn(4096, 4, generator=g)}   # 64 KiB: hashing.SMALL exactly
    torch.save(state, tmp_path / "m.pt")
    rules = split_all_rules(tmp_path)
    out = reshard(tmp_path / "m.pt", tmp_path / "out", "--tp", 2, "--rules", rules)
    mesh = json.loads((out / "mesh.json").read_text())["tensors"]
    for name, t in state.items():
        assert mesh[name]["sha256"] == hashlib.sha256(t.numpy().tobytes()).hexdigest(), name
    assert run("verify", out).exit_code == 0
