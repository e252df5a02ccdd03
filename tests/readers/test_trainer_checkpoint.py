"""A transformers Trainer `checkpoint-N/` converts as it is: the model's weights, with config.json,
generation config and tokenizer files carried over, and the optimizer, scheduler, RNG, trainer state
and training arguments named in the summary and the manifest, never carried. Checked by the real
consumer: from_pretrained on OUT gives the same logits as on the checkpoint."""
import json

import pytest
import torch

from tests.fixtures import trainer
from tests.helpers import run

TRAINING = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    plain = trainer.trainer_checkpoint(tmp_path_factory.mktemp("trainer"))
    tied = trainer.trainer_checkpoint(tmp_path_factory.mktemp("trainer_tied"), tied=True)
    trainer.as_bin(tied)
    return {"safetensors": plain, "bin, tied": tied}


def logits(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 33, 70, 2]])).logits


@pytest.mark.parametrize("kind", ["safetensors", "bin, tied"])
def test_trainer_checkpoint_converts_as_it_is(checkpoints, tmp_path, kind):
    src = checkpoints[kind]
    assert TRAINING <= {p.name for p in src.iterdir()} and (src / "tokenizer.json").exists()
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    assert "also holds" not in r.stdout
    for name in TRAINING:
        assert f"{name} (training state: " in r.stdout
        assert not (out / name).exists()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert {s["name"] for s in manifest["source"]["skipped_files"]} == TRAINING
    assert torch.equal(logits(out), logits(src))
    assert run("verify", out, "--against", src).exit_code == 0
    if kind == "bin, tied":
        assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_json_lists_the_training_state(checkpoints, tmp_path):
    r = run("convert", checkpoints["safetensors"], tmp_path / "out", "--json")
    skipped = json.loads(r.stdout)["skipped_files"]
    assert {s["name"]: s["reason"] for s in skipped}["optimizer.pt"] == "training state: optimizer"


def test_an_index_or_link_leading_to_training_state_is_refused(checkpoints, tmp_path):
    import shutil
    src = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoints["bin, tied"], src)
    (src / "pytorch_model.bin").unlink()
    (src / "pytorch_model.bin").symlink_to("optimizer.pt")     # the optimizer's state posing as the model
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "leads to) optimizer.pt, a Trainer's optimizer" in r.stderr, r.stderr
    (src / "pytorch_model.bin").unlink()
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "optimizer.pt"}}))
    r = run("convert", src, tmp_path / "out")
    assert r.exit_code == 2 and "optimizer.pt" in r.stderr and not (tmp_path / "out").exists()
