"""`make bench`: ckptconv against the bound and the naive way, on the same bytes, in one run.

Method (docs/benchmarks.md): each command is a separate process on a warm page cache, rows
interleaved and rotated between rounds; we report the median wall time of BENCH_REPEAT runs, GB/s, peak RSS (ru_maxrss of that process, via wait4) and
ratios to the bound (read + write with SHA-256 in a second thread) and to cp. Not a test: no thresholds.
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
    return seconds, usage.ru_maxrss / 1024


def measure_all(rows):
    """rows: (name, cmd, out dir or None). Runs them interleaved REPEAT times, starting each round at
    the next row (so drift in the machine's state, and the disk's clean-up after the previous row's
    writes, hit every row alike); returns (name, seconds per round, max peak RSS MB)."""
    times = {name: [] for name, _, _ in rows}
    rss = {name: 0.0 for name, _, _ in rows}
    for rep in range(REPEAT):
        for name, cmd, out in rows[rep % len(rows):] + rows[:rep % len(rows)]:
            t, r = _once(cmd, out)
            times[name].append(t)
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
    bound, cp = by_name["bound"], by_name["cp"]
    print(f"\n{title} ({nbytes / 1e9:.3f} GB, {REPEAT} rounds; ratios: median of the rounds' ratios (range))")
    print("| command | median wall s | GB/s | peak RSS MB | x bound | x cp |\n|---|---:|---:|---:|---:|---:|")
    for name, times, rss in rows:
        secs = statistics.median(times)
        print(f"| {name} | {secs:.2f} | {nbytes / secs / 1e9:.2f} | {rss:.0f} | {paired(times, bound)} | "
              f"{paired(times, cp)} |")
    sys.stdout.flush()


def scratch_dir() -> Path:
    d = DATA / "scratch"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compare(title, src: Path, files, ours: tuple, naive: tuple):
    """The standard table: cp, the bound (over `files`), ckptconv (`ours` = name, CLI args) and the
    naive way (`naive` = name, script), all on the same bytes, warm cache, interleaved."""
    scratch = scratch_dir()
    for f in files:
        warm(f)
    recursive = ["-r"] if src.is_dir() else []
    rows = measure_all([
        ("cp", ["cp", *recursive, src, scratch / "copy"], scratch / "copy"),
        ("bound", [PY, "-c", BOUND, *files, scratch / "bound"], None),
        (ours[0], [PY, "-m", "ckptconv.cli", *ours[1][:2], scratch / "out", *ours[1][2:], "--quiet"],
         scratch / "out"),
        (naive[0], [PY, "-c", naive[1], src, scratch / "naive"], scratch / "naive"),
    ])
    (scratch / "bound").unlink(missing_ok=True)
    table(title, sum(f.stat().st_size for f in files), rows)


def llama_src(layers) -> Path:
    return generate("llama_1b", DATA / f"llama-{layers}L.pt", str(DATA / f"llama-{layers}L.pt"), layers)


def bench_convert(layers):
    src = llama_src(layers)
    compare(f"convert .pt -> safetensors, {layers} layers", src, [src], ("ckptconv convert", ["convert", src]),
            ("torch.load(mmap) + save_file", NAIVE_TORCH))


def bench_grok(layers):
    src = generate("grok_dir", DATA / f"grok-{layers}L", str(DATA / f"grok-{layers}L"), layers) / "ckpt-0"
    files = sorted(src.iterdir())
    compare(f"Grok-style pickle directory -> safetensors (lossless), {layers} layers, {len(files)} files", src, files,
            ("ckptconv pickle-to-safetensors", ["pickle-to-safetensors", src]),
            ("pickle.load each file + save_file", NAIVE_GROK))


def bench_dcp(layers):
    src = generate("dcp_dir", DATA / f"dcp-{layers}L", str(DATA / f"dcp-{layers}L"), layers)
    files = sorted(src.glob("*.distcp"))
    compare(f"DCP (1 process, {len(files)} .distcp) -> safetensors, {layers} layers", src, files,
            ("ckptconv convert (DCP)", ["convert", src]),
            ("dcp_to_torch_save + torch.load + save_file", NAIVE_DCP))


def bench_reshard(layers):
    src = llama_src(layers)
    compare(f"reshard .pt -> tp 8, {layers} layers", src, [src],
            ("ckptconv reshard --tp 8", ["reshard", src, "--tp", "8", "--heads", "16", "--kv-heads", "16",
                                         "--head-dim", "128"]),
            ("naive TP=8: torch.load(mmap), chunk, save_file x 8 (no hashes)", NAIVE_TP))


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
    print("| command | median wall s | GB/s | peak RSS MB | x plain reshard |\n|---|---:|---:|---:|---:|")
    for name, times, rss in (("reshard --tp 8", plain, plain_rss), ("reshard --tp 8 --target vllm", fused, fused_rss)):
        secs = statistics.median(times)
        print(f"| {name} | {secs:.2f} | {n / secs / 1e9:.2f} | {rss:.0f} | {paired(times, plain)} |")
    sys.stdout.flush()


def bench_verify(layers):
    src = llama_src(layers)
    out, tp8 = DATA / f"verify-{layers}L", DATA / f"verify-{layers}L-tp8"
    for target, args in ((out, ["convert", src, out]),
                         (tp8, ["reshard", src, tp8, "--tp", "8", "--heads", "16", "--kv-heads", "16",
                                "--head-dim", "128"])):
        if not target.exists():
            subprocess.run([PY, "-m", "ckptconv.cli", *map(str, args), "--quiet"], check=True, stdout=subprocess.DEVNULL)
    files = sorted(out.glob("*.safetensors"))
    for f in files:
        warm(f)
    n = sum(f.stat().st_size for f in files)
    (_, hash_times, hash_rss), (_, verify_times, verify_rss) = measure_all([
        ("hash", [PY, "-c", HASH_ONE_THREAD, *files], None),
        ("verify", [PY, "-m", "ckptconv.cli", "verify", out, "--quiet"], None)])
    hash_secs, verify_secs = statistics.median(hash_times), statistics.median(verify_times)
    print(f"\nverify (structural, every file hashed), {n / 1e9:.3f} GB, {REPEAT} rounds")
    print("| command | median wall s | GB/s | peak RSS MB | x one hashlib pass |\n|---|---:|---:|---:|---:|")
    print(f"| hashlib sha256, one thread, 16 MiB reads | {hash_secs:.2f} | {n / hash_secs / 1e9:.2f} | {hash_rss:.0f} | 1.00 |")
    print(f"| ckptconv verify | {verify_secs:.2f} | {n / verify_secs / 1e9:.2f} | {verify_rss:.0f} | "
          f"{paired(verify_times, hash_times)} |")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([PY, "-m", "ckptconv.cli", "verify", tp8, "--device", "cpu", "--json", "--quiet"],
                       capture_output=True, text=True, env=env)
    import json
    dev = json.loads(r.stdout)["device"]
    print(f"\nverify --device cpu of the tp 8 output on 8 CPU devices: {dev['bytes'] / 1e9:.3f} GB placed in "
          f"{dev['seconds']:.2f} s = {dev['gb_per_s']:.2f} GB/s, global arrays: {dev['global_arrays']}")
    sys.stdout.flush()


def bench_distributed(layers):
    """2 processes (jax.distributed on 127.0.0.1) against 1, for convert and reshard --tp 8."""
    import socket
    src = llama_src(layers)
    scratch = scratch_dir()
    warm(src)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    jobs = {"convert": ["convert", src, scratch / "out", "--max-shard-size", "500MB"],
            "reshard --tp 8": ["reshard", src, scratch / "out", "--tp", "8", "--heads", "16", "--kv-heads", "16",
                               "--head-dim", "128"]}
    print(f"\nseveral processes on this 2-core machine, {src.stat().st_size / 1e9:.3f} GB, median of {REPEAT}")
    print("| job | 1 process s | 2 processes s | 2 vs 1 |\n|---|---:|---:|---:|")
    for job, args in jobs.items():
        one, two = [], []
        for _ in range(REPEAT):
            shutil.rmtree(scratch / "out", ignore_errors=True)
            one.append(_once([PY, "-m", "ckptconv.cli", *map(str, args), "--quiet"], scratch / "out")[0])
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.sync()
            start = time.perf_counter()
            procs = [subprocess.Popen([PY, "-m", "ckptconv.cli", *map(str, args), "--quiet", "--coordinator",
                                       f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
            if any(p.wait() for p in procs):
                raise SystemExit(f"distributed {job} failed")
            two.append(time.perf_counter() - start)
            shutil.rmtree(scratch / "out", ignore_errors=True)
        a, b = statistics.median(one), statistics.median(two)
        print(f"| {job} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    sys.stdout.flush()


SCENARIOS = {"convert": lambda: (bench_convert(18), bench_convert(36)), "grok": lambda: bench_grok(20),
             "dcp": lambda: bench_dcp(18), "reshard": lambda: (bench_reshard(18), bench_reshard(36)),
             "verify": lambda: bench_verify(18), "distributed": lambda: bench_distributed(18),
             "vllm": lambda: bench_vllm(18)}


def main():
    # Measure the tool as installed: pip compiles bytecode at install time, while an editable
    # checkout under PYTHONDONTWRITEBYTECODE would recompile every module on every run (~0.17 s).
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "ckptconv")], check=True, stdout=subprocess.DEVNULL)
    for name in sys.argv[1:] or list(SCENARIOS):
        SCENARIOS[name]()


if __name__ == "__main__":
    main()
