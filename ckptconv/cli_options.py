"""What every command of the command line (cli.py) shares: the click decorators that turn flags into
typed requests (`read_options`, `write_options`, `mesh_options`, `cluster_options`, `with_option`),
`command` (--debug, --quiet, --verbose, --json, and every error as one line), the group that answers
click's own usage errors in one line too, `emit`, the --json summary an error is also given as, and
`retired`: the options a command gave up, accepted for a release with a note.
"""
import dataclasses
import functools
import json
import sys
import traceback

import click

from .jobs.verify.cluster import MAX_PROCESSES, join
from .tp.intervals import MAX_RANKS
from .jobs.convert import single_file
from . import requests, signals
from .io import mapped
from .sizes import parse_size
from .storage.urls import StorageOptions, hide_secrets
from .errors import CkptError, UsageError, printable
from .formats.manifest import HUB_STEMS, STEM, stem_problem
from .tp.presets import PRESETS
from .readers import readers


def _fail(message: str, code: int = 2, as_json=False):
    message = hide_secrets(message)
    if as_json:
        emit("error", {"ok": False, "exit_code": code, "error": printable(message)})
    click.echo(f"ckptconv: error: {printable(message)}", err=True)
    sys.exit(code)


# verify/2: problems are objects (kind, file, tensor, detail, message); reshard/2: rows may have
# `boxes`, and with --ep stacked experts are cut on two axes (no `ranges` no longer means even there)
SCHEMA_VERSIONS = {"verify": 2, "reshard": 2}


def emit(command_name: str, document: dict):
    """A --json summary on stdout, tagged with its schema (docs/json.md): `ckptconv.COMMAND/N`."""
    version = SCHEMA_VERSIONS.get(command_name, 1)
    click.echo(json.dumps({"schema": f"ckptconv.{command_name}/{version}", **document}, indent=2))


_VERBOSE = "ckptconv.verbose"
_STORAGE = "ckptconv.storage"


def verbose() -> bool:
    """Whether this command was given -v."""
    return click.get_current_context().meta.get(_VERBOSE, False)


def storage() -> StorageOptions:
    """This command's --endpoint-url, --concurrency, --part-size, --retries and --stall-timeout, as the
    StorageOptions its typed requests (`read`, `write`) carry to every process and task of the job."""
    return click.get_current_context().meta.get(_STORAGE) or StorageOptions()


def command(fn):
    """Common flags and error handling: one line per error unless --debug (and with --json, the error
    as a JSON object on stdout too); terminating signals clean up and exit 128 + n (signals.py)."""

    @click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
    @click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
    @click.option("--verbose", "-v", is_flag=True, help="Say more in the summary: the files written (convert), each "
                  "tensor's rule (reshard), each problem's kind and what was checked (verify).")
    @click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout (docs/json.md).")
    @click.option("--endpoint-url", metavar="URL", help="The S3 API endpoint for s3:// URLs (MinIO, Ceph, R2, a local "
                  "server: http:// accepted when given here); default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, then "
                  "AWS's own. For gs:// URLs, the GCS endpoint (an emulator); default: GOOGLE_BASE_URL, then "
                  "Google's (docs/storage.md).")
    @click.option("--concurrency", type=click.IntRange(1, 256), default=16, show_default=True,
                  help="Ranged GETs of an object-store source in flight at once (memory: this x --part-size).")
    @click.option("--part-size", default="16MiB", show_default=True, metavar="SIZE",
                  help="Bytes of one ranged GET, and the smallest part of an upload (64KiB to 5GiB).")
    @click.option("--retries", type=click.IntRange(0, 100), default=10, show_default=True,
                  help="Times one object-store request is retried on a transient failure (a cut connection, "
                  "5xx, 429/SlowDown, a stall), with exponential backoff, within 180 s.")
    @click.option("--stall-timeout", type=click.FloatRange(0.01, 3600), default=30.0, show_default=True,
                  metavar="SECONDS", help="An object-store read that delivers nothing for this long has failed "
                  "(and is retried).")
    @functools.wraps(fn)
    def wrapper(*args, debug, verbose, endpoint_url, concurrency, part_size, retries, stall_timeout, **kwargs):
        click.get_current_context().meta[_VERBOSE] = verbose
        mapped.forget_changes()
        as_json = kwargs.get("as_json")
        with signals.handled():
            try:
                try:
                    options = _storage(endpoint_url, concurrency, part_size, retries, stall_timeout)
                    click.get_current_context().meta[_STORAGE] = options
                    for name in ("read", "write"):   # (built by the decorators outside this one)
                        if kwargs.get(name) is not None:
                            kwargs[name] = dataclasses.replace(kwargs[name], storage=options)
                    return fn(*args, **kwargs)
                finally:   # one that came while the summary or problems were printed (outside our code)
                    signals.check()
            except signals.Interrupted as e:
                _interrupted(e, as_json)
            except BrokenPipeError:  # stdout closed early (`| head`): not an error of ours
                sys.stderr.close()
                sys.exit(0)
            except Exception as e:
                with signals.deferred():   # the error is reported whole, not cut by a signal
                    if debug:
                        traceback.print_exc()
                    if signals.received():
                        _interrupted(signals.received(), as_json)
                    _fail(*_reason(e), as_json=as_json)

    return wrapper


