"""Outputs pinned byte for byte: the SHA-256 of every file that convert and reshard write for a set of
deterministic inputs (torch.save files of every layout, a Llama-shaped .bin directory, Grok-1 and DCP
checkpoints, and the Orbax checkpoints committed under tests/fixtures/data/orbax/: OCDBT, zarr v2 and
v3, their codecs and layouts), recorded in tests/fixtures/data/pinned_outputs.json. Restructuring must not change a byte; an
issue that changes the output contract re-records them (CKPTCONV_PIN_RECORD=1) and says so.

Inputs are made with torch and numpy only (no transformers or huggingface_hub, whose versions would
change the inputs); the manifests record SRC by its base name, whatever the folder the inputs are in
(test_no_machine_paths.py).

Inputs are arithmetic-free: their values come from numpy's uniform draws, integers and exact scalings
(tests/fixtures/values.py), never from torch's normal sampler, a module's initialisation, a forward or
backward pass or an optimizer step. Those pick SIMD and BLAS code paths by CPU, so on another machine
(AMD against Intel, or ATEN_CPU_CAPABILITY=default) they give other bytes and the pins would fail
although ckptconv's output is right for its input."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures import grok as grok_fixtures, models as fixtures, values
from tests.helpers import DATA, ROOT, run

PINS = DATA / "pinned_outputs.json"
RECORD = os.environ.get("CKPTCONV_PIN_RECORD") == "1"


def llama_bin(d: Path):
    """A Llama-shaped state dict (GQA: 4 query, 2 kv heads) in two .bin shards with an index."""
    rng = np.random.default_rng(0)
    hidden, inter, vocab, kv = 32, 48, 64, 16
    sd = {"model.embed_tokens.weight": values.floats(rng, vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (kv, hidden)),
                            ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))]:
            sd[p + name + ".weight"] = values.floats(rng, *shape)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    sd["model.norm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = values.floats(rng, vocab, hidden)
    d.mkdir()
    names = list(sd)
    halves = {"pytorch_model-00001-of-00002.bin": names[:10], "pytorch_model-00002-of-00002.bin": names[10:]}
    for file, keys in halves.items():
        torch.save({k: sd[k] for k in keys}, d / file)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "intermediate_size": inter,
                                               "vocab_size": vocab, "num_hidden_layers": 2}))
    (d / "tokenizer_config.json").write_text("{}")


def adapter_bin(d: Path):
    """A LoRA adapter's state dict as PEFT saves it (`adapter_model.bin`, torch.save) beside its
    `adapter_config.json`: the output is named after it and carries the config."""
    rng = np.random.default_rng(1)
    d.mkdir()
    p = "base_model.model.model.layers.0.self_attn."
    torch.save({p + f"{proj}.lora_{ab}.weight": values.floats(rng, *((2, 32) if ab == "A" else (dim, 2)))
                for proj, dim in (("q_proj", 32), ("v_proj", 16)) for ab in "AB"}, d / "adapter_model.bin")
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                       "target_modules": ["q_proj", "v_proj"]}))


def make_inputs(root: Path):
    torch.save(fixtures.layout_cases(), root / "layouts.pt")
    torch.save(fixtures.layout_cases(), root / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save(fixtures.dtype_matrix(), root / "dtypes.pt")
    torch.save(fixtures.training_state(), root / "train.pt")
    llama_bin(root / "llama")
    adapter_bin(root / "lora")
    grok_fixtures.write_dir(root / "grok", grok_fixtures.make_params(2))
    import torch.distributed.checkpoint as dcp
    from tests.fixtures.dcp import nested_state
    dcp.save(nested_state(), checkpoint_id=root / "dcp")


JOBS = {
    "layouts": ["convert", "layouts.pt"],
    "legacy": ["convert", "legacy.pt"],
    "dtypes": ["convert", "dtypes.pt", "--max-shard-size", "200B"],
    "train": ["convert", "train.pt"],
    "llama": ["convert", "llama", "--max-shard-size", "30KB"],
    "llama-bf16": ["convert", "llama", "--dtype", "bf16", "--strip-prefix", "model."],
    "llama-tp2": ["reshard", "llama", "--tp", "2"],
    "llama-tp4": ["reshard", "llama", "--tp", "4", "--max-shard-size", "20KB"],
    "grok": ["pickle-to-safetensors", "grok"],
    "grok-bf16": ["convert", "grok", "--dequantize", "bf16"],
    "grok-mixtral": ["convert", "grok", "--layout", "mixtral"],
    "dcp": ["convert", "dcp"],
    "adapter": ["convert", "lora/adapter_model.bin"],
}
# the committed Orbax checkpoints (made by the real Orbax: tests/fixtures/orbax.py), read where they are;
# converted in this process (a few ms each, where a process each would add ~4.5 s to make test)
ORBAX = ["flax-ocdbt", "flax-zarr2", "flax-zarr3", "flax-ocdbt-zarr3", "flax-raw", "flax-2proc", "flax-2proc-zarr",
         "manager", "manager-zarr", "mixed", "zarr2-layouts", "zarr3-layouts"]
JOBS.update({f"orbax-{name}": ["convert", str(DATA / "orbax" / name)] for name in ORBAX})
JOBS.update({f"orbax-{name}-all": ["convert", str(DATA / "orbax" / name), "--state-dict", "none"]
             for name in ("manager", "manager-zarr")})   # the optimizer state's arrays too


def digests(out: Path) -> dict:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pinned")
    make_inputs(root)
    got = {}
    for job, (command, src, *extra) in JOBS.items():
        if job.startswith("orbax-"):
            r = run(command, src, root / f"out-{job}", *extra, "--quiet")
            assert r.exit_code == 0, (job, r.stderr)
            got[job] = digests(root / f"out-{job}")
            continue
        r = subprocess.run([sys.executable, "-m", "ckptconv.cli", command, src, f"out-{job}", *extra, "--quiet"],
                           cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, (job, r.stderr)
        got[job] = digests(root / f"out-{job}")
    if RECORD:
        PINS.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    return got


@pytest.mark.parametrize("job", sorted(JOBS))
def test_outputs_are_byte_identical_to_the_pinned_ones(outputs, job):
    assert outputs[job] == json.loads(PINS.read_text())[job]


def test_pins_cover_every_kind_of_output(outputs):
    pinned = json.loads(PINS.read_text())
    assert sorted(pinned) == sorted(JOBS)
    assert any("rank-00003/" in f for f in pinned["llama-tp4"]) and "mesh.json" in pinned["llama-tp4"]
    assert all("manifest.json" in files or "mesh.json" in files for files in pinned.values())
    assert np.all([len(files) >= 3 for files in pinned.values()])
    # huggingface_hub's names: one shard alone, several with their index; the stem from the source
    assert "model.safetensors" in pinned["layouts"] and not any("index" in f for f in pinned["layouts"])
    assert "model.safetensors.index.json" in pinned["dtypes"] and "rank-00000/model.safetensors" in pinned["llama-tp2"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(pinned["adapter"])
    assert all(f"orbax-{name}" in pinned for name in ORBAX)
