"""`make bench`: ckptconv against the bound and the naive way, on the same bytes, in one run.

Method (docs/benchmarks.md): each command is a separate process on a warm page cache (the `cold`
scenario drops it before every run), rows interleaved and rotated between rounds; we report the
median wall time of BENCH_REPEAT runs, GB/s, peak RSS (ru_maxrss of that process, via wait4) and
per-round ratios to the floors measured in the same run: an O_DIRECT copy of the same bytes
(convert), a convert of the same source (reshard), hashlib with both cores busy or over the largest
file (verify); and how many times faster than the naive way. Not a test: no thresholds.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("BENCH_DIR", ROOT / "bench-data"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "5"))
PY = sys.executable

BOUND = r'''
import hashlib, os, sys, threading, queue
*srcs, dst = sys.argv[1:]
q = queue.Queue(4); h = hashlib.sha256()
def hasher():
    while (b := q.get()) is not None:
        h.update(b)
t = threading.Thread(target=hasher); t.start()
with open(dst, "wb", buffering=0) as fo:
    for src in srcs:
        with open(src, "rb", buffering=0) as fi:
            while True:
                b = fi.read(16 << 20)
                if not b:
                    break
                q.put(b); fo.write(b)
q.put(None); t.join(); print(h.hexdigest())
'''

NAIVE_GROK = r'''
import dataclasses, os, pickle, sys
import numpy as np
from safetensors.numpy import save_file
@dataclasses.dataclass
class QuantizedWeight8bit:
    weight: np.ndarray
    scales: np.ndarray
sys.modules["__main__"].QuantizedWeight8bit = QuantizedWeight8bit
src, out = sys.argv[1], sys.argv[2]
tensors = {}
for name in sorted(os.listdir(src)):
    with open(os.path.join(src, name), "rb") as f:
        obj = pickle.load(f)  # what the official loader does (it executes whatever the file says)
    if isinstance(obj, QuantizedWeight8bit):
        tensors[name + ".weight"], tensors[name + ".scales"] = obj.weight, obj.scales
    else:
        tensors[name] = obj
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
'''

NAIVE_TORCH = r'''
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[2] + "/model.safetensors", metadata={"format": "pt"})
'''

# The peer that gives what ckptconv gives (issue 33): the Hub's own route (sharded safetensors and an
# index, huggingface_hub's save_torch_state_dict), the SHA-256 of every file written (what a user runs
# to publish a SHA256SUMS beside them), and sync (the bytes on disk when it returns, as ckptconv's
# O_DIRECT writes are).
HUB_PEER = r'''
import hashlib, os, sys, torch
from huggingface_hub import save_torch_state_dict
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
save_torch_state_dict(sd, sys.argv[2])
sums = []
for name in sorted(os.listdir(sys.argv[2])):
    h = hashlib.sha256()
    with open(os.path.join(sys.argv[2], name), "rb", buffering=0) as f:
        while b := f.read(16 << 20):
            h.update(b)
    sums.append(f"{h.hexdigest()}  {name}\n")
with open(os.path.join(sys.argv[2], "SHA256SUMS"), "w") as f:
    f.writelines(sums)
os.sync()
'''
HUB_NAME = "Hub: torch.load(mmap) + save_torch_state_dict + SHA-256 of each file + sync"


def generate(fn, path: Path, *args):
    """Make a benchmark input once, in a child process (so our own RSS never leaks into a fork)."""
    if not path.exists():
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench; bench.{fn}{args!r}"
        subprocess.run([PY, "-c", code], check=True)
    return path


def llama_1b(path, layers: int):
    """A bf16 checkpoint shaped like a 1B Llama (hidden 2048, MLP 5632, vocab 32000), saved by torch."""
    path = Path(path)
    import torch
    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    h, f, v = 2048, 5632, 32000

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(v, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            sd[p + f"self_attn.{n}_proj.weight"] = w(h, h)
        sd[p + "mlp.gate_proj.weight"] = w(f, h)
        sd[p + "mlp.up_proj.weight"] = w(f, h)
        sd[p + "mlp.down_proj.weight"] = w(h, f)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd["lm_head.weight"] = w(v, h)
    tmp = path.with_suffix(".tmp")
    torch.save(sd, tmp)
    os.rename(tmp, path)
    return path


def optimizer_state(path, n: int):
    """n small float32 tensors (16 each) named like an optimizer state, in one torch.save file."""
    import torch
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))
    kinds = ("exp_avg", "exp_avg_sq", "step", "param")
    sd = {f"state.{i // 4}.{kinds[i % 4]}": base[i].clone() for i in range(n)}
    tmp = path.with_suffix(".tmp")
    torch.save(sd, tmp)
    os.rename(tmp, path)


def llama_scaled(path, gigabytes: float):
    """A bf16 checkpoint of `gigabytes` in 160 equal [rows, 8192] tensors, written by torch.save
    (storage bytes from a repeated random block: the content does not matter). Each tensor maps the
    one block's file (shared, so its pages are the page cache's, not 20 GB of this process's memory)
    and is a storage of its own, so torch.save writes all 160."""
    import torch
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = int(gigabytes * 1e9 / 160 / 8192 / 2) // 64 * 64   # (split evenly by reshard --tp 8 ... 64)
    block_file = path.with_suffix(".block")
    block = (torch.randn(rows, 8192, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    block.view(torch.int16).numpy().tofile(block_file)
    del block
    sd = {f"model.layers.{i // 8}.w{i % 8}.weight":
          torch.from_file(str(block_file), shared=True, size=rows * 8192, dtype=torch.bfloat16).view(rows, 8192)
          for i in range(160)}
    tmp = path.with_suffix(".tmp")
    torch.save(sd, tmp)
    os.rename(tmp, path)
    block_file.unlink()


NAIVE_DCP = r'''
import os, sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, out = sys.argv[1], sys.argv[2]
dcp_to_torch_save(src, out + "/full.pt")
sd = torch.load(out + "/full.pt", mmap=True, weights_only=True)
save_file({k: v.contiguous() for k, v in sd.items()}, out + "/model.safetensors", metadata={"format": "pt"})
'''

NAIVE_TP = r'''
import os, sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
tp = 8
for r in range(tp):
    piece = {}
    for k, v in sd.items():
        if v.dim() == 2 and ("o_proj" in k or "down_proj" in k):
            piece[k] = v.chunk(tp, 1)[r].contiguous()
        elif v.dim() == 2:
            piece[k] = v.chunk(tp, 0)[r].contiguous()
        else:
            piece[k] = v
    os.makedirs(f"{sys.argv[2]}/rank-{r}", exist_ok=True)
    save_file(piece, f"{sys.argv[2]}/rank-{r}/model.safetensors", metadata={"format": "pt"})
'''

HASH_ONE_THREAD = r'''
import hashlib, sys
for path in sys.argv[1:]:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while b := f.read(16 << 20):
            h.update(b)
'''

# the verify floor: hashlib over the files with both cores busy (each file's two halves on two threads)
HASH_TWO_THREADS = r'''
import hashlib, os, sys, threading
def run(jobs):
    for path, start, stop in jobs:
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            while start < stop and (b := f.read(min(16 << 20, stop - start))):
                h.update(b); start += len(b)
halves = ([], [])
for path in sys.argv[1:]:
    mid = os.path.getsize(path) // 2
    halves[0].append((path, 0, mid)); halves[1].append((path, mid, os.path.getsize(path)))
threads = [threading.Thread(target=run, args=(h,)) for h in halves]
for t in threads: t.start()
for t in threads: t.join()
'''

# verify's floor (issue 33): two SHA-256 passes over every byte, on two cores: verify digests each file
# and, apart, each tensor's bytes. One thread hashes the files, another hashes them again, reading
# 16 MiB at a time as verify does.
HASH_TWO_PASSES = r'''
import hashlib, sys, threading
def run(paths):
    for path in paths:
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while b := f.read(16 << 20):
                h.update(b)
threads = [threading.Thread(target=run, args=(sys.argv[1:],)) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
'''

# the convert floor: an O_DIRECT copy (page-cache read, direct write) of every source file
COPY_FLOOR = 'out=$1; shift; for f; do dd if="$f" of="$out/copy" bs=16M oflag=direct status=none; done'


def dcp_dir(path, layers: int):
    """The 1B-shaped Llama state dict saved by torch's DCP from one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    sd = torch.load(llama_src(layers), mmap=True, weights_only=True)
    tmp = Path(str(path) + ".tmp")
    dcp.save(dict(sd), checkpoint_id=tmp)
    os.rename(tmp, path)


