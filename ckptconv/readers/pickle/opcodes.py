"""The pickle VM's data opcodes (vm.py runs them): the table from opcode to handler (`_OPS`, filled
by `@_op`) and the handlers that only push, pop and fill what the pickle spells out - framing, the
stack, scalars, strings and bytes, containers, the memo. The handlers that resolve globals, call,
instantiate, set state or reach outside the pickle are vm.py's, under its SECURITY comment.
"""
import codecs
import struct

from ...errors import printable

from .standins import InertObject, StandIn, StateDict


_OPS = [None] * 256   # opcode -> handler(vm, op); a true result means STOP
_U16, _U32, _U64, _I32, _F64BE = (struct.Struct(f) for f in ("<H", "<I", "<Q", "<i", ">d"))


def _op(*codes):
    def add(handler):
        for code in codes:
            _OPS[code] = handler
        return handler
    return add


def _pushing(code, value):
    _OPS[code] = lambda vm, op: vm.stack.append(value)


# --- framing and the stack

@_op(0x80)  # PROTO
def _proto(vm, op):
    if vm.byte() > 5:
        raise vm.ctx.bad("unsupported pickle protocol")


@_op(0x95)  # FRAME: a length hint; opcodes run on regardless
def _frame(vm, op):
    if vm.unpack(_U64) > vm.n - vm.pos:
        raise vm.ctx.bad("FRAME longer than the data")


@_op(0x2E)  # STOP
def _stop(vm, op):
    if len(vm.stack) != 1 or vm.metastack:
        raise vm.ctx.bad("STOP with an unbalanced stack")
    return True


@_op(0x28)  # MARK
def _mark(vm, op):
    vm.metastack.append(vm.stack)
    vm.stack = []


@_op(0x30)  # POP
def _pop(vm, op):
    if vm.stack:
        vm.stack.pop()
    else:
        vm.pop_mark()


@_op(0x31)  # POP_MARK
def _pop_mark(vm, op):
    vm.pop_mark()


@_op(0x32)  # DUP
def _dup(vm, op):
    vm.stack.append(vm.stack[-1])


# --- scalars

_pushing(0x4E, None)   # NONE
_pushing(0x88, True)   # NEWTRUE
_pushing(0x89, False)  # NEWFALSE
_pushing(0x29, ())     # EMPTY_TUPLE


@_op(0x4B)  # BININT1
def _binint1(vm, op):
    vm.stack.append(vm.byte())


@_op(0x4D)  # BININT2
def _binint2(vm, op):
    vm.stack.append(vm.unpack(_U16))


@_op(0x4A)  # BININT
def _binint(vm, op):
    vm.stack.append(vm.unpack(_I32))


@_op(0x8A)  # LONG1
def _long1(vm, op):
    vm.stack.append(int.from_bytes(vm.take(vm.byte()), "little", signed=True))


@_op(0x8B)  # LONG4
def _long4(vm, op):
    k = vm.unpack(_I32)
    if k > 1 << 20:
        raise vm.ctx.bad(f"LONG4 of {k} bytes")
    vm.stack.append(int.from_bytes(vm.take(k), "little", signed=True))


@_op(0x47)  # BINFLOAT
def _binfloat(vm, op):
    vm.stack.append(vm.unpack(_F64BE))


@_op(0x49)  # INT (text): also spells True/False in protocol 0
def _int(vm, op):
    text = vm.line()
    vm.stack.append(True if text == b"01" else False if text == b"00" else int(text))


@_op(0x4C)  # LONG (text)
def _long(vm, op):
    vm.stack.append(int(vm.line().rstrip(b"L")))


@_op(0x46)  # FLOAT (text)
def _float(vm, op):
    vm.stack.append(float(vm.line()))


# --- strings and bytes

@_op(0x58)  # BINUNICODE
def _binunicode(vm, op):
    vm.stack.append(str(vm.take(vm.unpack(_U32)), "utf-8", "surrogatepass"))


@_op(0x8C)  # SHORT_BINUNICODE
def _short_binunicode(vm, op):
    vm.stack.append(str(vm.take(vm.byte()), "utf-8", "surrogatepass"))


@_op(0x8D)  # BINUNICODE8
def _binunicode8(vm, op):
    vm.stack.append(str(vm.take(vm.unpack(_U64)), "utf-8", "surrogatepass"))


@_op(0x56)  # UNICODE (text)
def _unicode(vm, op):
    vm.stack.append(vm.line().decode("raw-unicode-escape"))


@_op(0x43)  # SHORT_BINBYTES
def _short_binbytes(vm, op):
    vm.push_bytes(vm.byte())


@_op(0x42)  # BINBYTES
def _binbytes(vm, op):
    vm.push_bytes(vm.unpack(_U32))


@_op(0x8E)  # BINBYTES8
def _binbytes8(vm, op):
    vm.push_bytes(vm.unpack(_U64))


@_op(0x96)  # BYTEARRAY8
def _bytearray8(vm, op):
    vm.push_bytes(vm.unpack(_U64), mutable=True)


