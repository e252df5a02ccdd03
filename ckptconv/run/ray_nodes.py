"""What a Ray node needs to run ckptconv's tasks, and the check of every node before a run's tasks go
out (run/ray_executor.py; docs/distributed.md#what-a-node-needs).

A node needs Ray and ckptconv's runtime dependencies (numpy, safetensors, ml_dtypes; obstore for a
bucket, zstandard for zstd-compressed sources). ckptconv itself travels with the job by default: the
driver's package directory, compiled parts included, in the runtime_env's `py_modules` (Ray uploads it
once to the cluster, keyed by its content, and unpacks it on each node before the node's first task).
`CKPTCONV_RAY_SHIP=0` leaves it out, for clusters where every node has ckptconv installed (the same
version as the driver).

`runtime_env` merges the job's runtime_env: the Ray Job's own (Ray hands a job's entrypoint its config
in RAY_JOB_CONFIG_JSON_ENV_VAR), then the command's `--ray-runtime-env` field by field over it
(`env_vars` variable by variable), the `py_modules` of both kept, ckptconv's after them.

`node_report` runs on each node with CPUs (one task pinned to it, pickled by value: it must not need
ckptconv to be unpickled there) and says which modules do not import there; `verdict` turns the reports
into one line (or notes). This module imports neither Ray nor anything from ckptconv at its top."""
import json
import os
import sys

SHIP_ENV = "CKPTCONV_RAY_SHIP"
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"   # (Ray's: a job's config, for its entrypoint's ray.init)
# What a task imports besides ckptconv: each one a node must import where the driver has it loaded
# (obstore only for a bucket, zstandard only for a zstd source).
DEPENDENCIES = ("numpy", "safetensors", "ml_dtypes", "obstore", "zstandard")
# ckptconv's compiled parts (setup.py), optional: without them a task hashes with hashlib and reads
# mapped inputs without the SIGBUS guard; the output is the same.
COMPILED = ("ckptconv._sha256x", "ckptconv._mapguard")


def shipped() -> bool:
    """Whether the run ships ckptconv with its tasks (the default; CKPTCONV_RAY_SHIP=0 does not)."""
    return os.environ.get(SHIP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def package_dir() -> str:
    """The directory of the ckptconv this driver runs (its compiled parts inside), as py_modules ships it."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # (this module is ckptconv/run/)


def job_runtime_env() -> dict:
    """The runtime_env of the Ray Job this driver is the entrypoint of ({} outside a job)."""
    text = os.environ.get(JOB_CONFIG_ENV)
    if not text:
        return {}
    try:
        env = json.loads(text).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return {}
    return dict(env) if isinstance(env, dict) else {}


def runtime_env(given: dict | None, job: dict | None = None, ship: bool = True) -> dict:
    """The runtime_env the driver joins the cluster with: `job`'s, `given` over it field by field
    (env_vars by variable), the py_modules of both, then ckptconv's own when `ship`."""
    merged = dict(job or {})
    modules = list(merged.get("py_modules") or [])
    for key, value in (given or {}).items():
        if key == "env_vars" and isinstance(merged.get("env_vars"), dict) and isinstance(value, dict):
            merged["env_vars"] = {**merged["env_vars"], **value}
        elif key == "py_modules" and isinstance(value, list):
            modules += [m for m in value if m not in modules]
        else:
            merged[key] = value
    if ship:
        here = package_dir()
        modules += [] if here in modules else [here]
    if modules:
        merged["py_modules"] = modules
    return merged


def wanted() -> tuple:
    """(the modules a node must import for this run, those it should: ckptconv's compiled parts
    this driver loaded), from what this driver imported."""
    needed = ["ckptconv", "ckptconv.run.tasks", "ckptconv.run.ray_executor"]
    needed += [m for m in DEPENDENCIES if m in sys.modules]
    return needed, [m for m in COMPILED if m in sys.modules]


def node_report(needed, compiled) -> dict:
    """On a node: which of `needed` and `compiled` do not import there (each with its error's first
    line), its ckptconv's version and the node's platform. Plain data; imports only the standard
    library at its top, so it unpickles on a node without ckptconv."""
    import importlib
    import platform
    import sys as _sys

    def failed(names):
        out = []
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException as e:   # (an extension built for another platform: ImportError, OSError)
                first = (str(e).strip().splitlines() or [""])[0]
                out.append([name, f"{type(e).__name__}: {first}"[:300]])
        return out

    missing = failed(needed)
    unloaded = [] if missing else failed(compiled)
    own = _sys.modules.get("ckptconv")
    return {"missing": missing, "unloaded": unloaded, "version": getattr(own, "__version__", None),
            "platform": f"{_sys.platform} {platform.machine()} {_sys.implementation.cache_tag}"}


def version_here() -> str:
    """The driver's ckptconv version (the package is imported whenever one of its modules is)."""
    return sys.modules["ckptconv"].__version__


def platform_here() -> str:
    import platform
    return f"{sys.platform} {platform.machine()} {sys.implementation.cache_tag}"


def named(node: dict) -> str:
    """A node as a line names it: its address and Ray's node id (what `ray list nodes` shows)."""
    return f"node {node.get('NodeManagerAddress', '?')} (node id {node.get('NodeID', '?')})"


def verdict(reports, version: str, ship: bool) -> tuple:
    """(the one error line, or None; notes) for [(node, report)] of every node checked."""
    remedy = (f"install ckptconv[ray] {version} on every node, or let the run ship it (unset {SHIP_ENV})"
              if not ship else "install it on every node (pip install 'ckptconv[ray]' brings ckptconv's "
              "dependencies), or have the job's runtime_env install it (--ray-runtime-env '{\"pip\": [...]}')")
    bad = [(node, r) for node, r in reports if r["missing"]]
    if bad:
        node, r = bad[0]
        name, why = r["missing"][0]
        more = f" (and {len(bad) - 1} other node{'s' if len(bad) > 2 else ''} alike)" if len(bad) > 1 else ""
        return f"{named(node)} cannot import {name} ({why}){more}: {remedy}", []
    if not ship:
        other = [(node, r) for node, r in reports if r["version"] != version]
        if other:
            node, r = other[0]
            return (f"{named(node)} has ckptconv {r['version']} where the driver has {version}: every node "
                    f"runs the driver's version: {remedy}"), []
    notes = []
    for node, r in reports:
        if r["unloaded"]:
            parts = ", ".join(name.rsplit(".", 1)[-1] for name, _ in r["unloaded"])
            notes.append(f"{named(node)}: ckptconv's compiled parts ({parts}) do not load there "
                         f"({r['unloaded'][0][1]}; its platform {r['platform']}, the driver's {platform_here()}): "
                         "its tasks hash with hashlib and read without the SIGBUS guard; the output is the same"
                         + (f" (install ckptconv on every node and set {SHIP_ENV}=0 for its own)" if ship else ""))
    return None, notes