def grok_dir(path, layers: int):
    """A Grok-1-style directory of numpy pickles (int8 + bf16 scales), about 103 MB per layer."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import grok as gf
    dims = gf.Dims(vocab=32000, emb=1024, q_heads=8, kv_heads=2, head=128, ffn=4096, experts=8)
    tmp = Path(str(path) + ".tmp")
    gf.write_dir(tmp, gf.make_params(layers, dims))
    os.rename(tmp, path)


def remove(path: Path):
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _once(cmd, out):
    if out is not None:
        remove(out)
        if cmd[0] != "cp" and "ckptconv.cli" not in cmd:
            out.mkdir(parents=True)
    os.sync()  # start each run with no dirty pages from the last one (not timed)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmark command failed: {' '.join(map(str, cmd))}")
    if out is not None:
        remove(out)
    CPU.append(usage.ru_utime + usage.ru_stime)   # (the last run's CPU seconds, its children's included)
    return seconds, usage.ru_maxrss / 1024


CPU = []
CPU_S = {}   # row name -> CPU seconds per round, from measure_all


def measure_all(rows):
    """rows: (name, cmd, out dir or None). Runs them interleaved REPEAT times, starting each round at
    the next row (so drift in the machine's state, and the disk's clean-up after the previous row's
    writes, hit every row alike); returns (name, seconds per round, max peak RSS MiB)."""
    times = {name: [] for name, _, _ in rows}
    rss = {name: 0.0 for name, _, _ in rows}
    for rep in range(REPEAT):
        for name, cmd, out in rows[rep % len(rows):] + rows[:rep % len(rows)]:
            t, r = _once(cmd, out)
            times[name].append(t)
            CPU_S.setdefault(name, []).append(CPU[-1])
            rss[name] = max(rss[name], r)
    return [(name, times[name], rss[name]) for name, _, _ in rows]


def paired(times, base):
    """Median and range of the per-round ratios (each round's runs ran back to back, so a ratio
    within a round sees the same machine state; the spread across rounds is the machine's)."""
    ratios = sorted(t / b for t, b in zip(times, base))
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def warm(path: Path):
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)


