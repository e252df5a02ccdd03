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
from .base import RunFacts, register
from .files import Written, copy_files
from .mesh import MeshWriter


def _links(shards: dict) -> dict:
    """{vLLM's name for each rank shard (a link to it): its digest} of a result's `shards`."""
    return {part_name(rank, part): digest for rank, files in shards.items() for part, (_, digest) in enumerate(files)}


@register("vllm")
class VllmWriter(MeshWriter):
    def write(self, units, tmp, progress=None, share=(0, 1)):
        result = super().write(units, tmp, progress, share)
        for rank, shards in result.shards.items():
            for part, (name, digest) in enumerate(shards):
                os.link(Path(tmp) / fmt.rank_dir(rank) / name, Path(tmp) / part_name(rank, part))
        result.linked = _links(result.shards)
        return result

    def accepts(self, result, units, tmp) -> str | None:
        """(see MeshWriter.accepts) and its links are its rank shards', named as vLLM names them."""
        why = super().accepts(result, units, tmp)
        if why is None and result.linked != _links(result.shards):
            return "its links are not its rank shards'"
        return why

    def known_digests(self, results) -> dict:
        """The links are the rank shards, hashed as they were written: SHA256SUMS lists them without
        reading 2 x the model again."""
        return {name: digest for r in results for name, digest in r.linked.items()}

    def finish(self, tmp, results) -> RunFacts:
        copy_files(tmp, self.content.model_files, Written(), self.content.edited, self.content.added)
        return super().finish(tmp, results)
