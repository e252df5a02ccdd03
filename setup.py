"""The compiled parts, both optional: without a compiler the package installs and works without them.
ckptconv._sha256x: several SHA-256 streams at once with the x86 SHA extensions (else hashlib).
ckptconv._mapguard: a SIGBUS handler, so that a mapped input truncated while it is read stops the
run with an error instead of killing the process (else unguarded, as before; see mapped.py)."""
from setuptools import Extension, setup

# -O3: the streams' state arrays must be scalarised into registers for the rounds to interleave
# (at -O2 two streams ran at 2.8 GB/s instead of 3.5).
setup(ext_modules=[Extension("ckptconv._sha256x", ["ckptconv/_sha256x.c"], extra_compile_args=["-O3"], optional=True),
                   Extension("ckptconv._mapguard", ["ckptconv/_mapguard.c"], optional=True)])
