"""Megatron-Core GPT models as data: the architecture a checkpoint's training arguments describe
(`Arch`), the names of its merged tensors, and its export under Hugging Face names.

How Megatron splits each tensor over tensor-parallel ranks is not written here: it is the `megatron`
preset (tp/presets.py), the same rules `reshard` splits with, and readers/megatron.py merges a
checkpoint's ranks as the inverse of that split (docs/formats.md#megatron). What is here:
- `arch(args)`: the typed facts the reader, the rules and the export need, from `args`;
- `layer_name`: one spelling for both layouts (global layer numbers; the layer norms as the modules
  are named, `input_layernorm` and `pre_mlp_layernorm`, which torch_dist and TransformerEngine
  models spell `self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight`);
- `to_hf` and `hf_config`: the Llama / Qwen2 / Mixtral names and config.json (docs/convert.md#megatron),
  each Hugging Face tensor a lazy slice or join of the merged one (q, k and v gathered per query
  group; fc1's gate and up halves).
"""
import json
import math
import re
from dataclasses import dataclass

from ..errors import BadInput, UsageError, brief
from ..tensor import Concat, TensorSource

PRESET = "megatron"          # SwiGLU's fc1 holds [gate; up] on every rank
PRESET_PLAIN = "megatron-mlp"  # a plain MLP's fc1 is column-parallel


@dataclass(frozen=True)
class Arch:
    """A Megatron GPT as its training arguments (`args`) describe it, and how it was split."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int                  # query groups (key/value heads)
    head_dim: int                # kv_channels
    vocab: int                   # rows of the embedding (padded_vocab_size)
    real_vocab: int | None       # the tokenizer's, when args says it and it is smaller
    norm: str                    # "RMSNorm" | "LayerNorm"
    eps: float
    swiglu: bool
    position: str                # position_embedding_type: "rope", "learned_absolute", ...
    rotary_base: float
    rotary_percent: float
    tied: bool
    bias_linear: bool
    qkv_bias: bool
    qk_layernorm: bool
    experts: int | None
    topk: int | None
    expert_ffn: int | None
    max_positions: int | None
    dtype: str                   # "bfloat16" | "float16" | "float32": what training ran in
    tp: int
    pp: int
    ep: int
    vp: int | None               # virtual pipeline chunks per stage
    extras: tuple = ()           # (name, value) of args fields the export cannot honour

    @property
    def rules_params(self) -> dict:
        return {"heads": self.heads, "kv_heads": self.groups, "head_dim": self.head_dim}

    @property
    def preset(self) -> str:
        return PRESET if self.swiglu else PRESET_PLAIN

    def config(self) -> dict:
        """What reshard's rules read (tp/presets.choose_rules): the preset and its head counts."""
        return {"model_type": self.preset, "num_attention_heads": self.heads, "num_key_value_heads": self.groups,
                "head_dim": self.head_dim, "hidden_size": self.hidden}


def _get(args: dict, key, kinds, where, default=KeyError, positive=False):
    if key not in args or args[key] is None:
        if default is KeyError:
            raise BadInput(f"{where}: args has no {key!r}")
        return default
    value = args[key]
    if kinds is int and (type(value) is not int or (positive and value <= 0) or value < 0 or value > 2**40):
        raise BadInput(f"{where}: args.{key} is {brief(value, 60)}, not a {'positive ' if positive else ''}count")
    if kinds is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise BadInput(f"{where}: args.{key} is {brief(value, 60)}, not a number")
    if kinds is bool and not isinstance(value, bool):
        raise BadInput(f"{where}: args.{key} is {brief(value, 60)}, not true or false")
    if kinds is str and not isinstance(value, str):
        raise BadInput(f"{where}: args.{key} is {brief(value, 60)}, not a string")
    return value


def _dtype(args: dict) -> str:
    if args.get("bf16") is True:
        return "bfloat16"
    if args.get("fp16") is True:
        return "float16"
    return "float32"


