"""Every variant tests/fixtures/megatron.py makes with the real Megatron-Core (legacy and torch_dist;
TP 1/2, PP 1/2, TP 2 x PP 2, virtual pipeline chunks, EP 2 with TP or PP; tied, untied, q/k/v biases,
a mixture of experts) merges bit for bit to the TP 1 model every layout was loaded from; verify
--against the Megatron directory passes; `--to hf` loads in transformers with Megatron's own logits;
reshard straight from the checkpoint joins back to the same tensors.

Run by `make test-megatron`, which makes the Megatron venv and the fixtures (about 6 minutes on two
CPUs) and points CKPTCONV_MEGATRON_FIXTURES at them; skipped otherwise."""
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import assert_same, run
from tests.readers.test_megatron import check_logits, check_merged, model_of

ROOT = os.environ.get("CKPTCONV_MEGATRON_FIXTURES")
pytestmark = pytest.mark.skipif(not ROOT or not Path(ROOT).is_dir(),
                                reason="CKPTCONV_MEGATRON_FIXTURES is not set (make test-megatron sets it)")
ROOT = Path(ROOT or ".")


def variants():
    from tests.fixtures.megatron import VARIANTS
    return list(VARIANTS)


@pytest.mark.parametrize("name", variants())
def test_merged_bit_for_bit_and_verified(name, tmp_path):
    for src in (ROOT / name, ROOT / name / "iter_0000001"):
        out = tmp_path / src.name
        r = run("convert", src, out, "--quiet")
        assert r.exit_code == 0, r.stderr
        check_merged(out, name, ROOT)
        r = run("verify", out, "--against", src)
        assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", variants())
def test_to_hf_gives_megatrons_logits(name, tmp_path):
    out = tmp_path / "hf"
    r = run("convert", ROOT / name, out, "--to", "hf", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_logits(out, name, ROOT)
    config = json.loads((out / "config.json").read_text())
    want = {"bias": "qwen2", "moe": "mixtral"}.get(model_of(name), "llama")
    assert config["model_type"] == want
    assert run("verify", out, "--against", ROOT / name).exit_code == 0


@pytest.mark.parametrize("name", [n for n in variants() if "-tp2-" in n or "-tp1-" in n])
def test_reshard_joins_back(name, tmp_path):
    src = ROOT / name
    r = run("reshard", src, tmp_path / "out", "--tp", 2, "--quiet")
    assert r.exit_code == 0, r.stderr
    assert run("verify", tmp_path / "out", "--against", src).exit_code == 0
    r = run("convert", tmp_path / "out", tmp_path / "back", "--quiet")   # the mesh read back: the whole model
    assert r.exit_code == 0, r.stderr
    got = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        got.update(load_file(f))
    want = load_file(ROOT / f"{model_of(name)}.reference.safetensors")
    assert sorted(got) == sorted(want)
    for k in got:
        assert_same(got[k], want[k], k)


def test_the_matrix_is_what_the_fixture_script_makes():
    from tests.fixtures.megatron import VARIANTS
    assert {p.name for p in ROOT.iterdir() if p.is_dir()} >= set(VARIANTS)
    for name in VARIANTS:
        assert (ROOT / name / "latest_checkpointed_iteration.txt").read_text() == "1"
