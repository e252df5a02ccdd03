"""The bounds on what a file can make ckptconv do: nesting depth, tensor shapes, and the work budget
for non-tensor state. Every reader uses these; docs/security.md says which bound covers which part.
"""
from .errors import BadInput

# Nesting of any structure read from a file (pickled containers, JSON headers and metadata). Real
# checkpoints nest a few dozen levels at most; the bound keeps every walk far from Python's and C's
# recursion limits (tuple hashing in C has no guard at all).
MAX_DEPTH = 100

# Shapes every consumer can load: numpy (and so the safetensors library) refuses more than 32 axes in
# numpy 1.x and a product of the non-zero axes whose bytes overflow a signed 64-bit size.
MAX_NDIM = 32
_MAX_BYTES = 2**63 - 1


def shape_problem(shape, itemsize: int):
    """Why `shape` is not a loadable tensor shape (None when it is): ints >= 0, at most MAX_NDIM axes,
    and the non-zero axes' product times the item size below 2**63 (zeros do not excuse the others)."""
    if not isinstance(shape, (tuple, list)):
        return f"shape {type(shape).__name__} is not a list of sizes"
    if len(shape) > MAX_NDIM:
        return f"shape has {len(shape)} axes, more than the {MAX_NDIM} numpy and safetensors load"
    total = itemsize
    for n in shape:
        if type(n) is not int or n < 0:
            return f"shape {list(shape)[:MAX_NDIM]!r} has a size that is not a non-negative integer"
        if n:
            total *= n
            if total > _MAX_BYTES:
                return f"shape {list(shape)} spans more than 2**63 bytes, which no consumer can load"
    return None


class Budget:
    """Work reading a pickle may cause beyond its own opcodes, in units of about one object: hashing
    shared tuples, expanding shared containers into names, writing extras. It grows with the bytes of
    the pickles read into it (BASE + PER_BYTE x bytes), so a few hundred bytes that reference
    themselves cannot ask for 2**64 of anything."""

    BASE = 100_000
    PER_BYTE = 16

    def __init__(self, path, nbytes: int = 0):
        self.path, self.nbytes, self.left = path, 0, self.BASE
        self.add_bytes(nbytes)

    def add_bytes(self, nbytes: int):
        """A pickle of `nbytes` is read against this budget."""
        self.nbytes += nbytes
        self.left += self.PER_BYTE * nbytes

    def spend(self, units: int, what: str):
        self.left -= units
        if self.left < 0:
            raise BadInput(f"{self.path}: {what} expands far beyond the {self.nbytes} bytes of its pickle "
                           "(shared or self-referencing objects); refused")
