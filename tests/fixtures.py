"""Fixture producers. Only tests import torch; the product never does."""
from pathlib import Path

import numpy as np
import torch


def dtype_matrix():
    """One tensor per dtype safetensors can store, filled with random bits (NaN payloads included)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
               torch.uint32, torch.uint64]:
        size = torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(0, 256, (3, 5 * size), dtype=torch.uint8, generator=g)
        t = raw.view(dt) if dt != torch.bool else (raw[:, :5] % 2).bool()
        out[str(dt).removeprefix("torch.")] = t
    return out


def layout_cases():
    """Views, shared storage, transposes, offsets, 0-d, empty, channels_last, a Parameter."""
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return {
        "base": base,
        "view_rows": base[2:4],                    # storage offset
        "view_cols": base[:, 3:6],                 # non-contiguous
        "transposed": base.t(),                    # stride (1, 8)
        "strided": base[::2, ::3],
        "tied_a": base,                            # same tensor twice (tied weights)
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "channels_last": torch.arange(2 * 3 * 4 * 5, dtype=torch.int32).reshape(2, 3, 4, 5).to(
            memory_format=torch.channels_last),
        "param": torch.nn.Parameter(torch.linspace(-1, 1, 7, dtype=torch.bfloat16), requires_grad=False),
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
    }


def training_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    import argparse
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "loss": np.float32(0.25),
            "args": argparse.Namespace(lr=1e-3, name="run1"), "version": torch.__version__,
            "nested": {"a": [torch.ones(2), {"b": torch.zeros(1, dtype=torch.int64)}]}}


def make_torch_fixtures(d: Path) -> dict:
    paths = {}
    torch.save(dtype_matrix(), d / "dtypes.pt")
    paths["dtypes"] = d / "dtypes.pt"
    torch.save(layout_cases(), d / "layouts.pt")
    paths["layouts"] = d / "layouts.pt"
    torch.save(layout_cases(), d / "legacy.pt", _use_new_zipfile_serialization=False)
    paths["legacy"] = d / "legacy.pt"
    torch.save(dtype_matrix(), d / "legacy_dtypes.pt", _use_new_zipfile_serialization=False)
    paths["legacy_dtypes"] = d / "legacy_dtypes.pt"
    torch.save(training_state(), d / "train.pt")
    paths["train"] = d / "train.pt"
    torch.save({"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)}, d / "complex.pt")
    paths["complex"] = d / "complex.pt"
    return paths


def make_hf_llama(d: Path) -> dict:
    """A tiny random Llama (GQA) saved as sharded .bin + index by huggingface_hub, with its config."""
    from huggingface_hub import save_torch_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    src = d / "bin"
    src.mkdir()
    save_torch_state_dict(model.state_dict(), src, safe_serialization=False, max_shard_size="60KB")
    config.save_pretrained(src)
    (src / "README.md").write_text("tiny test model\n")
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        logits = model(ids).logits
    return {"dir": src, "ids": ids, "logits": logits, "state": model.state_dict()}

