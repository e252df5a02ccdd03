"""The Hugging Face libraries load what ckptconv writes without being told its names (docs/output.md,
docs/convert.md "Files carried"): a PEFT adapter saved with `save_pretrained(safe_serialization=
False)` and converted from its `adapter_model.bin` loads with `PeftModel.from_pretrained(base, OUT)`
and gives the adapter's logits; a diffusers UNet saved the same way loads with
`UNet2DModel.from_pretrained(OUT)` and gives the same output. Both sides run the same computation on
the same input; the models are tiny and their weights are exact numpy draws (tests/fixtures/values.py)."""
import copy

import numpy as np
import pytest
import torch

from tests.fixtures import values
from tests.helpers import run


def tiny_llama(rng):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():   # (parameters only: the rotary buffers stay what the config makes them)
        for p in model.parameters():
            p.copy_(values.floats(rng, *p.shape))
    return model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A base Llama and a LoRA adapter of it (every LoRA weight non-zero), saved by PEFT as .bin."""
    from peft import LoraConfig, get_peft_model
    d = tmp_path_factory.mktemp("peft")
    rng = np.random.default_rng(0)
    base = tiny_llama(rng)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(values.floats(rng, *p.shape))
    model.save_pretrained(d / "lora", safe_serialization=False)
    assert sorted(p.name for p in (d / "lora").iterdir()) == ["README.md", "adapter_config.json", "adapter_model.bin"]
    return base, d


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("src", ["lora/adapter_model.bin", "lora"])
def test_peft_loads_the_converted_adapter_and_gives_its_logits(adapter, tmp_path, src):
    from peft import PeftModel
    base, d = adapter
    out = tmp_path / "out"
    r = run("convert", d / src, out, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in out.iterdir()}
    ids = torch.tensor([[1, 5, 9, 33, 62, 7]])
    theirs = logits(PeftModel.from_pretrained(copy.deepcopy(base), d / "lora").eval(), ids)
    ours = logits(PeftModel.from_pretrained(copy.deepcopy(base), out).eval(), ids)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits(base, ids))   # (the adapter was loaded: it changes the logits)
    assert run("verify", out, "--against", d / src).exit_code == 0


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    """A tiny diffusers UNet2DModel saved by diffusers as .bin with its config.json."""
    from diffusers import UNet2DModel
    d = tmp_path_factory.mktemp("unet")
    model = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 8),
                        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                        norm_num_groups=4)
    values.set_weights(model, np.random.default_rng(1))
    model.save_pretrained(d / "unet", safe_serialization=False)
    assert sorted(p.name for p in (d / "unet").iterdir()) == ["config.json", "diffusion_pytorch_model.bin"]
    return d / "unet"


@pytest.mark.parametrize("src,extra", [("diffusion_pytorch_model.bin", ()), ("", ()),
                                       ("diffusion_pytorch_model.bin", ("--max-shard-size", "20KB"))])
def test_diffusers_loads_the_converted_unet_without_a_name(unet, tmp_path, src, extra):
    from diffusers import UNet2DModel
    out = tmp_path / "out"
    r = run("convert", unet / src if src else unet, out, *extra, "--quiet")
    assert r.exit_code == 0, r.stderr
    names = {p.name for p in out.iterdir()}
    assert "config.json" in names
    assert ("diffusion_pytorch_model.safetensors.index.json" in names) == bool(extra)
    sample = values.floats(np.random.default_rng(2), 1, 1, 8, 8)
    theirs_model = UNet2DModel.from_pretrained(unet).eval()
    ours_model = UNet2DModel.from_pretrained(out, use_safetensors=True).eval()
    theirs_sd, ours_sd = theirs_model.state_dict(), ours_model.state_dict()
    assert list(ours_sd) == list(theirs_sd) and all(torch.equal(ours_sd[k], v) for k, v in theirs_sd.items())
    with torch.no_grad():
        theirs = in_own_memory(UNet2DModel.from_pretrained(unet).eval())(sample, 3).sample
        ours = in_own_memory(UNet2DModel.from_pretrained(out, use_safetensors=True).eval())(sample, 3).sample
    assert torch.equal(ours, theirs)


def in_own_memory(model):
    """`model` with every weight copied into memory torch allocated: where a tensor lies (a mapped
    safetensors file's 8-byte-aligned offsets, a .bin's storages) picks among the CPU's convolution
    kernels, which round differently; the same values must give the same output."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()
    return model


@pytest.mark.parametrize("extra", [(), ("--max-shard-size", "10KB")])
def test_transformers_and_accelerate_load_one_shard_and_several(tmp_path, extra):
    """transformers' from_pretrained and accelerate's load_checkpoint_and_dispatch find the one
    model.safetensors as they find numbered shards and their index, converted from a
    pytorch_model.bin (torch.save of the state dict, as transformers before 5 saved it) with its
    config.json carried."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM
    model = tiny_llama(np.random.default_rng(3))
    (tmp_path / "saved").mkdir()
    torch.save(model.state_dict(), tmp_path / "saved" / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path / "saved")
    out = tmp_path / "out"
    assert run("convert", tmp_path / "saved" / "pytorch_model.bin", out, *extra, "--quiet").exit_code == 0
    assert ("model.safetensors.index.json" in {p.name for p in out.iterdir()}) == bool(extra)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    want = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval(), ids)   # (from the .bin)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids), want)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    dispatched = load_checkpoint_and_dispatch(empty, out, device_map={"": "cpu"}).eval()
    assert torch.equal(logits(dispatched, ids), want)
