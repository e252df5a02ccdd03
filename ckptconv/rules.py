"""Partition rules: which axis of each tensor is split for a tensor-parallel mesh, and how.

A rule set is `layout` ("torch": Linear weights are [out, in]; "jax": [in, out]) plus an ordered
list of rules; the first whose pattern fully matches a name wins, and unmatched tensors are
replicated. Presets (llama, gpt2, gpt-neox, grok-1) are rule sets too, built from a model's config;
`--rules FILE` reads the same thing from TOML. `split()` turns a rule into per-rank intervals.
"""
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import safejson
from .errors import BadInput, UsageError, brief

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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


def check_recorded(mesh: dict, where):
    """The rules a mesh.json records must be rules (patterns compile, kinds and fields are known):
    BadInput naming `where` otherwise. They are checked as data; `recorded` never runs them."""
    try:
        from_json(mesh["rules"])
    except UsageError as e:
        raise BadInput(f"{where}: its rules: {e}") from None
    return mesh


def recorded(obj: dict) -> RuleSet:
    """The rules to reshard a reshard output again with. A preset is rebuilt from its name and head
    counts; regular expressions read from a checkpoint are never run (one can take exponential time on
    a chosen name), so rules that came from a file must be given again with --rules."""
    name, params = obj.get("name"), obj.get("params")
    if name not in PRESETS or not isinstance(params, dict):
        raise UsageError(f"this reshard output was made with {name!r} rules, which are not a preset: give them "
                         "again with --rules FILE (mesh.json records them under 'rules')")
    try:
        return PRESETS[name]({k: _positive(params, k, "mesh.json rules") for k in ("heads", "kv_heads", "head_dim")
                              if k in params})
    except KeyError as e:
        raise BadInput(f"mesh.json: the recorded {name} rules lack {e.args[0]!r}") from None


