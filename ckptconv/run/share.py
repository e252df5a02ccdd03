"""The one balancer: which process does which unit of a job, by bytes, deterministically. A run's
units (shard files, rank directories: runner.py), a verify's rank directories, shards and tensors
(layouts' `check_units`) and a reshard's global digests (layouts/mesh) are all split by `assign`,
so that `ckptconv plan` prints the split a run makes."""
from dataclasses import dataclass, field


def assign(sizes, processes: int) -> list:
    """Owner process of each unit: balanced by bytes, deterministic (largest first, to the least
    loaded process, ties to the lower index)."""
    load = [0] * processes
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(processes), key=lambda q: (load[q], q))
        owner[i] = p
        load[p] += sizes[i]
    return owner


@dataclass
class Share:
    """What this process checks of a verify split over processes: `units` maps a kind ("rank",
    "shard", "tensor") to [(key, bytes)], each kind balanced on its own. Whatever no unit names
    (what is not on disk or not valid, the top level of an output) is process 0's. `merge(stage)`
    gathers every process's findings of a stage (jobs/verify); alone, it does nothing."""

    process: int = 0
    processes: int = 1
    units: dict = field(default_factory=dict)
    merge_stage: object = None

    def __post_init__(self):
        self._owner = {(kind, key): o for kind, rows in self.units.items()
                       for (key, _), o in zip(rows, assign([size for _, size in rows], self.processes))}

    @property
    def is_main(self) -> bool:
        return self.process == 0

    def mine(self, kind: str, key) -> bool:
        return self.processes == 1 or self._owner.get((kind, key), 0) == self.process

    def merge(self, stage: str):
        if self.merge_stage is not None:
            self.merge_stage(stage)
