"""Shared fixtures: checkpoints made by the real producers (torch.save, transformers, huggingface_hub).
Helpers (running the CLI, reading outputs, comparing tensors) are in tests/helpers.py."""
import pytest


@pytest.fixture(scope="session")
def torch_fixtures(tmp_path_factory):
    from tests.fixtures import models as fixtures
    return fixtures.make_torch_fixtures(tmp_path_factory.mktemp("torch"))


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    from tests.fixtures import models as fixtures
    return fixtures.make_hf_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def big_pt(tmp_path_factory):
    """192 MiB of float32 in 24 tensors: long enough to interrupt a conversion mid-run."""
    import torch
    p = tmp_path_factory.mktemp("big") / "big.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({f"w{i}": torch.randn(1024, 2048, generator=g) for i in range(24)}, p)  # 24 x 8 MiB
    return p
