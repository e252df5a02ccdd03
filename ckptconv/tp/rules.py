"""Partition rules: which axis of each tensor is split for a tensor-parallel mesh, and how.

A rule set is `layout` ("torch": Linear weights are [out, in]; "jax": [in, out]) plus an ordered
list of rules; the first whose pattern fully matches a name wins, and unmatched tensors are
replicated. Presets (presets.py) are rule sets too, built from a model's config; `--rules FILE`
reads the same thing from TOML (docs/reshard.md). tp/intervals.py turns a rule into per-rank intervals.
"""
import functools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..storage import files as storage
from .. import safejson, safetoml
from ..errors import BadInput, UsageError, brief
from ..formats.mesh import RULE_FIELDS

KINDS = ("column", "row", "vocab", "expert", "replicate", "qkv", "gate_up")


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str | None = None      # one of KINDS, or None with an explicit axis
    axis: int | None = None
    heads: int | None = None     # column: whole query heads per rank; qkv: query heads
    kv_heads: int | None = None  # column: whole kv heads per rank, shared by tp/kv ranks when fewer than tp; qkv
    head_dim: int | None = None  # qkv (and column with heads, where it can also be derived)
    experts: bool = False        # leading axis holds experts: with --ep it is split across expert groups

    @functools.cache   # (a rule is frozen; a plan names its rule once per tensor)
    def describe(self) -> str:
        params = {k: v for k, v in asdict(self).items() if k in ("heads", "kv_heads", "head_dim") and v}
        base = self.kind or f"axis {self.axis}"
        return base + ("(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")


@dataclass
class RuleSet:
    name: str
    layout: str
    rules: list
    params: dict = field(default_factory=dict)
    guessed: bool = False   # chosen from tensor names alone (not recorded: a fact of this run)

    def match(self, name: str):
        for rule in self.rules:
            if re.fullmatch(rule.pattern, name):
                return rule
        return None

    def to_json(self) -> dict:
        return {"name": self.name, "layout": self.layout, "params": self.params,
                "rules": [{k: v for k, v in asdict(r).items() if v is not None and v is not False}
                          for r in self.rules]}


def from_json(obj: dict) -> RuleSet:
    """A rule set recorded in mesh.json, as data (its patterns are compiled, never matched here)."""
    return RuleSet(obj["name"], obj["layout"], [_rule(r, "recorded rules") for r in obj["rules"]], obj.get("params", {}))


def check_recorded(mesh, where):
    """The rules a mesh.json (formats/mesh.MeshDoc) records must be rules (patterns compile, kinds and
    fields are known): BadInput naming `where` otherwise. They are checked as data; `recorded` never
    runs them."""
    try:
        from_json(mesh.rules)
    except UsageError as e:
        raise BadInput(f"{where}: its rules: {e}") from None
    return mesh


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def _rule(raw: dict, where: str) -> Rule:
    unknown = set(raw) - set(RULE_FIELDS)
    if unknown or "pattern" not in raw:
        raise UsageError(f"{where}: a rule needs 'pattern' and may have kind/axis/heads/kv_heads/head_dim/experts "
                         f"(unknown: {sorted(unknown)})")
    for key, want in RULE_FIELDS.items():
        if key in raw and type(raw[key]) is not want:
            raise UsageError(f"{where}: a rule's {key} must be {_TYPE_NAMES[want]}, not {brief(raw[key])}")
    rule = f"rule {brief(raw['pattern'], 80)}"   # (what a file says is shown bounded: mesh.json records rules)
    for key in ("heads", "kv_heads", "head_dim"):
        if raw.get(key) is not None and raw[key] <= 0:
            raise UsageError(f"{where}: {rule}: {key} must be positive, not {brief(raw[key])}")
    kind, axis = raw.get("kind"), raw.get("axis")
    if (kind is None) == (axis is None):
        raise UsageError(f"{where}: {rule} needs exactly one of 'kind' or 'axis'")
    if kind is not None and kind not in KINDS:
        raise UsageError(f"{where}: {rule}: kind {brief(kind, 40)} is not one of {', '.join(KINDS)}")
    if kind == "qkv" and not all(raw.get(k) for k in ("heads", "kv_heads", "head_dim")):
        raise UsageError(f"{where}: {rule}: kind 'qkv' takes heads, kv_heads and head_dim")
    try:
        re.compile(raw["pattern"])
    except re.error as e:
        raise UsageError(f"{where}: {rule}: the pattern is not a valid regular expression: {e}") from None
    return Rule(**raw)


MAX_RULES_FILE = 1 << 20   # bytes: a rules file is a few dozen rules


def load_rules_file(path) -> RuleSet:
    """The rules a --rules file gives, and its text as read once (recorded in mesh.json: the rules
    parsed are the text recorded, even if the file changes during the run). Read as every file a
    user names is: a regular file (a FIFO or device is refused without waiting on it), capped in
    size, nesting bounded before it is parsed (safetoml)."""
    where = f"--rules {path}"
    try:
        data = safejson.read(path, "rules file", limit=MAX_RULES_FILE)
        raw = safetoml.loads(data, where, "rules file")
    except BadInput as e:
        raise UsageError(str(e) if str(e).startswith(where) else f"--rules {e}") from None
    text = data.decode("utf-8")
    layout = raw.get("layout", "torch")
    if layout not in ("torch", "jax"):
        raise UsageError(f"--rules {path}: layout must be 'torch' or 'jax', not {brief(layout, 40)}")
    listed = raw.get("rule", [])
    if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
        raise UsageError(f"--rules {path}: 'rule' must be [[rule]] tables, not {brief(listed)}")
    rules = [_rule(r, f"--rules {path}") for r in listed]
    if not rules:
        raise UsageError(f"--rules {path}: no [[rule]] entries")
    return RuleSet(f"rules file {Path(path).name}", layout, rules, {"file": text})


def read_config(model_files, made=None) -> dict | None:
    """config.json among the model files: the one a reader made (`made`, name -> bytes: a Megatron
    checkpoint's, from its args), else the one carried."""
    if made and "config.json" in made:
        config = safejson.loads(made["config.json"], "config.json", "config.json")
        return config if isinstance(config, dict) else None
    for rel, path in model_files:
        if rel == "config.json":
            config = storage.load_json(path, "config.json", limit=64 << 20)
            return config if isinstance(config, dict) else None
    return None
