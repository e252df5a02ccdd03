"""The Megatron reader's torch_dist layout (readers/megatron.py reads with it): common.pt's args,
the DCP checkpoint beside it read with readers/dcp.py, and its stacked layer (and expert) tensors
unstacked under the merged names as lazy views. Registers nothing: megatron.py is the reader.
"""
import math
from pathlib import Path

from ..errors import BadInput
from ..storage import files as storage
from ..limits import Budget
from ..tensor import TensorSource
from ..tp import megatron as mt
from . import ReadOptions, confined
from . import dcp
from .megatron_legacy import _allow, _found, _load, _namespace
from .pickle import unpickler
from .pickle.megatron_globals import megatron_globals
from .pickle.unpickler import InertObject


# --- The torch_dist layout -----------------------------------------------------------------------

def _torch_dist(d: Path, root: str, options: ReadOptions, meta: dict):
    backend = meta.get("sharded_backend")
    if backend != "torch_dist":
        raise BadInput(f"{d / 'metadata.json'}: sharded_backend is {_found(backend)}; only 'torch_dist' is read")
    common = d / "common.pt"
    if not common.is_file():
        raise BadInput(f"{d}: a torch_dist checkpoint without common.pt (which holds args)")
    allow = _allow(options)
    m = storage.open_file(confined(common, root))
    u = unpickler.Unlisted(m.path)
    top = _load(m, allow, u)
    if not isinstance(top, dict) or "args" not in top:
        raise BadInput(f"{common}: holds no 'args' (Megatron's training arguments)")
    args = _namespace(top["args"], common)
    if unpickler.unread_in(args) is not None:
        raise u.refusal()
    a = mt.arch(args, common)
    ckpt = dcp.read(d, options, dcp.allowlist(options.allow_globals, megatron_globals()), lambda fqn: not fqn.endswith("_extra_state") and "/" not in fqn
                    and not fqn.startswith(("optimizer", "rng_state")))
    tensors, dropped = _unstack(ckpt.tensors, a, d)
    extras = unpickler.extras_json({"args": InertObject("argparse.Namespace", state=dict(args)),
                                    "checkpoint_version": top.get("checkpoint_version"),
                                    "iteration": top.get("iteration")}, Budget(common))
    described = {"layout": "torch_dist", "files": ckpt.source.files or [], "damaged": ckpt.source.damaged, "tp": a.tp,
                 "pp": a.pp, "ep": a.ep, **({"vp": a.vp} if a.vp else {})}
    return tensors, a, extras, described, dropped, [m] + ckpt.mapped


class Taken(TensorSource):
    """Index `i` of the leading axis of `base` (one layer of a stacked tensor), lazily: a slice of it
    along a later axis is a slice of the base, so it keeps its file span."""

    __slots__ = ("base", "i", "name", "dtype", "shape")

    def __init__(self, base: TensorSource, i: int, name: str):
        self.base, self.i, self.name, self.dtype, self.shape = base, i, name, base.dtype, base.shape[1:]

    def _region(self, index):
        return self.base.region((slice(self.i, self.i + 1),) + tuple(index))[0]

    def sliced(self, axis: int, start: int, stop: int) -> TensorSource:
        return Taken(self.base.sliced(axis + 1, start, stop), self.i, self.name)

    def file_span(self):
        span = self.base.sliced(0, self.i, self.i + 1).file_span() if self.base.shape[0] > 1 else self.base.file_span()
        return span

    def release(self):
        self.base.release()


_STACKED = "decoder.layers."
_EXPERTS = "mlp.experts.experts."


def _unstack(tensors: list, a: mt.Arch, d: Path) -> tuple:
    """torch_dist's global tensors under the merged names: `decoder.layers.X` [layers, ...] one per
    layer, `decoder.layers.mlp.experts.experts.X` [layers, experts, ...] one per layer and expert."""
    by = {t.name: t for t in tensors}
    out, dropped = [], []
    head = [t for t in tensors if not t.name.startswith(_STACKED)]
    stacked = [t for t in tensors if t.name.startswith(_STACKED)]
    for t in head:
        if t.name.startswith("output_layer.") and a.tied:
            dropped.append({"name": t.name, "reason": "a copy of the tied embedding"})
            continue
        if t.name.startswith(("embedding.", "output_layer.", "decoder.final_layernorm.")):
            continue   # (placed below, in Megatron's order)
        raise BadInput(f"{d}: tensor {t.name!r} is not part of a Megatron GPT model ckptconv reads")
    for t in stacked:   # (one piece per layer and expert: as many as it has elements, whatever args claims)
        if not t.shape or t.shape[0] != a.layers or not math.prod(t.shape):
            raise BadInput(f"{d}: tensor {t.name!r} stacks {t.shape[0] if t.shape else 0} layers"
                           f"{'' if math.prod(t.shape) else ' of no elements'}; args.num_layers says {a.layers}")
        rest = t.name[len(_STACKED):]
        if rest.startswith(_EXPERTS) and (len(t.shape) < 2 or t.shape[1] != a.experts):
            raise BadInput(f"{d}: tensor {t.name!r} stacks {t.shape[1] if len(t.shape) > 1 else 0} experts; "
                           f"args.num_experts says {a.experts}")
    experts = [t for t in stacked if t.name[len(_STACKED):].startswith(_EXPERTS)]
    if not stacked or bool(experts) != bool(a.experts):
        raise BadInput(f"{d}: holds {len(stacked)} stacked layer tensors, {len(experts)} of them experts; args says "
                       f"{a.layers} layers and {a.experts or 'no'} experts")
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        if name in by:
            out.append(by[name])
    if "embedding.word_embeddings.weight" not in by:
        raise BadInput(f"{d}: holds no embedding.word_embeddings.weight")
    for layer in range(a.layers):
        for t in stacked:
            if t not in experts:
                out.append(Taken(t, layer, mt.layer_name(layer, t.name[len(_STACKED):])))
        for e in range(a.experts or 0):   # (in Megatron's order: each expert's tensors together)
            for t in experts:
                what = t.name[len(_STACKED) + len(_EXPERTS):]
                name = mt.layer_name(layer, f"mlp.experts.local_experts.{e}.{what}")
                out.append(Taken(Taken(t, layer, t.name), e, name))
    for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        if name in by:
            out.append(by[name])
    if not a.tied:
        if "output_layer.weight" not in by:
            raise BadInput(f"{d}: holds no output_layer.weight, and args says the embeddings are untied")
        out.append(by["output_layer.weight"])
    return out, dropped
