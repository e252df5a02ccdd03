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
