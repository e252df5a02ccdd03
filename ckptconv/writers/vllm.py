"""vLLM's pre-sharded layout (`reshard --target vllm`): a reshard output (writers/mesh.py: rank
directories, mesh.json, manifests, SHA256SUMS, so verify and the mesh reader work on it) whose top
level is also what vLLM's `load_format="sharded_state"` reads: each rank's shard files as
`model-rank-{r}-part-{p}.safetensors` and the model files (config.json, generation config,
tokenizer). The rank files are hard links to the rank directories' shards: the same bytes, written
once. The tensors are vLLM's own (tp/vllm.py). Layout: docs/reshard.md#vllm.
"""
import os
from pathlib import Path

from ..formats import mesh as fmt
from ..tp.vllm import part_name
from .base import register
from .files import Written, copy_files
from .mesh import MeshWriter


@register("vllm")
class VllmWriter(MeshWriter):
    def write(self, units, tmp, progress=None, share=(0, 1)):
        result = super().write(units, tmp, progress, share)
        for unit in units:
            rank_dir = Path(tmp) / fmt.rank_dir(unit.rank)
            shards = sorted(n for n in os.listdir(rank_dir) if n.endswith(".safetensors"))
            for part, name in enumerate(shards):
                os.link(rank_dir / name, Path(tmp) / part_name(unit.rank, part))
        return result

    def finish(self, tmp, results) -> dict:
        copy_files(tmp, self.content.model_files, Written(), self.content.edited)
        return super().finish(tmp, results)
