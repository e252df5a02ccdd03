"""What the allowlisting VM accepts: the globals that can run code (refused wherever they appear,
in every spelling), a format's allowlist with the modules it reads itself (`Allowlist.owned`), the
user's `--allow-global` additions (only ever adding records), and the globals of a file on no list
(`Unlisted`: inert records, counted; a refusal names them and the way out). docs/security.md lists
the lists.
"""

from ...errors import UnsafePickle, UsageError, printable

from .standins import InertClass, InertObject, Placeholder



# Modules and names that can run code, load more pickles or reach the system. A checkpoint that
# names one is an attack, not a format: refused wherever it appears, whatever --allow-global says.
CODE_MODULES = ("os", "posix", "nt", "subprocess", "sys", "importlib", "runpy", "marshal", "pickle", "_pickle",
                "cPickle", "types", "shutil", "socket", "ctypes", "code", "codeop", "pty", "commands", "popen2",
                "multiprocessing", "threading", "_thread", "asyncio", "signal", "webbrowser", "pdb", "timeit",
                "inspect", "gc", "io", "_io", "tempfile", "glob", "zipimport", "pkgutil", "doctest", "logging.config",
                "numpy.ctypeslib", "torch.fx", "torch.package", "_winapi", "ensurepip", "pandas.io.pickle")
CODE_NAMES = {(b, n) for b in ("builtins", "__builtin__") for n in (
    "eval", "exec", "execfile", "compile", "getattr", "setattr", "delattr", "__import__", "open", "file", "input",
    "raw_input", "globals", "locals", "vars", "breakpoint", "apply", "reload")} | {
    ("operator", "attrgetter"), ("operator", "methodcaller"), ("functools", "partial"), ("functools", "reduce"),
    ("numpy.testing._private.utils", "runstring"), ("numpy.testing.utils", "runstring"),
    ("numpy", "load"), ("numpy.lib.npyio", "load"), ("numpy", "fromfile"), ("numpy", "memmap"),
    ("torch", "load"), ("torch.serialization", "load"), ("torch.jit", "load"), ("torch", "_load_global_deps"),
    ("operator", "call"), ("_operator", "call"), ("uuid", "_get_command_stdout"), ("platform", "_syscmd_file"),
    ("pandas", "read_pickle"), ("sympy", "sympify"), ("numexpr", "evaluate"),
    ("torch.jit", "_load_for_lite_interpreter")}


# Reached through other spellings too: a dotted name (protocol 4 resolves `pathlib` + `os.system`),
# a C twin (`_operator`, `_posixsubprocess`) or a Python 2 name; so every part of the dotted path is
# looked at, leading underscores dropped.
CODE_PARTS = {m.lstrip("_").lower() for m in CODE_MODULES} | {
    "posixsubprocess", "imp", "frozen_importlib", "frozen_importlib_external", "thread", "stringio", "cstringio",
    "urllib", "urllib2", "http", "httplib", "ftplib", "smtplib", "telnetlib", "pydoc", "cprofile", "profile",
    "hub", "cpp_extension", "f2py", "distutils", "setuptools", "pip", "site", "builtins", "__builtin__"}
CODE_LAST = {n for _, n in CODE_NAMES if n != "call"} | {
    "system", "popen", "spawn", "fork_exec", "load_inline", "urlopen", "locate", "exit", "quit", "loads", "attrgetter",
    "methodcaller", "partial", "read_pickle", "sympify", "_load_for_lite_interpreter", "run_docstring_examples",
    "load_library", "_forward_from_src", "reduce_graph_module"}
SAFE_BUILTINS = {"set", "frozenset", "bytearray", "object", "list", "dict", "tuple", "int", "long", "float", "str",
                 "unicode", "bytes", "bool"}
# In-memory files of io: plain containers of bytes or text, read as inert records (standins.BENIGN);
# every other name of io and _io (open, FileIO, ...) reaches the system.
SAFE_IO = {(m, n) for m in ("io", "_io") for n in ("BytesIO", "StringIO")}
_CODE_BARE = {_p.strip("_").lower() for _p in CODE_PARTS}
_LAST_BARE = {_p.strip("_").lower() for _p in CODE_LAST}


