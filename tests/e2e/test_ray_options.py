"""--ray's options where Ray is not installed (the main venv; the Ray executor itself is tested by
`make test-ray`, tests/ray/): one line saying how to get it, before anything is read or written;
--ray with --workers or --distributed is refused."""
import importlib.util

import pytest

from tests.helpers import run


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
@pytest.mark.parametrize("args", [["convert", "SRC", "OUT", "--ray"], ["reshard", "SRC", "OUT", "--tp", "2", "--ray=h:1"],
                                  ["verify", "SRC", "--ray"]])
def test_ray_missing_is_one_line_before_anything_is_read(tmp_path, args):
    args = [tmp_path / "nothing-here" if a == "SRC" else tmp_path / "out" if a == "OUT" else a for a in args]
    r = run(*args)
    assert r.exit_code == 2 and r.stderr == "ckptconv: error: --ray needs Ray: pip install 'ckptconv[ray]'\n", r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, said", [(["--workers", "2"], "--workers sets this host's tasks"),
                                         (["--distributed"], "runs in one driver now")])
def test_ray_with_workers_or_distributed_is_refused(hf_llama, tmp_path, extra, said):
    r = run("convert", hf_llama["dir"], tmp_path / "out", *extra, "--ray=127.0.0.1:1")
    assert r.exit_code == 2 and said in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_the_api_takes_ray_as_the_command_line_does(hf_llama, tmp_path):
    from ckptconv import api
    from ckptconv.errors import UsageError
    with pytest.raises(UsageError, match="--workers sets this host's tasks"):
        api.convert(hf_llama["dir"], tmp_path / "out", ray=True, workers=2)
    with pytest.raises(UsageError, match="ray: expected an address, True or None, not int"):
        api.verify(tmp_path, ray=3)
    if importlib.util.find_spec("ray") is None:
        for call in (lambda: api.convert(hf_llama["dir"], tmp_path / "out", ray="127.0.0.1:1"),
                     lambda: api.reshard(hf_llama["dir"], tmp_path / "out", 2, ray=True),
                     lambda: api.verify(tmp_path, ray=True)):
            with pytest.raises(UsageError, match=r"--ray needs Ray: pip install 'ckptconv\[ray\]'"):
                call()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("address", ["http://admin:hunter2@127.0.0.1:1", "127.0.0.1:1?token=hunter2#frag",
                                     "ray://127.0.0.1:1/?sig=hunter2", "127.0.0.1:1#hunter2", "ray://:@127.0.0.1:1",
                                     "http://u:p@127.0.0.1:1"])
def test_a_credential_in_the_ray_address_is_never_shown(address):
    """--ray ADDRESS (or RAY_ADDRESS) as the lines about it show it, and Ray's own message about it."""
    from ckptconv.run.ray_executor import shown
    assert "hunter2" not in shown(address) and "127.0.0.1:1" in shown(address)
    said = shown(address, f"Failed to connect to {address}")
    assert "hunter2" not in said and "Failed to connect to" in said and "127.0.0.1:1" in said
    assert shown(address, "http: refused; unknown user") == "'http: refused; unknown user'"   # (short parts garble nothing)


@pytest.mark.parametrize("given, said", [("{", "--ray-runtime-env: its value is not valid JSON"),
                                         ("[1]", "--ray-runtime-env: expected a JSON object (Ray's runtime_env), not list")])
def test_a_ray_runtime_env_that_is_not_a_json_object_is_one_line(hf_llama, tmp_path, given, said):
    r = run("convert", hf_llama["dir"], tmp_path / "out", "--ray=127.0.0.1:1", "--ray-runtime-env", given)
    assert r.exit_code == 2 and said in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_ray_runtime_env_without_ray_is_refused(hf_llama, tmp_path):
    r = run("convert", hf_llama["dir"], tmp_path / "out", "--ray-runtime-env", "{}")
    assert r.exit_code == 2 and "--ray-runtime-env is the runtime_env of --ray's tasks: give --ray too" in r.stderr
    assert not (tmp_path / "out").exists()


