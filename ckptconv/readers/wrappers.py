"""Training checkpoints: where the model's weights are beside the training state, and `--state-dict`.

A torch.save file of a training run holds the model's state dict under a key of the trainer's
choosing (`state_dict`, `model`, `model_state_dict`, `module`, `net`, an EMA copy, or one level down:
chgnet's `model.state_dict`), beside optimizer, scheduler and scaler state. `survey` names what each
top-level entry holds; `unwrap` picks the weights (`--state-dict auto`: a top-level `state_dict` as
before, else the one candidate beside recognisable training state; `KEY` or a dotted path; `none`);
`TrainingParts` is what inspect and convert say about it (docs/convert.md#training-checkpoints);
`set_aside` what becomes of the rest. A training-state key numbered by its trainer (Lightning's
`optimizer_0`, `optimizer_1`: a known key, `_`, digits) is that state. Only entries' names and
whether they reach a tensor are looked at, each walk charged to the pickle's budget; nothing here
changes a tensor.
"""
import re
from dataclasses import dataclass

from ..errors import UsageError, printable
from ..limits import Budget
from .pickle import unpickler
from .pickle.numpy_globals import NumpyArray
from .pickle.torch_globals import TorchTensor, TorchTensorUnsupported, flatten

WRAPPER_KEY = "state_dict"   # PyTorch Lightning, Stable Diffusion: unwrapped by `auto` whenever it holds tensors
MODEL = "model weights"
EMA = "EMA weights"
OTHER = "other"
_MODEL_KEYS = ("state_dict", "model", "model_state_dict", "module", "net", "network", "model_state")
_EMA_KEYS = ("ema", "model_ema", "ema_model", "state_dict_ema", "ema_state_dict", "ema_state")
_NESTED_KEYS = ("state_dict", "model_state_dict", "module")   # one level down: chgnet's model.state_dict
_TRAINING = {
    **dict.fromkeys(("optimizer", "optimizers", "optimizer_state_dict", "optimizer_states", "optimizer_state", "optim",
                     "optim_state", "optim_state_dict", "opt_state", "opt_state_dict"), "optimizer state"),
    **dict.fromkeys(("scheduler", "schedulers", "lr_scheduler", "lr_schedulers", "scheduler_state_dict",
                     "lr_scheduler_state_dict", "sched"), "scheduler state"),
    **dict.fromkeys(("scaler", "grad_scaler", "amp", "amp_scaler", "scaler_state_dict"), "grad scaler state"),
    **dict.fromkeys(("rng_state", "rng_states", "cuda_rng_state", "torch_rng_state"), "random number generator state"),
    **dict.fromkeys(("callbacks", "loops"), "Lightning training state"),
    "frozen_param_fragments": "DeepSpeed's copies of frozen parameters",
    **dict.fromkeys(("train_state", "dataloader", "data_loader"), "training loop state"),   # torchtitan
}
SHOWN = 8   # entries of other kinds named one by one
TOP = "."   # --state-dict for the tensors at a state's top level (a DCP save that flattens the model: torchtitan)


_KINDS = {**_TRAINING, **dict.fromkeys(_EMA_KEYS, EMA), **dict.fromkeys(_MODEL_KEYS, MODEL)}
_NUMBERED = re.compile(r"(.+)_[0-9]+")   # Lightning's optimizer_0, optimizer_1 (strategies/fsdp.py, model_parallel.py)


def kind(key: str) -> str:
    """What an entry of a training checkpoint holds, by its key: a key of training state followed by
    `_N` is that state."""
    found = _KINDS.get(key)
    if found is None and (numbered := _NUMBERED.fullmatch(key)) is not None:
        found = _TRAINING.get(numbered.group(1))
    return found or OTHER


def mapping(value):
    """The dict `value` is (a dict, or the items of a record of a dict subclass), or None."""
    if isinstance(value, dict):
        return value
    if isinstance(value, unpickler.InertObject) and not value.unread and isinstance(value.items, dict):
        return value.items
    return None


