"""One safetensors file (`ckptconv convert model.ckpt model.safetensors`, the habit of diffusion and
LoRA users): `__metadata__` holds `"format": "pt"` and, under `ckptconv.manifest`, the manifest
facts as a JSON string (format tag, source, every tensor's SHA-256, extras), so that
`ckptconv verify FILE [--against SRC]` works on the file alone (docs/output.md).

The header comes first but the digests are known last: it is written with placeholder digests of
the same length, the data streams after it, and the header is rewritten in place at the end.
"""
import dataclasses
import json
import os

from ..formats import manifest as fmt
from ..formats.safetensors import header_size
from ..io.hashing import Pipeline
from ..io.outfile import pwrite_all
from .base import Content, RunFacts, WriteOptions, Writer, register
from .files import ShardFile, Written, check_space, write_shards


def metadata(content: Content, digests: dict) -> dict:
    facts = {"format": fmt.FORMAT, "source": content.source, "extras": content.extras,
             "tensors": {name: {"sha256": d} for name, d in digests.items()}, **content.manifest}
    return {"format": "pt", fmt.SINGLE_KEY: json.dumps(facts, sort_keys=True, separators=(",", ":"))}


@register("single")
class SingleWriter(Writer):
    single_file = True

    def __init__(self, options: WriteOptions, content: Content, out):
        super().__init__(options, content, out)
        self.file_name = os.path.basename(os.path.abspath(out))
        self.unit = None

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
        final = dataclasses.replace(unit, metadata=metadata(self.content, dict(written.by_tensor([unit]))))
        fd = os.open(os.path.join(tmp, unit.name), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            at = 0
            for piece in final.header():
                pwrite_all(fd, memoryview(piece), at)
                at += len(piece)
            if self.options.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return written.result()

    def finish(self, tmp, results) -> RunFacts:
        return RunFacts([self.file_name])
