"""A bucket OUT's life: `bucket_output` is io/output.atomic_output's counterpart for a URL. It claims
OUT (a create-only lock object: lease.py), decides what may be replaced (as check_target does, with
--overwrite replacing only a previous ckptconv output, after unpublishing it: a store cannot swap a
prefix), yields the target, and publishes it (the pointer, create-only) or rolls it back (every
object the run created deleted, every multipart upload aborted), on an error or a signal alike.

Tasks of the run (run/tasks.py) write their units into the same OUT from other processes and hosts
through a `BucketTask`: the OUT, the job's storage options, and nothing of the driver's lock; each
task's objects are named in its answer and adopted by the driver, which alone publishes. A task that
fails deletes what it wrote; what a killed one left is swept by the driver's rollback.
"""
import contextlib
import os
from dataclasses import dataclass

from ..errors import BadInput, CkptError, OutputError, printable
from ..signals import check, deferred, published as announce
from ..io.output import replaceable
from .publisher import Publisher
from .targets import BucketTarget, BucketOut
from .urls import StorageOptions, is_url, parse, redact


@dataclass(frozen=True)
class BucketTask:
    """Where a task writes its units of a bucket OUT the driver claimed (plain data: crosses processes)."""

    url: str
    options: StorageOptions
    single: bool = False
    side_by_side: int = 1

    def target(self) -> BucketTarget:
        """The OUT as a target in the task's process: objects written are tracked (`written`), never
        the pointer, never the lock."""
        from .bucket import Session
        return BucketTarget(BucketOut(TaskPublisher(parse(self.url), self.options, single=self.single), None,
                                 Session(self.options), self.side_by_side))


def written(target: BucketTarget) -> dict:
    """{path under OUT: size} of what a task wrote through `target`."""
    return dict(target.out.known)


class TaskPublisher(Publisher):
    """A Publisher without the lock: the driver holds it; this writes objects and, on failure, deletes
    its own."""

    def claim(self, take_over: bool = False):
        raise OutputError(f"{self.out}: a task writes into the driver's claim, never its own")

    def _check_held(self):
        pass

    def rollback(self, everything: bool = False) -> list:
        problems = []
        for w in list(self.open):
            try:
                w.abort()
            except Exception as e:  # noqa: BLE001
                problems.append(str(e))
        self.open.clear()
        doomed = self.created + sorted(self.started - set(self.created))
        try:
            self._sweep(doomed) if doomed else None
        except Exception as e:  # noqa: BLE001
            problems.append(str(e))
        self.created.clear()
        self.started.clear()
        return problems


def _refuse_inputs(out: str, inputs):
    """OUT may not be or hold an input of the run, nor lie inside a source read from the store."""
    real = str(parse(out)).rstrip("/")
    for p in getattr(inputs, "files", inputs):
        if is_url(os.fspath(p)):
            r = str(parse(os.fspath(p))).rstrip("/")
            if r == real or r.startswith(real + "/"):
                raise OutputError(f"{redact(out)}: {'is' if r == real else 'holds'} the input {redact(os.fspath(p))}; "
                                  "write the output somewhere else")
            if real.startswith(r + "/"):   # (a key below an object's: the source would read as a prefix after)
                raise OutputError(f"{redact(out)}: lies under the input object {redact(os.fspath(p))}, which would "
                                  "then also be a prefix; write the output somewhere else")
    for root in getattr(inputs, "roots", ()):
        if is_url(os.fspath(root)):
            r = str(parse(os.fspath(root))).rstrip("/")
            if real == r or real.startswith(r + "/"):
                raise OutputError(f"{redact(out)}: lies inside the source {redact(os.fspath(root))}, where a later read "
                                  "of the source would take it for part of the checkpoint; write the output somewhere else")


def _listed(publisher) -> dict:
    """{path under OUT: size} of every object there now (one listing, all pages)."""
    from .objects import listing
    return {e.name: e.size for e in listing(publisher.out, publisher.options, publisher.store)}


