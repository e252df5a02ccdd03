"""Stand-ins for the globals of a TorchScript archive's data.pkl (torch.jit.save).

Its module tree is pickled as `__torch__.<module path>.<Class>` objects made with NEWOBJ and given
their attributes by BUILD. Those classes exist only as TorchScript source in the archive's `code/`
entries, which torch compiles on load and this never reads as code: here an object is a
`ScriptObject`, its attributes as data. The `torch.jit._pickle` helpers tag lists and dicts with
their static types; the value itself is what is kept.
"""
from .unpickler import Function, StandIn

SCRIPT_MODULE = "__torch__"   # every TorchScript class lives below this module name


class ScriptObject:
    """An instance of a TorchScript class: its qualified name and the state BUILD gave it (a dict of
    attributes for a module; any value for a custom class)."""

    def __init__(self, qualname):
        self.qualname, self.state, self.built = qualname, {}, False

    def build(self, state, ctx):
        if self.built:
            raise ctx.bad(f"TorchScript object {self.qualname} is given its state twice")
        self.state, self.built = state, True

    def to_jsonable(self) -> dict:
        """In extras (an object inside a list attribute): its class only, never its state."""
        return {"__class__": self.qualname}


class ScriptClass(StandIn):
    """`__torch__.*`: instantiated (NEWOBJ with no arguments) as a `ScriptObject`, never called."""

    namespace = True

    def __init__(self, qualname=SCRIPT_MODULE + ".*"):
        self.qualname = qualname

    def named(self, qualname) -> "ScriptClass":
        return ScriptClass(qualname)

    def new(self, args, kwargs, ctx):
        if args != () or kwargs:
            raise ctx.bad(f"TorchScript class {self.qualname} instantiated with arguments")
        return ScriptObject(self.qualname)


def _typed_list(qualname):
    def build(ctx, items):
        if type(items) is not list:
            raise ctx.bad(f"{qualname} of a {type(items).__name__}, not a list")
        return items
    return Function(qualname, build)


def _restore_type_tag(ctx, value, type_text=None):
    if not isinstance(type_text, str):
        raise ctx.bad("torch.jit._pickle.restore_type_tag without a type name")
    return value


def _tensor_from_id(ctx, *args):
    raise ctx.bad("torch.jit._pickle.build_tensor_from_id: tensors kept in a separate table (a mobile "
                  "archive) are not supported")


def script_globals() -> dict:
    """What a TorchScript data.pkl adds to torch's allowlist."""
    out = {(SCRIPT_MODULE, "*"): ScriptClass()}
    for name in ("build_intlist", "build_tensorlist", "build_doublelist", "build_boollist"):
        out[("torch.jit._pickle", name)] = _typed_list(f"torch.jit._pickle.{name}")
    out[("torch.jit._pickle", "restore_type_tag")] = Function("torch.jit._pickle.restore_type_tag",
                                                              _restore_type_tag)
    out[("torch.jit._pickle", "build_tensor_from_id")] = Function("torch.jit._pickle.build_tensor_from_id",
                                                                  _tensor_from_id)
    return out
