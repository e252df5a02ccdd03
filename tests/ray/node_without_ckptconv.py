"""A Ray node whose Python has Ray and ckptconv's dependencies but not ckptconv: Ray's own worker set-up
(ray._private.workers.setup_worker, this node's `setup_worker_path`), except that the worker it starts
runs CKPTCONV_TEST_NODE_PYTHON (an environment of the node's raylet): a venv that sees the test venv's
site-packages as a plain path entry, so that its `.pth` files, the editable install of ckptconv among
them, are never read. A runtime_env's py_modules still reach the worker (PYTHONPATH), as on any node."""
import os
import runpy
import sys

from ray._private.runtime_env.context import RuntimeEnvContext

NODE_PYTHON = os.environ["CKPTCONV_TEST_NODE_PYTHON"]
_exec_worker = RuntimeEnvContext.exec_worker


def exec_worker(self, passthrough_args, language):
    if self.py_executable == sys.executable:   # (a runtime_env that brings its own Python keeps it)
        self.py_executable = NODE_PYTHON
    _exec_worker(self, passthrough_args, language)


RuntimeEnvContext.exec_worker = exec_worker
runpy.run_module("ray._private.workers.setup_worker", run_name="__main__")