def _storage(endpoint_url, concurrency, part_size, retries, stall_timeout) -> StorageOptions:
    try:
        size = parse_size(part_size)
    except (ValueError, UsageError) as e:
        raise UsageError(f"--part-size {printable(part_size)}: {e}") from None
    return StorageOptions(endpoint_url=endpoint_url, concurrency=concurrency, part_size=size, retries=retries,
                          stall_seconds=stall_timeout)


def _interrupted(e: signals.Interrupted, as_json=False):
    after = f"{e.published} was published before it and is complete" if e.published else "no output was published"
    _fail(f"interrupted by {e.name}; {after}", e.exit_code, as_json)


def _reason(e: Exception) -> tuple:
    """(one-line message, exit status) for a failure. A file that shrank under its mapping was read
    as zeros (mapped.py): whatever a reader then made of them, the cause is the change."""
    changed = mapped.changed_files()
    if changed:
        return f"{changed[0]}: changed while it was being read; nothing was written", 2
    if isinstance(e, CkptError):
        return str(e), e.exit_code
    if isinstance(e, OSError):
        return f"{e.filename or ''}: {e.strerror or e}".lstrip(": "), 2
    return f"unexpected {type(e).__name__}: {e} (rerun with --debug for a traceback)", 2  # a bug


def read_options(fn=None, *, leave_out=()):
    """How to read a source (every command): the common options and those each reader declares;
    `leave_out` names common options a command has no use for (verify: it replays what convert
    recorded), which then take their defaults."""
    if fn is None:
        return functools.partial(read_options, leave_out=leave_out)
    for reader in reversed(list(readers().values())):
        for opt in reversed(reader.options):
            kind = (click.Path(path_type=str) if opt.path else click.Choice(list(opt.choices))   # (the reader opens it)
                    if opt.choices else opt.type)
            fn = click.option(opt.flag, opt.dest, type=kind, help=opt.help)(fn)
    declared = [opt.dest for reader in readers().values() for opt in reader.options]
    common = [
        ("one_shard", click.option(
            "--one-shard", is_flag=True,
            help="SRC is one shard of an indexed set (model-00001-of-00006.safetensors beside its index): "
            "convert that shard alone instead of refusing.")),
        ("max_extra_size", click.option(
            "--max-extra-size", default="256MB", show_default=True, metavar="SIZE",
            help="Largest model file (config, tokenizer, README ...) carried into OUT; larger ones are skipped "
            "and listed.")),
        ("workers", click.option("--workers", type=click.IntRange(1, requests.MAX_WORKERS), default=None,
                                 help="convert, reshard, verify: tasks in flight on this host, each in a worker process "
                                 "of its own: an output file (a rank directory for reshard) written with its own "
                                 "digests, or a share of verify's checks; 1 does one at a time.  [default: half the "
                                 "cores this process may use, for an output of 256 MB or more; else 1]  Other "
                                 "commands: source files parsed at once (plan: the workers a run would use, "
                                 "default 1).")),
        ("state_dict", click.option(
            "--state-dict", default="auto", show_default=True, metavar="auto|KEY|none",
            help="Training checkpoints: auto writes the model's tensors under their bare names when it finds "
            "them (a top-level 'state_dict', or the one of model, model_state_dict, module, net, ema ... beside "
            "optimizer, scheduler and scaler state; an Orbax train state's params; inspect says which); KEY or a "
            "dotted path (model.state_dict) "
            "unwraps that entry; none keeps every tensor under its flattened name.")),
        ("skip_unsupported", click.option(
            "--skip-unsupported", is_flag=True,
            help="Leave out tensors safetensors cannot store (complex, quantized; numpy object arrays, never "
            "unpickled) and list them.")),
        ("allow_global", click.option(
            "--allow-global", multiple=True, metavar="MODULE.NAME",
            help="Accept one more pickled class as inert data (never imported or called); MODULE.* accepts a "
            "module and those below it. Globals that can run code are refused all the same.")),
        ("only", click.option("--only", multiple=True, metavar="PREFIX",
                              help="Keep only tensors whose name starts with PREFIX (repeatable); skips unread "
                              "items.")),
        ("fmt", click.option("--from", "fmt", type=click.Choice(sorted(readers())), help="Force the input format.")),
    ]
    defaults = {"only": (), "allow_global": (), "skip_unsupported": False, "state_dict": "auto", "workers": None,
                "max_extra_size": "256MB", "one_shard": False}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = {d: kwargs.pop(d) for d in declared}
        common_values = {k: kwargs.pop(k, defaults[k]) for k in defaults}
        kwargs["read"] = requests.read_options(
            only=common_values["only"], allow_globals=common_values["allow_global"],
            state_dict=common_values["state_dict"], skip_unsupported=common_values["skip_unsupported"],
            workers=common_values["workers"], reader_options=given, max_extra_size=common_values["max_extra_size"],
            one_shard=common_values["one_shard"], spell=requests.flag_name)
        return fn(*args, **kwargs)

    for name, option in common:
        if name not in leave_out:
            wrapper = option(wrapper)
    return wrapper


