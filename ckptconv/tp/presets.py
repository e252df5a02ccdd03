"""Partition presets: rule sets for model families, registered with `@preset`, and `choose_rules`,
the one place plan and reshard pick the rules of a checkpoint.

A preset is a function from head counts ({"heads", "kv_heads", "head_dim"}) to a RuleSet. Its
registration says which config.json `model_type`s it serves and, for checkpoints without a config,
which tensor name marks its family; adding a model family is one decorated function here.
"""
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import BadInput, CkptError, UsageError, brief
from .rules import Rule, RuleSet, load_rules_file, read_config


@dataclass(frozen=True)
class Preset:
    name: str
    build: Callable                # head counts -> RuleSet
    model_types: tuple = ()        # config.json model_type values it serves
    marker: str | None = None      # a tensor name pattern (full match) that only this family has
    defaults: dict = field(default_factory=dict)  # head counts when there is no config (Grok-1's are fixed)


PRESETS = {}   # (an engine's layout registers its own names' preset too: layouts/vllm)


def preset(name: str, model_types=(), marker=None, defaults=None):
    def add(build):
        PRESETS[name] = Preset(name, build, tuple(model_types), marker, dict(defaults or {}))
        return build
    return add


@dataclass
class MeshSpec:
    """The target mesh and how to choose its rules (reshard, plan --tp)."""

    tp: int
    ep: int = 1
    preset: str | None = None
    rules_file: str | None = None
    heads: dict = field(default_factory=dict)   # --heads/--kv-heads/--head-dim overrides
    pad_vocab: bool = False
    allow_replicate: tuple = ()                  # --allow-replicate PATTERN: whole on every rank, knowingly


def choose_rules(ckpt, spec: MeshSpec) -> RuleSet:
    """--rules, then --preset; for a reshard output the preset it recorded; then config.json's
    model_type (the checkpoint's own, or a shapes description's), then tensor names."""
    if spec.rules_file:
        return load_rules_file(spec.rules_file)
    if spec.preset is None and ckpt.recorded_rules is not None:
        return recorded(ckpt.recorded_rules)
    config = read_config(ckpt.model_files, getattr(ckpt, "made", None)) or ckpt.config or {}
    name = spec.preset or _by_model_type(config)
    guessed = name is None
    name = name or _by_names([t.name for t in ckpt.tensors])
    if name is None:
        raise UsageError("no partition preset fits this checkpoint (known: " + ", ".join(PRESETS) +
                         "; config.json model_type or tensor names decide); give --preset or --rules FILE. "
                         "A tensor-parallel output in which nothing is split would be a mistake.")
    if name not in PRESETS:
        raise UsageError(f"--preset {name!r}: unknown (known: {', '.join(PRESETS)})")
    chosen = PRESETS[name]
    overrides = {k: v for k, v in spec.heads.items() if v}
    params = {**chosen.defaults, **overrides} if chosen.defaults else model_params(config, overrides)
    try:
        rules = chosen.build(params)
    except KeyError as e:
        raise UsageError(f"preset {name}: no {e.args[0]!r} in config.json (give --heads/--kv-heads/--head-dim "
                         "or --rules)") from None
    rules.guessed = guessed and not chosen.defaults   # a family with fixed shapes (Grok-1) is recognised, not guessed
    return rules


# Where a Hugging Face config.json states each head count itself (not derived from others)
STATED = {"heads": ("num_attention_heads", "n_head"), "kv_heads": ("num_key_value_heads",),
          "head_dim": ("head_dim",), "layers": ("num_hidden_layers",)}


def stated(config: dict, key: str):
    """The count `key` (STATED) config.json states, or None."""
    return next((config[n] for n in STATED[key] if type(config.get(n)) is int), None)


