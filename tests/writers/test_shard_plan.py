"""The shard plan on plain data (Hugging Face's rule): shards filled in order up to the limit, a
tensor never split, one larger than the limit alone, names always STEM-0000k-of-0000n."""
from types import SimpleNamespace

from ckptconv import dtypes
from ckptconv.writers.base import assign
from ckptconv.writers.files import plan_shards

U8 = dtypes.BY_CODE["U8"]


def tensors(*sizes):
    return [SimpleNamespace(name=f"t{i}", dtype=U8, shape=(n,), nbytes=n) for i, n in enumerate(sizes)]


def layout(shards):
    return [(s.name, [t.name for t in s.tensors]) for s in shards]


def test_filled_in_order_up_to_the_limit():
    assert layout(plan_shards(tensors(3, 3, 3), 6)) == [("model-00001-of-00002.safetensors", ["t0", "t1"]),
                                                         ("model-00002-of-00002.safetensors", ["t2"])]


def test_a_tensor_over_the_limit_gets_a_shard_of_its_own():
    assert layout(plan_shards(tensors(2, 10, 2), 4)) == [("model-00001-of-00003.safetensors", ["t0"]),
                                                          ("model-00002-of-00003.safetensors", ["t1"]),
                                                          ("model-00003-of-00003.safetensors", ["t2"])]


def test_one_shard_is_still_numbered_and_the_stem_names_it():
    (shard,) = plan_shards(tensors(1, 1), 100, "adapter_model")
    assert shard.name == "adapter_model-00001-of-00001.safetensors"
    assert shard.size == len(shard.header) + 2


def test_nothing_to_write_is_one_empty_shard():
    assert layout(plan_shards([], 10)) == [("model-00001-of-00001.safetensors", [])]


def test_units_are_balanced_by_bytes_deterministically():
    assert assign([5, 4, 3, 3, 1], 2) == [0, 1, 1, 0, 1]
    assert assign([1, 1], 3) == [0, 1]
    assert assign([], 2) == []
