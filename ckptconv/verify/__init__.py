"""verify: prove an output is intact and consistent, equal to its source, and loads onto devices.

Structural checks read every byte once: each shard is streamed from its mapping while one thread
digests the file and another digests each tensor's bytes (both cores), and every finding becomes one
line naming the file and the tensor. Reshard outputs are checked rank by rank, then against
mesh.json by assembling each global tensor lazily from the rank pieces (never in memory).

One module per job: report.py (what a finding is), scan.py (an output directory's entries and
metadata files), shards.py (one shard: header, the safetensors library's view, digests), output.py
(an output ckptconv wrote, against its own records), foreign.py (outputs it did not write), mesh.py
(reshard outputs), against.py (--against), job.py (the stages in order, on one process or several).
"""
from .against import compare_against
from .foreign import FOREIGN_NOTE
from .job import total_bytes, verify
from .mesh import verify_mesh, verify_mesh_tensors
from .output import verify_dir, verify_file
from .report import KINDS, Problem, Report

__all__ = ["verify", "total_bytes", "Report", "Problem", "KINDS", "FOREIGN_NOTE", "verify_dir", "verify_file",
           "verify_mesh", "verify_mesh_tensors", "compare_against"]