def arch(args: dict, where) -> Arch:
    """The architecture and parallel sizes `args` (the Namespace's fields) describe, each checked."""
    heads = _get(args, "num_attention_heads", int, where, positive=True)
    hidden = _get(args, "hidden_size", int, where, positive=True)
    gqa = _get(args, "group_query_attention", bool, where, False)
    groups = _get(args, "num_query_groups", int, where, heads, positive=True) if gqa else heads
    head_dim = _get(args, "kv_channels", int, where, None, positive=True) or (hidden // heads)
    if heads % groups:
        raise BadInput(f"{where}: args.num_attention_heads {heads} is not a multiple of num_query_groups {groups}")
    ffn = _get(args, "ffn_hidden_size", int, where, 4 * hidden, positive=True)
    vocab = _get(args, "padded_vocab_size", int, where, positive=True)
    real = _get(args, "vocab_size", int, where, None)
    experts = _get(args, "num_experts", int, where, None) or None
    vp = _get(args, "virtual_pipeline_model_parallel_size", int, where, None) or None
    norm = _get(args, "normalization", str, where, "LayerNorm")
    return Arch(
        layers=_get(args, "num_layers", int, where, positive=True), hidden=hidden, ffn=ffn, heads=heads,
        groups=groups, head_dim=head_dim, vocab=vocab, real_vocab=real if real and real < vocab else None,
        norm=norm, eps=float(_get(args, "norm_epsilon", float, where, 1e-5)),
        swiglu=_get(args, "swiglu", bool, where, False),
        position=_get(args, "position_embedding_type", str, where, "learned_absolute"),
        rotary_base=float(_get(args, "rotary_base", float, where, 10000)),
        rotary_percent=float(_get(args, "rotary_percent", float, where, 1.0)),
        tied=not _get(args, "untie_embeddings_and_output_weights", bool, where, False),
        bias_linear=_get(args, "add_bias_linear", bool, where, True),
        qkv_bias=_get(args, "add_qkv_bias", bool, where, False),
        qk_layernorm=_get(args, "qk_layernorm", bool, where, False),
        experts=experts, topk=_get(args, "moe_router_topk", int, where, 2) if experts else None,
        expert_ffn=(_get(args, "moe_ffn_hidden_size", int, where, None) or ffn) if experts else None,
        max_positions=_get(args, "max_position_embeddings", int, where, None),
        dtype=_dtype(args),
        tp=_get(args, "tensor_model_parallel_size", int, where, 1, positive=True),
        pp=_get(args, "pipeline_model_parallel_size", int, where, 1, positive=True),
        ep=_get(args, "expert_model_parallel_size", int, where, 1, positive=True),
        vp=vp if vp and vp > 1 else None,
        extras=tuple((k, args[k]) for k in ("moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
                                              "moe_router_score_function", "rotary_interleaved",
                                              "apply_rope_fusion_interleaved", "moe_router_topk_scaling_factor",
                                              "expert_tensor_parallel_size", "moe_layer_freq",
                                              "first_k_dense_replace")
                     if args.get(k) not in (None, False)))


# --- One spelling of the merged names -----------------------------------------------------------

# TransformerEngine's and torch_dist's spelling of the layer norms (fused into the linear layer after
# them) -> the modules' own, which ckptconv writes
_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
          "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


def layer_name(layer: int, rest: str) -> str:
    """`decoder.layers.{layer}.{rest}`, its layer norm spelled as the module is named."""
    return f"decoder.layers.{layer}.{_NORMS.get(rest, rest)}"


# --- Hugging Face names -------------------------------------------------------------------------

def hf_family(a: Arch) -> str:
    """"llama", "qwen2" or "mixtral"; UsageError naming what the architecture lacks otherwise."""
    lacks = []
    if a.norm != "RMSNorm":
        lacks.append(f"RMSNorm (args.normalization is {a.norm})")
    if not a.swiglu:
        lacks.append("SwiGLU (args.swiglu is not set)")
    if a.position != "rope":
        lacks.append(f"rotary position embeddings (args.position_embedding_type is {a.position})")
    if a.rotary_percent != 1.0:
        lacks.append(f"rotary embeddings over the whole head (args.rotary_percent is {a.rotary_percent})")
    if a.bias_linear:
        lacks.append("linear layers without biases (args.add_bias_linear is set)")
    if a.qk_layernorm:
        lacks.append("attention without q/k layer norms (args.qk_layernorm is set)")
    if a.experts and a.qkv_bias:
        lacks.append("a mixture of experts without q/k/v biases")
    for key, value in a.extras:
        if not (key == "moe_router_score_function" and value == "softmax") and \
                not (key == "expert_tensor_parallel_size" and value == a.tp):
            lacks.append(f"args.{key} at its default (it is {brief(value, 40)})")
    if lacks:
        raise UsageError("--to hf: this Megatron model is not one of the Llama family (Llama, Qwen2, Mixtral) "
                         "ckptconv maps: it lacks " + "; ".join(lacks))
    return "mixtral" if a.experts else "qwen2" if a.qkv_bias else "llama"


def hf_config(a: Arch) -> dict:
    """config.json for `from_pretrained`, from the architecture (docs/convert.md#megatron)."""
    family = hf_family(a)
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
    cfg = {"architectures": [arch_name], "model_type": family, "hidden_size": a.hidden,
           "intermediate_size": a.expert_ffn if a.experts else a.ffn, "num_attention_heads": a.heads,
           "num_key_value_heads": a.groups, "head_dim": a.head_dim, "num_hidden_layers": a.layers,
           "rms_norm_eps": a.eps, "rope_theta": a.rotary_base,
           "rope_parameters": {"rope_type": "default", "rope_theta": a.rotary_base},
           "vocab_size": a.real_vocab or a.vocab, "max_position_embeddings": a.max_positions or 4096,
           "tie_word_embeddings": a.tied, "hidden_act": "silu", "torch_dtype": a.dtype}
    if family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if family == "mixtral":
        cfg.update(num_local_experts=a.experts, num_experts_per_tok=a.topk, router_aux_loss_coef=0.0)
    return cfg


def config_bytes(cfg: dict) -> bytes:
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _rows(src: TensorSource, name: str, ranges) -> TensorSource:
    """Rows `ranges` [(start, stop)] of `src` (axis 0), joined: a slice, or a join of slices."""
    parts = [src.sliced(0, a, b) for a, b in ranges]
    return parts[0].renamed(name) if len(parts) == 1 else Concat(name, parts, 0)


def _qkv(src: TensorSource, base: str, a: Arch) -> list:
    """linear_qkv [groups x (q per group + 2) x head_dim, ...]: per query group its q heads, its k,
    its v; as q_proj, k_proj, v_proj (each group's rows, in group order)."""
    qpg, hd = a.heads // a.groups, a.head_dim
    per = (qpg + 2) * hd
    # (a row range per query group: as many as the tensor has elements, whatever count args claims)
    if src.shape[0] != a.groups * per or not math.prod(src.shape):
        raise BadInput(f"tensor {src.name!r}: {list(src.shape)}, not {a.groups} query groups x ({qpg} + 2) heads x "
                       f"{hd} rows of elements")
    kind = src.name.rsplit(".", 1)[1]
    q = [(g * per, g * per + qpg * hd) for g in range(a.groups)]
    k = [(g * per + qpg * hd, g * per + (qpg + 1) * hd) for g in range(a.groups)]
    v = [(g * per + (qpg + 1) * hd, (g + 1) * per) for g in range(a.groups)]
    return [_rows(src, f"{base}self_attn.{p}_proj.{kind}", r) for p, r in (("q", q), ("k", k), ("v", v))]


def _gate_up(src: TensorSource, base: str, names: tuple) -> list:
    """fc1 [2F, H] = [gate; up]: as two tensors."""
    n = src.shape[0]
    if n % 2:
        raise BadInput(f"tensor {src.name!r}: fc1 has {n} rows, not a gate and an up half")
    return [src.sliced(0, 0, n // 2).renamed(base + names[0]), src.sliced(0, n // 2, n).renamed(base + names[1])]


def _vocab(src: TensorSource, name: str, a: Arch) -> TensorSource:
    if src.shape[0] != a.vocab:
        raise BadInput(f"tensor {src.name!r}: {src.shape[0]} rows, args.padded_vocab_size says {a.vocab}")
    return src.sliced(0, 0, a.real_vocab).renamed(name) if a.real_vocab else src.renamed(name)


def to_hf(tensors: list, a: Arch) -> list:
    """The merged tensors (Megatron names) under the Hugging Face family's names, lazily; a tensor
    the mapping does not know is refused naming it (nothing is dropped silently)."""
    family = hf_family(a)
    out = []
    for t in tensors:
        name = t.name
        if name == "embedding.word_embeddings.weight":
            out.append(_vocab(t, "model.embed_tokens.weight", a))
            continue
        if name == "output_layer.weight":
            if not a.tied:
                out.append(_vocab(t, "lm_head.weight", a))
            continue   # (tied: Hugging Face ties lm_head to the embedding; the stage's copy is the same)
        if name == "decoder.final_layernorm.weight":
            out.append(t.renamed("model.norm.weight"))
            continue
        m = LAYER.fullmatch(name)
        mapped = _layer_to_hf(t, int(m.group(1)), m.group(2), a, family) if m else None
        if mapped is None:
            raise BadInput(f"tensor {name!r}: no {family} name for it (--to hf maps the Llama family's tensors only)")
        out.extend(mapped)
    return out


_MIXTRAL_FC = ("w1.weight", "w3.weight")


def _layer_to_hf(t, layer: int, rest: str, a: Arch, family: str):
    base = f"model.layers.{layer}."
    simple = {"input_layernorm.weight": "input_layernorm.weight",
              "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
              "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
              "mlp.linear_fc2.weight": "mlp.down_proj.weight",
              "mlp.router.weight": "block_sparse_moe.gate.weight"}
    if rest in simple:
        if rest.startswith("mlp.linear_fc") and family == "mixtral" or rest == "mlp.router.weight" and family != \
                "mixtral":
            return None
        return [t.renamed(base + simple[rest])]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(t, base, a)
    if rest == "mlp.linear_fc1.weight" and family != "mixtral":
        return _gate_up(t, base, ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
    m = EXPERT.fullmatch(rest)
    if m and family == "mixtral":
        e, what = m.group(1), m.group(2)
        p = f"{base}block_sparse_moe.experts.{e}."
        if what == "linear_fc1.weight":
            return _gate_up(t, p, _MIXTRAL_FC)
        if what == "linear_fc2.weight":
            return [t.renamed(p + "w2.weight")]
    return None