def table(title, nbytes, rows):
    by_name = {name: times for name, times, _ in rows}
    floor, bound = by_name["copy floor (dd O_DIRECT)"], by_name["bound"]
    print(f"\n{title} ({nbytes / 1e9:.3f} GB, {REPEAT} rounds; ratios: median of the rounds' ratios (range))")
    print("| command | median wall s | GB/s | CPU s / GB | peak RSS MiB | x copy floor | x bound |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, times, rss in rows:
        secs = statistics.median(times)
        cpu = statistics.median(CPU_S[name][-len(times):]) / (nbytes / 1e9)
        print(f"| {name} | {secs:.2f} | {nbytes / secs / 1e9:.2f} | {cpu:.2f} | {rss:.0f} | {paired(times, floor)} | "
              f"{paired(times, bound)} |")
    sys.stdout.flush()


def scratch_dir() -> Path:
    d = DATA / "scratch"
    d.mkdir(parents=True, exist_ok=True)
    return d


def copy_floor_row(files, scratch):
    return ("copy floor (dd O_DIRECT)", ["sh", "-c", COPY_FLOOR, "sh", scratch / "floor", *files], scratch / "floor")


def compare(title, src: Path, files, ours: list, naive: tuple, against=None, peer=None):
    """The standard table: the copy floor (an O_DIRECT copy of `files`), cp, the bound, ckptconv
    (`ours`: [(name, CLI args)]) and the naive way (`naive` = name, script), all on the same bytes,
    warm cache, interleaved; ratios to the floor per round, and how many times faster than the naive
    way the first of `ours` is. `against`: the name of another row the first of ours is judged by;
    `peer` (name, script): a route with ckptconv's guarantees, the one the first of ours is judged
    against (the naive row then stays unjudged)."""
    scratch = scratch_dir()
    for f in files:
        warm(f)
    recursive = ["-r"] if src.is_dir() else []
    rows = measure_all([
        copy_floor_row(files, scratch),
        ("cp", ["cp", *recursive, src, scratch / "copy"], scratch / "copy"),
        ("bound", [PY, "-c", BOUND, *files, scratch / "bound" / "copy"], scratch / "bound"),
        *[(name, [PY, "-m", "ckptconv.cli", *args[:2], scratch / "out", *args[2:], "--quiet"], scratch / "out")
          for name, args in ours],
        (naive[0], [PY, "-c", naive[1], src, scratch / "naive"], scratch / "naive"),
        *([(peer[0], [PY, "-c", peer[1], src, scratch / "peer"], scratch / "peer")] if peer else []),
    ])
    table(title, sum(f.stat().st_size for f in files), rows)
    by_name = {name: times for name, times, _ in rows}
    first, judged = ours[0][0], (peer or naive)[0]
    print(f"{first}: {paired(by_name[judged], by_name[first])}x faster than {judged}"
          + (f"; {paired(by_name[first], by_name[against])}x {against}" if against else ""))
    sys.stdout.flush()
    return rows


def llama_src(layers) -> Path:
    return generate("llama_1b", DATA / f"llama-{layers}L.pt", str(DATA / f"llama-{layers}L.pt"), layers)


def bench_convert(layers):
    src = llama_src(layers)
    compare(f"convert .pt -> safetensors, {layers} layers", src, [src], [("ckptconv convert", ["convert", src])],
            ("torch.load(mmap) + save_file (no hashes, no sync; unjudged)", NAIVE_TORCH),
            against="copy floor (dd O_DIRECT)", peer=(HUB_NAME, HUB_PEER))


def bench_grok(layers):
    src = generate("grok_dir", DATA / f"grok-{layers}L", str(DATA / f"grok-{layers}L"), layers) / "ckpt-0"
    files = sorted(src.iterdir())
    compare(f"Grok-style pickle directory -> safetensors (lossless), {layers} layers, {len(files)} files", src, files,
            [("ckptconv pickle-to-safetensors", ["pickle-to-safetensors", src])],
            ("pickle.load each file + save_file", NAIVE_GROK))


def bench_dcp(layers):
    src = generate("dcp_dir", DATA / f"dcp-{layers}L", str(DATA / f"dcp-{layers}L"), layers)
    files = sorted(src.glob("*.distcp"))
    compare(f"DCP (1 process, {len(files)} .distcp) -> safetensors, {layers} layers", src, files,
            [("ckptconv convert (DCP)", ["convert", src])],
            ("dcp_to_torch_save + torch.load + save_file", NAIVE_DCP))


def bench_reshard(layers):
    src = llama_src(layers)
    compare(f"reshard .pt -> tp 8, {layers} layers", src, [src],
            [("ckptconv reshard --tp 8", ["reshard", src, "--tp", "8", "--heads", "16", "--kv-heads", "16",
                                          "--head-dim", "128"]),
             ("ckptconv convert (same source)", ["convert", src])],
            ("naive TP=8: torch.load(mmap), chunk, save_file x 8 (no hashes)", NAIVE_TP),
            against="ckptconv convert (same source)")


def bench_vllm(layers):
    """reshard --target vllm against plain reshard, tp 8, on the same source (a directory: the 1B-shaped
    .pt with its config.json): fusing q/k/v and gate/up and padding the vocabulary are lazy, so they
    should cost no extra pass."""
    pt = llama_src(layers)
    src = DATA / f"llama-{layers}L-hf"
    if not src.exists():
        src.mkdir()
        os.link(pt, src / "pytorch_model.bin")
        (src / "config.json").write_text(json.dumps({
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
            "num_key_value_heads": 16, "head_dim": 128, "num_hidden_layers": layers, "vocab_size": 32000,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    warm(pt)
    scratch = scratch_dir()
    cli = [PY, "-m", "ckptconv.cli", "reshard", src]
    (_, plain, plain_rss), (_, fused, fused_rss) = measure_all([
        ("mesh", [*cli, scratch / "out", "--tp", "8", "--quiet"], scratch / "out"),
        ("vllm", [*cli, scratch / "out", "--tp", "8", "--target", "vllm", "--quiet"], scratch / "out")])
    n = pt.stat().st_size
    print(f"\nreshard --tp 8 --target vllm against plain reshard --tp 8, {layers} layers, {n / 1e9:.3f} GB, "
          f"{REPEAT} rounds")
    print("| command | median wall s | GB/s | peak RSS MiB | x plain reshard |\n|---|---:|---:|---:|---:|")
    for name, times, rss in (("reshard --tp 8", plain, plain_rss), ("reshard --tp 8 --target vllm", fused, fused_rss)):
        secs = statistics.median(times)
        print(f"| {name} | {secs:.2f} | {n / secs / 1e9:.2f} | {rss:.0f} | {paired(times, plain)} |")
    sys.stdout.flush()


def bench_verify(layers):
    """verify against its floor: the larger of one hashlib pass over the largest output file (a file
    digest is sequential) and hashlib over all output files on two threads (both cores busy), per
    round; for a one-file output and for one in 500 MB shards."""
    src = llama_src(layers)
    outs = {"one 2.1 GB shard": DATA / f"verify-{layers}L", "500 MB shards": DATA / f"verify-{layers}L-500MB"}
    tp8 = DATA / f"verify-{layers}L-tp8"
    for target, args in ((outs["one 2.1 GB shard"], ["convert", src, outs["one 2.1 GB shard"]]),
                         (outs["500 MB shards"], ["convert", src, outs["500 MB shards"], "--max-shard-size", "500MB"]),
                         (tp8, ["reshard", src, tp8, "--tp", "8", "--heads", "16", "--kv-heads", "16",
                                "--head-dim", "128"])):
        if not target.exists():
            subprocess.run([PY, "-m", "ckptconv.cli", *map(str, args), "--quiet"], check=True, stdout=subprocess.DEVNULL)
    for label, out in outs.items():
        files = sorted(out.glob("*.safetensors"))
        for f in files:
            warm(f)
        n = sum(f.stat().st_size for f in files)
        largest = max(files, key=lambda f: f.stat().st_size)
        rows = measure_all([
            ("hashlib, largest file, one thread", [PY, "-c", HASH_ONE_THREAD, largest], None),
            ("hashlib, all files, two threads", [PY, "-c", HASH_TWO_THREADS, *files], None),
            ("hashlib, two passes over all files, two threads", [PY, "-c", HASH_TWO_PASSES, *files], None),
            ("ckptconv verify", [PY, "-m", "ckptconv.cli", "verify", out, "--quiet"], None)])
        by_name = {name: times for name, times, _ in rows}
        floor = [max(a, b) for a, b in zip(by_name["hashlib, largest file, one thread"],
                                           by_name["hashlib, all files, two threads"])]
        two = by_name["hashlib, two passes over all files, two threads"]
        print(f"\nverify (structural, every file hashed), {label}: {len(files)} files, {n / 1e9:.3f} GB, "
              f"{REPEAT} rounds; one-pass floor = the larger of the first two hashlib rows, per round; two-pass "
              "floor = the third (verify digests each file and each tensor)")
        print("| command | median wall s | GB/s | peak RSS MiB | x one-pass floor | x two-pass floor |\n"
              "|---|---:|---:|---:|---:|---:|")
        for name, times, rss in rows:
            secs = statistics.median(times)
            print(f"| {name} | {secs:.2f} | {n / secs / 1e9:.2f} | {rss:.0f} | {paired(times, floor)} | "
                  f"{paired(times, two)} |")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([PY, "-m", "ckptconv.cli", "verify", tp8, "--device", "cpu", "--json", "--quiet"],
                       capture_output=True, text=True, env=env)
    dev = json.loads(r.stdout)["device"]
    print(f"\nverify --device cpu of the tp 8 output on 8 CPU devices: {dev['bytes'] / 1e9:.3f} GB placed in "
          f"{dev['seconds']:.2f} s = {dev['gb_per_s']:.2f} GB/s, global arrays: {dev['global_arrays']}")
    sys.stdout.flush()


def drop_caches() -> bool:
    """Empty the page cache (root only): a cold run reads from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure_cold(rows):
    """rows: (name, cmd, out or None), each run REPEAT times right after dropping the page cache,
    rows in order within a round. Returns ({name: seconds per round}, {name: peak RSS MiB}), or None
    (and says so) where the cache cannot be dropped."""
    times, rss = {name: [] for name, _, _ in rows}, {name: 0.0 for name, _, _ in rows}
    for _ in range(REPEAT):
        for name, cmd, dest in rows:
            if not drop_caches():
                print("\ncold cache: skipped (dropping the page cache needs root)")
                return None
            seconds, peak = _once(cmd, dest)
            times[name].append(seconds)
            rss[name] = max(rss[name], peak)
    return times, rss


def bench_cold(layers):
    """convert and verify with a cold page cache beside their floors, each run after dropping the
    caches (sync; echo 3 > /proc/sys/vm/drop_caches, as root)."""
    src = llama_src(layers)
    scratch = scratch_dir()
    out = DATA / f"verify-{layers}L"
    if not out.exists():
        subprocess.run([PY, "-m", "ckptconv.cli", "convert", src, out, "--quiet"], check=True, stdout=subprocess.DEVNULL)
    files = sorted(out.glob("*.safetensors"))
    rows = [copy_floor_row([src], scratch),
            ("ckptconv convert", [PY, "-m", "ckptconv.cli", "convert", src, scratch / "out", "--quiet"], scratch / "out"),
            (HUB_NAME, [PY, "-c", HUB_PEER, src, scratch / "peer"], scratch / "peer"),
            ("ckptconv reshard --tp 8", [PY, "-m", "ckptconv.cli", "reshard", src, scratch / "tp8", "--tp", "8",
                                         "--heads", "16", "--kv-heads", "16", "--head-dim", "128", "--quiet"],
             scratch / "tp8"),
            ("hashlib, output, two threads", [PY, "-c", HASH_TWO_THREADS, *files], None),
            ("hashlib, output, one thread", [PY, "-c", HASH_ONE_THREAD, *files], None),
            ("ckptconv verify", [PY, "-m", "ckptconv.cli", "verify", out, "--quiet"], None)]
    measured = measure_cold(rows)
    if measured is None:
        return
    times = measured[0]
    n = src.stat().st_size
    print(f"\ncold page cache, {n / 1e9:.3f} GB, {REPEAT} rounds (caches dropped before every run)")
    print("| command | median wall s | GB/s | ratio |\n|---|---:|---:|---:|")
    verify_floor = [max(a, b) for a, b in zip(times["hashlib, output, two threads"], times["hashlib, output, one thread"])]
    for name, ts in times.items():
        ratio = (paired(ts, times["copy floor (dd O_DIRECT)"]) + " x copy floor" if name == "ckptconv convert" else
                 paired(ts, times["ckptconv convert"]) + " x convert" if name == "ckptconv reshard --tp 8" else
                 paired(ts, times["ckptconv convert"]) + " x ckptconv convert" if name == HUB_NAME else
                 paired(ts, verify_floor) + " x hash floor" if name == "ckptconv verify" else "")
        print(f"| {name} | {statistics.median(ts):.2f} | {n / statistics.median(ts) / 1e9:.2f} | {ratio} |")
    sys.stdout.flush()


def _executor_jobs(src, scratch, shard: str) -> dict:
    """The two jobs the executor benches time: convert in `shard` shards (several tasks) and reshard
    --tp 8 (eight rank directories) of the 1B-shaped source."""
    return {"convert": ["convert", src, scratch / "out", "--max-shard-size", shard, "--quiet"],
            "reshard --tp 8": ["reshard", src, scratch / "out", "--tp", "8", "--heads", "16", "--kv-heads", "16",
                               "--head-dim", "128", "--quiet"]}


def _executor_rows(job: str, measured, n: int):
    """One table row per executor row of `job`, its ratio to the first row (--workers 1) per round."""
    base = measured[0][1]
    for name, ts, rss in measured:
        cpu = statistics.median(CPU_S[name][-len(ts):]) / (n / 1e9)
        print(f"| {job} | {name} | {statistics.median(ts):.2f} | {paired(ts, base)} | {cpu:.2f} | {rss:.0f} |")
        del CPU_S[name]
    sys.stdout.flush()


def bench_workers(layers):
    """The local executor (--workers N tasks in flight: worker processes; the threads variant beside
    it, CKPTCONV_LOCAL_WORKERS=thread) against --workers 1, for convert (500 MB shards) and reshard
    --tp 8 of the same source, and verify of convert's output (500 MB shards), warm cache,
    interleaved: wall time, its ratio to --workers 1 per round (median (range)), CPU s/GB (the driver
    and its workers), peak RSS of the largest process."""
    src = llama_src(layers)
    scratch = scratch_dir()
    warm(src)
    n = src.stat().st_size
    cli = [PY, "-m", "ckptconv.cli"]
    threads = ["env", "CKPTCONV_LOCAL_WORKERS=thread"]
    jobs = _executor_jobs(src, scratch, "500MB")
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, cores})
    print(f"\nworkers on this {cores}-core machine, {n / 1e9:.3f} GB .pt, warm cache, {REPEAT} rounds")
    print("| job | --workers | median wall s | x --workers 1 | CPU s / GB | peak RSS MiB |\n|---|---|---:|---:|---:|---:|")
    for job, args in jobs.items():
        rows = [(f"{w} (processes)", [*cli, *map(str, args), "--workers", str(w)], scratch / "out") for w in counts]
        rows += [(f"{w} (threads)", [*threads, *cli, *map(str, args), "--workers", str(w)], scratch / "out")
                 for w in counts if w > 1]
        _executor_rows(job, measure_all(rows), n)
    checked = DATA / f"verify-{layers}L-500MB"   # (verify: its shares of the checks, of what convert wrote)
    if not checked.exists():
        subprocess.run([*cli, "convert", src, checked, "--max-shard-size", "500MB", "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
    for f in sorted(checked.glob("*.safetensors")):
        warm(f)
    rows = [(f"{w} (processes)", [*cli, "verify", checked, "--quiet", "--workers", str(w)], None) for w in counts]
    _executor_rows("verify", measure_all(rows), n)


def bench_ray(layers):
    """The Ray executor (--ray) on a 2-node local Ray cluster (ray.cluster_utils, one CPU a node, both
    on this host) against the local executor on the same cores (--workers 2) and --workers 1, for
    convert (200 MB shards: several tasks) and reshard --tp 8 of the same source, warm cache,
    interleaved: the overhead Ray adds (driver join, task scheduling, each task re-opening the source;
    the cluster's start is not timed). Needs Ray in the interpreter that runs the bench
    (BENCH_PY=.venv-ray/bin/python make bench ... or .venv-ray/bin/python bench/bench.py ray)."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        print("\nray: skipped (Ray is not installed in this interpreter: .venv-ray/bin/python bench/bench.py ray)")
        return
    src = llama_src(layers)
    scratch = scratch_dir()
    warm(src)
    n = src.stat().st_size
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    up = time.perf_counter() - started
    try:
        cli = [PY, "-m", "ckptconv.cli"]
        jobs = _executor_jobs(src, scratch, "200MB")
        print(f"\nray: a 2-node local cluster (1 CPU a node; started in {up:.1f} s, not timed) against the local "
              f"executor, {n / 1e9:.3f} GB .pt, warm cache, {REPEAT} rounds")
        print("| job | executor | median wall s | x --workers 1 | driver CPU s / GB | driver peak RSS MiB |\n"
              "|---|---|---:|---:|---:|---:|")
        for job, args in jobs.items():
            rows = [("--workers 1", [*cli, *map(str, args), "--workers", "1"], scratch / "out"),
                    ("--workers 2", [*cli, *map(str, args), "--workers", "2"], scratch / "out"),
                    ("--ray (2 nodes)", [*cli, *map(str, args), f"--ray={cluster.address}"], scratch / "out")]
            _executor_rows(job, measure_all(rows), n)
    finally:
        cluster.shutdown()


def bench_ray_start(rounds=5):
    """What shipping ckptconv with the job costs at the start of a --ray run (run/ray_nodes.py), on a
    fresh 2-node local cluster each round (ray.cluster_utils, one CPU a node): the driver's join
    (ray.init; shipped, it zips the package and uploads it, unless the cluster holds it already) and
    the check of every node (one task a node: its first worker, started in the job's runtime_env,
    the shipped package fetched and unpacked there first), for the first run on the cluster (fresh),
    the next (warm) and with CKPTCONV_RAY_SHIP=0 (installed). Medians and ranges of `rounds`."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        print("\nray-start: skipped (Ray is not installed in this interpreter: .venv-ray/bin/python bench/bench.py "
              "ray-start)")
        return
    script = ("import json, logging, os, sys, time\nimport ray\nfrom ckptconv.run import ray_executor\n"
              "ex = ray_executor.RayExecutor(sys.argv[1])\nt0 = time.perf_counter()\n"
              "ray.init(address=sys.argv[1], runtime_env=ex._valid_env(ray), logging_level=logging.ERROR, "
              "log_to_driver=False)\nt1 = time.perf_counter()\nex._check_nodes(ray)\nt2 = time.perf_counter()\n"
              "ray.shutdown()\nprint(json.dumps([t1 - t0, t2 - t1]))\n")
    found = {}
    for _ in range(rounds):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        try:
            for case, ship in (("shipped, fresh cluster", "1"), ("shipped, warm cluster", "1"), ("installed", "0")):
                r = subprocess.run([PY, "-c", script, cluster.address], cwd=scratch_dir(), check=True,
                                   capture_output=True, text=True, env={**os.environ, "CKPTCONV_RAY_SHIP": ship})
                for phase, seconds in zip(("join", "check"), json.loads(r.stdout.strip().splitlines()[-1])):
                    found.setdefault((case, phase), []).append(seconds)
        finally:
            cluster.shutdown()
    print(f"\nray-start: a fresh 2-node local cluster each round, {rounds} rounds")
    print("| ckptconv on the nodes | driver joins (ray.init) s | every node checked s |\n|---|---:|---:|")
    for case in ("shipped, fresh cluster", "shipped, warm cluster", "installed"):
        cells = [found[(case, phase)] for phase in ("join", "check")]
        print(f"| {case} | " + " | ".join(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in cells)
              + " |")


def split_all_rules(scratch) -> Path:
    """A rules file that splits every tensor on its first axis (an optimizer state has no model type)."""
    rules = scratch / "split-all.toml"
    rules.write_text('layout = "torch"\n[[rule]]\npattern = ".*"\naxis = 0\n')
    return rules


def bench_many():
    """Many small tensors (an optimizer state): inspect, convert, reshard --tp 2 and verify, each
    once per size; time per 10,000 tensors (linear means a flat column) and peak RSS. Each job's
    start-up (the median of three runs on a file of one tensor) is measured first: the column beyond
    it is the time the tensors take, which a 10,000-tensor run would otherwise hide under start-up."""
    sizes = [int(n) for n in os.environ.get("BENCH_MANY", "10000,50000,100000,1000000").split(",")]
    scratch = scratch_dir()
    rules = split_all_rules(scratch)
    cli = [PY, "-m", "ckptconv.cli"]
    out = scratch / "many-out"

    def jobs(src):
        return [("inspect", [*cli, "inspect", src, "--quiet"], None),
                ("convert", [*cli, "convert", src, out, "--quiet"], None),
                ("verify", [*cli, "verify", out, "--quiet"], None),
                ("reshard --tp 2", [*cli, "reshard", src, scratch / "many-tp2", "--tp", "2", "--rules", rules,
                                    "--quiet"], scratch / "many-tp2")]

    one = generate("optimizer_state", DATA / "many-1.pt", str(DATA / "many-1.pt"), 1)
    start = {}
    for _ in range(3):
        remove(out)
        for job, cmd, dest in jobs(one):
            start.setdefault(job, []).append(_once(cmd, dest)[0])
    start = {job: statistics.median(ts) for job, ts in start.items()}
    remove(out)
    print("\nmany small tensors (16 float32 each, one torch.save file), one run each; s / 10k = seconds per "
          "10,000 tensors; beyond start-up: less the job's start-up on one tensor ("
          + ", ".join(f"{job} {t:.2f} s" for job, t in start.items()) + ")")
    print("| tensors | job | wall s | s / 10k | s / 10k beyond start-up | peak RSS MiB |\n|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        src = generate("optimizer_state", DATA / f"many-{n}.pt", str(DATA / f"many-{n}.pt"), n)
        warm(src)
        remove(out)
        for job, cmd, dest in jobs(src):
            seconds, rss = _once(cmd, dest)
            print(f"| {n:,} | {job} | {seconds:.2f} | {seconds / n * 1e4:.2f} | "
                  f"{(seconds - start[job]) / n * 1e4:.2f} | {rss:.0f} |")
            sys.stdout.flush()
        remove(out)
        if n >= 1_000_000:
            src.unlink()   # 360 MB; made again when next asked for


SCALE_RULES = """layout = "torch"
[[rule]]
pattern = "model\\\\.layers\\\\.\\\\d+\\\\.w[0-5]\\\\.weight"
axis = 0
[[rule]]
pattern = "model\\\\.layers\\\\.\\\\d+\\\\.w[67]\\\\.weight"
axis = 1
"""


def bench_scale():
    """A generated checkpoint of BENCH_SCALE_GB (default 20) with a cold page cache: convert and
    reshard --tp 8 (6 of every 8 tensors split on their first axis, 2 on their second, about a
    Llama's mix) beside the O_DIRECT copy floor, peak RSS flat. Each output is removed before the next run,
    so the disk holds the source and one output. Each job at --workers 1 and 2 (and this machine's
    core count, where more): the local executor's tasks in flight on a disk that is really read."""
    gigabytes = float(os.environ.get("BENCH_SCALE_GB", "20"))
    counts = sorted({1, 2, len(os.sched_getaffinity(0))})
    src = generate("llama_scaled", DATA / f"scaled-{gigabytes:g}GB.pt", str(DATA / f"scaled-{gigabytes:g}GB.pt"),
                   gigabytes)
    scratch = scratch_dir()
    rules = scratch / "scaled-rules.toml"
    rules.write_text(SCALE_RULES)
    cli = [PY, "-m", "ckptconv.cli"]
    global REPEAT
    repeat, REPEAT = REPEAT, min(REPEAT, 3)
    try:
        rows = [copy_floor_row([src], scratch)]
        for w in counts:
            rows.append((f"ckptconv convert --workers {w}", [*cli, "convert", src, scratch / "out", "--quiet",
                                                              "--workers", str(w)], scratch / "out"))
        for w in counts:
            rows.append((f"ckptconv reshard --tp 8 --workers {w}",
                         [*cli, "reshard", src, scratch / "tp8", "--tp", "8", "--rules", rules, "--quiet", "--workers",
                          str(w)], scratch / "tp8"))
        measured = measure_cold(rows)
        if measured is None:
            return
        times, rss = measured
        n = src.stat().st_size
        floor = times["copy floor (dd O_DIRECT)"]
        print(f"\nscale, cold page cache: generated {n / 1e9:.3f} GB .pt (160 tensors), {REPEAT} rounds, "
              f"{len(os.sched_getaffinity(0))} cores")
        print("| command | median wall s | GB/s | peak RSS MiB | x copy floor | x --workers 1 | x convert |\n"
              "|---|---:|---:|---:|---:|---:|---:|")
        for name, ts in times.items():
            job, _, w = name.partition(" --workers ")
            one = times.get(f"{job} --workers 1") if w and w != "1" else None
            convert = times["ckptconv convert --workers 1"] if name == "ckptconv reshard --tp 8 --workers 1" else None
            print(f"| {name} | {statistics.median(ts):.2f} | {n / statistics.median(ts) / 1e9:.2f} | {rss[name]:.0f} | "
                  f"{paired(ts, floor)} | {paired(ts, one) if one else ''} | {paired(ts, convert) if convert else ''} |")
        sys.stdout.flush()
    finally:
        REPEAT = repeat


def bench_plan():
    """`ckptconv plan`'s estimates of time and peak RSS beside what the same run measures (median of
    BENCH_REPEAT runs, warm cache): the constants in plan.py come from these rows."""
    big = llama_src(18)
    many = generate("optimizer_state", DATA / "many-100000.pt", str(DATA / "many-100000.pt"), 100000)
    scratch = scratch_dir()
    tp8 = ["--tp", "8", "--heads", "16", "--kv-heads", "16", "--head-dim", "128"]
    jobs = [("convert 2.1 GB", "convert", big, []), ("reshard --tp 8 2.1 GB", "reshard", big, tp8),
            ("convert 100,000 tensors", "convert", many, []),
            ("reshard --tp 2 100,000 tensors", "reshard", many, ["--tp", "2", "--rules", split_all_rules(scratch)])]
    print("\nplan's estimates against the run (warm cache; ratio = estimate / measured median)")
    print("| job | est. s | measured s | ratio | est. peak MB | measured peak MB | ratio |\n|---|---:|---:|---:|---:|---:|---:|")
    for label, job, src, extra in jobs:
        warm(src)
        plan_args = ["plan", src, *extra] if job == "reshard" else ["plan", src]
        est = json.loads(subprocess.run([PY, "-m", "ckptconv.cli", *map(str, plan_args), "--json"], check=True,
                                        capture_output=True, text=True).stdout)
        runs = [_once([PY, "-m", "ckptconv.cli", job, src, scratch / "out", *extra, "--quiet"], scratch / "out")
                for _ in range(REPEAT)]
        secs, rss = statistics.median(r[0] for r in runs), max(r[1] for r in runs)
        proc = est["processes"][0]
        est_mb = proc["peak_rss_bytes"] / 1e6
        print(f"| {label} | {est['seconds']:.2f} | {secs:.2f} | {est['seconds'] / secs:.2f} | {est_mb:.0f} | "
              f"{rss * 1.048576:.0f} | {est_mb / (rss * 1.048576):.2f} |")
        sys.stdout.flush()


def zero3_dir(path, gigabytes: float):
    """A ZeRO-3 checkpoint of 2 ranks with `gigabytes` of fp32 masters (and twice that of Adam
    moments), written with torch.save in the structure DeepSpeed 0.19.8 writes (tests/fixtures/
    zero_layout.py): 4096 x 4096 matrices and a few odd sizes the ranks pad."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import zero_layout
    tmp = Path(str(path) + ".tmp")
    remove(tmp)
    zero_layout.write(tmp, _zero3_params(gigabytes), world=2, stage=3, keep=False)
    os.rename(tmp, path)


def _zero3_params(gigabytes: float) -> list:
    n = max(1, round(gigabytes * 1e9 / (4096 * 4096 * 4)))
    return [(f"layers.{i}.weight", (4096, 4096)) for i in range(n)] + [("norm.weight", (4097,)),
                                                                      ("head.bias", (3, 7, 11))]


def zero3_pt(path, gigabytes: float):
    """The same masters (shapes and values) as one torch.save file: what a plain convert reads."""
    import numpy as np
    import torch
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import zero_layout
    rng = np.random.default_rng(0)
    sd = {n: torch.from_numpy(zero_layout.floats(rng, int(np.prod(s)))).reshape(s) for n, s in _zero3_params(gigabytes)}
    torch.save(sd, str(path) + ".tmp")
    os.rename(str(path) + ".tmp", path)


def _partitions(src: Path) -> list:
    """(file, offset, length) of each rank's fp32 partition in its optimizer-state file (the largest
    storage written last: the moments come first)."""
    import struct
    import zipfile
    out = []
    for f in sorted((src / "global_step1").glob("*_optim_states.pt")):
        with zipfile.ZipFile(f) as z, open(f, "rb") as fh:
            entries = []
            for info in z.infolist():
                if "/data/" in info.filename:
                    fh.seek(info.header_offset + 26)
                    n, extra = struct.unpack("<HH", fh.read(4))
                    entries.append((info.header_offset + 30 + n + extra, info.file_size))
        out.append((f, *max(entries, key=lambda e: (e[1], e[0]))))
    return out


def _resident_bytes(path: Path) -> int:
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        anchor = ctypes.c_char.from_buffer(m)
        libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor
        return sum(b & 1 for b in bytes(vec)) * mmap.PAGESIZE
    finally:
        m.close()


def _evict(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


DS_PY = Path(os.environ.get("BENCH_DEEPSPEED_PYTHON", ROOT / ".venv-deepspeed" / "bin" / "python"))


def bench_deepspeed(sizes=(1.0, 2.0)):
    """ZeRO-3 (2 ranks) -> safetensors: ckptconv against DeepSpeed's zero_to_fp32.py
    --safe_serialization (in the DeepSpeed venv `make test-deepspeed` makes) and an O_DIRECT copy of
    the fp32 partition bytes, warm (the partitions in the page cache) and cold (the rank files evicted
    from it with posix_fadvise before every run: no root needed, other files untouched); then the
    bytes ckptconv reads of the rank files, counted with mincore after a cold run."""
    scratch = scratch_dir()
    floor = 'out=$1; shift; while [ $# -gt 0 ]; do dd if="$1" of="$out/copy" iflag=skip_bytes,count_bytes ' \
            'skip=$2 count=$3 bs=16M oflag=direct status=none; shift 3; done'
    for gb in sizes:
        src = generate("zero3_dir", DATA / f"zero3-{gb:g}G", str(DATA / f"zero3-{gb:g}G"), gb)
        parts = _partitions(src)
        masters = sum(n for _, _, n in parts)
        files = sorted((src / "global_step1").iterdir())
        rows = [("copy floor (dd O_DIRECT, the partitions)",
                 ["sh", "-c", floor, "sh", scratch / "floor", *[str(x) for p in parts for x in p]], scratch / "floor"),
                ("ckptconv convert", [PY, "-m", "ckptconv.cli", "convert", src, scratch / "out", "--quiet"],
                 scratch / "out")]
        pt = generate("zero3_pt", DATA / f"zero3-{gb:g}G.pt", str(DATA / f"zero3-{gb:g}G.pt"), gb)
        rows.append(("ckptconv convert, the same masters as one .pt (control)",
                     [PY, "-m", "ckptconv.cli", "convert", pt, scratch / "pt", "--quiet"], scratch / "pt"))
        if DS_PY.exists():
            rows.append(("zero_to_fp32.py --safe_serialization",
                         ["env", "DS_ACCELERATOR=cpu", DS_PY, "-m", "deepspeed.utils.zero_to_fp32", src,
                          scratch / "naive", "--safe_serialization"], scratch / "naive"))
        for cold in (False, True):
            times, rss = {name: [] for name, _, _ in rows}, {name: 0.0 for name, _, _ in rows}
            for rep in range(REPEAT):
                for name, cmd, out in rows[rep % len(rows):] + rows[:rep % len(rows)]:
                    os.sync()
                    if cold:
                        _evict(pt)
                    else:
                        warm(pt)
                    for f, off, n in parts:
                        if cold:
                            _evict(f)
                        else:   # warm: the bytes every row reads
                            subprocess.run(["dd", f"if={f}", "of=/dev/null", "iflag=skip_bytes,count_bytes",
                                            f"skip={off}", f"count={n}", "bs=16M", "status=none"], check=True)
                    t, r = _once(cmd, out)
                    times[name].append(t)
                    rss[name] = max(rss[name], r)
            base, ours = times[rows[0][0]], times[rows[1][0]]
            print(f"\nDeepSpeed ZeRO-3, 2 ranks -> safetensors, {'cold' if cold else 'warm'}: {masters / 1e9:.3f} GB "
                  f"of fp32 masters in {sum(f.stat().st_size for f in files) / 1e9:.3f} GB of rank files ({REPEAT} "
                  "rounds; ratios: median of the rounds' ratios (range))")
            print("| command | median wall s | GB/s (masters) | peak RSS MiB | x copy floor |\n|---|---:|---:|---:|---:|")
            for name, _, _ in rows:
                secs = statistics.median(times[name])
                print(f"| {name} | {secs:.2f} | {masters / secs / 1e9:.2f} | {rss[name]:.0f} | "
                      f"{paired(times[name], base)} |")
            if DS_PY.exists():
                print(f"ckptconv convert: {paired(times[rows[3][0]], ours)}x faster than zero_to_fp32.py; "
                      f"{paired(ours, times[rows[2][0]])}x the control")
            else:
                print(f"zero_to_fp32.py: skipped ({DS_PY} missing: `make test-deepspeed` makes it)")
            sys.stdout.flush()
        os.sync()
        for f in files:
            _evict(f)
        before = sum(_resident_bytes(f) for f in files)
        _once([PY, "-m", "ckptconv.cli", "convert", src, scratch / "out", "--quiet"], scratch / "out")
        read = sum(_resident_bytes(f) for f in files) - before
        print(f"bytes of the rank files ckptconv read (page cache emptied of them first): {read / 1e9:.3f} GB, "
              f"{read / masters:.4f} x the fp32 partitions ({masters / 1e9:.3f} GB); the rank files hold "
              f"{sum(f.stat().st_size for f in files) / 1e9:.3f} GB")
        sys.stdout.flush()


# hidden 2048, 16 query heads in 8 groups of 128, SwiGLU 5632, vocabulary 32000, bf16: 90 MB a layer
MEGATRON = dict(hidden=2048, heads=16, groups=8, head_dim=128, ffn=5632, vocab=32000, tp=4, pp=2)


def megatron_legacy(path, layers: int):
    """A TP 4 x PP 2 Megatron-LM legacy checkpoint of a `layers`-layer bf16 GPT, written with torch.save
    in the structure the real files have (tests/fixtures/megatron.py): per rank
    iter_0000001/mp_rank_TT_PPP/model_optim_rng.pt = {args (a Namespace), checkpoint_version 3.0,
    iteration, model (this rank's slices, layers numbered from 0 per stage, `_extra_state` None),
    opt_param_scheduler, rng_state}; values are random bits (nothing computes with them)."""
    import argparse
    import numpy as np
    import torch
    m = MEGATRON
    tp, pp, hd = m["tp"], m["pp"], m["head_dim"]
    rng = np.random.default_rng(0)

    def w(*shape):   # random bf16 bits of normal magnitude (exponent 0x3c-0x3f: no inf, no nan)
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0x83FF | 0x3C00
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)

    args = argparse.Namespace(
        num_layers=layers, hidden_size=m["hidden"], ffn_hidden_size=m["ffn"], num_attention_heads=m["heads"],
        group_query_attention=True, num_query_groups=m["groups"], kv_channels=hd, max_position_embeddings=4096,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, position_embedding_type="rope", rotary_base=10000,
        untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False,
        padded_vocab_size=m["vocab"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1, bf16=True, params_dtype=torch.bfloat16, iteration=1)
    tmp = Path(str(path) + ".tmp")
    remove(tmp)
    if layers % pp:
        raise SystemExit(f"megatron_legacy: {layers} layers do not split over {pp} pipeline stages")
    per_stage = layers // pp
    qkv = m["groups"] // tp * (m["heads"] // m["groups"] + 2) * hd
    for p in range(pp):
        for t in range(tp):
            sd = {}
            if p == 0:
                sd["embedding.word_embeddings.weight"] = w(m["vocab"] // tp, m["hidden"])
            for i in range(per_stage):
                pre = f"decoder.layers.{i}."
                sd[pre + "input_layernorm.weight"] = w(m["hidden"])
                sd[pre + "self_attention.linear_proj.weight"] = w(m["hidden"], m["heads"] * hd // tp)
                sd[pre + "self_attention.linear_proj._extra_state"] = None
                sd[pre + "self_attention.linear_qkv.weight"] = w(qkv, m["hidden"])
                sd[pre + "self_attention.linear_qkv._extra_state"] = None
                sd[pre + "pre_mlp_layernorm.weight"] = w(m["hidden"])
                sd[pre + "mlp.linear_fc1.weight"] = w(2 * m["ffn"] // tp, m["hidden"])
                sd[pre + "mlp.linear_fc1._extra_state"] = None
                sd[pre + "mlp.linear_fc2.weight"] = w(m["hidden"], m["ffn"] // tp)
                sd[pre + "mlp.linear_fc2._extra_state"] = None
            if p == pp - 1:
                sd["decoder.final_layernorm.weight"] = w(m["hidden"])
                sd["output_layer.weight"] = w(m["vocab"] // tp, m["hidden"])
            f = tmp / "iter_0000001" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt"
            f.parent.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": sd,
                        "opt_param_scheduler": {"num_steps": 1, "max_lr": 1e-4},
                        "rng_state": [{"torch_rng_state": torch.get_rng_state()}],
                        "num_floating_point_operations_so_far": 0}, f)
    (tmp / "latest_checkpointed_iteration.txt").write_text("1")
    os.rename(tmp, path)


def bench_megatron(sizes=(12, 22)):
    """A TP 4 x PP 2 legacy checkpoint (1.3 and 2.2 GB of bf16 weights in 8 rank files) merged and
    written (Megatron names, and --to hf), against an O_DIRECT copy of the rank files; and reshard to
    TP 8 straight from it, against merging first and resharding the merged model."""
    for layers in sizes:
        _bench_megatron(layers)


def _bench_megatron(layers):
    m = MEGATRON
    src = generate("megatron_legacy", DATA / f"megatron-tp4pp2-{layers}L", str(DATA / f"megatron-tp4pp2-{layers}L"),
                   layers)
    files = sorted(src.glob("iter_0000001/*/model_optim_rng.pt"))
    scratch = scratch_dir()
    control = DATA / f"megatron-tp4pp2-{layers}L-merged"   # the merged model as safetensors: the writer alone
    if not control.exists():
        subprocess.run([PY, "-m", "ckptconv.cli", "convert", src, control, "--quiet"], check=True)
    for f in files:
        warm(f)
    cli = [PY, "-m", "ckptconv.cli"]
    merged = scratch / "merged"
    heads = f"--preset megatron --heads {m['heads']} --kv-heads {m['groups']} --head-dim {m['head_dim']}"
    two_steps = (f"{' '.join(map(str, cli))} convert {src} {merged} --quiet && "   # (the merged model has no args)
                 f"{' '.join(map(str, cli))} reshard {merged} {scratch / 'tp8b'} --tp 8 {heads} --quiet; rc=$?; "
                 f"rm -rf {merged}; exit $rc")
    rows = measure_all([
        copy_floor_row(files, scratch),
        ("ckptconv convert", [*cli, "convert", src, scratch / "out", "--quiet"], scratch / "out"),
        ("ckptconv convert --to hf", [*cli, "convert", src, scratch / "hf", "--to", "hf", "--quiet"], scratch / "hf"),
        ("ckptconv reshard --tp 8 (direct)", [*cli, "reshard", src, scratch / "tp8", "--tp", "8", "--quiet"],
         scratch / "tp8"),
        ("convert, then reshard --tp 8", ["sh", "-c", two_steps], scratch / "tp8b"),
        ("control: ckptconv convert of the merged model (safetensors)", [*cli, "convert", control, scratch / "ctl",
                                                                          "--quiet"], scratch / "ctl"),
    ])
    nbytes = sum(f.stat().st_size for f in files)
    by_name = {name: times for name, times, _ in rows}
    floor = by_name["copy floor (dd O_DIRECT)"]
    print(f"\nMegatron legacy TP 4 x PP 2, {layers} layers ({nbytes / 1e9:.3f} GB in {len(files)} rank files, "
          f"{REPEAT} rounds; ratios: median of the rounds' ratios (range))")
    print("| command | median wall s | GB/s | peak RSS MiB | x copy floor |\n|---|---:|---:|---:|---:|")
    for name, times, rss in rows:
        secs = statistics.median(times)
        print(f"| {name} | {secs:.2f} | {nbytes / secs / 1e9:.2f} | {rss:.0f} | {paired(times, floor)} |")
    print(f"ckptconv convert: {paired(by_name['ckptconv convert'], by_name[rows[-1][0]])}x the control")
    print(f"reshard --tp 8 direct: {paired(by_name['convert, then reshard --tp 8'], by_name['ckptconv reshard --tp 8 (direct)'])}"
          "x faster than convert-then-reshard (peak RSS of that row: its larger step)")
    sys.stdout.flush()


# -- object storage (issue 39): a bucket on moto's S3 API server on 127.0.0.1 -------------------------------

# The floor: the same bytes through this host with the same client, nothing parsed, nothing hashed:
# concurrent ranged GETs (16 x 16 MiB in flight, as ckptconv's default window) into a local file, or
# into a multipart upload (obstore's put, parts of 16 MiB, 8 in flight) of one object.
S3_FLOOR = r"""
import os, sys, obstore
from concurrent.futures import ThreadPoolExecutor
from obstore.store import S3Store
endpoint, bucket, key, dst = sys.argv[1:5]
store = S3Store(bucket, config={"endpoint": endpoint}, client_options={"allow_http": True})
size = obstore.head(store, key)["size"]
part = 16 << 20
offsets = range(0, size, part)
def get(o):
    return o, obstore.get_range(store, key, start=o, end=min(size, o + part))
with ThreadPoolExecutor(16) as pool:
    results = pool.map(get, offsets)
    if dst.startswith("s3://"):
        obstore.put(store, dst.split("/", 3)[3], (bytes(b) for _, b in results), chunk_size=part, max_concurrency=8)
    else:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for o, b in results:
            os.pwrite(fd, b, o)
        os.close(fd)
"""

# The route a user takes today: the client's own high-level transfer down, convert locally, and (to a
# bucket) its high-level transfer up, file by file.
S3_NAIVE = r"""
import os, subprocess, sys, boto3
endpoint, bucket, key, dst, scratch = sys.argv[1:6]
s3 = boto3.client("s3", endpoint_url=endpoint)
local = os.path.join(scratch, os.path.basename(key))
s3.download_file(bucket, key, local)
out = os.path.join(scratch, "out") if dst.startswith("s3://") else dst
subprocess.run([sys.executable, "-m", "ckptconv.cli", "convert", local, out, "--quiet"], check=True)
os.unlink(local)
if dst.startswith("s3://"):
    prefix = dst.split("/", 3)[3]
    for name in sorted(os.listdir(out)):
        s3.upload_file(os.path.join(out, name), bucket, f"{prefix}/{name}")
"""


def _bucket_rows(endpoint, bucket, key, scratch, to_bucket: bool):
    out = f"s3://{bucket}/out" if to_bucket else str(scratch / "out")
    where = "s3->s3" if to_bucket else "s3->local"
    return [(f"ranged copy floor, {where}", [PY, "-c", S3_FLOOR, endpoint, bucket, key, out]),
            (f"ckptconv convert {where}", [PY, "-m", "ckptconv.cli", "convert", f"s3://{bucket}/{key}", out, "--quiet",
                                           "--endpoint-url", endpoint]),
            (f"naive {where}: download, convert, " + ("upload" if to_bucket else "(no upload)"),
             [PY, "-c", S3_NAIVE, endpoint, bucket, key, out, scratch])]


def bench_s3(sizes=(1.0, 2.0)):
    """convert from a bucket, to a local directory and to the bucket, against the ranged copy floor and
    the naive route, on moto's server over loopback (which binds: a Python server, ~25 MB/s of ranged
    GETs on these cores); then ckptconv's peak RSS at a larger size (flat, not proportional)."""
    import boto3
    sys.path.insert(0, str(ROOT))
    from tests.storage.server import start_moto, stop_moto
    scratch = scratch_dir()
    server, endpoint = start_moto(scratch / "moto.log")
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    os.environ.update(env)
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="bench")
        rss_by_size = {}
        for i, gigabytes in enumerate(sizes):
            pt = generate("llama_scaled", DATA / f"llama-{gigabytes:g}GB.pt", str(DATA / f"llama-{gigabytes:g}GB.pt"),
                          gigabytes)
            # safetensors: its tensors are found from one header; a torch zip's each need a local header
            # read, and a ranged GET costs moto time in proportion to the whole object (108 ms on 168 MB)
            src = DATA / f"llama-{gigabytes:g}GB.safetensors"
            if not src.exists():
                subprocess.run([PY, "-m", "ckptconv.cli", "convert", pt, src, "--quiet"], check=True,
                               stdout=subprocess.DEVNULL)
            key = src.name
            s3.upload_file(str(src), "bench", key)
            n = src.stat().st_size
            if i == 0:
                for to_bucket in (False, True):
                    rows = _bucket_rows(endpoint, "bench", key, scratch, to_bucket)
                    times, rss = {name: [] for name, _ in rows}, {name: 0.0 for name, _ in rows}
                    for rep in range(REPEAT):
                        for name, cmd in rows[rep % len(rows):] + rows[:rep % len(rows)]:
                            t, r = _once(cmd, None)
                            times[name].append(t)
                            rss[name] = max(rss[name], r)
                            _clean_outputs(s3, scratch)
                    floor, ours = rows[0][0], rows[1][0]
                    print(f"\n{rows[1][0]} ({n / 1e9:.3f} GB safetensors, {REPEAT} rounds; ratios: median (range) "
                          "of the rounds')")
                    print("| command | median wall s | GB/s | peak RSS MiB | x floor |\n|---|---:|---:|---:|---:|")
                    for name, _ in rows:
                        secs = statistics.median(times[name])
                        print(f"| {name} | {secs:.2f} | {n / secs / 1e9:.3f} | {rss[name]:.0f} | "
                              f"{paired(times[name], times[floor])} |")
                    print(f"{ours}: {paired(times[rows[2][0]], times[ours])}x faster than the naive route")
                    sys.stdout.flush()
            else:
                _, r = _once(_bucket_rows(endpoint, "bench", key, scratch, True)[1][1], None)
                _clean_outputs(s3, scratch)
            rss_by_size[gigabytes] = max(rss_by_size.get(gigabytes, 0), r if i else rss[ours])
            s3.delete_object(Bucket="bench", Key=key)
        print("ckptconv convert s3->s3 peak RSS by size: "
              + ", ".join(f"{g:g} GB: {m:.0f} MiB" for g, m in rss_by_size.items()))
        print(f"local disk used by ckptconv s3->s3: none (its scratch holds only: {sorted(os.listdir(scratch))})")
    finally:
        stop_moto(server)


def _clean_outputs(s3, scratch):
    for o in s3.list_objects_v2(Bucket="bench", Prefix="out").get("Contents", []):
        s3.delete_object(Bucket="bench", Key=o["Key"])
    for u in s3.list_multipart_uploads(Bucket="bench").get("Uploads", []):
        s3.abort_multipart_upload(Bucket="bench", Key=u["Key"], UploadId=u["UploadId"])
    for name in ("out",):
        remove(scratch / name)


# --- Orbax (issue 40) ------------------------------------------------------------------------------

# Orbax itself writes the checkpoint and runs the route users take today; it lives in its own venv
# (make test-orbax makes .venv-orbax), never in ckptconv's.
ORBAX_PY = os.environ.get("CKPTCONV_ORBAX_PYTHON", str(ROOT / ".venv-orbax" / "bin" / "python"))

ORBAX_WRITE = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
path, gigabytes = sys.argv[1], float(sys.argv[2])
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
rows, cols = 4096, 8192                       # 64 MiB of bf16 per matrix
n = max(1, round(gigabytes * 1e9 / (rows * cols * 2)))
params = {}
for i in range(n):
    sharding = NamedSharding(mesh, P("data", "model") if i % 2 else P("model", "data"))
    make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.bfloat16), out_shardings=sharding)
    params[f"layer_{i:03d}"] = {"kernel": make(jax.random.key(i))}
params["norm"] = {"scale": jax.device_put(jnp.ones((cols,), jnp.bfloat16), NamedSharding(mesh, P()))}
ckptr = ocp.StandardCheckpointer()
ckptr.save(os.path.abspath(path), {"params": params})
ckptr.wait_until_finished()
"""

# What users run today: Orbax's own restore (the whole tree in host memory), safetensors' save_file,
# then the SHA-256 of the file and sync (what ckptconv's output carries).
ORBAX_NAIVE = r"""
import hashlib, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file
src, out = sys.argv[1], sys.argv[2]
tree = ocp.PyTreeCheckpointer().restore(os.path.abspath(src))
flat = {}
def walk(prefix, node):
    if isinstance(node, dict):
        for k, v in node.items():
            walk(f"{prefix}.{k}" if prefix else k, v)
    else:
        flat[prefix] = np.asarray(node)
walk("", tree["params"] if "params" in tree else tree)
save_file(flat, os.path.join(out, "model.safetensors"))
h = hashlib.sha256()
with open(os.path.join(out, "model.safetensors"), "rb", buffering=0) as f:
    while b := f.read(16 << 20):
        h.update(b)
with open(os.path.join(out, "SHA256SUMS"), "w") as f:
    f.write(f"{h.hexdigest()}  model.safetensors\n")
os.sync()
"""

# ckptconv in this process, then what the kernel says it read from the disk (cold cache) and the
# bytes its read calls asked for
READ_BYTES = r"""
import sys
from ckptconv.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    print(f"READ {io['read_bytes']} {io['rchar']}", file=sys.stderr)
"""


def orbax_dir(path, gigabytes: float):
    subprocess.run([ORBAX_PY, "-c", ORBAX_WRITE, str(path), str(gigabytes)], check=True)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_orbax(gigabytes=(2.2, 4.4)):
    """An Orbax OCDBT checkpoint written by Orbax itself (bf16, sharded over 8 CPU devices) converted
    by ckptconv against the copy floor and the route users take today (Orbax restore + save_file +
    SHA-256 + sync), warm cache; ckptconv's peak RSS at two sizes (flat, not proportional); and the
    bytes it reads from the disk with a cold cache against the checkpoint's bytes."""
    if not Path(ORBAX_PY).exists():
        print(f"\norbax: skipped ({ORBAX_PY} is missing: make test-orbax makes it, or set CKPTCONV_ORBAX_PYTHON)")
        return
    scratch = scratch_dir()
    peaks = {}
    for i, size in enumerate(gigabytes):
        src = DATA / f"orbax-{size:g}GB"
        if not src.exists():
            orbax_dir(src, size)
        files = sorted(p for p in src.rglob("*") if p.is_file())
        nbytes = _tree_bytes(src)
        if i == 0:
            for f in files:
                warm(f)
            rows = measure_all([
                copy_floor_row(files, scratch),
                ("ckptconv convert", [PY, "-m", "ckptconv.cli", "convert", src, scratch / "out", "--quiet"],
                 scratch / "out"),
                ("Orbax restore + save_file + SHA-256 + sync", [ORBAX_PY, "-c", ORBAX_NAIVE, src, scratch / "naive"],
                 scratch / "naive"),
            ])
            by_name = {name: times for name, times, _ in rows}
            print(f"\norbax OCDBT -> safetensors ({nbytes / 1e9:.3f} GB on disk, {REPEAT} rounds; ratios: median "
                  "(range) of the rounds')")
            print("| command | median wall s | GB/s | CPU s / GB | peak RSS MiB | x copy floor |\n|---|---:|---:|---:|---:|---:|")
            for name, times, rss in rows:
                secs = statistics.median(times)
                cpu = statistics.median(CPU_S[name][-len(times):]) / (nbytes / 1e9)
                print(f"| {name} | {secs:.2f} | {nbytes / secs / 1e9:.2f} | {cpu:.2f} | {rss:.0f} | "
                      f"{paired(times, by_name['copy floor (dd O_DIRECT)'])} |")
            print(f"ckptconv convert: {paired(by_name['Orbax restore + save_file + SHA-256 + sync'], by_name['ckptconv convert'])}"
                  "x faster than Orbax restore + save_file + SHA-256 + sync")
            peaks[size] = max(rss for name, _, rss in rows if name == "ckptconv convert")
            if drop_caches():
                remove(scratch / "out")
                r = subprocess.run([PY, "-c", READ_BYTES, "convert", str(src), str(scratch / "out"), "--quiet"],
                                   capture_output=True, text=True, check=True)
                line = [x for x in r.stderr.splitlines() if x.startswith("READ ")][-1].split()
                print(f"bytes read from the disk (cold cache): {int(line[1]) / 1e9:.3f} GB of {nbytes / 1e9:.3f} GB "
                      f"on disk ({int(line[1]) / nbytes:.2f}x); read calls asked for {int(line[2]) / 1e9:.3f} GB")
                remove(scratch / "out")
            else:
                print("bytes read from the disk: not measured (dropping the page cache needs root)")
        else:
            _, peaks[size] = _once([PY, "-m", "ckptconv.cli", "convert", src, scratch / "out", "--quiet"],
                                   scratch / "out")
        sys.stdout.flush()
    print("ckptconv convert peak RSS by size: " + ", ".join(f"{g:g} GB: {m:.0f} MiB" for g, m in peaks.items()))


SCENARIOS = {"convert": lambda: (bench_convert(18), bench_convert(36)), "grok": lambda: bench_grok(20),
             "dcp": lambda: bench_dcp(18), "reshard": lambda: (bench_reshard(18), bench_reshard(36)),
             "verify": lambda: bench_verify(18),
             "workers": lambda: bench_workers(18), "ray": lambda: bench_ray(18), "ray-start": bench_ray_start,
             "vllm": lambda: bench_vllm(18), "cold": lambda: bench_cold(18), "many": bench_many, "plan": bench_plan,
             "scale": bench_scale, "deepspeed": bench_deepspeed, "megatron": bench_megatron, "s3": bench_s3,
             "orbax": bench_orbax}


def main():
    # Measure the tool as installed: pip compiles bytecode at install time, while an editable
    # checkout under PYTHONDONTWRITEBYTECODE would recompile every module on every run (~0.17 s).
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "ckptconv")], check=True, stdout=subprocess.DEVNULL)
    for name in sys.argv[1:] or list(SCENARIOS):
        SCENARIOS[name]()


if __name__ == "__main__":
    main()
