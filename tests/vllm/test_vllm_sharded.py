"""`reshard --target vllm` checked by the engine itself: vLLM (CPU, its own venv: `make test-vllm`)
loads the output with load_format="sharded_state" at tp 1 and 2 and generates the same greedy tokens
as from the source directory, and each rank file holds exactly the keys, shapes and dtypes vLLM's
loader requires, bit for bit what a normal vLLM load of the source puts in those parameters. A
tampered output (one rank's q heads swapped) changes the tokens: the test can fail.

Skipped unless CKPTCONV_VLLM_PYTHON names the vLLM venv's python (the make target sets it)."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import bits, run

VLLM_PYTHON = os.environ.get("CKPTCONV_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).exists(),
                                reason="vLLM's venv not given (make test-vllm)")
HERE = Path(__file__).parent


def engine(model_dir, load_format, tp, dump=None) -> list:
    """Greedy tokens from one vLLM run in its own process group (ended, with its workers, after)."""
    env = {**os.environ, "PYTHONPATH": str(HERE / "hook"), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if dump:
        env["CKPTCONV_VLLM_DUMP"] = str(dump)
    # output to files, not pipes: vLLM's engine and worker processes inherit them and may outlive
    # the main process for a moment; the whole process group is ended once it has answered
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([VLLM_PYTHON, str(HERE / "engine.py"), str(model_dir), load_format, str(tp)], env=env,
                             stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            p.wait(timeout=600)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        assert p.returncode == 0, err.read()[-3000:]
        return json.loads(out.read().strip().splitlines()[-1])["tokens"]


def _config(kind):
    import transformers as T
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    return {"llama": (T.LlamaConfig(**common, vocab_size=500), T.LlamaForCausalLM),   # vocab: not a multiple of 64
            "qwen2": (T.Qwen2Config(**common, vocab_size=512, tie_word_embeddings=True), T.Qwen2ForCausalLM),
            "mixtral": (T.MixtralConfig(**common, vocab_size=512, num_local_experts=4, num_experts_per_tok=2),
                        T.MixtralForCausalLM),
            "qwen3_moe": (T.Qwen3MoeConfig(**common, vocab_size=512, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64, head_dim=32), T.Qwen3MoeForCausalLM)}[kind]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each model saved by save_pretrained (MoE experts per expert), in bf16, its q/k weights scaled
    up so attention is far from uniform (a wrong q/k layout then changes the tokens); the MoE models
    also as their in-memory state dict (stacked experts) saved straight to safetensors."""
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("vllm_src")
    out = {}
    for kind in ("llama", "qwen2", "mixtral", "qwen3_moe"):
        config, cls = _config(kind)
        torch.manual_seed(0)
        model = cls(config).to(torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "q_proj" in name or "k_proj" in name:
                    p.mul_(8)
        model.save_pretrained(root / kind)
        out[kind] = root / kind
        if kind in ("mixtral", "qwen3_moe"):
            stacked = root / f"{kind}-stacked"
            stacked.mkdir()
            sd = {k: v.contiguous() for k, v in model.state_dict().items()}
            assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)   # the in-memory form
            save_file(sd, stacked / "model.safetensors", metadata={"format": "pt"})
            for f in ("config.json", "generation_config.json"):
                shutil.copy(root / kind / f, stacked / f)
            out[f"{kind}-stacked"] = stacked
    return out


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory):
    """What vLLM makes of each source directory at tp 1 and 2: greedy tokens and, per rank, its
    parameters as loaded. Computed once per (model, tp)."""
    cache = {}

    def get(kind, tp):
        if (kind, tp) not in cache:
            dump = tmp_path_factory.mktemp(f"ref_{kind}_{tp}")
            cache[kind, tp] = engine(sources[kind], "auto", tp, dump), dump
        return cache[kind, tp]
    return get


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral", "mixtral-stacked", "qwen3_moe", "qwen3_moe-stacked"])
def test_vllm_loads_the_output_and_generates_the_same_tokens(sources, reference, tmp_path, kind, tp):
    from safetensors import safe_open
    out = tmp_path / "out"
    r = run("reshard", sources[kind], out, "--tp", tp, "--target", "vllm", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", out, "--against", sources[kind]).exit_code == 0
    want_tokens, ref = reference(kind.split("-")[0], tp)
    dump = tmp_path / "dump"
    dump.mkdir()
    assert engine(out, "sharded_state", tp, dump) == want_tokens
    for rank in range(tp):
        required = json.loads((dump / f"keys-rank{rank}.json").read_text())
        held = {}
        for f in sorted(out.glob(f"model-rank-{rank}-part-*.safetensors")):
            with safe_open(f, framework="pt") as st:
                held.update({k: st.get_tensor(k) for k in st.keys()})
        assert sorted(held) == sorted(required)
        with safe_open(ref / f"ref-rank{rank}.safetensors", framework="pt") as st:
            loaded = {k: st.get_tensor(k) for k in st.keys()}
        for name, (shape, dtype) in required.items():
            t = held[name]
            assert list(t.shape) == shape and str(t.dtype).replace("torch.", "") == dtype, name
            # the router lives in vLLM's gate module; its state dict also names it under experts
            want = loaded.get(name, loaded.get(name.replace(".mlp.experts.gate.", ".mlp.gate.")))
            assert want is not None and want.dtype == t.dtype and bits(t) == bits(want), name


def test_a_tampered_output_changes_the_tokens(sources, reference, tmp_path):
    """Rank 1's first two q heads swapped in its qkv_proj: vLLM still loads it, and the tokens change."""
    from safetensors.torch import load_file, save_file
    out = tmp_path / "out"
    assert run("reshard", sources["llama"], out, "--tp", 2, "--target", "vllm", "--quiet").exit_code == 0
    f = out / "model-rank-1-part-0.safetensors"
    tensors = load_file(f)
    w = tensors["model.layers.0.self_attn.qkv_proj.weight"]
    hd = 32
    w[:2 * hd] = torch.cat([w[hd:2 * hd], w[:hd]])
    f.unlink()   # the rank directory's copy stays: verify would point at the difference
    save_file(tensors, f, metadata={"format": "pt"})
    assert engine(out, "sharded_state", 2) != reference("llama", 2)[0]
