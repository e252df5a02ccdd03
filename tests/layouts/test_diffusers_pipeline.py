"""A diffusers pipeline directory (model_index.json and a folder per component), converted the way
diffusers lays it out (docs/convert.md#diffusers-pipelines, docs/output.md#pipelines): pipelines made
and saved by diffusers itself, loaded back by `DiffusionPipeline.from_pretrained` with no weight
missing or unexpected and giving the same images from the same seed; SHA256SUMS over the tree;
verify and verify --against; variants, shards, weights already in safetensors; refusals."""
import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptconv.formats.sums import format_sums, parse_sums, unsafe_path
from tests.fixtures import pipelines
from tests.helpers import ROOT, assert_refused, cli, opened_outside, run, run_subprocess


@pytest.fixture(scope="module")
def ddpm(tmp_path_factory):
    return pipelines.ddpm(tmp_path_factory.mktemp("ddpm") / "ddpm")


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return pipelines.stable_diffusion(tmp_path_factory.mktemp("sd") / "sd")


def convert(src, out, *extra):
    r = run("convert", src, out, "--quiet", *extra)
    assert r.exit_code == 0, r.stderr
    return r


def tree(d: Path) -> dict:
    """{relative path: bytes} of every file under `d`."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def load(path, **kw):
    """DiffusionPipeline.from_pretrained(path) and what diffusers and transformers logged meanwhile.
    Every weight is then copied into memory of torch's own: a tensor's alignment (a mapped safetensors
    file's offsets, a .bin's storage) picks among the CPU kernels, which round differently."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    import transformers
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    loggers = [diffusers_logging.get_logger("diffusers"), transformers.logging.get_logger("transformers")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        pipe = DiffusionPipeline.from_pretrained(path, **kw)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for t in [*module.parameters(), *module.buffers()]:
                t.data = t.data.clone()
    return pipe, stream.getvalue()


def images(pipe):
    """The pipeline's images on one thread (the same float sums for both pipelines compared); torch's
    thread count is put back after, so the logits other tests compare are computed as their
    references were (a session fixture computed before this ran, on the default count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = {"prompt": "a cat", "height": 16, "width": 16} if "text_encoder" in pipe.components else {}
        return pipe(generator=torch.Generator().manual_seed(0), num_inference_steps=2, output_type="np", **kw).images
    finally:
        torch.set_num_threads(threads)


def assert_loads_as(src, out, **kw):
    """OUT loads with nothing missing or unexpected, every component's weights equal to SRC's, and
    gives SRC's images from the same seed."""
    theirs, _ = load(src, **kw)
    ours, said = load(out, **kw)
    for word in ("missing", "unexpected", "newly initialized", "not used", "not initialized"):
        assert word not in said.lower(), said
    assert sorted(ours.components) == sorted(theirs.components)
    for name, module in ours.components.items():
        if isinstance(module, torch.nn.Module):
            a, b = module.state_dict(), theirs.components[name].state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    x, y = images(ours), images(theirs)
    assert (x == y).all()


def sha256sum_check(out: Path):
    r = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


def test_a_ddpm_pipeline_converts_as_diffusers_lays_it_out(ddpm, tmp_path):
    out = tmp_path / "out"
    convert(ddpm, out)
    files = tree(out)
    assert sorted(files) == ["SHA256SUMS", "manifest.json", "model_index.json", "scheduler/scheduler_config.json",
                             "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "unet/manifest.json"]
    for name in ("model_index.json", "scheduler/scheduler_config.json", "unet/config.json"):
        assert files[name] == (ddpm / name).read_bytes(), name
    assert len(sha256sum_check(out)) == 6
    # (no name without a dot in a component folder: diffusers, loading a variant, splits each at one)
    assert all("." in p.name for p in (out / "unet").iterdir())
    from diffusers import UNet2DModel
    _, info = UNet2DModel.from_pretrained(out, subfolder="unet", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert_loads_as(ddpm, out)
    assert run("verify", out).exit_code == 0
    r = run("verify", out, "--against", ddpm)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("text_encoder_bin", [False, True])
def test_a_stable_diffusion_pipeline_loads_and_draws_the_same(tmp_path, text_encoder_bin):
    """UNet and VAE saved as .bin; the text encoder as transformers writes it (model.safetensors:
    converted too, re-sharded and hashed) or as a torch.save'd pytorch_model.bin; the tokenizer carried."""
    src = pipelines.stable_diffusion(tmp_path / "sd", text_encoder_bin=text_encoder_bin)
    out = tmp_path / "out"
    convert(src, out)
    files = tree(out)
    assert "text_encoder/model.safetensors" in files and "text_encoder/pytorch_model.bin" not in files
    for name in os.listdir(src / "tokenizer"):
        assert files[f"tokenizer/{name}"] == (src / "tokenizer" / name).read_bytes()
    assert {n.split("/")[0] for n in files if "/" in n} == {"scheduler", "text_encoder", "tokenizer", "unet", "vae"}
    sha256sum_check(out)
    from transformers import CLIPTextModel
    _, info = CLIPTextModel.from_pretrained(out, subfolder="text_encoder", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert_loads_as(src, out)
    r = run("verify", out, "--against", src)
    assert r.exit_code == 0, r.stdout + r.stderr


def test_each_folder_of_weights_is_what_converting_that_folder_alone_writes(sd, tmp_path):
    """A component of weights is the sharded output `convert SRC/unet` writes, byte for byte (the
    one-component conversion itself is unchanged: tests/layouts/test_pinned_outputs.py)."""
    out = tmp_path / "out"
    convert(sd, out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "ckptconv.pipeline/1"
    assert manifest["components"] == {"scheduler": "files", "text_encoder": "weights", "tokenizer": "files",
                                      "unet": "weights", "vae": "weights"}
    assert manifest["source"]["pipeline"] == "StableDiffusionPipeline" and manifest["source"]["path"] == "sd"
    sums = parse_sums((out / "SHA256SUMS").read_bytes(), paths=True)[0]
    assert sorted(sums) == sorted([*manifest["files"], "manifest.json"])
    for name in ("text_encoder", "unet", "vae"):
        alone = tmp_path / name
        convert(sd / name, alone)
        theirs = tree(alone)
        assert parse_sums(theirs.pop("SHA256SUMS"))[0] == {f.partition("/")[2]: d for f, d in sums.items()
                                                          if f.startswith(name + "/")}
        assert theirs == tree(out / name), name
        # given alone, a folder is checked as its pipeline checks it, against the pipeline's SHA256SUMS
        r = run("verify", out / name, "--against", sd / name)
        assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr
    (out / "unet" / "SHA256SUMS").write_bytes((tmp_path / "unet" / "SHA256SUMS").read_bytes())
    for where in (out, out / "unet"):
        r = run("verify", where)
        assert r.exit_code == 1 and "a component folder holds no SHA256SUMS of its own" in r.stdout, r.stdout


def test_verify_names_a_tampered_or_unlisted_file(sd, tmp_path):
    out = tmp_path / "out"
    convert(sd, out)
    assert run("verify", out).exit_code == 0
    shard = out / "vae" / "diffusion_pytorch_model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    r = run("verify", out)
    assert r.exit_code == 1, r.stdout
    assert f"{shard}: tensor 'post_quant_conv.bias': sha256 differs from the manifest" in r.stdout, r.stdout
    shard.write_bytes(bytes(data[:-3]) + bytes([data[-3] ^ 1]) + bytes(data[-2:]))
    assert run("verify", out).exit_code == 0
    carried = out / "tokenizer" / "tokenizer_config.json"
    carried.write_bytes(carried.read_bytes() + b" ")
    r = run("verify", out)
    assert r.exit_code == 1 and f"{carried}: sha256 differs from SHA256SUMS" in r.stdout, r.stdout
    (out / "scheduler" / "extra.txt").write_text("x")
    (out / "samples").mkdir()
    r = run("verify", out)
    assert f"{out / 'scheduler' / 'extra.txt'}: file is not listed in SHA256SUMS or the manifest" in r.stdout
    assert f"{out / 'samples'}: folder is not a component the manifest lists" in r.stdout


def test_verify_against_compares_each_component_with_its_source(sd, tmp_path):
    out = tmp_path / "out"
    convert(sd, out)
    changed = tmp_path / "changed"
    subprocess.run(["cp", "-r", str(sd), str(changed)], check=True)
    weights = torch.load(changed / "unet" / "diffusion_pytorch_model.bin")
    weights["conv_in.bias"][1] += 1
    torch.save(weights, changed / "unet" / "diffusion_pytorch_model.bin")
    r = run("verify", out, "--against", changed)
    assert r.exit_code == 1, r.stdout
    assert f"{out / 'unet'}: tensor 'conv_in.bias' differs from the source at index (1,)" in r.stdout
    assert "1 problem(s)" in r.stdout
    subprocess.run(["cp", str(sd / "unet" / "diffusion_pytorch_model.bin"), str(changed / "unet")], check=True)
    assert run("verify", out, "--against", changed).exit_code == 0
    (changed / "scheduler" / "scheduler_config.json").write_text("{}")
    r = run("verify", out, "--against", changed)
    assert r.exit_code == 1 and f"{out / 'scheduler' / 'scheduler_config.json'}: is not the source's" in r.stdout


def test_variants_keep_their_names_and_shards_their_index(tmp_path):
    """`.fp16` weights come out as diffusers names a variant's (`.fp16.safetensors`, its shards and
    `.safetensors.index.fp16.json`); a sharded component comes out sharded with its index."""
    src = pipelines.ddpm(tmp_path / "fp16", variant="fp16")
    assert (src / "unet" / "diffusion_pytorch_model.fp16.bin").is_file()
    out = tmp_path / "fp16-st"
    convert(src, out)
    assert (out / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert_loads_as(src, out, variant="fp16")
    sharded = pipelines.ddpm(tmp_path / "sharded", variant="fp16", max_shard_size="20KB")
    assert (sharded / "unet" / "diffusion_pytorch_model.bin.index.fp16.json").is_file()
    out = tmp_path / "sharded-st"
    convert(sharded, out, "--max-shard-size", "20KB")
    names = sorted(os.listdir(out / "unet"))
    assert "diffusion_pytorch_model.safetensors.index.fp16.json" in names
    assert "diffusion_pytorch_model.fp16-00001-of-00004.safetensors" in names
    assert_loads_as(src, out, variant="fp16")
    assert run("verify", out, "--against", sharded).exit_code == 0
    plain = pipelines.ddpm(tmp_path / "plain", max_shard_size="20KB")
    out = tmp_path / "plain-st"
    convert(plain, out, "--max-shard-size", "20KB")
    assert "diffusion_pytorch_model.safetensors.index.json" in os.listdir(out / "unet")
    assert_loads_as(pipelines.ddpm(tmp_path / "whole"), out)


def test_of_several_variants_the_default_is_converted_and_the_others_named(tmp_path):
    src = pipelines.ddpm(tmp_path / "both")
    pipelines.ddpm(src, variant="fp16", safe_serialization=True)   # (save_pretrained keeps the .bin beside)
    r = run("convert", src, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["skipped_files"] == [
        {"name": "unet/diffusion_pytorch_model.fp16.safetensors",
         "reason": "the fp16 variant; the weights without one were converted"}]
    assert sorted(os.listdir(tmp_path / "out" / "unet")) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                              "manifest.json"]
    assert run("verify", tmp_path / "out", "--against", src).exit_code == 0


def test_bad_input_in_one_component_fails_the_whole_run(sd, tmp_path):
    src = tmp_path / "sd"
    subprocess.run(["cp", "-r", str(sd), str(src)], check=True)
    weights = src / "vae" / "diffusion_pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[:5000])
    out = tmp_path / "out"
    assert_refused(cli("convert", src, out), out, str(weights), "truncated")
    assert not out.exists()
    subprocess.run(["rm", "-r", str(src / "vae")], check=True)
    assert_refused(cli("convert", src, out), out, f"{src / 'vae'}: model_index.json names the component 'vae'")
    (src / "model_index.json").write_text('{"_class_name": "X", "../unet": ["diffusers", "UNet2DModel"]}')
    assert_refused(cli("convert", src, out), out, "component '../unet' is not a folder name")


def test_nothing_outside_the_pipeline_is_read(sd, tmp_path):
    """A link leading out of SRC is refused where weights would be read through it, skipped and
    listed where a file would be carried; one to another folder inside SRC is followed."""
    src, out, elsewhere = tmp_path / "sd", tmp_path / "out", tmp_path / "elsewhere"
    subprocess.run(["cp", "-r", str(sd), str(src)], check=True)
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("secret")
    (src / "tokenizer" / "vocab.txt").symlink_to(elsewhere / "secret.txt")
    r = cli("convert", src, out, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "tokenizer/vocab.txt (a symbolic link leading outside the source)" in r.stdout
    assert opened_outside(r, src, out, tmp_path / ".out.ckptconv-tmp", tmp_path / ".out.ckptconv-lock") == []
    assert not (out / "tokenizer" / "vocab.txt").exists() and run("verify", out).exit_code == 0
    os.replace(src / "unet" / "diffusion_pytorch_model.bin", elsewhere / "unet.bin")
    (src / "unet" / "diffusion_pytorch_model.bin").symlink_to(elsewhere / "unet.bin")
    out = tmp_path / "out2"
    assert_refused(cli("convert", src, out), out, "leads outside the checkpoint", src=src)
    (src / "unet" / "diffusion_pytorch_model.bin").unlink()
    subprocess.run(["rm", "-r", str(src / "unet")], check=True)
    (src / "unet").symlink_to(sd / "unet")
    assert_refused(cli("convert", src, out), out, f"{src / 'unet'}: leads outside the checkpoint", src=src)
    (src / "unet").unlink()
    (src / "unet").symlink_to("vae")   # (another folder inside SRC: read)
    assert run("convert", src, out, "--quiet").exit_code == 0


def test_overwrite_lock_and_resume_as_for_a_directory(ddpm, tmp_path):
    out = tmp_path / "out"
    convert(ddpm, out, "--max-shard-size", "20KB")
    assert run("convert", ddpm, out).exit_code == 2
    convert(ddpm, out, "--max-shard-size", "20KB", "--overwrite")
    lock = tmp_path / ".again.ckptconv-lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    r = run("convert", ddpm, tmp_path / "again")
    assert r.exit_code == 2 and f"pid {os.getpid()}" in r.stderr and not (tmp_path / "again").exists()
    lock.unlink()
    # a run killed once two of the UNet's four shards are written (its journal after each)
    killed = ("import os, signal, sys\nfrom ckptconv.formats import manifest\nfrom ckptconv.cli import main\n"
              "write, n = manifest.write_journal, []\n"
              "def journal(*a):\n    write(*a)\n    n.append(1)\n"
              "    if len(n) == 2:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
              "manifest.write_journal = journal\nmain(sys.argv[1:], prog_name='ckptconv')\n")
    resumed = tmp_path / "resumed"
    p = subprocess.run([sys.executable, "-c", killed, "convert", ddpm, resumed, "--max-shard-size", "20KB", "-q"],
                       cwd=ROOT, capture_output=True)
    assert p.returncode == -signal.SIGKILL and not resumed.exists()
    tmp = tmp_path / ".resumed.ckptconv-tmp"
    done = sorted(n for n in os.listdir(tmp / "unet") if n.endswith(".safetensors"))
    assert len(done) == 2
    r = run("convert", ddpm, resumed, "--max-shard-size", "20KB", "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["resumed_bytes"] == sum(os.path.getsize(resumed / "unet" / n) for n in done)
    assert tree(resumed) == tree(out)


def test_inspect_and_plan_say_what_the_pipeline_is(sd):
    r = run("inspect", sd)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{sd}: diffusers, 348 tensors")
    assert lines[2] == "components of StableDiffusionPipeline:"
    assert lines[3].split() == ["scheduler", "diffusers", "PNDMScheduler:", "no", "weights;", "carried:",
                                "scheduler_config.json"]
    assert any(line.split()[:5] == ["unet", "diffusers", "UNet2DConditionModel:", "torch,", "208"] for line in lines)
    found = json.loads(run("inspect", sd, "--json").stdout)
    unet = next(c for c in found["components"] if c["name"] == "unet")
    assert unet["format"] == "torch" and unet["tensor_count"] == 208 and unet["files"] == ["config.json"]
    assert sum(c["bytes"] for c in found["components"]) == found["total_bytes"]
    plan = json.loads(run("plan", sd, "--max-shard-size", "100KB", "--json").stdout)
    assert [u["name"] for u in plan["units"]] == [
        "text_encoder/model.safetensors", "unet/diffusion_pytorch_model-00001-of-00003.safetensors",
        "unet/diffusion_pytorch_model-00002-of-00003.safetensors",
        "unet/diffusion_pytorch_model-00003-of-00003.safetensors", "vae/diffusion_pytorch_model.safetensors"]


def test_what_takes_one_checkpoint_says_which_to_give(ddpm, tmp_path):
    for args, said in [(("reshard", ddpm, tmp_path / "r", "--tp", "2"), "reshard takes one checkpoint"),
                       (("convert", ddpm, tmp_path / "one.safetensors"), "a .safetensors OUT does not apply"),
                       (("convert", ddpm, tmp_path / "o", "--strip-prefix", "x"), "--strip-prefix does not apply"),
                       (("convert", ddpm, tmp_path / "o", "--only", "unet"), "--only selects the tensors of one")]:
        r = run(*args)
        assert r.exit_code == 2 and said in r.stderr, (args, r.stderr)
    out = tmp_path / "out"
    convert(ddpm, out)
    r = run("verify", out, "--device", "cpu")
    assert r.exit_code == 2 and f"give one of its folders ({out / 'unet'})" in r.stderr, r.stderr
    # (JAX fixes its devices when it starts: in a process of its own)
    r = run_subprocess("verify", out / "unet", "--device", "cpu", "--quiet", cwd=ROOT)
    assert r.returncode == 0 and "device cpu: 1 rank(s) on 1 device(s)" in r.stdout, r.stdout + r.stderr


def test_two_workers_write_the_same_tree(sd, tmp_path):
    from tests.helpers import run
    assert run("convert", sd, tmp_path / "two", "--max-shard-size", "50KB", "--quiet", "--workers", 2).exit_code == 0
    convert(sd, tmp_path / "one", "--max-shard-size", "50KB")
    assert tree(tmp_path / "two") == tree(tmp_path / "one")
    r = run("verify", tmp_path / "two", "--against", sd, "--workers", 2)
    assert r.exit_code == 0 and "matches the source" in r.stdout, r.stdout + r.stderr


def test_a_tree_sha256sums_lists_folder_and_file_only():
    assert unsafe_path("unet/config.json") is None and unsafe_path("model_index.json") is None
    for bad in ("../x", "/etc/passwd", "a/b/c", "unet/", "a//b", "./x", "unet/.."):
        assert unsafe_path(bad) is not None, bad
    assert parse_sums(format_sums({"unet/a": "0" * 64}, paths=True), paths=True) == ({"unet/a": "0" * 64}, [])
    sums, problems = parse_sums(b"0" * 64 + b"  ../x\n", paths=True)
    assert sums == {} and "not opened" in problems[0]
    with pytest.raises(Exception):
        format_sums({"unet/a": "0" * 64})   # (an output of one folder lists plain names only)


def test_a_manifest_naming_paths_outside_is_a_problem_never_opened(ddpm, tmp_path):
    out = tmp_path / "out"
    convert(ddpm, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["../outside"] = {"sha256": "0" * 64, "size": 1}
    manifest["components"]["../up"] = "weights"
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = cli("verify", out)
    assert r.returncode == 1, r.stderr
    assert "files lists '../outside', which is not a plain path" in r.stdout
    assert "component '../up': not a folder name" in r.stdout
    assert opened_outside(r, out) == []


# -- what the outside attack on pipelines found -------------------------------------------------------------

def _resign(out: Path):
    """SHA256SUMS (and the top manifest's files) made again after an edit, as a consistent forger would."""
    import hashlib
    manifest = json.loads((out / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (out / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    (out / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((out / n).read_bytes()).hexdigest()}  {n}\n"
                                            for n in names))


def test_what_the_top_manifest_records_of_the_source_is_compared(sd, tmp_path):
    out = tmp_path / "out"
    convert(sd, out)
    for edit, said in [(lambda s: s.update(pipeline="EvilPipeline"), "source.pipeline is 'EvilPipeline'"),
                       (lambda s: s.update(cast="F16"), "source.cast is 'F16', component")]:
        forged = tmp_path / "forged"
        subprocess.run(["rm", "-rf", str(forged)], check=True)
        subprocess.run(["cp", "-r", str(out), str(forged)], check=True)
        manifest = json.loads((forged / "manifest.json").read_text())
        edit(manifest["source"])
        (forged / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _resign(forged)
        assert run("verify", forged).exit_code == 0   # (consistent: only the source can tell)
        r = run("verify", forged, "--against", sd)
        assert r.exit_code == 1 and said in r.stdout, r.stdout
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["target"] = "tp"
    (forged / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _resign(forged)
    r = run("verify", forged)
    assert r.exit_code == 1 and "a pipeline output records no engine's target" in r.stdout


def test_a_component_whose_weights_hold_nothing_or_named_mesh_json_is_refused(ddpm, tmp_path):
    from safetensors.torch import save_file
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(ddpm), str(src)], check=True)
    save_file({}, src / "scheduler" / "diffusion_pytorch_model.safetensors")
    assert_refused(cli("convert", src, tmp_path / "out"), tmp_path / "out", "scheduler: its weight files",
                   "hold no tensors")
    (src / "scheduler" / "diffusion_pytorch_model.safetensors").unlink()
    index = json.loads((src / "model_index.json").read_text())
    index["mesh.json"] = ["diffusers", "DDPMScheduler"]
    (src / "model_index.json").write_text(json.dumps(index))
    (src / "mesh.json").mkdir()
    assert_refused(cli("convert", src, tmp_path / "out"), tmp_path / "out", "mesh.json")


def test_a_link_in_a_cache_snapshot_reaches_its_blobs_only(ddpm, tmp_path):
    """SRC at X/snapshots/REV (a Hugging Face cache) may link into X/blobs, never elsewhere in X."""
    x = tmp_path / "models--org--name"
    (x / "blobs").mkdir(parents=True)
    (x / ".ssh").mkdir()
    (x / ".ssh" / "id_rsa").write_text("secret\n")
    snap = x / "snapshots" / "rev"
    subprocess.run(["mkdir", "-p", str(snap.parent)], check=True)
    subprocess.run(["cp", "-r", str(ddpm), str(snap)], check=True)
    (snap / "scheduler" / "notes.txt").symlink_to("../../../.ssh/id_rsa")
    r = run("convert", snap, tmp_path / "out")
    assert r.exit_code == 0, r.stderr
    assert not (tmp_path / "out" / "scheduler" / "notes.txt").exists()
    assert "scheduler/notes.txt (a symbolic link leading outside the source)" in r.stdout


KILLED_AFTER = """
import contextlib, os, sys
from ckptconv import api

@contextlib.contextmanager
def progress(total):
    seen = [0]
    def update(n):   # (a task's bytes arrive when it answered: its record is kept by then)
        seen[0] += 1
        if seen[0] == 3:
            os._exit(9)   # (as SIGKILL: the temporary output stays; the workers end with the driver)
    yield update

api.convert(sys.argv[1], sys.argv[2], max_shard_size="50KB", workers=2, resume=True, progress=progress)
"""


def test_resume_with_two_workers_keeps_a_pipeline_s_finished_shards(sd, tmp_path):
    """Each component's shards are tasks: a killed run's finished ones are re-hashed in their folders
    and kept; what else the run left in a kept component's folder is removed."""
    import json
    import subprocess
    import sys
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILLED_AFTER, str(sd), str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    tmp = tmp_path / ".out.ckptconv-tmp"
    assert r.returncode == 9 and not out.exists() and list((tmp / ".ckptconv-tasks").glob("*.json")), r.stderr
    kept_folder = next(p.parent for p in tmp.glob("*/*.safetensors"))
    (kept_folder / "stale.safetensors").write_bytes(b"of another plan")
    r = run("convert", sd, out, "--max-shard-size", "50KB", "--workers", 2, "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    note = json.loads(r.stdout)["resume_note"]
    assert note.endswith("task(s) finished by the interrupted run were kept") and int(note.split(" of ")[0]) >= 1
    convert(sd, tmp_path / "one", "--max-shard-size", "50KB")
    assert tree(out) == tree(tmp_path / "one")