def _bare(part: str) -> str:
    """A dotted path's part as the code-running lists spell it: underscores around it dropped
    (`__builtin__` is `builtin`, `_posixsubprocess` is `posixsubprocess`), lower case."""
    return part.strip("_").lower()


def runs_code(module: str, name: str) -> bool:
    """Whether `module.name` can run code or reach the system, in any spelling: Python 2's names,
    C twins, a dotted path through a module attribute (`pathlib.os.system`)."""
    if (module, name) in SAFE_IO:
        return False
    if (module, name) in CODE_NAMES or any(module == m or module.startswith(m + ".") for m in CODE_MODULES):
        return True
    parts = [_bare(p) for p in f"{module}.{name}".split(".")]
    if parts[0] in ("builtin", "builtins"):   # builtins: only the plain types below
        return len(parts) != 2 or parts[1] not in SAFE_BUILTINS
    return any(p in _CODE_BARE for p in parts) or parts[-1] in _LAST_BARE or "." in name


class Unlisted:
    """Globals of one file that are on no allowlist (and run no code): each becomes a `Placeholder`,
    an inert class whose instances are records naming it (never imported or called), and is counted
    here with its first offset. Records are data wherever they are, kept or dropped; only what a
    global of a module the format reads itself builds (`owned`: a tensor kind ckptconv does not
    read) refuses the run when it is to be written (`refusal`)."""

    SHOWN = 8   # globals named in the refusal

    def __init__(self, path):
        self.path, self.found = path, {}   # qualname -> [count, first offset]
        self.owned = set()                 # those in a module the format reads itself (Allowlist.owned)

    def placeholder(self, qualname: str, offset: int, owned: bool = False) -> "Placeholder":
        entry = self.found.setdefault(qualname, [0, offset])
        entry[0] += 1
        if owned:
            self.owned.add(qualname)
        return Placeholder(qualname, self, owned)

    def refusal(self) -> UnsafePickle:
        """One line naming the globals of a module the format reads itself (count, first offset),
        none of which ckptconv reads; without such a global, every one with the `--allow-global`
        patterns that admit it and nothing that runs code."""
        names = sorted(self.found, key=lambda q: self.found[q][1])
        owned = [q for q in names if q in self.owned]
        shown = owned or names
        listed = ", ".join(f"{q} (x{self.found[q][0]}, first at pickle offset {self.found[q][1]})"
                           for q in shown[:self.SHOWN])
        more = f" and {len(shown) - self.SHOWN} more" if len(shown) > self.SHOWN else ""
        if owned:
            return UnsafePickle(f"{self.path}: refused: {printable(listed, 1000)}{more} in the state to be written: "
                                f"{printable(owned[0], 200)} is part of the format but builds something ckptconv "
                                "does not read; nothing was executed. Leave that state out (--state-dict, --only)")
        return UnsafePickle(f"{self.path}: refused: {len(names)} global(s) in the state to be written are not on "
                            f"the allowlist: {printable(listed, 1000)}{more}; nothing was executed. To keep them as "
                            f"inert data (never imported or called): {printable(hint(names), 300)}; or leave that "
                            "state out (--state-dict, --only)")

    def listing(self) -> list:
        """Every such global of the file, with how often the file names it: for the summary and the
        manifest's `source.placeholders`."""
        return listing([self])


def listing(unlisted) -> list:
    """The globals several files (`Unlisted`s) record as inert data, each once, with how often they
    name it in all (a class every rank file of a checkpoint pickles is one line, not one per rank)."""
    counts = {}
    for u in unlisted:
        for q, (c, _) in u.found.items():
            counts[q] = counts.get(q, 0) + c
    return [{"global": q, "count": c} for q, c in sorted(counts.items())]


