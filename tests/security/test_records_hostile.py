"""Hostile records (issue 30): every class on no allowlist is now built as an inert record wherever it
sits, with the items SETITEMS/APPENDS give a dict or list subclass and the state BUILD gives it. What
a file can make of that stays data, bounded by its bytes: one line and exit 2 otherwise, nothing
executed, nothing left beside OUT."""
import struct

from tests.helpers import assert_clean, cli, run
from tests.security.test_trust import _u, torch_file


def refused(r, out, *fragments):
    """In-process run refused: exit 2, one `ckptconv: error:` line naming every fragment, no OUT."""
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("ckptconv: error: "), r.stderr
    assert_clean(r.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out.exists() and not (out.parent / f".{out.name}.ckptconv-tmp").exists()


def _record(cls="__main__\nThing\n") -> bytes:
    """NEWOBJ of a class on no allowlist, with no arguments."""
    return b"c" + cls.encode() + b")\x81"


def test_a_record_is_a_dict_or_a_list_never_both(tmp_path):
    src = torch_file(tmp_path / "m.pt", _u("r") + _record() + b"(" + _u("k") + b"K\x01u" + b"(K\x02e")
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "m.pt", "APPENDS on a __main__.Thing that holds "
            "dict items", "offset")


def test_a_record_cannot_forge_its_class_name(tmp_path):
    """A BUILD state naming `__class__` would make a record claim another class in the manifest."""
    src = torch_file(tmp_path / "m.pt", _u("r") + _record() + b"}(" + _u("__class__") + _u("torch.Tensor") + b"ub")
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "m.pt", "a __main__.Thing record, has two parts "
            "named '__class__'")
    assert run("convert", src, tmp_path / "out", "--only", "w").exit_code == 0   # left out: data like any other


def test_dict_subclass_keys_chosen_to_collide_are_refused(tmp_path):
    keys = b"".join(b"\x8a\x10" + ((2**61 - 1) * (i + 1)).to_bytes(16, "little", signed=True) + b"N"
                    for i in range(1000))
    src = torch_file(tmp_path / "m.pt", _u("r") + _record() + b"(" + keys + b"u")
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "beyond the 2**61 - 1")


def test_a_shared_state_copied_into_many_records_is_bounded_by_the_budget(tmp_path):
    """One memoized dict of 20,000 entries given by BUILD to 2,000 records: 40 M copies from a file of
    200 KB. Each BUILD copies (and is charged for) the state it is given."""
    shared = b"}(" + b"".join(b"J" + struct.pack("<i", i) + b"N" for i in range(20000)) + b"uq\x00"
    src = torch_file(tmp_path / "m.pt", _u("big") + shared + _u("recs") + b"(" + (_record() + b"h\x00b") * 2000 + b"l")
    out = tmp_path / "out"
    r = cli("convert", src, out, timeout=60)
    assert r.returncode == 2 and "copies of shared objects" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()


def test_reconstructor_bases_are_object_dict_or_list(tmp_path):
    body = _u("r") + b"ccopyreg\n_reconstructor\n(c__main__\nThing\nc__builtin__\nset\nNtR"
    refused(run("convert", torch_file(tmp_path / "a.pt", body), tmp_path / "out"), tmp_path / "out",
            "copyreg._reconstructor of __main__.Thing on the base builtins.set")
    body = _u("r") + b"ccopyreg\n_reconstructor\n(c__main__\nThing\nc__builtin__\ndict\n]tR"
    refused(run("convert", torch_file(tmp_path / "b.pt", body), tmp_path / "out"), tmp_path / "out",
            "the dict subclass __main__.Thing with a list")


def test_what_the_format_builds_and_ckptconv_does_not_read_is_never_a_key(tmp_path):
    """A record built by a global of torch's own modules (a tensor kind ckptconv does not read) as a
    dict key would become a name and lose the tensor: refused wherever it is."""
    key = b"ctorch._utils\n_rebuild_wrapper_subclass\n)R"
    src = torch_file(tmp_path / "m.pt", _u("state_dict") + b"}" + _u("v") + b"K\x01s" + _u("x") + b"}" + key
                     + b"K\x01s")
    refused(run("convert", src, tmp_path / "out"), tmp_path / "out", "torch._utils._rebuild_wrapper_subclass",
            "part of the format")


def test_a_class_used_as_a_key_is_named_and_inert(tmp_path):
    """SD 1.x's spelling, by hand: the class itself is the key; nothing of it is called."""
    src = torch_file(tmp_path / "m.pt", _u("callbacks") + b"}c__main__\nModelCheckpoint\n}" + _u("dirpath")
                     + _u("/ckpts") + b"ss")
    out = tmp_path / "out"
    r = run("convert", src, out)
    assert r.exit_code == 0, r.stderr
    assert "__main__.ModelCheckpoint (x1)" in r.stdout
    import json
    assert json.loads((out / "manifest.json").read_text())["extras"] == {
        "callbacks.__main__.ModelCheckpoint.dirpath": "/ckpts"}
