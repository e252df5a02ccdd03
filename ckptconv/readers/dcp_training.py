"""Training states saved through DCP, unwrapped like torch files (`--state-dict`, readers/wrappers.py).

A DCP checkpoint is a state dict flattened to dotted names; the save planner keeps each name's path
in the dict it flattened (`Metadata.planner_data`: `"model.layers.0.weight" -> ("model",
"layers.0.weight")`). So the top level is known without guessing from dots: an FSDP `{model, optim}`
save, Lightning's `{model, optimizer_0, ...}` (its meta.pt beside: dcp_lightning.py), Accelerate's
`{model}` give the model's entry; torchtitan flattens the model's own names to the top level beside
`optimizer`, `lr_scheduler`, `dataloader` and `train_state`, which is the model with the training
state left out. The names written are those the stack's own consolidation gives (`dcp_to_torch_save`
or Lightning's consolidate_checkpoint, then the model's key; `merge_fsdp_weights`).
Without planner data whose paths spell their names (another planner's private data), nothing is
unwrapped. Only names are looked at here; the reader reads what is kept (readers/dcp.py).
"""
from dataclasses import dataclass

from ..errors import printable
from . import wrappers
from .wrappers import EMA, MODEL, OTHER, TOP, Entry, Survey, Unwrapped

MAX_PATH = 64   # parts of one planner path (a state dict's nesting, as limits.MAX_DEPTH bounds pickles)


@dataclass
class Unwrap:
    """What is written: the name each kept item is written under (fqn -> name), the other top-level
    entries that hold tensors (dropped), and the layout inspect and convert describe."""

    names: dict            # fqn -> name written; an fqn absent is not read
    dropped: list          # {"name", "reason"}
    chosen: str | None     # the entry written (TOP: the top level), None: everything
    layout: object         # wrappers.TrainingParts or None


def paths(planner_data, fqns) -> dict | None:
    """fqn -> its path in the saved state dict, when the planner data gives one for every fqn and each
    path spells its fqn (`".".join`, as DCP's flattening makes it); None otherwise."""
    if not isinstance(planner_data, dict):
        return None
    out = {}
    for fqn in fqns:
        path = planner_data.get(fqn)
        if not isinstance(path, (tuple, list)) or not 0 < len(path) <= MAX_PATH \
                or not all(type(p) in (str, int) for p in path) or ".".join(map(str, path)) != fqn:
            return None
        out[fqn] = tuple(path)
    return out


def _nested(entries, by_top) -> list:
    """A model (or EMA) entry holding one state dict one level down (`model.state_dict`): that key."""
    out = []
    for e in entries:
        inner = {p[1] for p in by_top[e.key] if len(p) > 1}
        if e.kind in (MODEL, EMA) and len(inner) == 1 and all(len(p) > 2 for p in by_top[e.key]) \
                and next(iter(inner)) in wrappers._NESTED_KEYS:
            out.append(Entry(f"{e.key}.{next(iter(inner))}", e.kind))
        else:
            out.append(e)
    return out


def unwrap(items: dict, planner_data, how: str, where, beside=None) -> Unwrap | None:
    """`items`: fqn -> whether it is a tensor item, in file order; `how`: --state-dict; `beside`: the
    tensors of each entry of the state saved beside the DCP items (Lightning's meta.pt), shown in the
    layout. None: every item is written under its own name (no training state, no single model entry
    in it, or `none`)."""
    if how == "none":
        return None
    found = paths(planner_data, list(items))
    if found is None:
        if how != "auto":
            raise wrappers.NoSuchEntry(f"--state-dict {how!r}: {where} records no state-dict paths (its save planner's "
                                       "data), so no entry can be picked; --only and --strip-prefix select by name")
        return None
    by_top = {}
    for path in found.values():
        by_top.setdefault(str(path[0]), []).append(path)
    holding = [k for k in by_top if any(items[".".join(map(str, p))] for p in by_top[k])]
    leaves = [k for k in holding if all(len(p) == 1 for p in by_top[k])]
    entries = _nested([Entry(k, wrappers.kind(k)) for k in holding if k not in leaves], by_top)
    if how == "auto":
        if all(e.kind == OTHER for e in entries):
            return None   # a plain state dict (or one with no recognisable training state)
        steps = _auto(entries, bool(leaves))
        if steps is None:
            return None
    elif how == TOP:
        steps = ()
        if not leaves:
            raise wrappers.NoSuchEntry(f"--state-dict .: {where} holds no tensors at its top level (its entries: "
                                       f"{printable(', '.join(repr(k) for k in list(by_top)[:12]), 300)})")
    else:
        steps = (how,) if how in by_top else tuple(how.split("."))
        if not any(len(p) > len(steps) and tuple(map(str, p[:len(steps)])) == steps for p in found.values()):
            shown = ", ".join(repr(k) for k in list(by_top)[:12])
            raise wrappers.NoSuchEntry(f"--state-dict {how!r}: {where} has no entry under that key or dotted path at "
                                       f"its top level (it holds {printable(shown, 300)})")
    names, counts = {}, {}
    for fqn, path in found.items():
        if steps == () and len(path) == 1 or steps and len(path) > len(steps) \
                and tuple(map(str, path[:len(steps)])) == steps:
            names[fqn] = ".".join(map(str, path[len(steps):]))
        elif str(path[0]) in holding:
            counts[str(path[0])] = counts.get(str(path[0]), 0) + bool(items[fqn])   # dropped, never read
        else:
            names[fqn] = fqn   # state without tensors beside the model: its extras, as for torch files
    chosen = ".".join(steps) if steps else TOP
    dropped = [{"name": k, "reason": "tensors outside the state dict"} for k, n in counts.items() if n]
    shown = tuple(Entry(TOP, MODEL) if e.key == TOP else e for e in ([Entry(TOP, OTHER)] if leaves else []) + entries)
    layout = wrappers.layout(Unwrapped(None, {}, chosen, Survey(shown, chosen if how == "auto" else None)), how,
                             [n for f, n in names.items() if items[f]], {**counts, **(beside or {})})
    return Unwrap(names, dropped, chosen, layout)


def _auto(entries, leaves: bool):
    """The path of the entry `auto` writes: torch files' rule (wrappers._auto) when no model tensors lie
    at the top level; else the top level itself (`()`) when every entry beside them is recognisable
    training state (torchtitan)."""
    if not leaves:
        key = wrappers._auto(entries)
        return tuple(key.split(".")) if key is not None else None
    return () if entries and all(e.kind not in (OTHER, MODEL, EMA) for e in entries) else None
