"""The `ckptconv` command line (click). Errors are one line on stderr; exit 0 ok, 1 problems, 2 bad input.
What the commands share (their options, errors, --json) is cli_options.py's."""
import contextlib
import gc
import json
import os
import shlex
import signal
import sys
import warnings

# The command multiplies no matrices: keep numpy's OpenBLAS from starting a thread per core that
# spins while we start up (0.1 s of CPU here, taken from the cores the hash threads need).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Until a command installs its handlers (signals.py), Ctrl-C just ends the process: nothing is
# written yet, and Python's KeyboardInterrupt would print a traceback from the middle of an import.
# (An ignored SIGINT, as a background job of a script has it, stays ignored.)
if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import click

from .jobs.verify.cluster import MAX_PROCESSES
from . import __version__
from .api import expected_identity, inspection
from .cli_options import (_OneLineErrors, Retired, cluster_options, distributed_refused, executor_options, command, emit,
                          mesh_options, read_options, retired, storage, verbose, with_option, write_options)
from .jobs.convert import ConvertOptions, convert
from . import requests
from .io import mapped
from .storage import files as storage_files
from .errors import BadInput, UsageError, printable
from .jobs.plan import NETWORK_GBPS, plan_run
from .progress import byte_progress
from .jobs.reshard import ReshardOptions, reshard
from .layouts import target_choices
from .jobs.verify import VerifyRequest, total_bytes, verify
from .readers import Source, damage, open_source, reader_for, readers
from .sizes import format_size


def say(text: str = ""):
    """A line of output that quotes file content (names, paths): escaped, so it stays one line."""
    click.echo(printable(text, limit=1 << 16))


def warn_damaged(damaged, src):
    """The one stderr line for a source whose unread entries lie past its files' ends (readers/damage.py):
    said with --json too, as an error is."""
    if damaged:
        click.echo(f"ckptconv: warning: {damage.line(damaged, src)}", err=True)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="ckptconv")
def main():
    """Convert large-model checkpoints to sharded safetensors, safely and streaming."""
    _allow_many_open_files()
    # A checkpoint of a million tensors is millions of small, acyclic objects; with the default
    # thresholds the cyclic collector rescans them all again and again (measured: 36 s against 12 s to
    # read an 800,000-tensor safetensors header). Collect rarely instead of never.
    gc.set_threshold(10_000, 100, 100)
    warnings.simplefilter("ignore")  # a library's warning would be a second line on stderr