def tensors_reached(value, budget: Budget, what="its non-tensor state", unread=False, stop=None):
    """The tensors `value` reaches through containers and records (with `unread`, also the records a
    global of the format's own modules built, kinds of tensor ckptconv does not read), as it meets
    them; a container for which `stop` is true is not entered. Each object is looked at once, and
    each charged to the pickle's budget as `what`."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if isinstance(v, (TorchTensor, TorchTensorUnsupported, NumpyArray)) or \
                (unread and isinstance(v, unpickler.InertObject) and v.unread):
            yield v
            continue
        if id(v) in seen or not isinstance(v, (dict, list, tuple, unpickler.InertObject)) or \
                (isinstance(v, unpickler.InertObject) and v.unread) or (stop is not None and stop(v)):
            continue
        seen.add(id(v))
        budget.spend(1, what)
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, unpickler.InertObject):
            todo.extend(part for _, part in unpickler.record_parts(v))
        else:
            todo.extend(v)


def holds_tensor(value, budget: Budget) -> bool:
    """Whether `value` reaches a tensor through containers and records (tensors_reached)."""
    return next(tensors_reached(value, budget), None) is not None


@dataclass(frozen=True)
class Entry:
    """A top-level entry (or a candidate one level down) that holds tensors."""

    key: str      # as --state-dict names it: `model_state_dict`, `model.state_dict`
    kind: str     # MODEL, EMA, a kind of training state, or OTHER


@dataclass(frozen=True)
class Survey:
    """What a training checkpoint's top level holds: its entries that hold tensors, in file order
    (a candidate's nested state dict in its place), and the one `auto` picks (None: none, or more
    than one could be the model)."""

    entries: tuple
    auto: str | None


def survey(obj, budget: Budget) -> Survey | None:
    """The entries of `obj` that hold tensors, when it is a dict with a candidate for the model's
    weights or recognisable training state holding tensors; None for anything else (a plain state
    dict: nothing is walked beyond its candidates' keys)."""
    top = mapping(obj)
    if top is None or not any(k in top and _marks_a_wrapper(k, top[k], budget) for k in _KINDS):
        return None   # (a known name looked up, not every key read: a plain state dict may hold a million)
    entries = []
    for k, v in top.items():
        if not holds_tensor(v, budget):
            continue
        name = unpickler.key_text(k)
        what = kind(k) if isinstance(k, str) else OTHER
        inner = mapping(v) if what in (MODEL, EMA) else None
        if inner is not None:   # chgnet: model -> {"state_dict": ..., "model_args": ...}
            nested = [nk for nk in _NESTED_KEYS if nk in inner and mapping(inner[nk]) is not None
                      and holds_tensor(inner[nk], budget)]
            if len(nested) == 1 and not any(ik != nested[0] and holds_tensor(iv, budget) for ik, iv in inner.items()):
                name = f"{name}.{nested[0]}"
        elif what in (MODEL, EMA):
            what = OTHER   # (a tensor, or a pickled module: not a state dict to unwrap)
        entries.append(Entry(name, what))
    return Survey(tuple(entries), _auto(entries))


def _marks_a_wrapper(key, value, budget) -> bool:
    """A candidate for the model's weights (a dict under one of their keys) or recognisable training
    state in a container, holding tensors: a plain state dict's tensor that happens to be named
    `scaler` is not."""
    what = kind(key) if isinstance(key, str) else OTHER
    if what == OTHER or not (mapping(value) is not None if what in (MODEL, EMA) else
                             isinstance(value, (dict, list, tuple, unpickler.InertObject))):
        return False
    return holds_tensor(value, budget)


def _auto(entries) -> str | None:
    """A top-level `state_dict` holding tensors (Lightning, Stable Diffusion: as always); else the one
    model candidate (or, without one, the one EMA copy) when every other entry holding tensors is
    recognisable training state or an EMA copy."""
    if any(e.key == WRAPPER_KEY for e in entries):
        return WRAPPER_KEY
    if any(e.kind == OTHER for e in entries):
        return None
    models = [e.key for e in entries if e.kind == MODEL]
    emas = [e.key for e in entries if e.kind == EMA]
    return models[0] if len(models) == 1 else emas[0] if not models and len(emas) == 1 else None


@dataclass
class Unwrapped:
    """What `unwrap` made of a file's object: the part written (`kept`), the rest of the wrapper by
    dotted name, the key (path) unwrapped or None, and the survey (None: no training layout)."""

    kept: object
    rest: dict
    key: str | None
    survey: Survey | None


class NoSuchEntry(UsageError):
    """--state-dict names an entry the file does not have (verify --against reads another source as
    asked then: jobs/verify/against.py)."""


def unwrap(obj, how: str, path, budget: Budget) -> Unwrapped:
    """`how` is --state-dict: "auto" unwraps what `survey` picks, "none" nothing, any other value that
    key of the top level or, if it has none, that dotted path (`model.state_dict`): refused if it
    does not lead to a dict."""
    found = survey(obj, budget)
    if how == "none":
        return Unwrapped(obj, {}, None, found)
    key = found.auto if how == "auto" and found is not None else None if how == "auto" else how
    if key is None:
        return Unwrapped(obj, {}, None, found)
    steps = _steps(obj, key)
    if steps is None:
        top = mapping(obj)
        keys = ", ".join(repr(k) for k in list(top)[:12]) if top is not None else f"a {type(obj).__name__}"
        raise NoSuchEntry(f"--state-dict {how!r}: {path} has no dict under that key or dotted path at its top level "
                         f"(it holds {printable(keys, 300)})")
    rest, prefix, level = {}, "", mapping(obj)
    for step in steps:   # the siblings along the path, under their dotted names, in file order
        for k, v in level.items():
            if k is not step:
                rest[prefix + unpickler.key_text(k)] = v
        prefix, level = f"{prefix}{step}.", mapping(level[step])
    return Unwrapped(level, rest, key, found)


def _steps(obj, key: str):
    """The keys leading from `obj` to the dict `key` names: the key itself, or its dotted parts
    (each a string key of a dict); None if there is no such dict."""
    top = mapping(obj)
    if top is None:
        return None
    if key in top:
        return [_same_key(top, key)] if mapping(top[key]) is not None else None
    level, steps = top, []
    for part in key.split("."):
        if level is None or part not in level:
            return None
        steps.append(_same_key(level, part))
        level = mapping(level[part])
    return steps if level is not None else None


def _same_key(level: dict, key: str):
    """The key object of `level` equal to `key` (a str subclass from a pickle compares equal)."""
    return next(k for k in level if k == key)


@dataclass
class Rest:
    """What becomes of the rest of a training wrapper (dotted name -> value): the extras kept, the
    entries dropped ({"name", "reason"}) and the tensors each entry holds (for the TrainingParts)."""

    extras: dict
    dropped: list
    counts: dict


def set_aside(rest: dict, path, budget: Budget, keep=lambda name: True) -> Rest:
    """An entry without tensors goes to the extras (those of its names `keep` accepts); one holding
    tensors, or a record a global of the format's own modules built (a kind of tensor ckptconv does
    not read), is dropped and named with why. The tensors are never read."""
    extras, dropped, counts = {}, [], {}
    for key, value in rest.items():
        wt, we, ws = flatten(value, path, prefix=key, budget=budget)
        counts[key] = len(wt) + len(ws)
        unread = unpickler.unread_in(value)
        if wt or ws:
            dropped.append({"name": key, "reason": "tensors outside the state dict"})
        elif unread is not None:
            dropped.append({"name": key, "reason": f"{unread.qualname} builds something ckptconv does not read"})
        else:
            extras.update(unpickler.extras_json({k: v for k, v in we.items() if keep(k)}, budget))
    return Rest(extras, dropped, counts)


@dataclass(frozen=True)
class Part:
    """An entry of a training checkpoint as inspect and convert describe it."""

    key: str
    kind: str
    tensors: int


def _tensors(n: int) -> str:
    return f"{n} tensor" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class TrainingParts:
    """What was found in a training checkpoint and what was done with it: its entries that hold
    tensors (at most SHOWN of other kinds named, the rest counted in `more`), the key whose tensors
    were written under their own names (None: everything under flattened names) and `--state-dict`
    as asked."""

    parts: tuple
    chosen: str | None
    asked: str
    more: tuple = (0, 0)   # (entries, tensors) of other kinds beyond those named

    def found(self) -> str:
        """`model weights under model_state_dict: 226 tensors; optimizer state under ...: 381 tensors`."""
        text = "; ".join(f"{p.kind} {'at the top level' if p.key == TOP else 'under ' + p.key}: "
                         f"{_tensors(p.tensors)}" for p in self.parts)
        if self.more[0]:
            text += f"; {self.more[0]} more entries: {_tensors(self.more[1])}"
        return text

    def choice(self) -> str:
        """Which tensors are written under which names, and the flag that picks otherwise: follows
        "wrote" (convert) or "converts" (inspect)."""
        candidates = [p.key for p in self.parts if p.kind in (MODEL, EMA)]
        if self.chosen is not None:
            how = "picked by --state-dict auto" if self.asked == "auto" else f"--state-dict {self.asked}"
            what = "the top-level tensors" if self.chosen == TOP else f"the tensors of {self.chosen!r}"
            return f"{what} under their own names ({how}; --state-dict none keeps everything)"
        flags = " or ".join(f"--state-dict {k}" for k in candidates[:4]) or "--state-dict KEY"
        if self.asked == "none":
            return f"every tensor under its flattened name (--state-dict none; {flags} writes one part)"
        others = [p.key for p in self.parts if p.kind == OTHER]
        why = (f"{', '.join(candidates)} could each be the model" if len(candidates) > 1 else
               f"{', '.join(others[:4])} also {'holds' if len(others) == 1 else 'hold'} tensors" if others else
               "no entry is the model's")
        return f"every tensor under its flattened name: no single part holds the model weights ({why}); {flags} " \
               "writes one part"

    def to_json(self) -> dict:
        return {"parts": [{"key": p.key, "kind": p.kind, "tensors": p.tensors} for p in self.parts],
                "state_dict": self.chosen, "asked": self.asked,
                **({"more_entries": self.more[0], "more_tensors": self.more[1]} if self.more[0] else {})}


def layout(unwrapped: Unwrapped, how: str, written: list, rest_counts: dict) -> TrainingParts | None:
    """The TrainingParts of one file: `written` the names of the tensors (and skipped ones) of the part
    written, `rest_counts` {dotted name: tensors} of the rest of the wrapper."""
    if unwrapped.survey is None and unwrapped.key is None:
        return None
    if unwrapped.key is not None:
        known = {e.key: e.kind for e in unwrapped.survey.entries} if unwrapped.survey is not None else {}
        first = kind(unwrapped.key.split(".", 1)[0])
        counted = [(unwrapped.key, known.get(unwrapped.key, first if first in (MODEL, EMA) else kind(unwrapped.key)),
                    len(written))]
        counted += [(k, kind(k), n) for k, n in rest_counts.items() if n]
    else:
        entries = unwrapped.survey.entries
        counts, by_first = dict.fromkeys((e.key for e in entries), 0), {}
        for e in entries:
            by_first.setdefault(e.key.split(".", 1)[0], []).append(e.key)
        for name in written:   # (the entry a name starts with: looked up by its first part)
            for key in by_first.get(name.split(".", 1)[0], ()):
                if name == key or name.startswith(key + "."):
                    counts[key] += 1
                    break
        counted = [(e.key, e.kind, counts[e.key]) for e in entries]
    named = [c for c in counted if c[1] != OTHER] + [c for c in counted if c[1] == OTHER][:SHOWN]
    beyond = [c for c in counted if c[1] == OTHER][SHOWN:]
    keep = {c[0] for c in named}
    return TrainingParts(tuple(Part(k, w, n) for k, w, n in counted if k in keep), unwrapped.key, how,
                  (len(beyond), sum(c[2] for c in beyond)))
