"""The reader interface and its registry.

A reader is one module that registers one `Reader`: its name (`--from NAME`, the manifest's
`source.format`), what it reads, `detect(path)`, `load(path, options) -> Checkpoint`, whether it
parses pickles (`pickle-to-safetensors` takes only those) or holds data at all (a shapes
description does not), the command-line options it declares for itself, its place in the
detection order and what it looks for (named when no reader recognises a path). Adding a format is one module that calls `register(...)`: every module of the
package is imported when the readers are first listed.
"""
from dataclasses import dataclass, field
from typing import Callable

from ..storage.urls import StorageOptions


@dataclass(frozen=True)
class ReaderOption:
    """A command-line option one reader declares (`--names FILE` for Grok-style directories); its
    value reaches the reader as `options.get(dest)`."""

    flag: str
    dest: str
    help: str
    choices: tuple = ()
    type: type = str
    path: bool = False     # an existing file


@dataclass
class ReadOptions:
    """How to read a source: the options every reader honours, and those readers declare."""

    allow_globals: list = field(default_factory=list)   # --allow-global MODULE.NAME
    skip_unsupported: bool = False
    only: list = field(default_factory=list)            # name prefixes to keep (items skipped unread)
    workers: int | None = None                          # --workers: tasks in flight (None: auto, run/executors.py)
    max_extra_size: int = 256 * 10**6                   # model files larger than this are not carried
    state_dict: str = "auto"                            # --state-dict auto|KEY|none (training wrappers)
    one_shard: bool = False                             # --one-shard: SRC is one shard of an indexed set, alone
    declared: dict = field(default_factory=dict)        # ReaderOption.dest -> value
    storage: StorageOptions = field(default_factory=StorageOptions)   # object stores: --endpoint-url, ...

    def get(self, dest: str):
        return self.declared.get(dest)


@dataclass
class Source:
    """What to read: a path, the format (None: detected) and how to read it."""

    path: str
    format: str | None = None
    options: ReadOptions = field(default_factory=ReadOptions)


@dataclass(frozen=True)
class Reader:
    name: str
    description: str
    detect: Callable            # (Path) -> bool, by content and names; never raises on foreign input
    load: Callable              # (Path, ReadOptions) -> Checkpoint
    priority: int               # detection order, lowest first (docs/formats.md#detection)
    parses_pickles: bool = False
    holds_data: bool = True
    options: tuple = ()         # ReaderOption
    looks_for: str = ""         # the names and contents detect recognises, for "found nothing" (docs/formats.md)
    suffixes: tuple = ()        # how its weight files' names end: never carried into OUT as model files
    fuzz: tuple = ()            # a minimal source for fuzz/fuzz_parsers.py: (relative path, bytes), the
                                # fuzzed bytes where bytes is None; one entry is a file SRC, more a directory


READERS = {}


def register(reader: Reader) -> Reader:
    READERS[reader.name] = reader
    return reader
