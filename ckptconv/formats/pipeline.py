"""A diffusers pipeline directory, both ways (docs/output.md, "Pipelines"): the components its
`model_index.json` names, and the top-level manifest.json a converted pipeline records them in.

    model_index.json   {"_class_name": "StableDiffusionPipeline", "_diffusers_version": …,
                        "unet": ["diffusers", "UNet2DConditionModel"], "safety_checker": [null, null],
                        "requires_safety_checker": false, …}

A component is a member whose name does not start with `_` and whose value is `[library, class]`,
two strings; `[null, null]` is a component the pipeline goes without; anything else is the
pipeline's own configuration. Each component is the folder of its name beside model_index.json.
"""
from dataclasses import dataclass

from .. import safejson
from ..errors import BadInput, brief, encodable
from .manifest import MANIFEST, file_entry_problem
from .mesh import MESH
from .sums import NAME as SUMS, unsafe_name, unsafe_path

MODEL_INDEX = "model_index.json"
FORMAT = "ckptconv.pipeline/1"
WEIGHTS, FILES = "weights", "files"   # what a component of a converted pipeline is (the manifest's "components")
MAX_COMPONENTS = 256   # diffusers' largest pipelines name about a dozen


def components(doc, where) -> list:
    """[(folder, library, class)] of the components a model_index.json names, in its order; BadInput
    naming `where` when it is not one (not an object, no `_class_name`, a name that is not a plain
    folder name, more than MAX_COMPONENTS)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("_class_name"), str):
        raise BadInput(f"{where}: not a diffusers model_index.json (a JSON object with a '_class_name')")
    found = []
    for name, value in doc.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        if value == [None, None]:
            continue   # a component the pipeline goes without (safety_checker: [null, null])
        if not all(isinstance(v, str) for v in value):
            continue   # (the pipeline's own configuration)
        why = unsafe_name(name) or (None if encodable(name) else "not valid Unicode text")
        if why is None and (name.startswith(".") or name in (MANIFEST, SUMS, MODEL_INDEX, MESH)):
            why = "a hidden name or one of an output's own files"
        if why is not None:
            raise BadInput(f"{where}: component {brief(name, 80)} is not a folder name beside it ({why})")
        found.append((name, value[0], value[1]))
    if len(found) > MAX_COMPONENTS:
        raise BadInput(f"{where}: names {len(found)} components, more than the {MAX_COMPONENTS} ckptconv reads")
    return found


def document(source: dict, kinds: dict, files: dict) -> dict:
    """The top-level manifest.json of a converted pipeline: what was read (`source`), each component
    folder's kind ({name: WEIGHTS, a ckptconv output directory of its own, or FILES, carried whole}),
    and every file of the tree but manifest.json and SHA256SUMS, `FOLDER/FILE` for a component's."""
    return {"format": FORMAT, "source": source, "components": dict(sorted(kinds.items())),
            "files": dict(sorted(files.items()))}


@dataclass(frozen=True)
class PipelineDoc:
    """The top-level manifest.json of a converted pipeline, type-checked: its source record, the kind
    of each component folder, and its files {path: {"sha256", "size"}} (the valid ones)."""

    source: dict
    components: dict
    files: dict


def _object(doc: dict, key: str, problems: list) -> dict:
    """doc[key] when it is an object, else {} and a problem saying what it is."""
    value = doc.get(key)
    if isinstance(value, dict):
        return value
    problems.append(f"{key} is {brief(value, 80)}, not an object")
    return {}


def read_document(data: bytes, where) -> tuple:
    """(PipelineDoc, problems) of a pipeline's manifest.json; (None, problems) when it is not one
    (BadInput when it is not JSON). A path or folder that is not plain is a problem, never returned."""
    doc = safejson.loads(data, where, MANIFEST)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None, [f"format is {brief(doc.get('format') if isinstance(doc, dict) else doc)}, not {FORMAT}"]
    problems, files, kinds = [], {}, {}
    source, listed, entries = (_object(doc, key, problems) for key in ("source", "components", "files"))
    problems += [f"{where_}{brief(value, 80)}: a pipeline output records no engine's target and no resharding"
                 for where_, value in (("target is ", doc.get("target")), ("source.target is ", source.get("target")),
                                       ("source.resharded is ", source.get("resharded"))) if value is not None]
    for name, kind in listed.items():
        why = unsafe_name(name)
        if why is not None or kind not in (WEIGHTS, FILES):
            problems.append(f"component {brief(name, 80)}: " + (f"not a folder name ({why})" if why else
                                                                 f"{brief(kind, 40)} is not {WEIGHTS} or {FILES}"))
            continue
        kinds[name] = kind
    for name, info in entries.items():
        why = unsafe_path(name)
        if why is not None:
            problems.append(f"files lists {brief(name, 80)}, which is not a plain path in this directory ({why}); "
                            "not opened")
        elif file_entry_problem(name, info) is not None:
            problems.append(file_entry_problem(name, info))
        else:
            files[name] = info
    return PipelineDoc(source, kinds, files), problems
