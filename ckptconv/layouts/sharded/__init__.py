"""The sharded safetensors directory (docs/output.md): shards filled in order up to the shard size and
named as huggingface_hub names them (`STEM.safetensors` alone, or `STEM-0000k-of-0000n.safetensors`
and `STEM.safetensors.index.json`), `manifest.json` with file and per-tensor SHA-256, a coreutils
`SHA256SUMS`, and the model files carried over; checked against those records (check.py), resumed
after a kill (resume.py)."""
import math

from ...formats.manifest import MANIFEST
from ...formats.mesh import MESH
from ...formats.sums import NAME as SUMS
from ...io.hashing import Pipeline
from ...storage import files as storage
from ..base import Content, Layout, RunFacts, WriteOptions, register
from ..files import Written, check_space, copy_files, finish_dir, plan_shards, write_shards
from ..scan import _listed, shard_sizes
from .check import verify_dir
from .resume import _keep_only, _plan_id, rehashes, reusable


@register("sharded")
class ShardedDirectory(Layout):
    order = 30

    def __init__(self, options: WriteOptions, content: Content, out=None, mesh=None):
        super().__init__(options, content, out)
        self.shards = []

    @classmethod
    def detect(cls, path) -> bool:
        path = storage.place(path)
        return path.is_dir() and not storage.exists(path / MESH) and any(
            storage.exists(path / n) for n in (MANIFEST, SUMS))

    @classmethod
    def check_units(cls, path) -> dict:
        """Its shards by bytes, its tensors by elements (what is on disk and valid), from one read of
        its metadata."""
        meta = _listed(storage.place(path))
        m_tensors = meta[1][4] or {}
        return {"shard": list(shard_sizes(storage.place(path), meta).items()),
                "tensor": [(n, math.prod(e.shape)) for n, e in m_tensors.items() if e is not None]}

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        """Against its own records; on several processes each hashes its share of the shards and
        process 0 does the rest."""
        mine = None if share is None or share.processes == 1 else \
            {f for f, _ in share.units.get("shard", ()) if share.mine("shard", f)}
        verify_dir(storage.place(path), report, progress, mine, structural=share is None or share.is_main, plain=True)

    def plan(self, tensors) -> list:
        self.shards = plan_shards(tensors, self.options.max_shard_size, self.options.stem)
        return self.shards

    def write(self, units, tmp, progress=None, share=(0, 1)):
        solo = share[1] == 1  # the journal (and --resume) belong to a run of one process
        reuse, note = Written(), None
        if solo and self.options.resume and self.content.identity:
            reuse, note = reusable(tmp, self.shards, self.content.identity)
            _keep_only(tmp, set(reuse.files))
        check_space(tmp, sum(s.size for s in units if s.name not in reuse.files)
                    + (self.content.added_bytes() if share[0] == 0 else 0), self.content.model_files if share[0] == 0 else ())
        journal = {"plan": _plan_id(self.shards), "source": self.content.identity} if solo and self.content.identity \
            else None
        pipeline = Pipeline()
        try:
            written = write_shards(tmp, units, pipeline, progress, self.options.fsync, reuse, journal,
                                   self.options.direct)
        finally:
            pipeline.close()
        return written.result(sum(v["size"] for v in reuse.files.values()), note)

    def rehashed(self, result, units, tmp) -> bool:
        """(see Layout.rehashed) Each shard read once (resume.rehashes)."""
        from ...storage.targets import as_target
        target = as_target(tmp)
        return rehashes(result, [(shard.name, shard, target) for shard in units])

    def finish(self, tmp, results) -> RunFacts:
        written, by_name = Written(), {}
        for r in results:
            by_name.update({name: r for name in r.files})
        for shard in self.shards:  # merged in plan order: the manifest is what one process writes
            r = by_name[shard.name]
            written.files[shard.name] = r.files[shard.name]
            written.digests[shard.name] = r.digests[shard.name]
        copy_files(tmp, self.content.model_files, written, self.content.edited, self.content.added)
        manifest = finish_dir(tmp, self.shards, written, {**self.content.source, **self.content.skipped()},
                              self.content.extras, self.content.manifest, self.options.stem)
        notes = [r.note for r in results if r.note]
        return RunFacts(sorted(manifest["files"]), sum(r.reused for r in results), notes[0] if notes else None)
