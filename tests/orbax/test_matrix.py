"""Every variant of tests/fixtures/orbax.py, made fresh by the real Orbax (`make test-orbax` sets
CKPTCONV_ORBAX_FIXTURES to where it made them): the reader's tests run against those instead of the
committed copies."""
import os

import pytest

if not os.environ.get("CKPTCONV_ORBAX_FIXTURES"):
    pytest.skip("needs fixtures made by the real Orbax: make test-orbax", allow_module_level=True)

from tests.readers.test_orbax import *  # noqa: F401,F403,E402  (the same tests, over the fresh fixtures)