def hint(qualnames) -> str:
    """`--allow-global` arguments that admit these globals and nothing that can run code: a module's
    pattern where that module is not a code-running one, else the exact names."""
    shown = []
    for q in qualnames:
        if not all(part.isidentifier() and part.isascii() for part in q.split(".")):
            continue   # (never a command to paste: a name with quotes or spaces is not suggested)
        top = q.split(".", 1)[0]
        broad = runs_code(top, "x") or any(m == top or m.startswith(top + ".") for m, _ in CODE_NAMES) \
            or any(m.startswith(top + ".") for m in CODE_MODULES)   # (a pattern there would cover one of them)
        pattern = q if broad else f"{top}.*"
        if pattern not in shown:
            shown.append(pattern)
    return " ".join(f"--allow-global '{p}'" for p in shown[:4]) or "--allow-global MODULE.NAME"


def unread_in(value):
    """The Placeholder of the first record `value` reaches (through containers, records and keys)
    that a global of the format's own modules built (`InertObject.unread`), or None; each object
    is looked at once."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if isinstance(v, InertObject) and v.unread:
            return v.placeholder
        if id(v) in seen or not isinstance(v, (dict, list, tuple, set, frozenset, InertObject)):
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, InertObject):
            todo.extend(v.args)
            todo.extend(v.state.keys())
            todo.extend(v.state.values())
            if isinstance(v.items, dict):
                todo.extend(v.items.keys())
                todo.extend(v.items.values())
            elif v.items is not None:
                todo.extend(v.items)
        else:
            todo.extend(v)
    return None


def record_parts(obj: InertObject) -> list:
    """A record's parts as (key, value), in the order they are written and named: its constructor
    arguments (`args`), a dict subclass's items under their own keys or a list subclass's under
    `__items__`, then the attributes BUILD gave it. Keys are pickled objects (`key_text` names them)."""
    parts = [("args", obj.args)] if obj.args else []
    if isinstance(obj.items, dict):
        parts.extend(obj.items.items())
    elif obj.items is not None:
        parts.append(("__items__", obj.items))
    parts.extend(obj.state.items())
    return parts


def allow_globals(names) -> dict:
    """`--allow-global MODULE.NAME` or `MODULE.*` (the module and those below it): accept these
    classes as inert records, never imported or called. A name or pattern that would admit a
    code-running global (in any spelling: `runs_code`) is refused here; a pattern is checked again
    for each global it meets."""
    out = {}
    for name in names or ():
        module, _, attr = name.rpartition(".")
        if not module or not attr or "*" in module or ("*" in attr and attr != "*") or "" in module.split(".") \
                or len(name) > 1000:
            raise UsageError(f"--allow-global {printable(name, 200)!r}: expected MODULE.NAME or MODULE.*")
        if runs_code(module, "x" if attr == "*" else attr):
            raise UsageError(f"--allow-global {printable(name, 200)!r}: "
                             + ("that module's globals can run code or reach the system" if attr == "*" else
                                "that global can run code or reach the system")
                             + "; it is refused whatever --allow-global says")
        out[(module, attr)] = InertClass(name)
    return out


class Allowlist(dict):
    """A format's stand-ins by (module, name), with the modules the format reads itself (`owned`:
    `torch._utils`, `numpy.core.multiarray` …: there a global builds a tensor or array, so a user's
    pattern never turns one ckptconv does not know into a record), and the user's `--allow-global`
    additions, which never replace a stand-in (`allowing`)."""

    def __init__(self, standins=(), owned=()):
        super().__init__(standins)
        self.owned = frozenset(owned)


def allowing(standins: dict, names, owned=()) -> Allowlist:
    """The format's `standins`, and `--allow-global names` only where no stand-in is (an exact name
    with one is what ckptconv reads already). A name in an `owned` module is a usage error."""
    allow = Allowlist(standins, owned)
    for (module, attr), cls in allow_globals(names).items():
        if attr != "*" and module in allow.owned and (module, attr) not in standins:
            raise UsageError(f"--allow-global {cls.qualname!r}: {module} is part of the format, read by ckptconv "
                             "itself (it builds tensors); --allow-global only adds classes no reader handles")
        allow.setdefault((module, attr), cls)
    return allow