def recorded_differences(recorded: dict, config: dict) -> list:
    """Lines for what a reshard output's recorded rules (mesh.json's `rules`) say that the source does
    not give (verify --against): a preset's recorded head counts against those config.json states
    (a count given by a flag where config.json has none is the record's), and its recorded rules
    against those its recorded counts build. Rules from a --rules file are the file's: nothing."""
    name = recorded.get("name") if isinstance(recorded, dict) else None
    chosen = PRESETS.get(name) if isinstance(name, str) else None
    if chosen is None:
        return []
    params = recorded.get("params") if isinstance(recorded.get("params"), dict) else {}
    out = [] if chosen.defaults else [
        f"rules.params.{key} is {brief(params.get(key), 40)}, the source's config.json gives {stated(config, key)}"
        for key in ("heads", "kv_heads", "head_dim") if stated(config, key) is not None
        and params.get(key) != stated(config, key)]
    try:
        built = json.loads(json.dumps(chosen.build(params).to_json()["rules"]))
    except (KeyError, TypeError, ValueError, ArithmeticError, CkptError):
        built = None
    if built != recorded.get("rules"):
        out.append(f"rules of preset {name!r} are not those its recorded params {brief(params, 80)} build")
    return out


def _by_model_type(config: dict) -> str | None:
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    return next((p.name for p in PRESETS.values() if model_type in p.model_types), None)


def _by_names(names) -> str | None:
    for p in PRESETS.values():
        if p.marker and any(re.fullmatch(p.marker, n) for n in names):
            return p.name
    return None


def recorded(obj: dict) -> RuleSet:
    """The rules to reshard a reshard output again with. A preset is rebuilt from its name and head
    counts; regular expressions read from a checkpoint are never run (one can take exponential time on
    a chosen name), so rules that came from a file must be given again with --rules."""
    name, params = obj.get("name"), obj.get("params")
    if name not in PRESETS:
        raise UsageError(f"this reshard output was made with {brief(name)} rules, which are not a preset: give them "
                         "again with --rules FILE (mesh.json records them under 'rules')")
    if not isinstance(params, dict):
        raise BadInput(f"mesh.json: the recorded {name} rules have no 'params' object (head counts); give --preset "
                       "or --rules again")
    try:
        return PRESETS[name].build({k: _positive(params, k, "mesh.json rules")
                                    for k in ("heads", "kv_heads", "head_dim") if k in params})
    except KeyError as e:
        raise BadInput(f"mesh.json: the recorded {name} rules lack {e.args[0]!r}") from None


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


# --- the presets (a checkpoint matching two markers gets the first registered)


@preset("grok-1", marker=r"(?s)transformer\.decoder_layer_.*", defaults={"heads": 48, "kv_heads": 8, "head_dim": 128})
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
        Rule(p + r"router\.w" + w, "replicate"),
    ]
    return RuleSet("grok-1", "jax", rules, {"heads": heads, "kv_heads": kv, "head_dim": hd})


@preset("llama", model_types=("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen2_moe", "qwen3_moe"),
        marker=r"(?:model\.)?layers\.\d+\.self_attn\.q_proj\.weight")
def llama(cfg: dict) -> RuleSet:
    """Llama and its relatives (Mistral, Qwen2/3, and the MoE ones: Mixtral, Qwen2-MoE, Qwen3-MoE),
    GQA: torch layout. Experts per expert as save_pretrained writes them (Mixtral w1/w3/w2, Qwen
    gate/up/down_proj) or stacked [E, ...] as transformers holds them in memory (gate_up_proj
    [E, 2I, H], down_proj [E, H, I]): tp splits each expert's intermediate axis, --ep the experts;
    Qwen2-MoE's shared expert is split like a dense MLP; routers are replicated."""
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
        Rule(p + r"mlp\.experts\.\d+\.(?:gate|up)_proj\.weight", "column"),
        Rule(p + r"mlp\.experts\.\d+\.down_proj\.weight", "row"),
        Rule(p + r"mlp\.experts\.gate_up_proj", "gate_up", experts=True),
        Rule(p + r"mlp\.experts\.down_proj", "row", experts=True),
        Rule(p + r"mlp\.shared_expert\.(?:gate|up)_proj\.weight", "column"),
        Rule(p + r"mlp\.shared_expert\.down_proj\.weight", "row"),
        Rule(p + r"(?:block_sparse_moe|mlp)\.gate\.weight|mlp\.shared_expert_gate\.weight", "replicate"),   # routers
        Rule(r"lm_head\.weight", "vocab"),
    ]
    return RuleSet("llama", "torch", rules, {"heads": heads, "kv_heads": kv, "head_dim": hd})