@_op(0x55)  # SHORT_BINSTRING (py2 str)
def _short_binstring(vm, op):
    vm.stack.append(str(vm.take(vm.byte()), "latin1"))


@_op(0x54)  # BINSTRING
def _binstring(vm, op):
    vm.stack.append(str(vm.take(vm.unpack(_I32)), "latin1"))


@_op(0x53)  # STRING (text, quoted)
def _string(vm, op):
    text = vm.line()
    if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b"'", b'"'):
        raise vm.ctx.bad("STRING opcode argument is not quoted")
    vm.stack.append(str(codecs.escape_decode(text[1:-1])[0], "latin1"))


# --- containers (tuples and frozensets record their depth and size, ctx.tuple; keys are checked
# before they are hashed, ctx.hashing)

@_op(0x85, 0x86, 0x87)  # TUPLE1/2/3
def _tuple_n(vm, op):
    k = op - 0x84
    if len(vm.stack) < k:
        _underflow(vm.ctx)
    vm.stack[-k:] = [vm.ctx.tuple(vm.stack[-k:])]


@_op(0x74)  # TUPLE
def _tuple(vm, op):
    items = vm.pop_mark()
    vm.stack.append(vm.ctx.tuple(items))


@_op(0x5D)  # EMPTY_LIST
def _empty_list(vm, op):
    vm.stack.append([])


@_op(0x6C)  # LIST
def _list(vm, op):
    items = vm.pop_mark()  # (before `vm.stack` is looked up: popping the mark replaces it)
    vm.stack.append(items)


@_op(0x61)  # APPEND
def _append(vm, op):
    item = vm.stack.pop()
    _as(vm.stack[-1], list, vm.ctx, "APPEND").append(item)


@_op(0x65)  # APPENDS
def _appends(vm, op):
    items = vm.pop_mark()
    _as(vm.stack[-1], list, vm.ctx, "APPENDS").extend(items)


@_op(0x7D)  # EMPTY_DICT
def _empty_dict(vm, op):
    vm.stack.append({})


@_op(0x64)  # DICT
def _dict(vm, op):
    items = vm.pop_mark()
    vm.stack.append(dict(zip(vm.ctx.hashing(items[0::2]), items[1::2])))


@_op(0x73)  # SETITEM
def _setitem(vm, op):
    v = vm.stack.pop()
    k = vm.stack.pop()
    _as(vm.stack[-1], dict, vm.ctx, "SETITEM")[vm.ctx.hashing((k,))[0]] = v


@_op(0x75)  # SETITEMS
def _setitems(vm, op):
    items = vm.pop_mark()
    if len(items) % 2:
        raise vm.ctx.bad("SETITEMS with an odd number of items")
    d = _as(vm.stack[-1], dict, vm.ctx, "SETITEMS")
    vm.ctx.hashing(items[0::2])
    for i in range(0, len(items), 2):
        d[items[i]] = items[i + 1]


@_op(0x8F)  # EMPTY_SET
def _empty_set(vm, op):
    vm.stack.append(set())


@_op(0x90)  # ADDITEMS
def _additems(vm, op):
    items = vm.pop_mark()
    _as(vm.stack[-1], set, vm.ctx, "ADDITEMS").update(vm.ctx.hashing(items))


@_op(0x91)  # FROZENSET
def _frozenset_op(vm, op):
    items = vm.pop_mark()
    vm.stack.append(vm.ctx.frozenset(items))


# --- memo

def _memo_ops(put, get, index):
    """PUT/GET in one spelling of the memo index (text line, one byte, four bytes)."""
    _OPS[put] = lambda vm, op: vm.memo_put(index(vm))
    _OPS[get] = lambda vm, op: vm.memo_get(index(vm))


_memo_ops(0x70, 0x67, lambda vm: int(vm.line()))    # PUT, GET (text)
_memo_ops(0x71, 0x68, lambda vm: vm.byte())         # BINPUT, BINGET
_memo_ops(0x72, 0x6A, lambda vm: vm.unpack(_U32))   # LONG_BINPUT, LONG_BINGET


@_op(0x94)  # MEMOIZE
def _memoize(vm, op):
    vm.memo_put(len(vm.memo) if vm.fetched is None else vm.memoized)   # (no PUTs beside: fetched_memo)
    vm.memoized += 1


def _underflow(ctx):
    raise ctx.bad("stack underflow")


def _as(obj, kind, ctx, opname):
    """The container an item opcode fills: a plain one, or the items of a record (an instance of a
    dict or list subclass: Lightning's AttributeDict)."""
    if type(obj) is kind or (kind is dict and isinstance(obj, StateDict)):
        return obj
    if isinstance(obj, InertObject) and kind in (dict, list):
        return obj.mapping(ctx, opname) if kind is dict else obj.sequence(ctx, opname)
    what = f"the global {printable(obj.qualname, 200)}" if isinstance(obj, StandIn) else f"a {type(obj).__name__}"
    raise ctx.unsafe(f"{opname} on {what}")