def cluster_options(fn):
    """verify --device across hosts: --distributed and friends (see docs/distributed.md)."""
    @click.option("--distributed", is_flag=True, help="verify --device: work as one of several processes, each "
                  "placing its host's ranks, global arrays over every host's devices (jax.distributed; also "
                  "implied by JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID or a multi-task SLURM job).")
    @click.option("--coordinator", metavar="HOST:PORT", help="Where JAX's coordination service runs (process 0).")
    @click.option("--num-processes", type=click.IntRange(1, MAX_PROCESSES), help="Processes in the job.")
    @click.option("--process-id", type=click.IntRange(0), help="This process's index.")
    @click.option("--cluster-timeout", type=click.IntRange(1), default=60, show_default=True,
                  help="Seconds to wait for every process to join and for other processes' findings.")
    @click.option("--heartbeat-timeout", type=click.IntRange(1), default=10, show_default=True,
                  help="Seconds without a heartbeat after which JAX counts a process as gone.")
    @functools.wraps(fn)
    def wrapper(*args, distributed, coordinator, num_processes, process_id, cluster_timeout, heartbeat_timeout, **kw):
        paths = [(what, kw[name]) for name, what in (("path", "PATH"), ("against", "--against"))
                 if kw.get(name) is not None]

        def cluster(executor=None):
            if executor is not None and (distributed or coordinator):
                raise UsageError("--ray runs the tasks of one driver; --distributed starts processes of their own: "
                                 "give one of them")
            if executor is not None or (kw.get("device") is None and not (distributed or coordinator)):
                return None   # (a launcher's environment alone does not make file checks a job of several)
            return join(distributed, coordinator, num_processes, process_id, cluster_timeout, heartbeat_timeout, paths)
        kw["cluster"] = cluster
        return fn(*args, **kw)

    return wrapper


def distributed_refused(command_name: str):
    """convert, reshard: the options of the old multi-process file work, kept hidden to say where it
    went (one driver, its tasks on --workers or --ray)."""
    def decorate(fn):
        @click.option("--distributed", is_flag=True, hidden=True)
        @click.option("--coordinator", hidden=True)
        @click.option("--num-processes", hidden=True)
        @click.option("--process-id", hidden=True)
        @click.option("--cluster-timeout", hidden=True)
        @click.option("--heartbeat-timeout", hidden=True)
        @functools.wraps(fn)
        def wrapper(*args, distributed, coordinator, num_processes, process_id, cluster_timeout, heartbeat_timeout,
                    **kw):
            if distributed or any(v is not None for v in (coordinator, num_processes, process_id, cluster_timeout,
                                                          heartbeat_timeout)):
                raise UsageError(f"--distributed: {command_name} runs in one driver now, its tasks in --workers N "
                                 "processes on this host or on a Ray cluster with --ray (docs/distributed.md)")
            return fn(*args, **kw)

        return wrapper
    return decorate


