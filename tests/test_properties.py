"""Property tests (hypothesis) of the pure parts every output rests on: the lazy TensorSource algebra
(regions, slices, joins and stacks, file spans over a real mapped file), the shard plan, and the
tensor-parallel intervals. Each property is checked against numpy doing the same thing eagerly."""
import math
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from ckptconv import dtypes
from ckptconv.formats.manifest import shard_name
from ckptconv.io.mapped import MappedFile
from ckptconv.tensor import ArraySource, Concat, MappedView, Stacked, iter_blocks
from ckptconv.tp.intervals import plan
from ckptconv.tp.rules import Rule, RuleSet
from ckptconv.layouts.files import plan_shards

F32, U8 = dtypes.BY_CODE["F32"], dtypes.BY_CODE["U8"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


def source_of(array: np.ndarray, name="t"):
    return ArraySource(name, F32, array.shape, lambda: array)


@st.composite
def built(draw):
    """(a lazy source, the array it must equal): an array cut into parts joined again, or stacked."""
    shape = draw(shapes)
    array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) + draw(st.integers(0, 100))
    how = draw(st.sampled_from(["plain", "concat", "stack", "slice-of-concat"]))
    if how == "stack":
        k = draw(st.integers(1, 3))
        arrays = [array + i for i in range(k)]
        return Stacked("t", [source_of(a) for a in arrays]), np.stack(arrays)
    if how == "plain":
        return source_of(array), array
    axis = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(draw(st.lists(st.integers(0, shape[axis]), max_size=3)))
    edges = [0, *cuts, shape[axis]]
    parts = [np.take(array, range(a, b), axis=axis) for a, b in zip(edges, edges[1:]) if b > a]
    joined = Concat("t", [source_of(p) for p in parts], axis)
    if how == "concat":
        return joined, array
    lo = draw(st.integers(0, shape[axis]))
    hi = draw(st.integers(lo, shape[axis]))
    return joined.sliced(axis, lo, hi), np.take(array, range(lo, hi), axis=axis)


@st.composite
def regions(draw, shape):
    index = []
    for n in shape:
        a = draw(st.integers(0, n))
        index.append(slice(a, draw(st.integers(a, n))))
    return tuple(index)


@SETTINGS
@given(st.data())
def test_a_region_of_any_composition_is_numpys_slice(data):
    src, want = data.draw(built())
    assert src.shape == want.shape
    index = data.draw(regions(want.shape))
    got = src.region(index)
    assert got.shape == want[index].shape and np.array_equal(got, want[index])


@SETTINGS
@given(st.data())
def test_a_slice_of_a_slice_is_the_slice_of_the_array(data):
    src, want = data.draw(built())
    axis = data.draw(st.integers(0, len(want.shape) - 1))
    lo = data.draw(st.integers(0, want.shape[axis]))
    hi = data.draw(st.integers(lo, want.shape[axis]))
    cut = src.sliced(axis, lo, hi)
    assert np.array_equal(cut.region(), np.take(want, range(lo, hi), axis=axis))


@SETTINGS
@given(st.data(), st.integers(4, 64))
def test_blocks_are_the_tensors_bytes_in_order(data, limit):
    src, want = data.draw(built())
    got = b"".join(np.ascontiguousarray(b).tobytes() for b in iter_blocks(src, limit))
    assert got == np.ascontiguousarray(want).tobytes()


@SETTINGS
@given(st.data())
def test_a_file_span_points_at_exactly_the_tensors_bytes(tmp_path_factory, data):
    """Where a composition says its bytes are one range of the file (the writer then copies that range
    without reading it as an array), that range is the tensor's row-major bytes."""
    shape = data.draw(shapes)
    rows = np.arange(math.prod(shape) * 3, dtype=np.float32)
    path = tmp_path_factory.mktemp("span") / "data.bin"
    path.write_bytes(b"\x07" * 8 + rows.tobytes())
    mapped = MappedFile(path)
    full = (3 * shape[0],) + shape[1:]
    view = MappedView("t", F32, full, mapped, 8)
    axis0 = data.draw(st.integers(0, full[0]))
    src = view.sliced(0, axis0, data.draw(st.integers(axis0, full[0])))
    if data.draw(st.booleans()):   # a slice of a join along its axis falls inside one part
        parts = [MappedView("p", F32, shape, mapped, 8 + i * rows.nbytes // 3) for i in range(3)]
        joined = Concat("t", parts, 0)
        a = data.draw(st.integers(0, full[0]))
        src = joined.sliced(0, a, data.draw(st.integers(a, full[0])))
    span = src.file_span()
    if span is not None:
        f, at = span
        assert bytes(f.view[at:at + src.nbytes]) == np.ascontiguousarray(src.region()).tobytes()


@SETTINGS
@given(st.lists(st.integers(0, 50), min_size=1, max_size=30), st.integers(1, 120))
def test_the_shard_plan_keeps_order_and_bounds(sizes, limit):
    tensors = [SimpleNamespace(name=f"t{i:03d}", dtype=U8, shape=(n,), nbytes=n) for i, n in enumerate(sizes)]
    shards = plan_shards(tensors, limit)
    assert [t.name for s in shards for t in s.tensors] == [t.name for t in tensors]
    for i, s in enumerate(shards):
        assert s.name == shard_name("model", i, len(shards))
        assert s.data_size == sum(t.nbytes for t in s.tensors)
        assert s.data_size <= limit or len(s.tensors) == 1   # (one larger than the limit stands alone)
        assert len(b"".join(s.header())) == s.header_size
    for a, b in zip(shards, shards[1:]):   # greedy: the next tensor did not fit the shard before it
        assert a.data_size + b.tensors[0].nbytes > limit


@SETTINGS
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 6), st.sampled_from(["column", "row", "vocab"]))
def test_rank_intervals_cover_the_axis_and_join_to_the_tensor(tp, per, other, kind):
    """Every index of the split axis is on exactly one rank, and the pieces in rank order are the
    tensor (torch layout: column and vocab split axis 0, row axis 1)."""
    shape = (tp * per, other) if kind != "row" else (other, tp * per)
    rules = RuleSet("t", "torch", [Rule(".*", kind)])
    (p,) = plan([SimpleNamespace(name="w", dtype=F32, shape=shape, nbytes=4 * math.prod(shape))], rules, tp)
    covered = sorted(i for r in range(tp) for a, b in p.ranges[r] for i in range(a, b))
    assert covered == list(range(shape[p.axis]))
    array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    pieces = [np.concatenate([np.take(array, range(a, b), axis=p.axis) for a, b in p.ranges[r]], axis=p.axis)
              for r in range(tp)]
    assert all(piece.shape == p.piece_shape(r) for r, piece in enumerate(pieces))
    assert np.array_equal(np.concatenate(pieces, axis=p.axis), array)
