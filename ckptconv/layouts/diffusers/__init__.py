"""A diffusers pipeline, converted component by component (docs/output.md, "Pipelines"):

    OUT/
      model_index.json             carried byte for byte, as every file beside it
      unet/                        a component with weights: the output directory `ckptconv convert
        config.json                SRC/unet` writes (shards named as its consumer loads them: the stem
        diffusion_pytorch_model.safetensors   and variant of the source's; an index when several), less
        manifest.json              its SHA256SUMS: the top level's lists its files (diffusers, loading
                                   a variant, splits every file name of a component folder at a dot)
      scheduler/  tokenizer/ …     a component without weights: its files, carried
      manifest.json                {"format": "ckptconv.pipeline/1", "source", "components", "files"}
      SHA256SUMS                   every file of the tree, `FOLDER/FILE` for a component's: `sha256sum -c` passes in OUT

The units are the components' shard files (`unet/diffusion_pytorch_model.safetensors`), shared out by
bytes like a sharded output's and written through the same stream; process 0 then writes each
component's index and manifest (files.finish_dir), the folders carried whole, the files
beside them, and last the top-level manifest and SHA256SUMS over the whole tree (check.py reads it all
back; --resume re-hashes each component's finished shards against its own journal).
"""
import dataclasses

from ...formats.manifest import MANIFEST
from ...formats.mesh import MESH, read_regular
from ...formats.pipeline import FILES, MODEL_INDEX, WEIGHTS, document, read_document
from ...formats.sums import NAME as SUMS, write_sums
from ...io.hashing import Pipeline
from ...errors import BadInput
from ..base import Content, Layout, OutputPart, RunFacts, WriteOptions, register
from ..files import Written, check_space, copy_files, finish_dir, plan_shards, write_json, write_shards
from ...storage import files as storage
from ...storage.targets import as_target
from ..sharded import ShardedDirectory
from ..sharded.resume import _keep_only, _plan_id, rehashes, reusable
from .check import check_component, check_units, component_of, verify_pipeline

FRESH = "no interrupted run of this output to resume; started afresh"