def _prepare(target: BucketTarget, taken, overwrite: bool, resume: bool, single: bool, not_ours, published):
    """What is under OUT before the run writes, decided as check_target decides it for a directory:
    nothing, a killed run's leftovers (its lock `taken` over: this run's now, kept for --resume,
    deleted for --overwrite), or a previous output, which only --overwrite replaces, and only a
    ckptconv output: it is unpublished (its pointer deleted first), then deleted, before anything is
    written, since a store cannot swap a prefix for another."""
    publisher, session = target.out.publisher, target.out.session
    out = session.place(str(publisher.out))
    if single:
        try:
            there = session.open(out) is not None
        except BadInput:
            there = False
        if not there:
            return
        replaceable(out, overwrite, not_ours, True)
        publisher.adopt([publisher.out.key])
        publisher.delete([publisher.out.key])
        return
    found = _listed(publisher)
    if not found:
        return
    shown = published(out, found) if published else None   # (the pointer of a published output)
    if taken is None or (shown is not None and not overwrite):
        replaceable(out, overwrite, not_ours, False)
    publisher.adopt([publisher.place(k).key for k in found])
    target.out.known.update(found)
    if taken is None or not resume:   # (--resume keeps a killed run's objects: its layout re-checks them)
        if shown is not None:
            target.remove(shown)   # unpublished at once: a consumer no longer finds it
        publisher.delete([publisher.place(k).key for k in target.out.known])
        target.out.known.clear()


@contextlib.contextmanager
def bucket_output(out, overwrite=False, resume=False, inputs=(), single_file=False, not_ours=None, pointer=None,
                  published=None, side_by_side: int = 1, options: StorageOptions = None, tasks: bool = False):
    """Yield a BucketTarget for the URL `out`, reached with `options` (the job's StorageOptions);
    publish it (the `pointer` last, create-only) if the block succeeds, roll it back otherwise, a
    signal included. `inputs`, `overwrite`, `resume`, `single_file` and `not_ours` as atomic_output
    takes them; `published(out, names)`: the pointer of the output already there when it is a
    published one (formats.published); `side_by_side`: files written at once. `tasks`: other processes
    write units into it too (`BucketTask`), so a rollback deletes everything under OUT and aborts
    every upload pending there, whoever started it."""
    from .bucket import Session
    from .publisher import Publisher
    options = options or StorageOptions()
    out = os.fspath(out)
    location = parse(out)
    _refuse_inputs(out, inputs)
    publisher = Publisher(location, options, single=single_file)
    session = Session(options)
    try:
        taken = publisher.claim(take_over=overwrite or resume)
        target = BucketTarget(BucketOut(publisher, pointer, session, side_by_side))
        _prepare(target, taken, overwrite, resume, single_file, not_ours or (lambda *a: "unknown"), published)
        session.forget(out)   # (what was there was read to decide; it may have been deleted since)
        yield target
        check()   # a signal still pending stops the run before it publishes
        foreign = sorted(set(_listed(publisher)) - set(target.out.known))
        if foreign:   # (someone else's objects would be published as part of this output)
            raise OutputError(f"{redact(out)}: {printable(foreign[0], 200)} appeared under OUT while the run wrote it "
                              f"({len(foreign)} object(s) not this run's); nothing was published")
        with deferred():
            publisher.publish_pointer()
            announce(out)   # (a signal after this: "published before it and is complete")
    except BaseException as e:
        if tasks:   # (what a task wrote and never answered for: under OUT all the same)
            with contextlib.suppress(CkptError):
                publisher.adopt([publisher.place(k).key for k in _listed(publisher)])
        problems = publisher.rollback(everything=tasks)
        if problems and isinstance(e, CkptError):
            raise OutputError(f"{e}; and rolling back, {problems[0]} (remove what is left under OUT yourself)") from None
        raise
