"""A conversion's recipe: what convert and reshard do to the source's tensors, in one order, and the
one schema of how an output records it, which `verify --against` reads back to do the same again.

    names without --strip-prefix  ->  tied weights written once (convert)  ->  floating tensors
    cast to --dtype  ->  the engine's layout (reshard --target vllm)

What the reader was asked (--only, --state-dict, a reader's own options such as Grok's --dequantize)
is the read side: the reader records it, and verify reads the source again with it.
"""
from dataclasses import dataclass

from . import dtypes, transforms
from .errors import BadInput, brief
from .layouts.base import for_target


@dataclass(frozen=True)
class Recipe:
    strip_prefix: str | None = None
    cast: object = None            # a DType of dtypes.CAST_TARGETS, or None
    target: dict | None = None     # an engine's layout (reshard --target vllm): {"engine", ...}, as it records it

    def records(self) -> dict:
        """What the output's manifest records of it, in its "source" entry."""
        return {**({"cast": self.cast.code} if self.cast is not None else {}),
                **({"strip_prefix": self.strip_prefix} if self.strip_prefix else {}),
                **({"target": self.target} if self.target is not None else {})}

    @classmethod
    def recorded(cls, source: dict) -> "Recipe":
        """The recipe an output's "source" entry records; BadInput saying which part is not one
        ckptconv writes (a manifest is read, not trusted)."""
        prefix, cast, target = source.get("strip_prefix"), source.get("cast"), source.get("target")
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise BadInput(f"source.strip_prefix {brief(prefix)} is not a prefix")
        dtype = next((d for d in dtypes.CAST_TARGETS.values() if d.code == cast), None)
        if cast is not None and dtype is None:
            raise BadInput(f"source.cast {brief(cast)} is not a --dtype ckptconv casts to")
        if target is not None and for_target(target) is None:
            raise BadInput(f"source.target {brief(target)} is not a layout ckptconv writes")
        return cls(prefix, dtype, target)

    def apply(self, tensors, where, untie: bool = False, same_bytes: bool = False) -> tuple:
        """(the tensors as the recipe makes them, {alias: kept name} of tied weights written once).
        `untie`: convert's step (transforms.untie; `same_bytes` when config.json says the
        embeddings are tied). UsageError or BadInput naming `where` when the source does not allow it."""
        tensors = transforms.strip_prefix(tensors, self.strip_prefix, where)
        aliases = {}
        if untie:
            tensors, aliases = transforms.untie(tensors, same_bytes=same_bytes)
        tensors = transforms.cast_floats(tensors, self.cast)   # (before any layout: the engine's dtype)
        if self.target is not None:   # (the engine's own names and shapes: its layout says how)
            engine = for_target(self.target)
            if engine is None:
                raise BadInput(f"target {brief(self.target)} is not a layout ckptconv writes")
            tensors = engine.to_target(tensors, self.target)
        return tensors, aliases