@preset("gpt2", model_types=("gpt2",))
def gpt2(cfg: dict) -> RuleSet:
    """GPT-2: Conv1D weights are [in, out] (jax-like layout); c_attn fuses q, k, v."""
    heads, hd = cfg["heads"], cfg["head_dim"]
    p = r"(?:transformer\.)?h\.\d+\."
    qkv = dict(heads=heads, kv_heads=heads, head_dim=hd)
    rules = [
        Rule(r"(?:transformer\.)?wte\.weight", "vocab"),
        Rule(r"(?:transformer\.)?wpe\.weight", "replicate"),   # position embeddings: every rank, as Megatron
        Rule(p + r"attn\.c_attn\.(?:weight|bias)", "qkv", **qkv),
        Rule(p + r"attn\.c_proj\.weight", "row"),
        Rule(p + r"mlp\.c_fc\.(?:weight|bias)", "column"),
        Rule(p + r"mlp\.c_proj\.weight", "row"),
        Rule(r"lm_head\.weight", "vocab"),
    ]
    return RuleSet("gpt2", "jax", rules, {"heads": heads, "head_dim": hd})


@preset("gpt-neox", model_types=("gpt_neox",))
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


def _megatron(name: str, fc1: str):
    """Megatron-Core GPT names (docs/formats.md#megatron), merged (global layer numbers): how Megatron
    itself splits each tensor over tensor-parallel ranks. readers/megatron.py merges a checkpoint's
    ranks as the inverse of exactly these rules; reshard splits with them."""

    def build(cfg: dict) -> RuleSet:
        heads, kv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        if heads % kv:
            raise BadInput(f"preset {name}: {heads} heads do not fall into {kv} query groups")
        p = r"decoder\.layers\.\d+\."
        # linear_qkv: per query group its q heads, then its k and v; a rank holds whole groups
        group = dict(heads=kv, head_dim=(heads // kv + 2) * hd)
        rules = [
            Rule(r"embedding\.word_embeddings\.weight|output_layer\.weight", "vocab"),
            Rule(p + r"self_attention\.linear_qkv\.(?:weight|bias)", "column", **group),
            Rule(p + r"self_attention\.linear_proj\.(?:weight|bias)", "row"),
            Rule(p + r"mlp\.linear_fc1\.(?:weight|bias)", fc1),
            Rule(p + r"mlp\.linear_fc2\.(?:weight|bias)", "row"),
            Rule(p + r"mlp\.experts\.local_experts\.\d+\.linear_fc1\.(?:weight|bias)", fc1),
            Rule(p + r"mlp\.experts\.local_experts\.\d+\.linear_fc2\.(?:weight|bias)", "row"),
            Rule(p + r"mlp\.router\.(?:weight|bias)", "replicate"),
            # the layer norms (and q/k norms), every rank's whole
            Rule(p + r"(?:input_layernorm|pre_mlp_layernorm|self_attention\.[qk]_layernorm)\.(?:weight|bias)"
                 r"|decoder\.final_layernorm\.(?:weight|bias)|embedding\.position_embeddings\.weight", "replicate"),
        ]
        return RuleSet(name, "torch", rules, {"heads": heads, "kv_heads": kv, "head_dim": hd})

    return build


# (model_type: what the megatron reader describes its checkpoint as, tp/megatron.Arch.config)
preset("megatron", model_types=("megatron",))(_megatron("megatron", "gate_up"))
preset("megatron-mlp", model_types=("megatron-mlp",))(_megatron("megatron-mlp", "column"))
