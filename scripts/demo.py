"""`make demo`: the main job end to end on a small checkpoint made here by the real producers.

A tiny random Llama is saved by huggingface_hub as sharded pytorch_model-*.bin (the way many Hub
repos still ship), then converted, resliced for tensor parallelism, and verified. Then a LoRA adapter
of it, saved by PEFT as adapter_model.bin, is converted to what PeftModel.from_pretrained loads.
"""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "demo-out"


def sh(*args):
    print("\n$ ckptconv " + " ".join(str(a).replace(str(ROOT) + "/", "") for a in args), flush=True)
    r = subprocess.run([sys.executable, "-m", "ckptconv.cli", *map(str, args)])
    if r.returncode not in (0,):
        raise SystemExit(f"demo step failed with exit status {r.returncode}")


def main():
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.models import make_hf_llama

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir()
    src = make_hf_llama(WORK)["dir"]
    print(f"made a tiny Llama checkpoint in {src.relative_to(ROOT)}: "
          + ", ".join(sorted(p.name for p in src.iterdir())))
    sh("inspect", src)
    sh("convert", src, WORK / "safetensors", "--max-shard-size", "100KB")
    sh("reshard", WORK / "safetensors", WORK / "tp4", "--tp", "4", "--dry-run")
    sh("reshard", WORK / "safetensors", WORK / "tp4", "--tp", "4")
    sh("verify", WORK / "safetensors", "--against", src)
    sh("verify", WORK / "tp4", "--against", src, "--device", "cpu")
    sh("convert", src, WORK / "model.safetensors", "--dtype", "bf16")   # one file, manifest in its metadata
    sh("verify", WORK / "model.safetensors", "--against", src)
    lora = make_adapter(src, WORK / "lora")
    print(f"\nmade a LoRA adapter of it with PEFT in {lora.relative_to(ROOT)}: "
          + ", ".join(sorted(p.name for p in lora.iterdir())))
    sh("convert", lora / "adapter_model.bin", WORK / "lora-st")   # named as PEFT loads it, its config beside
    print("\n$ ls demo-out/lora-st\n" + "  ".join(sorted(p.name for p in (WORK / "lora-st").iterdir())), flush=True)
    sh("verify", WORK / "lora-st", "--against", lora / "adapter_model.bin")
    print("\n$ (cd demo-out/safetensors && sha256sum -c SHA256SUMS)", flush=True)
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=WORK / "safetensors", check=True)
    print(f"\ndemo done: outputs are in {WORK.relative_to(ROOT)}/")


def make_adapter(base_dir: Path, out: Path) -> Path:
    """A LoRA adapter of the model in `base_dir`, saved by PEFT the way many adapters still ship
    (adapter_model.bin + adapter_config.json)."""
    import warnings
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    with warnings.catch_warnings():   # (a library's notes on its own deprecations: not the demo's)
        warnings.simplefilter("ignore")
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        model.save_pretrained(out, safe_serialization=False)
    return out


if __name__ == "__main__":
    main()
