"""A Ray node that has Ray and ckptconv's dependencies but not ckptconv (node_without_ckptconv.py), the
only node with CPUs of a local cluster (ray.cluster_utils; the head, where the driver runs, has none):
by default the run ships ckptconv with its tasks (runtime_env py_modules) and completes, byte-identical
to --workers 1; with CKPTCONV_RAY_SHIP=0 it stops at once with one line naming the node and what it
lacks; a runtime_env the user or the Ray Job gave is merged with the shipped package. `make test-ray`."""
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.helpers import ROOT  # noqa: E402
from tests.ray.test_ray import same_tree  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def node_python(tmp_path_factory):
    """A venv of this Python that sees this venv's site-packages (Ray, numpy, safetensors, ml_dtypes)
    as a plain path: Python reads no `.pth` file there, so the editable ckptconv is not installed in it."""
    venv = tmp_path_factory.mktemp("node-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    where = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                           capture_output=True, text=True).stdout.strip()
    Path(where, "test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    for code, ok in (("import ray, numpy, safetensors, ml_dtypes", True), ("import ckptconv", False)):
        r = subprocess.run([python, "-c", code], cwd=venv, capture_output=True, text=True)
        assert (r.returncode == 0) == ok, (code, r.stderr[-2000:])   # (the premise: Ray's there, ckptconv is not)
    return python


@pytest.fixture(scope="module")
def cluster(node_python):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    node = c.add_node(num_cpus=1, setup_worker_path=str(HERE / "node_without_ckptconv.py"),
                      env_vars={"CKPTCONV_TEST_NODE_PYTHON": str(node_python)})
    c.wait_for_nodes()
    yield c, node
    c.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.fixtures import models as fixtures
    return fixtures.make_hf_llama(tmp_path_factory.mktemp("llama"))


def cli(*args, cwd, env=None):
    """The command as a user runs it, from a directory of its own (not this checkout: Ray puts the
    driver's working directory on every worker's sys.path)."""
    env = {**os.environ, "RAY_ADDRESS": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckptconv.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def one(llama, tmp_path):
    out = tmp_path / "one"
    r = cli("convert", llama["dir"], out, "--max-shard-size", "60KB", "--quiet", "--workers", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return out


def test_the_package_is_shipped_with_the_tasks_by_default(cluster, llama, tmp_path):
    c, _ = cluster
    out = tmp_path / "ray"
    r = cli("convert", llama["dir"], out, "--max-shard-size", "60KB", "--quiet", f"--ray={c.address}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled parts" not in r.stderr, r.stderr   # (they load there: no note says they do not)
    same_tree(one(llama, tmp_path), out)
    r = cli("verify", out, "--against", llama["dir"], f"--ray={c.address}", cwd=tmp_path)
    assert r.returncode == 0 and "problem" not in r.stdout.lower(), r.stdout + r.stderr[-3000:]


def test_py_modules_carries_the_compiled_parts_and_the_node_loads_them(cluster, tmp_path):
    c, _ = cluster
    script = ("import sys, ray\nfrom ckptconv.run import ray_nodes\n"
              "ray.init(address=sys.argv[1], runtime_env=ray_nodes.runtime_env(None), log_to_driver=False)\n"
              "@ray.remote(num_cpus=1)\ndef where():\n"
              "    import ckptconv, ckptconv._sha256x, ckptconv._mapguard\n"
              "    return [ckptconv.__file__, ckptconv._sha256x.__file__, ckptconv._mapguard.__file__]\n"
              "print('\\n'.join(ray.get(where.remote())))\n")
    r = subprocess.run([sys.executable, "-c", script, c.address], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    package, *compiled = r.stdout.split()
    shipped = Path(package).parent
    assert "runtime_resources" in package and shipped != ROOT / "ckptconv", package   # (the node's copy)
    assert [Path(p).parent for p in compiled] == [shipped, shipped], compiled
    assert [Path(p).name.split(".")[0] for p in compiled] == ["_sha256x", "_mapguard"] and \
        all(p.endswith(".so") for p in compiled), compiled


def test_not_shipped_a_node_without_it_is_one_line_naming_the_node(cluster, llama, tmp_path):
    c, node = cluster
    out = tmp_path / "ray"
    r = cli("convert", llama["dir"], out, "--max-shard-size", "60KB", f"--ray={c.address}", cwd=tmp_path,
            env={"CKPTCONV_RAY_SHIP": "0"})
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: --ray"), r.stderr[-3000:]
    assert node.node_id in lines[0] and node.node_ip_address in lines[0], lines[0]
    assert "cannot import ckptconv (ModuleNotFoundError: No module named 'ckptconv')" in lines[0], lines[0]
    assert "lost" not in lines[0]
    assert not out.exists() and not (tmp_path / ".ray.ckptconv-tmp").exists()


def test_a_runtime_env_given_is_merged_with_the_shipped_package(cluster, llama, tmp_path):
    """--ray-runtime-env (as `ray job submit --runtime-env-json`), and a Ray Job's own runtime env (which
    Ray hands its entrypoint in RAY_JOB_CONFIG_JSON_ENV_VAR): their py_modules beside ckptconv's (the
    Job's not refused by Ray as a conflict with ray.init's); not shipped, the user's or the Job's own
    py_modules can be what brings ckptconv to the node."""
    c, _ = cluster
    extra = tmp_path / "extra"
    (extra / "ckptconv_test_extra").mkdir(parents=True)
    (extra / "ckptconv_test_extra" / "__init__.py").write_text("")
    given = json.dumps({"py_modules": [str(extra / "ckptconv_test_extra")], "env_vars": {"CKPTCONV_TEST_GIVEN": "1"}})
    job = {"py_modules": [str(extra / "ckptconv_test_extra")], "env_vars": {"CKPTCONV_TEST_JOB": "1"}}
    package = str(ROOT / "ckptconv")
    expected = one(llama, tmp_path)
    for name, args, env in (
            ("given", ["--ray-runtime-env", given], {}),
            ("both", ["--ray-runtime-env", given], {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": job})}),
            # not shipped: what the user's or the Job's own py_modules bring is what the node imports
            ("theirs", ["--ray-runtime-env", json.dumps({"py_modules": [package]})], {"CKPTCONV_RAY_SHIP": "0"}),
            ("job's", [], {"CKPTCONV_RAY_SHIP": "0", "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(
                {"runtime_env": {**job, "py_modules": [package]}})})):
        out = tmp_path / name
        r = cli("convert", llama["dir"], out, "--max-shard-size", "60KB", "--quiet", f"--ray={c.address}", *args,
                cwd=tmp_path, env=env)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        same_tree(expected, out)


@pytest.mark.parametrize("given, said", [({"pip": 3}, "runtime_env['pip'] must be of type str or List[str]"),
                                         ({"py_modules": ["/no/such/dir"]}, "/no/such/dir is not a valid path")])
def test_a_runtime_env_ray_refuses_is_one_line_without_its_env_values(cluster, llama, tmp_path, given, said):
    c, _ = cluster
    given = json.dumps({**given, "env_vars": {"AWS_SECRET_ACCESS_KEY": "hunter2hunter2"}})
    r = cli("convert", llama["dir"], tmp_path / "out", f"--ray={c.address}", "--ray-runtime-env", given, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "--ray-runtime-env: Ray refuses the runtime_env" in r.stderr and said in r.stderr, r.stderr
    assert "hunter2" not in r.stderr
    assert not (tmp_path / "out").exists()