def _rule(raw: dict, where: str) -> Rule:
    unknown = set(raw) - {"pattern", "kind", "axis", "heads", "kv_heads", "head_dim", "experts"}
    if unknown or "pattern" not in raw:
        raise UsageError(f"{where}: a rule needs 'pattern' and may have kind/axis/heads/kv_heads/head_dim/experts "
                         f"(unknown: {sorted(unknown)})")
    kind, axis = raw.get("kind"), raw.get("axis")
    if (kind is None) == (axis is None):
        raise UsageError(f"{where}: rule {raw['pattern']!r} needs exactly one of 'kind' or 'axis'")
    if kind is not None and kind not in KINDS:
        raise UsageError(f"{where}: rule {raw['pattern']!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "qkv" and not all(raw.get(k) for k in ("heads", "kv_heads", "head_dim")):
        raise UsageError(f"{where}: rule {raw['pattern']!r}: kind 'qkv' takes heads, kv_heads and head_dim")
    try:
        re.compile(raw["pattern"])
    except re.error as e:
        raise UsageError(f"{where}: rule pattern {raw['pattern']!r} is not a valid regular expression: {e}") from None
    return Rule(**raw)


def load_rules_file(path) -> RuleSet:
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--rules {path}: cannot read TOML: {e}") from None
    layout = raw.get("layout", "torch")
    if layout not in ("torch", "jax"):
        raise UsageError(f"--rules {path}: layout must be 'torch' or 'jax', not {layout!r}")
    rules = [_rule(r, f"--rules {path}") for r in raw.get("rule", [])]
    if not rules:
        raise UsageError(f"--rules {path}: no [[rule]] entries")
    return RuleSet(f"rules file {Path(path).name}", layout, rules, {"file": Path(path).read_text()})


# ---------------------------------------------------------------------------------------------
# Presets

def _positive(cfg: dict, key: str, where="config.json"):
    """cfg[key] as a positive int, None when absent; anything else is refused (a config.json is input)."""
    value = cfg.get(key)
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise BadInput(f"{where}: {key} must be a positive integer, not {brief(value, 60)}")
    return value


def model_params(cfg: dict, overrides: dict) -> dict:
    """Head counts from a Hugging Face config.json (any family's spelling), then --heads/--kv-heads/--head-dim."""
    heads = overrides.get("heads") or _positive(cfg, "num_attention_heads") or _positive(cfg, "n_head")
    hidden = _positive(cfg, "hidden_size") or _positive(cfg, "n_embd")
    out = {"heads": heads,
           "kv_heads": overrides.get("kv_heads") or _positive(cfg, "num_key_value_heads") or heads,
           "head_dim": overrides.get("head_dim") or _positive(cfg, "head_dim") or (hidden // heads if hidden and heads
                                                                                   else None),
           "hidden": hidden}
    return {k: v for k, v in out.items() if v}


def llama(cfg: dict) -> RuleSet:
    """Llama and its relatives (Mistral, Qwen2, Mixtral naming), GQA: torch layout."""
    heads, kv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    p = r"(?:model\.)?layers\.\d+\."
    rules = [
        Rule(r"(?:model\.)?embed_tokens\.weight", "vocab"),
        Rule(p + r"self_attn\.q_proj\.(?:weight|bias)", "column", heads=heads, head_dim=hd),
        Rule(p + r"self_attn\.(?:k|v)_proj\.(?:weight|bias)", "column", kv_heads=kv, head_dim=hd),
        Rule(p + r"self_attn\.o_proj\.weight", "row"),
        Rule(p + r"mlp\.(?:gate|up)_proj\.weight", "column"),
        Rule(p + r"mlp\.gate_up_proj\.weight", "gate_up"),
        Rule(p + r"mlp\.down_proj\.weight", "row"),
        Rule(p + r"block_sparse_moe\.experts\.\d+\.w[13]\.weight", "column"),
        Rule(p + r"block_sparse_moe\.experts\.\d+\.w2\.weight", "row"),
        Rule(r"lm_head\.weight", "vocab"),
    ]
    return RuleSet("llama", "torch", rules, {"heads": heads, "kv_heads": kv, "head_dim": hd})


def gpt2(cfg: dict) -> RuleSet:
    """GPT-2: Conv1D weights are [in, out] (jax-like layout); c_attn fuses q, k, v."""
    heads, hd = cfg["heads"], cfg["head_dim"]
    p = r"(?:transformer\.)?h\.\d+\."
    qkv = dict(heads=heads, kv_heads=heads, head_dim=hd)
    rules = [
        Rule(r"(?:transformer\.)?wte\.weight", "vocab"),
        Rule(p + r"attn\.c_attn\.(?:weight|bias)", "qkv", **qkv),
        Rule(p + r"attn\.c_proj\.weight", "row"),
        Rule(p + r"mlp\.c_fc\.(?:weight|bias)", "column"),
        Rule(p + r"mlp\.c_proj\.weight", "row"),
        Rule(r"lm_head\.weight", "vocab"),
    ]
    return RuleSet("gpt2", "jax", rules, {"heads": heads, "head_dim": hd})


def gpt_neox(cfg: dict) -> RuleSet:
    """GPT-NeoX: query_key_value interleaves q, k, v per head, so whole heads are contiguous rows."""
    heads = cfg["heads"]
    p = r"(?:gpt_neox\.)?layers\.\d+\."
    rules = [
        Rule(r"(?:gpt_neox\.)?embed_in\.weight", "vocab"),
        Rule(p + r"attention\.query_key_value\.(?:weight|bias)", "column", heads=heads,
             head_dim=3 * cfg["head_dim"]),
        Rule(p + r"attention\.dense\.weight", "row"),
        Rule(p + r"mlp\.dense_h_to_4h\.(?:weight|bias)", "column"),
        Rule(p + r"mlp\.dense_4h_to_h\.weight", "row"),
        Rule(r"(?:embed_out|lm_head)\.weight", "vocab"),
    ]
    return RuleSet("gpt-neox", "torch", rules, {"heads": heads})


GROK1 = {"heads": 48, "kv_heads": 8, "head_dim": 128}


def grok1(cfg: dict) -> RuleSet:
    """Grok-1 tree names (lossless int8 `.weight` + `.scales`, or dequantized): JAX layout [in, out],
    MoE weights [E, in, out]; attention by whole heads, MoE F split, router and norms replicated."""
    heads, kv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    p = r"transformer\.decoder_layer_\d+\."
    w = r"(?:\.weight)?"
    rules = [
        Rule(r"language_model\.in_out_embed\.embeddings", "vocab"),
        Rule(p + r"multi_head_attention\.query\.w" + w, "column", heads=heads, head_dim=hd),
        Rule(p + r"multi_head_attention\.(?:key|value)\.w" + w, "column", kv_heads=kv, head_dim=hd),
        Rule(p + r"multi_head_attention\.linear\.w" + w, "row"),
        Rule(p + r"moe\.(?:linear|linear_v)\.w" + w, "column", experts=True),
        Rule(p + r"moe\.linear_1\.w" + w, "row", experts=True),
    ]
    return RuleSet("grok-1", "jax", rules, {"heads": heads, "kv_heads": kv, "head_dim": hd})


PRESETS = {"llama": llama, "gpt2": gpt2, "gpt-neox": gpt_neox, "grok-1": grok1}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "mixtral": "llama", "qwen3": "llama",
                "gpt2": "gpt2", "gpt_neox": "gpt-neox"}


def choose(names, config: dict | None, preset: str | None, rules_file, heads_override: dict) -> RuleSet:
    """Pick the rule set: --rules, then --preset, then config.json's model_type, then tensor names."""
    if rules_file:
        return load_rules_file(rules_file)
    cfg = dict(config or {})
    if preset is None:
        model_type = cfg.get("model_type", "")
        preset = _MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if preset is None:
        if any(n.startswith("transformer.decoder_layer_") for n in names):
            preset = "grok-1"
        elif any(re.fullmatch(r"(?:model\.)?layers\.\d+\.self_attn\.q_proj\.weight", n) for n in names):
            preset = "llama"
    if preset is None:
        raise UsageError("no partition preset fits this checkpoint (known: " + ", ".join(PRESETS) +
                         "; config.json model_type or tensor names decide); give --preset or --rules FILE. "
                         "A tensor-parallel output in which nothing is split would be a mistake.")
    if preset not in PRESETS:
        raise UsageError(f"--preset {preset!r}: unknown (known: {', '.join(PRESETS)})")
    overrides = {k: v for k, v in heads_override.items() if v}
    params = {**GROK1, **overrides} if preset == "grok-1" else model_params(cfg, overrides)
    try:
        return PRESETS[preset](params)
    except KeyError as e:
        raise UsageError(f"preset {preset}: no {e.args[0]!r} in config.json (give --heads/--kv-heads/--head-dim "
                         "or --rules)") from None


def read_config(model_files) -> dict | None:
    for rel, path in model_files:
        if rel == "config.json":
            config = safejson.load_file(path, "config.json", limit=64 << 20)
            return config if isinstance(config, dict) else None
    return None
