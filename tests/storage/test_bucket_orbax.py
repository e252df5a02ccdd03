"""Orbax checkpoints in a bucket (moto's S3 API on 127.0.0.1) read as the same files on a local disk
do: convert and `reshard --tp 2` write byte-identical outputs, for the per-array zarr layouts, OCDBT and
a CheckpointManager directory (its latest complete step found from the listing)."""
import os

import pytest

from tests.helpers import DATA
from tests.storage.test_bucket_sources import same_tree
from tests.storage.test_bucket_training_formats import both

FIXTURES = DATA / "orbax"


# every committed layout under `make test-orbax`; the OCDBT one in `make test`
# (each variant starts its own reads against the server: about 5 s each on two cores)
EVERY = ["flax-zarr2", "flax-zarr3", "flax-raw", "flax-ocdbt", "manager", "manager-zarr"]


@pytest.mark.parametrize("name", EVERY if os.environ.get("CKPTCONV_ORBAX_FIXTURES") else ["flax-ocdbt"])
def test_an_orbax_checkpoint_converts_from_a_bucket_as_locally(s3, tmp_path, name):
    same_tree(*both(s3, FIXTURES / name, tmp_path, "convert"))


def test_an_orbax_checkpoint_reshards_from_a_bucket_as_locally(s3, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('layout = "jax"\n[[rule]]\npattern = ".*(kernel|embedding)"\naxis = 1\n')
    same_tree(*both(s3, FIXTURES / "flax-zarr2", tmp_path, "reshard", "--tp", "2", "--rules", rules))