def _allow_many_open_files():
    """Raise the soft limit on open files to the hard one: each mapped input file holds a descriptor
    (Python's mmap before 3.13), and a Grok-1 directory of several hosts has thousands of files."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def shell_word(path) -> str:
    """`path` as one word a POSIX shell (bash, zsh) reads back exactly: quoted where it must be, after
    `./` where it would read as an option, and as $'...' with escapes where it holds characters a
    terminal would not show as themselves (a newline, an escape, bytes that are not UTF-8)."""
    text = str(path)
    if text.startswith("-"):
        text = "./" + text
    if text.isprintable():
        return shlex.quote(text)
    raw = os.fsencode(text)
    return "$'" + "".join(chr(b) if 32 <= b < 127 and chr(b) not in "\\'" else f"\\x{b:02x}" for b in raw) + "'"


def identity_line(out, identity) -> str:
    """The output's identity and the command that checks it, quoted for a shell (a path with spaces,
    quotes or control characters pastes as it is)."""
    return f"identity: {identity} (check with: ckptconv verify {shell_word(out)} --expect {identity})"


def placeholder_line(placeholders) -> str:
    """The classes on no allowlist a pickle named, recorded as inert data, each with its count."""
    return ("classes on no allowlist, recorded as inert data (never imported or called): "
            + ", ".join(f"{p['global']} (x{p['count']})" for p in placeholders))


def summarised_line(groups) -> str:
    """The extras written as summaries, not whole (--max-extras)."""
    shown = ", ".join(f"{g} ({n} entr{'y' if n == 1 else 'ies'}, {format_size(b)} of JSON)" for g, n, b in groups[:8])
    return ("extras summarised in the manifest (past --max-extras): " + shown
            + (f" and {len(groups) - 8} more groups" if len(groups) > 8 else ""))


def module_lines(modules) -> list:
    """What became of each pickled nn.Module (readers/torch_modules.py)."""
    return [f"pickled module {m['class']} ({'under ' + repr(m['name']) if m['name'] else 'the whole file'}): read "
            f"as its state_dict(), {m['entries']} entries under those names; its other attributes left out"
            for m in modules]


def _convert_command(name, pickle_only, help_text):
    @main.command(name, help=help_text)
    @click.argument("src", type=click.Path(path_type=str))
    @click.argument("out", type=click.Path(path_type=str))
    @read_options
    @click.option("--strip-prefix", metavar="PREFIX", help="Remove PREFIX from tensor names that start with it.")
    @click.option("--dtype", type=click.Choice(requests.DTYPES), default="keep", show_default=True,
                  help="Cast floating tensors (round to nearest even); integers are kept.")
    @click.option("--no-copy-extras", is_flag=True, help="Do not carry config/tokenizer files into OUT.")
    @with_option
    @write_options(resume=True)
    @distributed_refused(name)
    @executor_options
    @command
    def run(src, out, fmt, read, strip_prefix, dtype, no_copy_extras, with_files, write, executor, quiet, as_json):
        source = Source(src, fmt, read)
        if pickle_only:   # (detection reads the source: only when it decides something)
            reader, _ = reader_for(src, fmt)
            if not reader.parses_pickles:
                raise UsageError(f"{src}: is a {reader.name} checkpoint, not a pickle-based one; use `ckptconv "
                                 "convert` for it")
        result = convert(source, out, ConvertOptions(strip_prefix, dtype, not no_copy_extras, with_files), write,
                         lambda total: byte_progress(total, "convert", quiet), executor)
        if as_json:
            emit("convert", result.to_json())
        else:
            _say_converted(result)
        warn_damaged(result.damaged, src)
        if result.also and not as_json:
            say(f"read the {result.format} weights; {src} also holds {' and '.join(result.also)} weights "
                f"(--from {result.also[0]} reads those)")

    return run


def _say_converted(result):
    """The summary of a convert on one process (or process 0 of several): what was written, and why
    anything was left out."""
    say(f"wrote {result.out}: {result.tensors} tensors, {format_size(result.bytes)} "
        f"in {len(result.files)} files, {result.seconds:.2f} s ({result.gb_per_s or 0:.2f} GB/s)"
        + (f"; reused {format_size(result.resumed_bytes)} from the interrupted run"
           if result.resumed_bytes else ""))
    say(identity_line(result.out, result.identity))
    if result.resume_note:
        say(f"--resume: {result.resume_note}")
    if verbose():
        out = storage_files.locate(result.out, storage())
        for name in result.files:
            path = out if len(result.files) == 1 and result.out.endswith(".safetensors") \
                else storage_files.join(out, name)
            say(f"  {name}  {format_size(storage_files.size(path))}")
    if result.skipped_files:
        say("not carried into OUT: " + "; ".join(f"{s['name']} ({s['reason']})"
                                                 for s in result.skipped_files))
    if result.summarised:
        say(summarised_line(result.summarised))
    for line in module_lines(result.modules):
        say(line)
    if result.layout is not None:
        say(f"training checkpoint: {result.layout.found()}")
        say(f"wrote {result.layout.choice()}")
    elif result.state_dict:
        say(f"wrote the tensors of {result.state_dict!r} under their own names (--state-dict none keeps "
            "everything)")
    if result.dropped:
        say("left out: " + "; ".join(f"{d['name']} ({d['reason']})" for d in result.dropped))
    if result.placeholders:
        say(placeholder_line(result.placeholders))


_convert_command("convert", False, """Convert SRC (any supported format) to sharded safetensors in OUT.

