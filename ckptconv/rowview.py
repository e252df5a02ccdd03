"""Per-tensor tables handed to callers (`inspect`'s tensors, a reshard plan's rows) as views: each
row is made when it is read, so a checkpoint of a million tensors is not held a second time as a
million dicts beside its own records."""
import copy
from collections.abc import Sequence


class RowView(Sequence):
    """`row(item)` for each of `items`, made on access; `list(view)` materializes them (--json)."""

    def __init__(self, items, row):
        self._items, self._row = items, row

    def __len__(self):
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._row(x) for x in self._items[i]]
        return self._row(self._items[i])

    def __deepcopy__(self, memo):
        """A list of the rows (dataclasses.asdict of a result holding a view gives plain JSON-able data)."""
        return [copy.deepcopy(row, memo) for row in self]

    def __eq__(self, other):
        return isinstance(other, (list, RowView)) and list(self) == list(other)

    def __repr__(self):
        return f"RowView({len(self)} rows)"
