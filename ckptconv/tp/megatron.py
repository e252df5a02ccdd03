"""Megatron-Core GPT models as data: the architecture a checkpoint's training arguments describe
(`Arch`) and the names of its merged tensors.

How Megatron splits each tensor over tensor-parallel ranks is not written here: it is the `megatron`
preset (tp/presets.py), the same rules `reshard` splits with, and readers/megatron.py merges a
checkpoint's ranks as the inverse of that split (docs/formats.md#megatron). What is here:
- `arch(args)`: the typed facts the reader, the rules and the export need, from `args`;
- `layer_name`: one spelling for both layouts (global layer numbers; the layer norms as the modules
  are named, `input_layernorm` and `pre_mlp_layernorm`, which torch_dist and TransformerEngine
  models spell `self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight`);
"""
import math
import re
from dataclasses import dataclass

from ..errors import BadInput, brief

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
    extras: tuple = ()           # (name, value) of args fields that change what the weights mean

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
