"""verify: prove an output is intact and consistent, equal to its source, and loads onto devices.

Which layout an output is, and that layout's own check, are the layout's (layouts/: sharded/check.py,
single.py, mesh/check.py, vllm/check.py, foreign.py; the shared pieces report.py, scan.py,
shardcheck.py). Structural checks read every byte once: each shard is streamed from its mapping
while one thread digests the file and another digests each tensor's bytes (both cores), and every
finding becomes one line naming the file and the tensor. Reshard outputs are checked rank by rank,
then against mesh.json by assembling each global tensor lazily from the rank pieces (never in memory).

Here: job.py (the stages in order, on one process or several), against.py (--against: the source
read again and the recipe replayed), device.py (--device: every piece placed on its device).
"""
from ...layouts.report import KINDS, Problem, Report
from .against import compare_against
from .job import VerifyRequest, total_bytes, verify

__all__ = ["verify", "VerifyRequest", "total_bytes", "Report", "Problem", "KINDS", "compare_against"]