@dataclasses.dataclass(frozen=True)
class Retired:
    """An option a command gave up (docs/README.md#retired-options): `flag`, why it no longer does
    anything (`why`, said in the note), and `metavar` for one that took a value (accepted as it was:
    repeatable), None for a flag."""

    flag: str
    why: str
    metavar: str | None = None


def retired(command_name: str, *options: Retired):
    """Options `command_name` gave up, still accepted for a release, since an option is never removed
    silently. Each is hidden from --help, and when given it changes nothing and prints one line on
    stderr: `ckptconv: note: COMMAND FLAG no longer does anything (WHY); it will be removed in the
    next release`."""
    def decorate(fn):
        for opt in options:
            def note(ctx, param, value, opt=opt):
                if value:
                    click.echo(f"ckptconv: note: {command_name} {opt.flag} no longer does anything ({opt.why}); "
                               "it will be removed in the next release", err=True)
            fn = click.option(opt.flag, hidden=True, expose_value=False, callback=note, is_flag=opt.metavar is None,
                              multiple=opt.metavar is not None, metavar=opt.metavar)(fn)
        return fn
    return decorate


def executor_options(fn):
    """--ray [ADDRESS]: run the command's tasks on a Ray cluster (run/ray_executor.py) instead of this
    host's --workers; the command gets `executor` (None: the local executor)."""
    @click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
                  help="Run every task (an output file, a rank directory; verify: a share of the checks) on "
                  "the Ray cluster at ADDRESS (without one: RAY_ADDRESS, else auto, the cluster this host is "
                  "in). SRC and OUT must be on storage every node sees (a shared file system or a bucket). "
                  "Put it after SRC and OUT, or write --ray=ADDRESS. Needs pip install 'ckptconv[ray]'. ckptconv itself travels with the "
                  "tasks (runtime_env py_modules; CKPTCONV_RAY_SHIP=0: every node has it installed). "
                  "See docs/distributed.md.")
    @click.option("--ray-runtime-env", "ray_runtime_env", metavar="JSON",
                  help="Ray's runtime_env for --ray's tasks, as `ray job submit --runtime-env-json` takes it "
                  "(pip, env_vars, py_modules, ...): merged over the Ray Job's own, with ckptconv's package "
                  "in py_modules beside yours.")
    @functools.wraps(fn)
    def wrapper(*args, ray_address, ray_runtime_env, **kw):
        from .run import executors
        read = kw.get("read")
        kw["executor"] = executors.chosen(ray_address, read.workers if read is not None else None, ray_runtime_env)
        return fn(*args, **kw)

    return wrapper


OVERWRITE_HELP = ("Replace OUT if it is a previous ckptconv output (anything else is refused, and OUT is never "
                  "SRC or a directory holding it). An empty directory needs no --overwrite.")


def _stem(ctx, param, value):
    problem = stem_problem(value) if value is not None else None
    if problem:
        raise click.BadParameter(problem)
    return value


def write_options(resume: bool):
    """How output files are written and named (convert, reshard): a WriteOptions as `write`."""
    def decorate(fn):
        @click.option("--max-shard-size", default="5GB", show_default=True,
                      help="Largest shard file, e.g. 500MB, 5GB, 1GiB. A tensor never spans files.")
        @click.option("--name", "stem", callback=_stem, metavar="STEM",
                      help=f"Name the files of an output directory STEM.safetensors, or STEM-00001-of-0000N."
                      f"safetensors and STEM.safetensors.index.json.  [default: the source's: "
                      f"{', '.join(f'{stem} for {stem}* weights' for stem in HUB_STEMS)}, else {STEM}]")
        @click.option("--overwrite", is_flag=True, help=OVERWRITE_HELP)
        @click.option("--max-extras", default="1MB", show_default=True, metavar="SIZE",
                      help="JSON of non-tensor state (extras) the manifest holds whole; past it the largest entries "
                      "are each summarised: type, entries, JSON bytes, SHA-256.")
        @click.option("--fsync", is_flag=True, help="fsync every file before OUT is published (durable on power loss).")
        @click.option("--buffered-io", is_flag=True,
                      help="Write shards through the page cache instead of O_DIRECT (to read OUT back from memory "
                      "right away, or where direct writes are slow, as on some network filesystems).")
        @functools.wraps(fn)
        def wrapper(*args, max_shard_size, stem, overwrite, fsync, buffered_io, max_extras, **kwargs):
            if stem is not None and single_file(kwargs.get("out") or ""):
                raise click.BadParameter("it names the files of an output directory; an OUT ending in "
                                         ".safetensors is one file, named by OUT", param_hint="'--name'")
            kwargs["write"] = requests.write_options(max_shard_size=max_shard_size, name=stem, overwrite=overwrite,
                                                     fsync=fsync, buffered_io=buffered_io,
                                                     resume=kwargs.pop("resume", False), max_extras=max_extras,
                                                     spell=requests.flag_name)
            return fn(*args, **kwargs)

        if resume:
            wrapper = click.option("--resume", is_flag=True, help="Reuse the shards a killed run of the same "
                                   "conversion finished (re-verified against its journal).")(wrapper)
        return wrapper
    return decorate