def test_the_runtime_env_merges_the_jobs_the_users_and_the_package():
    """ray_nodes.runtime_env: the Ray Job's runtime_env, --ray-runtime-env over it field by field
    (env_vars by variable), the py_modules of both, then ckptconv's own package directory."""
    from pathlib import Path
    import ckptconv
    from ckptconv.run import ray_nodes
    package = str(Path(ckptconv.__file__).resolve().parent)
    assert ray_nodes.package_dir() == package
    job = {"py_modules": ["gcs://_ray_pkg_job.zip"], "env_vars": {"A": "job", "B": "job"}, "pip": ["x"]}
    given = {"py_modules": ["/mine"], "env_vars": {"B": "mine", "C": "mine"}, "pip": ["y"], "working_dir": "/w"}
    assert ray_nodes.runtime_env(given, job) == {
        "py_modules": ["gcs://_ray_pkg_job.zip", "/mine", package], "env_vars": {"A": "job", "B": "mine", "C": "mine"},
        "pip": ["y"], "working_dir": "/w"}
    assert ray_nodes.runtime_env(given, job, ship=False)["py_modules"] == ["gcs://_ray_pkg_job.zip", "/mine"]
    assert ray_nodes.runtime_env(None) == {"py_modules": [package]}
    assert ray_nodes.runtime_env(None, ship=False) == {}
    assert ray_nodes.runtime_env({"py_modules": [package]}) == {"py_modules": [package]}   # (once)
    assert job == {"py_modules": ["gcs://_ray_pkg_job.zip"], "env_vars": {"A": "job", "B": "job"}, "pip": ["x"]}


@pytest.mark.parametrize("value, ships", [(None, True), ("1", True), ("0", False), ("false", False), ("off", False)])
def test_ckptconv_ray_ship_turns_shipping_off(monkeypatch, value, ships):
    from ckptconv.run import ray_nodes
    if value is None:
        monkeypatch.delenv("CKPTCONV_RAY_SHIP", raising=False)
    else:
        monkeypatch.setenv("CKPTCONV_RAY_SHIP", value)
    assert ray_nodes.shipped() is ships


def test_a_nodes_report_names_what_it_cannot_import_and_the_verdict_is_one_line():
    """ray_nodes.node_report as a node runs it (here: in this process), and the line or notes the
    driver makes of the reports."""
    from ckptconv.run import ray_nodes
    r = ray_nodes.node_report(["json", "ckptconv_no_such_module"], ["ckptconv_no_such_ext"])
    assert r["missing"] == [["ckptconv_no_such_module", "ModuleNotFoundError: No module named 'ckptconv_no_such_module'"]]
    assert r["unloaded"] == []   # (only asked once everything needed imports)
    r = ray_nodes.node_report(["json"], ["ckptconv_no_such_ext"])
    assert r["missing"] == [] and r["unloaded"][0][0] == "ckptconv_no_such_ext"
    node = {"NodeManagerAddress": "10.0.0.7", "NodeID": "ab12"}
    good = {"missing": [], "unloaded": [], "version": "0.1.0", "platform": "linux x86_64 cpython-311"}
    lacks = {**good, "missing": [["numpy", "ModuleNotFoundError: No module named 'numpy'"]], "version": None}
    line, notes = ray_nodes.verdict([({"NodeID": "0"}, good), (node, lacks), (node, lacks)], "0.1.0", ship=True)
    assert line.startswith("node 10.0.0.7 (node id ab12) cannot import numpy (ModuleNotFoundError: No module named "
                           "'numpy') (and 1 other node alike): install it on every node") and notes == [], line
    old = {**good, "version": "0.0.9"}
    line, _ = ray_nodes.verdict([(node, old)], "0.1.0", ship=False)
    assert line.startswith("node 10.0.0.7 (node id ab12) has ckptconv 0.0.9 where the driver has 0.1.0"), line
    assert ray_nodes.verdict([(node, old)], "0.1.0", ship=True) == (None, [])   # (shipped: the driver's runs there)
    other = {**good, "unloaded": [["ckptconv._sha256x", "ImportError: wrong ELF class"]], "platform": "linux aarch64"}
    line, notes = ray_nodes.verdict([(node, other)], "0.1.0", ship=True)
    assert line is None and len(notes) == 1 and notes[0].startswith(
        "node 10.0.0.7 (node id ab12): ckptconv's compiled parts (_sha256x) do not load there (ImportError: wrong "
        "ELF class; its platform linux aarch64, the driver's "), notes
