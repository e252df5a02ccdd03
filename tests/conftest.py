"""Shared fixtures: checkpoints made by the real producers (torch.save, transformers, huggingface_hub)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptconv.cli import main

ROOT = Path(__file__).resolve().parent.parent


class Result:
    def __init__(self, code, stdout, stderr):
        self.exit_code, self.stdout, self.stderr = code, stdout, stderr


def run(*args) -> Result:
    """Run the CLI in-process (fast); stdout and stderr kept apart."""
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


def run_subprocess(*args, **kw) -> subprocess.CompletedProcess:
    """Run the real console entry point in a fresh process (for exit codes and signals)."""
    return subprocess.run([sys.executable, "-m", "ckptconv.cli", *[str(a) for a in args]],
                          capture_output=True, text=True, cwd=kw.pop("cwd", None), **kw)


def load_output(out) -> dict:
    """Every tensor of an output dir, read by the real safetensors library (torch tensors)."""
    from safetensors import safe_open
    index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
    tensors = {}
    for name, file in index["weight_map"].items():
        with safe_open(Path(out) / file, framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


def bits(t):
    """A torch tensor's exact bytes, whatever its dtype (for bit-for-bit comparison)."""
    import torch
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a, b, name=""):
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (name, a.shape, b.shape)
    assert bits(a) == bits(b), name


@pytest.fixture(scope="session")
def torch_fixtures(tmp_path_factory):
    from tests import fixtures
    return fixtures.make_torch_fixtures(tmp_path_factory.mktemp("torch"))


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    from tests import fixtures
    return fixtures.make_hf_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def big_pt(tmp_path_factory):
    """192 MiB of float32 in 24 tensors: long enough to interrupt a conversion mid-run."""
    import torch
    p = tmp_path_factory.mktemp("big") / "big.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({f"w{i}": torch.randn(1024, 2048, generator=g) for i in range(24)}, p)  # 24 x 8 MiB
    return p
