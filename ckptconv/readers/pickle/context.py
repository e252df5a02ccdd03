"""The state of one unpickling (`Context`): the file and offset it names in errors, the work budget,
and the records that keep tuples, frozensets and dict keys bounded (depth, expanded size, hashing).
"""
import sys

from ...errors import BadInput, UnsafePickle, brief
from ...limits import MAX_DEPTH, Budget


_MODULUS = sys.hash_info.modulus  # 2**61 - 1 on 64-bit builds



class _Mark:
    pass


MARK = _Mark()


_SWEEP_MIN = 4096
_ONLY_HERE = 2   # getrefcount of an object held by its shape record alone: the record, the argument


class Context:
    """What stand-ins see: where we are (for messages), the work budget, and the depth and expanded
    size of every tuple and frozenset built so far. Those two are immutable, so both numbers are exact
    when they are made; Python hashes tuples by recursing in C with no guard, and hashing or writing
    out a shared tuple costs its expanded size, so both are bounded before anything hashes them."""

    def __init__(self, path, base_offset, budget: Budget, unlisted=None):
        self.path, self.base_offset, self.pos, self.budget = path, base_offset, 0, budget
        self.unlisted = unlisted   # None: a global on no allowlist stops the run at once
        self._shape = {}   # id -> (object, depth, expanded size), for nested tuples and frozensets
        self._sweep_at = _SWEEP_MIN
        self._credited = 0
        self.payloads = 0  # bytes of the payloads left in the file (Payload), up to here
        self.shapes = {}   # each distinct tensor shape kept once: stand-ins' tensors share its tuple

    def credit(self, pos: int):
        """The budget grows with the pickle bytes read so far, less the payloads left in place (a
        Grok file's tensor bytes, like a legacy file's storages after its pickle, justify nothing)."""
        if pos - self.payloads > self._credited:
            self.budget.add_bytes(pos - self.payloads - self._credited)
            self._credited = pos - self.payloads

    def bad(self, msg) -> BadInput:
        return BadInput(f"{self.path}: {msg} (pickle offset {self.base_offset + self.pos})")

    def unsafe(self, msg) -> UnsafePickle:
        return UnsafePickle(f"{self.path}: refused: {msg} (pickle offset {self.base_offset + self.pos}); "
                            "nothing was executed")

    def _size(self, x) -> tuple:
        """(depth, expanded size) of a value: recorded for nested tuples and frozensets, one level
        for flat ones (they hold no tuple), a leaf otherwise."""
        info = self._shape.get(id(x))
        if info is not None and info[0] is x:
            return info[1], info[2]
        return (1, len(x) + 1) if isinstance(x, (tuple, frozenset)) else (0, 1)

    def _made(self, obj, items, what):
        self.credit(self.pos)
        nested = [x for x in items if type(x) in (tuple, frozenset)]   # the rest are leaves: 1 each
        depth, size = 1, 1 + len(items) - len(nested)
        for x in nested:
            d, n = self._size(x)
            depth, size = max(depth, d + 1), size + n
        if depth > MAX_DEPTH:
            raise self.bad(f"{what}s nested more than {MAX_DEPTH} deep")
        if size > self.budget.left:
            raise self.bad(f"a {what} that expands to {size} values (shared members), more than the pickle's "
                           f"{self.budget.nbytes} bytes justify")
        if depth > 1:
            if len(self._shape) >= self._sweep_at:
                self._forget_unreachable()
            self._shape[id(obj)] = (obj, depth, size)
        return obj

    def _forget_unreachable(self):
        """Drop the records of tuples and frozensets nothing else holds any more: no opcode can reach
        them again (not the stack, the memo, nor a container), so they can never be a member again.
        Held by the table alone, every call's arguments (torch.save: one nested tuple per tensor)
        would live to the end of the load. Exact: CPython counts references. Swept when the table
        has doubled since the last sweep: linear in all."""
        shape = self._shape
        for key in [k for k, info in shape.items() if sys.getrefcount(info[0]) <= _ONLY_HERE]:
            del shape[key]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(shape))

    def copying(self, n: int):
        """Charge for copying `n` items or bytes: a stand-in called again and again on one shared
        (memoized) argument copies it every time, and a 6-byte call must not copy a megabyte free."""
        self.credit(self.pos)
        self.budget.spend(n + 1, "copies of shared objects")

    def tuple(self, items) -> tuple:
        self.copying(len(items))
        items = tuple(items)
        return self._made(items, items, "tuple")

    def frozenset(self, items) -> frozenset:
        self.copying(len(items))
        self.hashing(items)
        return self._made(frozenset(items), items, "frozenset")

    def hashing(self, keys):
        """Charge for hashing `keys` (a tuple's hash walks all of it, every time) and refuse keys
        chosen to collide; returns them."""
        self.credit(self.pos)
        cost = 0
        for k in keys:
            cost += self._size(k)[1]
        self.budget.spend(cost, "hashing its keys")
        for k in keys:
            self._unsalted(k)
        return keys

    def _unsalted(self, key):
        """Python hashes numbers by their value modulo 2**61 - 1, with no random salt (strings and
        bytes have one): numbers an attacker picks to be equal modulo it would make every insertion
        into a dict or set scan all the others, quadratic in the file's size. Such numbers cannot be
        keys, nor parts of tuple keys (walked once each; their size was charged above)."""
        todo, seen = [key], set()
        while todo:
            x = todo.pop()
            if isinstance(x, (int, float)) and not isinstance(x, bool) and not -_MODULUS < x < _MODULUS:
                raise self.bad(f"a dict key or set member holds the number {brief(x, 40)}, beyond the 2**61 - 1 "
                               "that Python can hash without collisions")
            if type(x) is tuple and id(x) not in seen:
                seen.add(id(x))
                todo.extend(x)