SRC: torch .pt/.bin/.pth/.ckpt/.pth.tar files and .bin directories, TorchScript, safetensors, DCP,
DeepSpeed ZeRO, Grok-1 shards, numpy .npy/.npz (docs/formats.md); training checkpoints give the
model's weights (--state-dict), classes in their state are inert records.

OUT gets model.safetensors, or when it takes several shards model-0000k-of-0000n.safetensors and
model.safetensors.index.json (huggingface_hub's names; --name renames them), manifest.json (file and
per-tensor SHA-256) and SHA256SUMS; OUT ending in .safetensors is one file instead, its manifest in
__metadata__. OUT is published atomically; nothing from SRC is executed.
Example: ckptconv convert pytorch_model.bin out/ --max-shard-size 2GB""")
_convert_command("pickle-to-safetensors", True, """Convert a pickle-based SRC (torch .pt/.bin, DCP, Grok-1
pickle shards) to sharded safetensors in OUT. The same as `convert`, refusing non-pickle sources.""")


@main.command("reshard")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str), required=False)
@mesh_options(tp_required=True)
@click.option("--dry-run", is_flag=True, help="Print the plan (rule, axis, bytes per rank) and write nothing.")
@click.option("--strip-prefix", metavar="PREFIX", help="Remove PREFIX from tensor names that start with it "
              "(before the rules match them).")
@click.option("--dtype", type=click.Choice(requests.DTYPES), default="keep", show_default=True,
              help="Cast floating tensors (round to nearest even); integers are kept; config.json says so.")
@click.option("--target", type=click.Choice(list(target_choices())), default="mesh", show_default=True,
              help="The layout written. " + "; ".join(f"{name}: {line}" for name, line in target_choices().items()) + ".")
@with_option
@write_options(resume=False)
@read_options
@distributed_refused("reshard")
@executor_options
@command
def reshard_cmd(src, out, mesh, dry_run, strip_prefix, dtype, target, with_files, write, fmt, read, executor, quiet,
                as_json):
    """Slice SRC for a tensor-parallel (and expert-parallel) mesh: OUT/mesh.json and OUT/rank-XXXXX/.

    Each rank directory is a complete sharded-safetensors output holding exactly what that rank
    loads (column-parallel layers their output features, row-parallel their input features,
    attention whole heads). With an engine's --target, OUT is also what that engine loads (see
    --target). Example: ckptconv reshard model/ out/ --tp 8
    """
    if out is None and not dry_run:
        raise UsageError("OUT is required unless --dry-run")
    result = reshard(Source(src, fmt, read), out, mesh, ReshardOptions(strip_prefix, target, dtype, with_files), write,
                     dry_run, lambda n: byte_progress(n, "reshard", quiet), executor)
    warn_damaged(result.damaged, src)
    if as_json:
        emit("reshard", result.to_json())
    elif dry_run:
        for line in plan_lines(result):
            say(line)
    else:
        say(f"wrote {result.out}: {result.ranks} ranks ({result.preset} rules, "
            f"{result.split} tensors split, {len(result.replicated)} replicated), "
            f"{format_size(result.bytes_written)} in {result.seconds:.2f} s")
        if result.identity:
            say(identity_line(result.out, result.identity))
        if result.summarised:
            say(summarised_line(result.summarised))
        if verbose():
            for line in plan_lines(result):
                say(line)


def _checks(report, against) -> list:
    """What a verify run checked, for -v."""
    done = [f"structure and metadata of {report.files} file(s) and {report.tensors} tensors",
            "what the safetensors library reads"]
    done.append("file and tensor sha256 against the recorded digests" if not report.foreign
                else "no digests (none recorded)")
    if against:   # verify compares with the source only once the output itself is sound
        compared = not report.problems or any(p.kind == "source" for p in report.problems)
        done.append(f"every tensor against {against}, bit for bit" if compared
                    else f"not compared with {against}: the output itself has problems")
    if report.device:
        done.append(f"every piece placed on {report.device.platform} devices")
    return done


def plan_lines(result) -> list:
    lines = [f"plan: {result.preset} rules ({result.layout} layout, {result.params}), "
             f"tp={result.tp} ep={result.ep}: {result.ranks} ranks"]
    width = min(max(len(t["name"]) for t in result.tensors), 80)  # one long name must not pad every line
    lines.append(f"  {'tensor':<{width}}  {'rule':<34} {'axis':>4}  {'bytes/rank (max)':>16}")
    for t in result.tensors:
        axis = "-" if t["axis"] is None else str(t["axis"])
        lines.append(f"  {t['name']:<{width}}  {t['rule']:<34} {axis:>4}  {format_size(max(t['bytes_per_rank'])):>16}"
                     + "".join(f"  uneven: {k}" for k in ("ranges", "boxes") if k in t))
    per = result.bytes_per_rank
    lines.append(f"totals: source {format_size(result.source_bytes)}; per rank {format_size(min(per))}"
                 f"..{format_size(max(per))}; {result.split} split, {len(result.replicated)} replicated "
                 f"({format_size(result.replicated_bytes)} whole on every rank)")
    if result.replicated:
        lines.append("replicated: " + ", ".join(result.replicated))
    if result.refusal:
        lines.append(f"a run would stop: {result.refusal}")
    return lines


@main.command("verify")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--against", type=click.Path(path_type=str), help="Compare every tensor with this source, bit for bit.")
@click.option("--device", type=click.Choice(requests.DEVICES), help="Load every rank's pieces onto devices "
              "with JAX and check them there.")
@click.option("--allow-fewer-devices", is_flag=True, help="Map ranks to devices round-robin when there are fewer.")
@click.option("--expect", metavar="sha256:DIGEST", help="The output's identity as its producer published it "
              "(convert and reshard print it): fail unless PATH is exactly that output.")
@read_options(leave_out=("only", "skip_unsupported", "one_shard"))
@retired("verify",
         Retired("--only", "verify --against reads the part of the source the output records it was made from: "
                 "convert's own --only", metavar="PREFIX"),
         Retired("--skip-unsupported", "verify --against reads what safetensors cannot store as facts of the source, "
                 "compared with what the output records as skipped, never a refusal"))
@cluster_options
@executor_options
@command
def verify_cmd(path, against, device, allow_fewer_devices, expect, fmt, read, cluster, executor, quiet, as_json):
    """Check an output of convert or reshard (a directory, or one .safetensors file convert wrote):
    digests, structure, the source, and a device load.

    Prints every problem found, one per line naming the file and the tensor; exits 0 when clean,
    1 when problems were found, 2 when it could not verify. Example: ckptconv verify out/ --against model/
    """
    expect = expected_identity(expect)
    cluster = cluster(executor)
    path = storage_files.locate(path, read.storage)   # (one session for the job: listed once)
    size = total_bytes(path) if storage_files.is_dir(path) else storage_files.size(path) \
        if storage_files.is_file(path) else 0
    with byte_progress(size, "verify", quiet) as progress:
        report = verify(VerifyRequest(path, against, read, fmt, device, allow_fewer_devices, expect), progress, cluster,
                        executor)
    changed = mapped.changed_files()
    if changed:
        raise BadInput(f"{changed[0]}: changed while it was being read; it could not be verified")
    if as_json:
        emit("verify", {"ok": not report.problems, "problems": [p.to_json() for p in report.problems],
                        "files": report.files,
                        "tensor_count": report.tensors, "bytes": report.bytes, "device": report.device.to_json() if report.device else None,
                        **({"notes": report.notes} if report.notes else {}),
                        **({"expected": report.expected} if expect else {})})
    elif cluster is not None and not cluster.is_main:
        say(f"process {cluster.process_id} of {cluster.num_processes}: checked its share; "
            f"{'no problems' if not report.problems else f'{len(report.problems)} problem(s)'} in the whole "
            "output (process 0 prints the report)")
    else:
        for p in report.problems:
            say(f"[{p.kind}] {p}" if verbose() else str(p))
        for note in report.notes:
            say(f"note: {note}")
        status = "OK" if not report.problems else f"{len(report.problems)} problem(s)"
        say(f"{path}: {status}: {report.files} shard files, {report.tensors} tensors, "
            f"{format_size(report.bytes)} {'read' if report.foreign else 'hashed'}"
            + (", matches the source" if against and not report.problems
                                                     else "")
            + (f", is the expected output {expect}" if report.expected and not report.problems else ""))
        if verbose():
            say("checked: " + "; ".join(_checks(report, against)))
        if report.device:
            d = report.device
            say(f"device {d.platform}: {d.ranks} rank(s) on {d.devices} device(s), "
                f"{format_size(d.bytes)} placed at {d.gb_per_s} GB/s"
                + (", global arrays assembled" if d.global_arrays else "")
                + "; peak per device: " + ", ".join(f"{k} {format_size(v)}" for k, v in d.peak_device_bytes.items()))
    if report.problems:
        sys.exit(1)


@main.command("plan")
@click.argument("src", type=click.Path(path_type=str))
@mesh_options(tp_required=False)
@click.option("--hosts", type=click.IntRange(1, MAX_PROCESSES), default=1, show_default=True,
              help="Processes sharing the work.")
@click.option("--disk-gbps", type=float, default=2.0, show_default=True, help="Disk bandwidth of one host, GB/s.")
@click.option("--network-gbps", type=click.FloatRange(0, min_open=True), default=NETWORK_GBPS, show_default=True,
              help="Network bandwidth of one host to an object store, GB/s (a 10 Gbit/s link: 1.25): what SRC in a "
                   "bucket is read at, and an --out in a bucket written at.")
@click.option("--out", "out", metavar="OUT", help="Where the run would write OUT: an object-store URL is written over "
              "the network (only that counts: nothing is looked at there).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest shard file.")
@read_options
@command
def plan_cmd(src, mesh, hosts, disk_gbps, network_gbps, out, max_shard_size, fmt, read, quiet, as_json):
    """Show what a convert (or, with --tp, a reshard) of SRC would do, without reading tensor data:
    bytes per output file and per process (and of those, over the network: SRC or --out in an object
    store), peak memory per process, and the time implied by --disk-gbps and --network-gbps. SRC may
    be a checkpoint or a shapes-only JSON (e.g. the Grok-1 tensors.json).

    Example: ckptconv plan grok1_tensors.json --tp 8 --hosts 8
    """
    ckpt = open_source(Source(src, fmt, read))
    result = plan_run(ckpt, hosts, disk_gbps, mesh, requests.write_options(max_shard_size=max_shard_size,
                                                                          storage=read.storage, spell=requests.flag_name),
                      network_gbps, out, read.workers or 1)
    if as_json:
        emit("plan", result.to_json())
        return
    tp = mesh.tp if mesh else None
    ep = mesh.ep if mesh else 1
    job = f"reshard --tp {tp}" + (f" --ep {ep}" if ep > 1 else "") + f" ({result.rules} rules)" if tp else "convert"
    net = f", network {network_gbps} GB/s" if result.networked else ""
    say(f"{src}: {result.format}, {result.tensors} tensors, {format_size(result.source_bytes)}; "
        f"{job} on {hosts} host(s) at {disk_gbps} GB/s each{net}"
        + (f", {result.workers} workers each" if result.workers > 1 else ""))
    for u in result.units:
        say(f"  {u.name:<36} {format_size(u.bytes):>12}  process {u.process}"
            + (f", worker {u.worker}" if result.workers > 1 else ""))
    unit = "rank dirs" if tp else "files"
    for p in result.processes:
        say(f"process {p.process}: {len(p.units)} {unit}, reads {format_size(p.bytes_read)}"
            f"{' over the network' if p.network_bytes_read else ''}, writes {format_size(p.bytes_written)}"
            f"{' over the network' if p.network_bytes_written else ''}, peak RSS ~{p.peak_rss_bytes / 2**20:.0f} MiB, "
            f"~{p.seconds:.3g} s")
    say(f"estimated time: {result.seconds:.3g} s ({result.time_model})")


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=str), required=False)
@click.option("--formats", "list_formats", is_flag=True,
              help="List the formats ckptconv reads and what it recognises each by (no PATH).")
@read_options
@command
def inspect_cmd(path, list_formats, fmt, read, quiet, as_json):
    """Show what a checkpoint holds (format, tensors, dtypes, bytes, extras) without converting it.

    For a training checkpoint it also says where the model's weights are beside the optimizer's state
    and which --state-dict picks them; classes in the pickle are listed with their counts.
    `ckptconv inspect --formats` lists the formats instead.
    """
    if list_formats or path is None:
        if path is not None or not list_formats:
            raise UsageError("give PATH to inspect, or --formats alone to list the formats ckptconv reads")
        _formats(as_json)
        return
    found = inspection(Source(path, fmt, read))
    warn_damaged(found.source.get("damaged"), path)
    if as_json:
        emit("inspect", {"path": found.path, "format": found.format, "source": found.source,
                         "tensor_count": len(found.tensors), "total_bytes": found.total_bytes, "dtypes": found.dtypes,
                         "tensors": list(found.tensors), "extras": found.extras, "model_files": found.model_files,
                         **({"skipped_files": found.skipped_files} if found.skipped_files else {}),
                         **({"also": found.also} if found.also else {}),
                         **({"layout": found.layout.to_json()} if found.layout is not None else {}),
                         **({"placeholders": found.placeholders} if found.placeholders else {}),
                         **({"components": found.components} if found.components else {})})
        return
    say(f"{path}: {found.format}, {len(found.tensors)} tensors, {format_size(found.total_bytes)}")
    if found.source.get("took"):   # which part of a source of several a reader read (Orbax: step, item)
        say(f"read: {found.source['took']}")
    say("dtypes: " + ", ".join(f"{k} {format_size(v)}" for k, v in found.dtypes.items()))
    if found.components:
        say(f"components of {found.source.get('pipeline')}:")
        width = min(max(len(c["name"]) for c in found.components), 40)
        for c in found.components:
            what = (f"{c['format']}" + (f" ({c['variant']} variant)" if c["variant"] else "")
                    + f", {c['tensor_count']} tensors, {format_size(c['bytes'])}") if c["format"] else "no weights"
            say(f"  {c['name']:<{width}}  {c['library']} {c['class']}: {what}; carried: "
                + (", ".join(c["files"]) or "nothing"))
    width = min(max((len(t["name"]) for t in found.tensors), default=4), 80)  # one long name must not pad every line
    for t in found.tensors:
        say(f"  {t['name']:<{width}}  {t['dtype']:<7} {str(t['shape']):<20} {format_size(t['bytes'])}")
    if found.extras:
        click.echo("extras: " + json.dumps(found.extras, sort_keys=True)[:2000])
    for line in module_lines(found.source.get("modules", [])):
        say(line)
    if found.layout is not None:
        say(f"training checkpoint: {found.layout.found()}")
        say(f"converts {found.layout.choice()}")
    if found.source.get("dropped"):
        say("left out: " + "; ".join(f"{d['name']} ({d['reason']})" for d in found.source["dropped"]))
    if found.placeholders:
        say(placeholder_line(found.placeholders))
    if found.source.get("skipped"):
        say("skipped: " + ", ".join(s["name"] for s in found.source["skipped"]))
    if found.model_files:
        say("model files: " + ", ".join(found.model_files))
    if found.skipped_files:
        say("not carried: " + "; ".join(f"{s['name']} ({s['reason']})" for s in found.skipped_files))
    if found.also:
        say(f"also holds {' and '.join(found.also)} weights, not read (--from {found.also[0]} reads those)")


def _formats(as_json):
    """inspect --formats: every reader, in detection order (docs/formats.md#detection)."""
    known = [{"name": r.name, "reads": r.description, "recognised_by": r.looks_for, "suffixes": list(r.suffixes)}
             for r in readers().values()]
    if as_json:
        emit("formats", {"formats": known})
        return
    for r in known:
        say(f"{r['name']}: {r['reads']}")
        if r["recognised_by"]:
            say(f"  recognised by: {r['recognised_by']}")


if __name__ == "__main__":
    main()
