"""A corpus of hostile pickles and the containers ckptconv reads, to put them in.

Each attack, if it were run by `pickle.load`, would create the canary file (or import and call
something it must not). ckptconv must refuse every one with exit 2 and never create the canary.
"""
import io
import json
import pickle
import struct
import zipfile
from pathlib import Path


class Reduce:
    """An object whose pickle calls `func(*args)` on load: what an attacker writes."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _s(text: str) -> bytes:
    """A protocol-0 STRING argument line."""
    return b"S" + repr(text).encode() + b"\n"


def _u(text: str) -> bytes:
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b


def attacks(canary: Path) -> dict:
    touch = f"touch {canary}"
    code = f"open({str(canary)!r}, 'w').close()"
    nested = pickle.dumps(None).replace(b"N", b"cos\nsystem\n(" + _s(touch) + b"tR", 1)
    return {
        "os.system": b"cos\nsystem\n(" + _s(touch) + b"tR.",
        "posix.system": b"\x80\x02cposix\nsystem\nq\x00" + _s(touch) + b"\x85R.",
        "subprocess": b"csubprocess\ncall\n((" + _s("touch") + _s(str(canary)) + b"ltR.",
        "builtins.exec": b"cbuiltins\nexec\n(" + _s(code) + b"tR.",
        "builtins.eval": b"\x80\x04" + _u("builtins") + _u("eval") + b"\x93" + _u(code) + b"\x85R.",
        "getattr-chain": b"cbuiltins\ngetattr\n(cbuiltins\nglobals\n)R" + _s("exec") + b"tR(" + _s(code) + b"tR.",
        "importlib": b"cimportlib\nimport_module\n(" + _s("os") + b"tR.",
        "runpy": b"crunpy\n_run_code\n(" + _s(code) + b"}tR.",
        "marshal-function": b"ctypes\nFunctionType\n(cmarshal\nloads\n(C\x00tR}tR.",
        "nested-pickle.loads": b"\x80\x03cpickle\nloads\nC" + bytes([len(nested)]) + nested + b"\x85R.",
        "numpy-build-setattr": b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"
                               b"}(X\x09\x00\x00\x00__class__cos\nsystem\nub.",
        "memo-stack-global": b"\x80\x04" + _u("os") + b"\x94" + _u("system") + b"\x94h\x00h\x01\x93"
                             + _u(touch) + b"\x85R.",
        "inst-unknown-class": b"(" + _s(touch) + b"ios\nsystem\n.",
        "obj-unknown-class": b"(cos\nsystem\n" + _s(touch) + b"o.",
        "newobj_ex-allowlisted-function": b"\x80\x04ccollections\nOrderedDict\n)}\x92.",
        "ext-opcode": b"\x80\x02\x82\x01" + _s(touch) + b"\x85R.",
        "persid-unexpected": b"P" + b"os.system" + b"\n.",
        "binpersid-unexpected": b"\x80\x02(" + _s("module") + _s("os") + b"tQ.",
    }


# --- containers


def torch_zip(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def torch_legacy(pkl: bytes) -> bytes:
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    return magic + pickle.dumps(1001, protocol=2) + pickle.dumps({"little_endian": True}, protocol=2) + pkl


def write_container(kind: str, pkl: bytes, d: Path, dcp_template: Path = None) -> Path:
    """Put `pkl` where `kind` of checkpoint keeps a pickle; return the path to convert."""
    d.mkdir(parents=True, exist_ok=True)
    if kind == "torch-zip":
        (d / "evil.pt").write_bytes(torch_zip(pkl))
        return d / "evil.pt"
    if kind == "torch-legacy":
        (d / "evil.pt").write_bytes(torch_legacy(pkl))
        return d / "evil.pt"
    if kind == "grok":
        (d / "ckpt-0").mkdir()
        (d / "ckpt-0" / "tensor00000_000").write_bytes(pkl)
        return d / "ckpt-0"
    if kind == "dcp-metadata":
        (d / ".metadata").write_bytes(pkl)
        (d / "__0_0.distcp").write_bytes(b"")
        return d
    if kind == "dcp-bytes-item":
        import shutil
        shutil.copytree(dcp_template, d, dirs_exist_ok=True)
        md = pickle.loads((d / ".metadata").read_bytes())
        key = next(k for k in md.storage_data if k.fqn == "step")
        info = md.storage_data[key]
        info.relative_path, info.offset, info.length = "evil.distcp", 0, len(pkl)
        (d / "evil.distcp").write_bytes(pkl)
        (d / ".metadata").write_bytes(pickle.dumps(md))
        return d
    raise ValueError(kind)


CONTAINERS = ["torch-zip", "torch-legacy", "grok", "dcp-metadata", "dcp-bytes-item"]


# --- safetensors header abuse


def safetensors_file(header: dict, data: bytes, claimed_len=None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", claimed_len if claimed_len is not None else len(text)) + text + data
