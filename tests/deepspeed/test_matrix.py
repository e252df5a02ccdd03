"""Every variant tests/fixtures/deepspeed.py makes with the real DeepSpeed (ZeRO stages 1-3; fp32,
fp16 and bf16 runs; frozen and tied parameters, odd sizes, several parameter groups, a torch
optimizer passed in, round-robin gradients, tiny Llamas with config.json) converts bit for bit to
what DeepSpeed's get_fp32_state_dict_from_zero_checkpoint returns for the same files, also cast to
bf16, also from the tag directory; verify --against the ZeRO directory passes; Llamas reshard;
pipeline checkpoints (PipelineModule, tied layers) to what DeepSpeed's own load_checkpoint gives.

Run by `make test-deepspeed`, which makes DeepSpeed's venv and the fixtures (about 70 s on two CPUs)
and points CKPTCONV_DEEPSPEED_FIXTURES at them; skipped otherwise."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import run
from tests.readers.test_deepspeed import check_output

ROOT = os.environ.get("CKPTCONV_DEEPSPEED_FIXTURES")
pytestmark = pytest.mark.skipif(not ROOT or not Path(ROOT).is_dir(),
                                reason="CKPTCONV_DEEPSPEED_FIXTURES is not set (make test-deepspeed sets it)")
ROOT = Path(ROOT or ".")


def variants(pipeline=False):
    from tests.fixtures.deepspeed import VARIANTS
    return [n for n, v in VARIANTS.items() if (v["model"] == "pipe") == pipeline]


def saves(name) -> tuple:
    """The steps after which variant `name` was saved (one global_stepN/ each)."""
    from tests.fixtures.deepspeed import VARIANTS
    return VARIANTS[name].get("saves", ())


@pytest.mark.parametrize("name", variants())
def test_bit_for_bit_with_deepspeeds_merge(name, tmp_path):
    for src in (ROOT / name, ROOT / name / (ROOT / name / "latest").read_text().strip()):
        out = tmp_path / src.name
        r = run("convert", src, out, "--quiet")
        assert r.exit_code == 0, r.stderr
        check_output(out, name, ROOT)
        r = run("verify", out, "--against", src)
        assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr
    r = run("convert", ROOT / name, tmp_path / "bf16", "--dtype", "bf16", "--quiet")
    assert r.exit_code == 0, r.stderr
    check_output(tmp_path / "bf16", name, ROOT, cast=torch.bfloat16)


@pytest.mark.parametrize("name", [n for n in variants() if len(saves(n)) > 1])
def test_ranks_of_two_saves_are_refused(name, tmp_path):
    """Rank 1's files of the first save beside rank 0's of the last: one line naming rank 1's file."""
    src = tmp_path / name
    shutil.copytree(ROOT / name, src)
    first, last = (f"global_step{s}" for s in (saves(name)[0], saves(name)[-1]))
    for f in (src / first).glob("*zero_pp_rank_1_*"):
        shutil.copy(f, src / last / f.name)
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "zero_pp_rank_1_mp_rank_00" in r.stderr and "files of different saves" in r.stderr
    assert not (tmp_path / "out").exists()


def test_frozen_parameters_stage_1_does_not_save_are_listed(tmp_path):
    r = run("convert", ROOT / "z1-bf16-frozen", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    assert [d["name"] for d in json.loads(r.stdout)["dropped"]] == ["frozen.weight", "frozen.bias"]


@pytest.mark.parametrize("name", [n for n in variants() if "llama" in n])
def test_llamas_reshard_and_verify(name, tmp_path):
    for target in ("mesh", "vllm"):
        out = tmp_path / target
        r = run("reshard", ROOT / name, out, "--tp", 2, "--target", target, "--quiet")
        assert r.exit_code == 0, r.stderr
        assert run("verify", out, "--against", ROOT / name).exit_code == 0


@pytest.mark.parametrize("name", variants(pipeline=True))
def test_pipelines_are_what_deepspeeds_own_load_gives(name, tmp_path):
    """PipelineModule checkpoints (ZeRO-1; fp32 and bf16; a TiedLayerSpec on both stages): bit for bit
    what a fresh engine's load_checkpoint gives (the masters; the loaded module's state dict once
    cast), from the directory and the tag directory."""
    from tests.readers.test_deepspeed import check_pipeline
    for src in (ROOT / name, ROOT / name / (ROOT / name / "latest").read_text().strip()):
        out = tmp_path / src.name
        r = run("convert", src, out, "--quiet")
        assert r.exit_code == 0, r.stderr
        check_pipeline(src, out, name, ROOT)


def test_the_matrix_is_what_the_fixture_script_makes():
    facts = {n: json.loads((ROOT / f"{n}.reference.json").read_text()) for n in variants()}
    assert any(f["shared"] for f in facts.values())   # tied weights are among them