@register("diffusers")
class PipelineDirectory(Layout):
    order = 25   # (before `sharded`: its top level holds a manifest.json too)
    reader = "diffusers"

    def __init__(self, options: WriteOptions, content: Content, out=None, mesh=None):
        super().__init__(options, content, out)
        self.shards = {}   # component -> its ShardFiles, named inside its folder

    # -- reading an output back ----------------------------------------------------------------------

    @classmethod
    def detect(cls, path) -> bool:
        path = storage.place(path)
        return path.is_dir() and not storage.exists(path / MESH) and storage.exists(path / MODEL_INDEX) and any(
            storage.exists(path / n) for n in (MANIFEST, SUMS))

    @classmethod
    def check_units(cls, path) -> dict:
        """Every component's shards by bytes and tensors by elements, as `FOLDER/NAME`."""
        return check_units(storage.place(path), ShardedDirectory)

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        mine = None if share is None or share.processes == 1 else share.mine
        verify_pipeline(storage.place(path), report, progress, mine, structural=share is None or share.is_main)

    @classmethod
    def parts(cls, path) -> list:
        """The top level and every component folder, as the top-level manifest records them: a folder of
        weights is read back as a sharded output; the files carried (a folder's whole, or beside the
        folders, less the --with files) with their digests."""
        path = storage.place(path)
        try:
            doc, _ = read_document(read_regular(path / MANIFEST), path / MANIFEST)
        except BadInput:
            doc = None
        if doc is None:
            return []
        added = doc.source.get("with") if isinstance(doc.source.get("with"), list) else []
        by_folder = {}
        for name, info in doc.files.items():
            folder, _, file = name.rpartition("/")
            by_folder.setdefault(folder, {})[file] = info["sha256"]
        top = {n: d for n, d in by_folder.get("", {}).items() if n not in added}
        return [OutputPart("", None, top)] + [
            OutputPart(name, ShardedDirectory if kind == WEIGHTS else None,
                       {} if kind == WEIGHTS else by_folder.get(name, {}))
            for name, kind in doc.components.items()]

    # -- writing -------------------------------------------------------------------------------------

    def pointer(self, units) -> str:
        """model_index.json, what diffusers opens first (carried from the source; manifest.json
        when the source has none to carry)."""
        return MODEL_INDEX if any(rel == MODEL_INDEX for rel, _ in self.content.model_files) else MANIFEST

    def plan(self, tensors=None) -> list:
        """Each component's shards, planned as a sharded output plans its own (`tensors`, their
        concatenation, is not needed: every part carries its own), named inside its folder."""
        units = []
        for part in self.content.parts:
            if not part.weights:
                continue
            stem = part.stem if part.variant is None else f"{part.stem}.{part.variant}"
            self.shards[part.name] = plan_shards(part.tensors, self.options.max_shard_size, stem)
            units += [dataclasses.replace(s, name=f"{part.name}/{s.name}") for s in self.shards[part.name]]
        return units

    def write(self, units, tmp, progress=None, share=(0, 1)):
        solo = share[1] == 1   # (the journals, and --resume, belong to a run of one process)
        mine = {}
        for u in units:
            folder, _, name = u.name.partition("/")
            mine.setdefault(folder, set()).add(name)
        reused, note = self._reusable(tmp) if solo and self.options.resume else ({}, None)
        first = share[0] == 0
        check_space(tmp, sum(u.size for u in units) - sum(v["size"] for w in reused.values() for v in w.files.values())
                    + (self.content.added_bytes() if first else 0),
                    [f for p in self.content.parts for f in p.content.model_files] + self.content.model_files
                    if first else ())
        written, pipeline, target = Written(), Pipeline(), as_target(tmp)
        try:
            for part in self.content.parts:
                if part.name not in mine:
                    continue
                target.mkdir(part.name, exist_ok=True)
                folder = target.sub(part.name)
                journal = {"plan": _plan_id(self.shards[part.name]), "source": part.content.identity} \
                    if solo and part.content.identity else None
                done = write_shards(folder, [s for s in self.shards[part.name] if s.name in mine[part.name]], pipeline,
                                    progress, self.options.fsync, reused.get(part.name), journal, self.options.direct)
                written.files.update({f"{part.name}/{n}": info for n, info in done.files.items()})
                written.digests.update({f"{part.name}/{n}": row for n, row in done.digests.items()})
        finally:
            pipeline.close()
        return written.result(sum(v["size"] for w in reused.values() for v in w.files.values()), note)

    def rehashed(self, result, units, tmp) -> bool:
        """(see Layout.rehashed) Each component's shard read once in its folder (resume.rehashes)."""
        target, shards = as_target(tmp), []
        for unit in units:
            folder, _, name = unit.name.partition("/")
            shard = next((s for s in self.shards.get(folder, ()) if s.name == name), None)
            if shard is None or not target.is_dir(folder):
                return False
            shards.append((unit.name, shard, target.sub(folder)))
        return rehashes(result, shards)

    def _reusable(self, tmp) -> tuple:
        """--resume: each component's shards a killed run finished, re-hashed against the journal in its
        folder ({component: Written}), and why not more; everything else it left is removed."""
        reused, notes, target = {}, {}, as_target(tmp)
        for part in self.content.parts:
            if not part.weights:
                continue
            if part.content.identity and target.is_dir(part.name):
                reused[part.name], notes[part.name] = reusable(target.sub(part.name), self.shards[part.name],
                                                               part.content.identity)
            else:
                reused[part.name], notes[part.name] = Written(), FRESH
        for name, is_dir in target.entries():
            if name in reused and is_dir:
                _keep_only(target.sub(name), set(reused[name].files))
            else:
                target.remove(name)
        said = {n for n in notes.values() if n}
        if len(said) <= 1 and all(notes.values()):
            return reused, next(iter(said), None)
        return reused, "; ".join(f"{name}: {n}" for name, n in notes.items() if n) or None

    def finish(self, tmp, results) -> RunFacts:
        by_name = {name: r for r in results for name in r.files}
        files, kinds, target = {}, {}, as_target(tmp)
        for part in self.content.parts:   # each folder: its shards' records, model files and metadata
            target.mkdir(part.name, exist_ok=True)
            folder = target.sub(part.name)
            written, c = Written(), part.content
            if part.weights:
                for shard in self.shards[part.name]:   # merged in plan order, as a sharded output's
                    r = by_name[f"{part.name}/{shard.name}"]
                    written.files[shard.name] = r.files[f"{part.name}/{shard.name}"]
                    written.digests[shard.name] = r.digests[f"{part.name}/{shard.name}"]
                copy_files(folder, c.model_files, written, c.edited, c.added)
                finish_dir(folder, self.shards[part.name], written, {**c.source, **c.skipped()}, c.extras, c.manifest,
                           part.stem, part.variant, sums=False)
            else:
                copy_files(folder, c.model_files, written)
            kinds[part.name] = WEIGHTS if part.weights else FILES
            files.update({f"{part.name}/{n}": info for n, info in written.files.items()})
        top = Written()
        copy_files(target, self.content.model_files, top, self.content.edited, self.content.added)
        files.update(top.files)
        sums = {name: info["sha256"] for name, info in files.items()}
        sums[MANIFEST] = write_json(target, MANIFEST, document({**self.content.source, **self.content.skipped()}, kinds,
                                                            files))
        write_sums(target, sums, paths=True)
        notes = [r.note for r in results if r.note]
        return RunFacts(sorted(files), sum(r.reused for r in results), notes[0] if notes else None)



@register("diffusers-component")
class ComponentDirectory(Layout):
    """One component folder of weights of a converted pipeline, given alone (`verify OUT/unet`,
    `--against SRC/unet`, `--device`): the sharded output it is, its files' digests read from the
    pipeline's top-level SHA256SUMS (it has none of its own). Written only as part of its pipeline."""

    order = 24

    @classmethod
    def detect(cls, path) -> bool:
        return component_of(storage.place(path)) is not None

    @classmethod
    def check_units(cls, path) -> dict:
        return ShardedDirectory.check_units(path)

    @classmethod
    def check(cls, path, report, progress=None, share=None):
        mine = None if share is None or share.processes == 1 else \
            {f for f, _ in share.units.get("shard", ()) if share.mine("shard", f)}
        check_component(storage.place(path), report, progress, mine, structural=share is None or share.is_main)

    def plan(self, tensors) -> list:
        raise NotImplementedError("a component folder is written as part of its pipeline (PipelineDirectory)")
