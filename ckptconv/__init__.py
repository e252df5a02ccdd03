"""ckptconv: convert large-model checkpoints to safetensors, safely and streaming.

The Python API (docs/api.md): `convert`, `reshard`, `verify` and `inspect` take the command line's
options as keywords and return typed results; every expected failure is a `CkptError`.
"""
__version__ = "0.1.0"   # the one place the version is written (pyproject.toml reads it)

from .errors import BadInput, CkptError, OutputError, UnsafePickle, UsageError  # noqa: E402
# (the jobs behind them, with their typed options, are ckptconv.jobs.convert, .reshard, .verify)
from .api import (ConvertResult, Inspection, Problem, Report, ReshardResult, StorageOptions, convert, inspect,  # noqa: E402
                  reshard, verify)

__all__ = ["convert", "reshard", "verify", "inspect", "ConvertResult", "ReshardResult", "Report", "Problem", "Inspection",
           "StorageOptions", "CkptError", "BadInput", "UnsafePickle", "UsageError", "OutputError", "__version__"]
