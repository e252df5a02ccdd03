"""The memo pass of the pickle VM (vm.py runs it before each pickle): which memo keys the stream
ever reads back, found by stepping over its opcodes without building anything.
"""
import pickletools
import struct


def _arg_sizes() -> list:
    """Per opcode byte, how its argument is laid out, from the standard library's opcode table (data
    only: pickletools describes the format, it runs nothing): a fixed size, LINE or LINES (one or two
    newline-terminated), or the Struct of a length prefix; None for a byte that is no opcode."""
    prefix = {pickletools.TAKEN_FROM_ARGUMENT1: "<B", pickletools.TAKEN_FROM_ARGUMENT4: "<i",
              pickletools.TAKEN_FROM_ARGUMENT4U: "<I", pickletools.TAKEN_FROM_ARGUMENT8U: "<Q"}
    sizes = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            sizes[ord(op.code)] = 0
        elif arg.n == pickletools.UP_TO_NEWLINE:
            sizes[ord(op.code)] = _LINES if arg.name.endswith("_pair") else _LINE
        else:
            sizes[ord(op.code)] = arg.n if arg.n >= 0 else struct.Struct(prefix[arg.n])
    return sizes


_LINE, _LINES = "line", "lines"
_ARG_SIZES = _arg_sizes()
_GETS = {0x67: _LINE, 0x68: struct.Struct("<B"), 0x6A: struct.Struct("<I")}   # GET, BINGET, LONG_BINGET
_PUTS, _MEMOIZE, _STOP = {0x70, 0x71, 0x72}, 0x94, 0x2E
_WATCH = set(_GETS) | _PUTS | {_MEMOIZE, _STOP}


def _line_end(mv, pos) -> int:
    """Just past the newline ending the line at `pos` (a line over 1 KiB: ValueError, store all);
    a short window first, as almost every line is (a stream of short text opcodes is not copied
    a kilobyte per opcode)."""
    at = bytes(mv[pos:pos + 32]).find(b"\n")
    return pos + (at if at >= 0 else bytes(mv[pos:pos + 1024]).index(b"\n")) + 1


def fetched_memo(mv):
    """The memo keys the pickle in `mv` ever reads back (GET), found by stepping over its opcodes
    without building anything, so the run stores only those: torch.save memoizes every object it
    writes (~8 per tensor) and reads back a handful, and a million-tensor file must not hold eight
    million dead objects until its end. None (store everything) when the stream cannot be stepped
    over to its STOP, or mixes MEMOIZE with explicit PUTs (MEMOIZE's key is the memo's length)."""
    sizes, n, pos, keys, puts, memoize = _ARG_SIZES, len(mv), 0, set(), False, False
    try:
        while pos < n:
            op = mv[pos]
            pos += 1
            size = sizes[op]
            if op in _WATCH:
                if op == _STOP:
                    return None if puts and memoize else keys
                get = _GETS.get(op)
                if get is _LINE:
                    keys.add(int(bytes(mv[pos:_line_end(mv, pos) - 1])))
                elif get is not None:
                    keys.add(get.unpack_from(mv, pos)[0])
                puts, memoize = puts or op in _PUTS, memoize or op == _MEMOIZE
            if size.__class__ is int:
                pos += size
            elif size is _LINE:
                pos = _line_end(mv, pos)
            elif size is _LINES:
                pos = _line_end(mv, _line_end(mv, pos))
            elif size is None:
                return None
            else:
                length = size.unpack_from(mv, pos)[0]
                if length < 0:
                    return None
                pos += size.size + length
    except (ValueError, struct.error):
        return None
    return None


def pickle_end(mv, pos: int = 0) -> tuple:
    """Step over the opcodes of the pickle at `pos` of `mv` without building anything, to find how
    much of a stream read front to back (an object's legacy torch pickles) must be fetched before the
    VM runs it: ("stop", just past its STOP, -); ("short", the offset `mv` must reach to go on: an
    opcode's argument, or a line, runs past its end; where that opcode starts, to step on from once
    it does); ("bad", where the VM stops anyway: a byte that is no opcode, or a negative length, -)."""
    sizes, n = _ARG_SIZES, len(mv)
    while pos < n:
        op = mv[pos]
        at = pos + 1
        size = sizes[op]
        if size is None:
            return "bad", pos, pos
        if size.__class__ is int:
            end = at + size
        elif size is _LINE or size is _LINES:
            end = at
            for _ in range(2 if size is _LINES else 1):
                found = _find_line_end(mv, end)
                if found < 0:
                    return "short", n + 1, pos
                end = found
        else:
            if at + size.size > n:
                return "short", at + size.size, pos
            length = size.unpack_from(mv, at)[0]
            if length < 0:
                return "bad", pos, pos
            end = at + size.size + length
        if end > n:
            return "short", end, pos
        if op == _STOP:
            return "stop", end, end
        pos = end
    return "short", n + 1, pos


def _find_line_end(mv, pos: int) -> int:
    """Just past the newline ending the line at `pos`, or -1 if `mv` ends first (windows growing
    fourfold: linear time)."""
    k = 32
    while True:
        at = bytes(mv[pos:pos + k]).find(b"\n")
        if at >= 0:
            return pos + at + 1
        if pos + k >= len(mv):
            return -1
        k *= 4
