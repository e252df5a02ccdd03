"""Lightning's `meta.pt` beside a sharded FSDP checkpoint's `.metadata` (docs/dcp.md#training-states).

Lightning 2.x's FSDPStrategy with `state_dict_type="sharded"` saves the model's and optimizers'
states through DCP and everything else of the checkpoint with `torch.save` into `meta.pt`, from rank
0: the Trainer the rest of `dump_checkpoint` (`epoch`, `global_step`, `pytorch-lightning_version`,
`loops`, `callbacks`, `lr_schedulers`, `hparams_name`, `hyper_parameters`, ...), Fabric whatever the
user's state held that is neither a module nor an optimizer. Lightning's consolidation
(`lightning.fabric.utilities.load._load_distributed_checkpoint`) merges it into the DCP state's top
level, and so does this reader: with the model's entry written, meta.pt's entries are the rest of the
wrapper (extras, or dropped when they hold tensors, as for torch files: wrappers.set_aside); with
everything written (`--state-dict none`), its tensors are written too under their flattened names.
It runs through the allowlisting unpickler like any torch file, charged to its own budget.
"""
from dataclasses import dataclass

from ..errors import BadInput
from ..limits import Budget
from ..storage import files as storage
from . import LIGHTNING_META, confined, source_root, wrappers
from .pickle import unpickler
from .pickle.torch_globals import flatten
from .torch_pickle import load_zip


@dataclass
class Meta:
    """meta.pt, opened and unpickled: its mapped file, its entries (dotted name -> value) and the
    globals it recorded as inert data."""

    file: object
    entries: dict
    budget: Budget
    unlisted: object

    def set_aside(self, keep) -> wrappers.Rest:
        """Its entries as the rest of a training wrapper: extras (names `keep` accepts) or dropped."""
        return wrappers.set_aside(self.entries, self.file.path, self.budget, keep)

    def whole(self, keep):
        """Its tensors (names `keep` accepts), extras and skipped tensors, as `flatten` gives them."""
        t, e, s = flatten(self.entries, self.file.path, budget=self.budget)
        return ([src for name, src in t.items() if keep(name)],
                unpickler.extras_json({k: v for k, v in e.items() if keep(k)}, self.budget), s)


def open_meta(path, allow) -> Meta | None:
    """The meta.pt beside `path`'s `.metadata`, or None when there is none."""
    where = path / LIGHTNING_META
    if not storage.is_file(where):
        return None
    m = storage.open_file(confined(where, source_root(path)))
    budget, unlisted = Budget(where), unpickler.Unlisted(where)
    top = wrappers.mapping(load_zip(m, allow, budget=budget, unlisted=unlisted))
    if top is None:
        raise BadInput(f"{where}: holds no dict (Lightning writes the checkpoint's state beside the DCP items there)")
    return Meta(m, {unpickler.key_text(k): v for k, v in top.items()}, budget, unlisted)
