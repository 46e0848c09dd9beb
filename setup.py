"""The one build step pyproject.toml cannot declare (yet): kvstore's C extension.

``kvstore._chain`` (csrc/chain.c) computes the chained chunk keys of
``kvstore.keys.chain_keys`` in one C loop over xxHash's XXH3 (csrc/xxhash/, BSD
2-Clause). It is optional: where it cannot be compiled (no C compiler, no Python
headers) the install goes on without it and ``kvstore.keys`` uses its pure-Python
path, which gives the same keys, slower. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._chain",
            sources=["csrc/chain.c"],
            depends=["csrc/xxhash/xxhash.h"],
            include_dirs=["csrc"],
            optional=True,
        )
    ]
)
