"""The one compiled part: ckptconv._sha256x (several SHA-256 streams at once with the x86 SHA
extensions). Optional: without a compiler the package installs and hashes with hashlib."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptconv._sha256x", ["ckptconv/_sha256x.c"], optional=True)])
