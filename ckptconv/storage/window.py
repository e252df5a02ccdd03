"""The one read-ahead window: ranges of objects named ahead (`ahead`), fetched as concurrent ranged
GETs of at most `part_size` bytes, at most `slots` parts fetched or held at once, consumed in order
(`fill`). Ranges at most GAP apart in the same object share one GET (a zip's tensors lie between
small local headers; a legacy torch file's element counts before its storages).

Two kinds of users, one mechanism:
- a bucket source's session (bucket.py) keeps one window for every object of the run: a writer names
  the tensor bytes it will read next (RemoteFile.will_need), fills its staging buffers from them
  (RemoteFile.reader) and drops what it wrote (RemoteFile.release);
- `read_all(source, ranges)` gives the bytes of a run of ranges in order (headers, a zip's local
  headers, a decompressor's input) through a window of its own, a bounded number of ranges named ahead.

A `fill` of bytes the window holds or is fetching waits for them; one it does not is fetched at
once (never waiting for a slot, so a reader never waits on parts only another would consume).
Memory: `slots` parts of `part_size`, plus the part a `fill` copies from.
"""
import contextlib
import itertools
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..signals import check

GAP = 64 << 10   # ranges at most this far apart are fetched by one GET (the bytes between are dropped)
NEAR = 4         # wanted ranges a new one is compared with (a shard of a million names stays linear)


@dataclass
class _Part:
    source: object    # a SourceObject (objects.py): `fetch(start, end)`
    start: int
    end: int
    future: object


class Window:
    """See the module docstring. `source` is anything with `fetch(start, end) -> bytes` (objects.SourceObject)."""

    def __init__(self, slots: int, part_size: int, name: str = "ckptconv-ahead"):
        self.part_size, self.slots = part_size, slots
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix=name)
        self._parts = deque()    # _Part, in the order named
        self._wanted = deque()   # [source, start, end] not yet started
        self._lock = threading.Lock()
        weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def close(self):
        """Cancel what is fetched or wanted and let the threads go."""
        with self._lock:
            for p in self._parts:
                p.future.cancel()
            self._parts.clear()
            self._wanted.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def ahead(self, source, offset: int, length: int):
        """Want [offset, offset+length) of `source` next. A range already wanted or in the window is not
        asked twice; one that starts at most GAP after the last one wanted of the same source joins it.
        Parts are started when a `fill` comes (every range a shard names is known by then)."""
        if length <= 0:
            return
        end = offset + length
        with self._lock:
            near = itertools.islice(self._wanted, NEAR)
            if any(p.source is source and p.start <= offset and end <= p.end for p in self._parts) or \
                    any(w[0] is source and w[1] <= offset and end <= w[2] for w in near):
                return
            last = self._wanted[-1] if self._wanted else None
            if last is not None and last[0] is source and 0 <= offset - last[2] <= GAP:
                last[2] = max(last[2], end)
            else:
                self._wanted.append([source, offset, end])

    def start(self):
        """Start what is wanted, as far as the slots allow (a `fill` does so too)."""
        with self._lock:
            self._top_up()

    def _top_up(self):
        while len(self._parts) < self.slots and self._wanted:
            w = self._wanted[0]
            source, start = w[0], w[1]
            end = min(w[2], start + self.part_size)
            w[1] = end
            if w[1] >= w[2]:
                self._wanted.popleft()
            self._parts.append(_Part(source, start, end, self._pool.submit(source.fetch, start, end)))

    def drop(self, source, lo: int, hi: int):
        """Forget what is held or wanted of [lo, hi) of `source` (its bytes were used)."""
        with self._lock:
            kept = deque()
            for p in self._parts:
                if p.source is source and lo <= p.start and p.end <= hi:
                    p.future.cancel()
                else:
                    kept.append(p)
            self._parts = kept
            wanted = deque()
            for w in self._wanted:
                if w[0] is source and w[1] < hi and w[2] > lo:
                    if w[1] < lo:
                        wanted.append([source, w[1], lo])
                    if w[2] > hi:
                        wanted.append([source, hi, w[2]])
                else:
                    wanted.append(w)
            self._wanted = wanted
            self._top_up()

    def fill(self, source, view, offset: int):
        """`view` filled with `source`'s bytes from `offset`: from the window's parts where it holds or
        fetches them (parts of `source` wholly before `offset` are let go: they were not read), else
        fetched now, a part at a time."""
        with self._lock:
            self._top_up()
        got, n = 0, len(view)
        while got < n:
            at = offset + got
            with self._lock:
                part = next((p for p in self._parts if p.source is source and p.start <= at < p.end), None)
                if part is not None:
                    for p in [p for p in self._parts if p.source is source and p.end <= at]:
                        p.future.cancel()
                        self._parts.remove(p)
            if part is None:
                take = min(n - got, self.part_size)
                view[got:got + take] = memoryview(source.fetch(at, at + take))
                got += take
                check()
                continue
            data = part.future.result()
            check()   # a signal that arrived while this thread waited on the pool (signals.py)
            take = min(n - got, part.end - at)
            view[got:got + take] = memoryview(data)[at - part.start:at - part.start + take]
            got += take
            if at + take >= part.end:   # used up: its slot goes to the next part wanted
                with self._lock:
                    with contextlib.suppress(ValueError):
                        self._parts.remove(part)
                    self._top_up()


@dataclass(frozen=True)
class Piece:
    """Bytes of the `index`-th range asked of `stream`, starting `offset` bytes into that range."""

    index: int
    offset: int
    data: bytearray


def stream(source, ranges, slots: int, part_size: int):
    """The bytes of (offset, length) `ranges` (an iterable, consumed lazily) in the order given, as
    Pieces of at most `part_size` bytes (an empty range gives none), through a window of its own:
    ranges are named ahead until `slots` parts' worth of bytes are wanted, so memory stays about
    (slots + 1) x part_size. `source.check(offset, length, what)` refuses a range outside the object
    before it is named."""
    window = Window(slots, part_size, "ckptconv-get")
    todo, budget, planned = deque(), slots * part_size, 0
    it = enumerate(ranges)
    try:
        while True:
            while planned < budget:
                step = next(it, None)
                if step is None:
                    break
                index, (offset, length) = step
                source.check(offset, length, "a read")
                window.ahead(source, offset, length)
                todo.append((index, offset, length))
                planned += length
            if not todo:
                return
            index, offset, length = todo.popleft()
            for done in range(0, length, part_size):
                out = bytearray(min(part_size, length - done))
                window.fill(source, memoryview(out), offset + done)
                yield Piece(index, done, out)
            planned -= length
    finally:
        window.close()
