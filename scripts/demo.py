"""`make demo`: the main job end to end on a small checkpoint made here by the real producers.

A tiny random Llama is saved by huggingface_hub as sharded pytorch_model-*.bin (the way many Hub
repos still ship), then converted, resliced for tensor parallelism, and verified.
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
    print("\n$ (cd demo-out/safetensors && sha256sum -c SHA256SUMS)", flush=True)
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=WORK / "safetensors", check=True)
    print(f"\ndemo done: outputs are in {WORK.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