with_option = click.option(
    "--with", "with_files", multiple=True, metavar="FILE", type=click.Path(path_type=str),   # (read_added opens it)
    help="Also write FILE into OUT (into each rank directory of a reshard) under its own name, e.g. a config "
    "that no file of the source is paired with (repeatable; a regular file of at most --max-extra-size; a name "
    "OUT or the source's carried files already use is refused).")


def mesh_options(tp_required: bool):
    """The target mesh and its rules (reshard, plan --tp): a MeshSpec as `mesh` (None without --tp)."""
    def decorate(fn):
        @click.option("--tp", type=click.IntRange(1, MAX_RANKS), required=tp_required,
                      help="Tensor-parallel size of the target mesh." + ("" if tp_required else
                                                                        " Without it: plan a convert."))
        @click.option("--ep", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True,
                      help="Expert-parallel groups for MoE models (ranks = tp x ep, rank = group x tp + tp rank).")
        @click.option("--preset", type=click.Choice(sorted(PRESETS)),
                      help="Partition preset (default: from config.json model_type, else from tensor names).")
        @click.option("--rules", "rules_file", type=click.Path(path_type=str),   # (read as it is checked: rules.py)
                      help="Partition rules file (TOML, see docs/reshard.md).")
        @click.option("--heads", type=click.IntRange(1), help="Query heads (overrides config.json).")
        @click.option("--kv-heads", type=click.IntRange(1), help="Key/value heads (overrides config.json).")
        @click.option("--head-dim", type=click.IntRange(1), help="Head dimension (overrides config.json).")
        @click.option("--pad-vocab", is_flag=True, help="Zero-pad vocab rows (embeddings, lm_head) up to a multiple "
                      "of --tp instead of refusing; recorded as padded_shape in mesh.json.")
        @click.option("--allow-replicate", multiple=True, metavar="PATTERN", help="Tensors (regular expression, full "
                      "match) that may be copied whole to every rank although no rule says 'replicate' (repeatable).")
        @functools.wraps(fn)
        def wrapper(*args, tp, ep, preset, rules_file, heads, kv_heads, head_dim, pad_vocab, allow_replicate,
                    **kwargs):
            kwargs["mesh"] = None if tp is None else requests.mesh(
                tp=tp, ep=ep, preset=preset, rules=rules_file, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                pad_vocab=pad_vocab, allow_replicate=allow_replicate, spell=requests.flag_name)
            return fn(*args, **kwargs)
        return wrapper
    return decorate


class _OneLineErrors(click.Group):
    """click's usage errors (a bad option value, a missing argument) as every other error: one line,
    `ckptconv: error: …`, exit 2 (click prints the usage and the error on three)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        given = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(given, prog_name, complete_var, False, **extra)
        except click.ClickException as e:
            context = getattr(e, "ctx", None)
            hint = f" (see '{context.command_path} --help')" if context is not None else ""
            _fail(e.format_message() + hint, e.exit_code, "--json" in given)
        except click.exceptions.Abort:
            _fail("aborted", 1, "--json" in given)
        except Exception as e:   # raised while the options were read, before a command's own handling
            _fail(*_reason(e), as_json="--json" in given)
        sys.exit(code if isinstance(code, int) else 0)
