"""One safetensors file (`ckptconv convert model.ckpt model.safetensors`, the habit of diffusion and
LoRA users): `__metadata__` holds `"format": "pt"` and, under `ckptconv.manifest`, the manifest
facts as a JSON string (format tag, source, every tensor's SHA-256, extras), so that
`ckptconv verify FILE [--against SRC]` works on the file alone (docs/output.md). A .safetensors
file ckptconv did not write is checked here too, as far as a file without records can be.

The header comes first but the digests are known last: it is written with placeholder digests of
the same length, the data streams after it, and the header is rewritten in place at the end.
"""
import dataclasses
import json

from ..errors import BadInput, brief
from ..formats import manifest as fmt
from ..formats.safetensors import header_size, file_header
from ..io.hashing import Pipeline
from ..storage import files as storage
from ..storage.targets import as_target
from .base import Content, Layout, RunFacts, WriteOptions, register
from .files import ShardFile, Written, check_space, write_shards
from .foreign import _verify_foreign_files
from .report import _detail
from .shardcheck import _hash_shard, _library_view, _our_view


def metadata(content: Content, digests: dict) -> dict:
    facts = {"format": fmt.FORMAT, "source": content.source, "extras": content.extras,
             "tensors": {name: {"sha256": d} for name, d in digests.items()}, **content.manifest}
    return {"format": "pt", fmt.SINGLE_KEY: json.dumps(facts, sort_keys=True, separators=(",", ":"))}


@register("single")
class SingleFile(Layout):
    single_file = True
    order = 10

    def __init__(self, options: WriteOptions, content: Content, out, mesh=None):
        super().__init__(options, content, out)
        self.file_name = storage.name(out)
        self.unit = None

    @classmethod
    def detect(cls, path) -> bool:
        path = storage.place(path)
        return path.name.endswith(".safetensors") and path.is_file()

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        check_file(storage.place(path), report, progress)

    def plan(self, tensors) -> list:
        placeholder = metadata(self.content, {t.name: "0" * 64 for t in tensors})  # real digests: the same length
        size = header_size(((t.name, t.dtype, t.shape, t.nbytes) for t in tensors), placeholder)
        self.unit = ShardFile(self.file_name, list(tensors), size, sum(t.nbytes for t in tensors), placeholder)
        return [self.unit]

    def write(self, units, tmp, progress=None, share=(0, 1)):
        if not units:
            return Written().result()
        unit = units[0]
        check_space(tmp, unit.size)
        pipeline = Pipeline()
        try:
            written = write_shards(tmp, [unit], pipeline, progress, self.options.fsync, direct=self.options.direct)
        finally:
            pipeline.close()
        # the same header with the real digests (of the same length: header_pieces checks it), in place
        # (in a store: in the first part, held until the object is published: storage/writer.PointerWriter)
        final = dataclasses.replace(unit, metadata=metadata(self.content, dict(written.by_tensor([unit]))))
        as_target(tmp).patch(unit.name, 0, final.header(), self.options.fsync)
        return written.result()

    def finish(self, tmp, results) -> RunFacts:
        return RunFacts([self.file_name])


def check_file(path, report, progress=None):
    """A single-file output: its header, the safetensors library's view, `format: pt`, and every
    tensor's digest against the manifest facts in its `__metadata__` (a file cannot hold its own
    digest; `sha256sum` it apart)."""
    try:
        m = storage.open_file(path)
        header = file_header(m, path)
        raw = fmt.single_document(header.metadata, path)
    except BadInput as e:
        report.add(path, _detail(e, path), "metadata")
        return
    if raw is None:
        _verify_foreign_files(path, [path], {}, report)
        return
    for p in header.problems:
        report.add(path, p, "metadata")
    if header.problems:
        return
    _library_view(path, _our_view(header), report)
    if header.metadata.get("format") != "pt":
        report.add(path, f"__metadata__ format is {brief(header.metadata.get('format'))}, not 'pt'", "metadata")
    added = sorted(set(header.metadata) - {"format", fmt.SINGLE_KEY})
    if added:
        report.add(path, f"__metadata__ holds {', '.join(brief(k, 60) for k in added[:8])}, which ckptconv "
                         "does not write", "metadata")
    tensors, problems = fmt.check_single(raw)
    for p in problems:
        report.add(path, f"__metadata__ {fmt.SINGLE_KEY!r}: {p}", "metadata")
    present = {e.name for e in header.entries}
    for name in tensors:
        if name not in present:
            report.add(path, f"tensor {name!r} is in the manifest but not in the file", "missing", tensor=name)
    for name in sorted(present - set(tensors)):
        report.add(path, f"tensor {name!r} is in the file but missing from the manifest", "unlisted", tensor=name)
    _hash_shard(m, header, path.name, None, tensors.get, {}, report,
                progress)
    report.files += 1
    report.tensors += len(present)
