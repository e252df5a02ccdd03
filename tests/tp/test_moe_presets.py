"""MoE checkpoints under the llama preset's MoE rules (mesh target): Mixtral and Qwen3-MoE in the
per-expert form save_pretrained writes and the stacked form transformers holds in memory, Qwen2-MoE
with its shared expert. tp splits each expert's intermediate axis (checked numerically: the experts
computed per rank and summed equal the unsplit ones), routers are replicated, nothing is replicated
silently, and verify --against passes."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import run


def _save(model, d):
    model.save_pretrained(d / "per_expert")
    (d / "stacked").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "stacked" / "model.safetensors")
    shutil.copy(d / "per_expert" / "config.json", d / "stacked" / "config.json")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    import transformers as T
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    made = {}
    for kind, model in [
        ("mixtral", lambda: T.MixtralForCausalLM(T.MixtralConfig(**common, intermediate_size=48, num_local_experts=4,
                                                                  num_experts_per_tok=2))),
        ("qwen3_moe", lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**common, intermediate_size=64, num_experts=4,
                                                                      num_experts_per_tok=2, moe_intermediate_size=48,
                                                                      head_dim=8))),
        ("qwen2_moe", lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**common, intermediate_size=64, num_experts=4,
                                                                      num_experts_per_tok=2, moe_intermediate_size=48,
                                                                      shared_expert_intermediate_size=64)))]:
        torch.manual_seed(3)
        m = model()
        d = tmp_path_factory.mktemp(kind)
        _save(m, d)
        made[kind] = (d, m.state_dict())
    return made


def _rank(out, r):
    d = out / f"rank-{r:05d}"
    got = {}
    for f in sorted(d.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def _experts(x, gate_up, down):
    inter = gate_up.shape[1] // 2
    h = np.einsum("th,eih->eti", x, gate_up)
    return np.einsum("eti,ehi->eth", h[..., :inter] / (1 + np.exp(-h[..., :inter])) * h[..., inter:], down)


@pytest.mark.parametrize("form", ["per_expert", "stacked"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_split_by_tp_computes_the_same_experts(moe_models, tmp_path, kind, form):
    d, state = moe_models[kind]
    src, out = d / form, tmp_path / "out"
    r = run("reshard", src, out, "--tp", 2, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", out, "--against", src).exit_code == 0
    mesh = json.loads((out / "mesh.json").read_text())
    router = next(n for n in mesh["tensors"] if n.endswith(".gate.weight"))
    assert mesh["tensors"][router]["axis"] is None
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    p = "model.layers.0.mlp.experts."
    whole = _experts(x, state[p + "gate_up_proj"].numpy(), state[p + "down_proj"].numpy())
    total = 0
    for rank in range(2):
        got = _rank(out, rank)
        if form == "stacked":
            gate_up, down = got[p + "gate_up_proj"].numpy(), got[p + "down_proj"].numpy()
        else:   # this rank's per-expert pieces, stacked here
            pre = "model.layers.0.block_sparse_moe.experts." if kind == "mixtral" else p
            g, u, w = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            gate_up = np.stack([np.concatenate([got[f"{pre}{e}.{g}.weight"].numpy(), got[f"{pre}{e}.{u}.weight"].numpy()])
                                for e in range(4)])
            down = np.stack([got[f"{pre}{e}.{w}.weight"].numpy() for e in range(4)])
        assert gate_up.shape[1] == state[p + "gate_up_proj"].shape[1] // 2   # half of each expert per rank
        total = total + _experts(x, gate_up, down)
    np.testing.assert_allclose(total, whole, rtol=1e-4, atol=1e-5)
    if kind == "qwen2_moe":
        assert mesh["tensors"]["model.layers.0.mlp.shared_expert.down_proj.weight"]["axis"] == 1


@pytest.mark.parametrize("form", ["per_expert", "stacked"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_split_by_ep_and_tp_computes_the_same_experts(moe_models, tmp_path, kind, form):
    """--ep 2 --tp 2: rank g*2+t holds expert group g (experts 2g, 2g+1), each expert's intermediate
    axis split by t. Each rank's experts computed on its own, summed over the tp ranks of a group and
    joined over the groups, equal the unsplit experts; a reshard back to tp 1 is the source."""
    d, state = moe_models[kind]
    src, out = d / form, tmp_path / "out"
    r = run("reshard", src, out, "--tp", 2, "--ep", 2, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", out, "--against", src).exit_code == 0
    x = np.random.default_rng(2).standard_normal((3, 32)).astype(np.float32)
    p = "model.layers.0.mlp.experts."
    whole = _experts(x, state[p + "gate_up_proj"].numpy(), state[p + "down_proj"].numpy())
    combined = np.zeros_like(whole)
    for rank in range(4):
        group, got = rank // 2, _rank(out, rank)
        experts = [2 * group, 2 * group + 1]
        if form == "stacked":
            gate_up, down = got[p + "gate_up_proj"].numpy(), got[p + "down_proj"].numpy()
            assert gate_up.shape[0] == 2                 # only its group's experts
        else:
            pre = "model.layers.0.block_sparse_moe.experts." if kind == "mixtral" else p
            g, u, w = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            assert not any(f"{pre}{e}.{g}.weight" in got for e in range(4) if e not in experts)
            gate_up = np.stack([np.concatenate([got[f"{pre}{e}.{g}.weight"].numpy(), got[f"{pre}{e}.{u}.weight"].numpy()])
                                for e in experts])
            down = np.stack([got[f"{pre}{e}.{w}.weight"].numpy() for e in experts])
        assert gate_up.shape[1] == state[p + "gate_up_proj"].shape[1] // 2   # half of each expert per tp rank
        combined[experts] += _experts(x, gate_up, down)
    np.testing.assert_allclose(combined, whole, rtol=1e-4, atol=1e-5)
    back = tmp_path / "tp1"
    assert run("reshard", out, back, "--tp", 1, "--quiet").exit_code == 0
    assert run("verify", back, "--against", src).exit_code == 0
