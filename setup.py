"""The one build step pyproject.toml cannot declare (yet): kvstore's C extensions.

- ``kvstore.native._chain`` (csrc/chain.c) computes the chained chunk keys of
  ``kvstore.keys.chain_keys`` in one C loop over xxHash's XXH3 (csrc/xxhash/, BSD
  2-Clause).
- ``kvstore.native._memcopy`` (csrc/memcopy.c) copies many host regions in one call with
  the GIL released once, for the copy engine (``kvstore.copies``), and copies while
  verifying XXH3 checksums in one pass (``kvstore.format.codec``'s decode).

Both are optional: where they cannot be compiled (no C compiler, no Python
headers) the install goes on without them and kvstore uses its pure-Python paths,
which give the same results, slower. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.native._chain",
            sources=["csrc/chain.c"],
            depends=["csrc/xxhash/xxhash.h"],
            include_dirs=["csrc"],
            optional=True,
        ),
        Extension(
            "kvstore.native._memcopy",
            sources=["csrc/memcopy.c"],
            depends=["csrc/xxhash/xxhash.h"],
            include_dirs=["csrc"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
