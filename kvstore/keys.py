"""Chunk keys: chained, namespaced, deterministic hashes of token prefixes.

Tokens are cut into chunks of ``block_tokens``; only full chunks get a key.
The key of chunk ``i`` is::

    key[0] = xxh3_128(seed,     seed=xxh3_64(tokens[0]))
    key[i] = xxh3_128(key[i-1], seed=xxh3_64(tokens[i]))

where ``tokens[i]`` is the little-endian int32 bytes of the chunk and
``seed`` is the 16-byte fingerprint of a :class:`Namespace` (model id and
revision, KV layout, dtype, tensor-parallel rank, adapter, user salt). Two
requests share a key only if they share the whole prefix in the same
namespace, and the same tokens give the same keys in every process on every
machine: no ``hash()``, no pickle, no per-process random seed.

The chain state is the full 128-bit key; each chunk enters through its 64-bit
xxh3 digest as the seed of the next xxh3-128. The whole chain runs in one C
loop over xxHash's XXH3 (``kvstore.native._chain``, csrc/chain.c, compiled by the
install): ~30 ns per 16-token chunk, most of it creating the key's ``bytes``.
Where that extension was not built, the same keys come from a pure-Python
path (``itertools.accumulate`` over python-xxhash, no bytecode per chunk, but
~150 ns per chunk in the calls and objects it creates: too slow at vLLM's
16-token blocks). :data:`CHAIN_IMPL` says which one runs.

Keys are plain 16-byte ``bytes`` (:data:`BlockKey`), cheap to create, to
hash in dicts and to send anywhere; ``key.hex()`` is the readable form.
Engines that already have block hashes pass them through
:func:`engine_keys`, which folds in the namespace so that different models
never share keys.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, starmap
from typing import TYPE_CHECKING, Any, NewType

import numpy as np
import torch
import xxhash

from kvstore.errors import InvalidInputError, LayoutMismatchError
from kvstore.layout import KVLayout
from kvstore.native import chain as _chain  # None where the install did not compile it

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = [
    "CHAIN_IMPL",
    "KEY_BYTES",
    "BlockKey",
    "Namespace",
    "ChunkTokens",
    "check_keys",
    "chain_keys",
    "chain_keys_native",
    "chain_keys_python",
    "engine_keys",
    "format_key",
    "tail_key",
    "tokens_to_bytes",
]

#: A 16-byte chunk key. At run time it is plain ``bytes`` (like vLLM's BlockHash).
BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

#: Which :func:`chain_keys` runs: ``"c"`` (the compiled ``kvstore.native._chain``) or
#: ``"python"`` (the fallback where the extension was not built). Same keys either way.
CHAIN_IMPL = "python" if _chain is None else "c"

#: The compiled chain loop itself, ``chain_keys_native(token_bytes, step_bytes, parent)``
#: (``kvstore.native._chain``; ``step_bytes`` is ``4 * block_tokens``), or None where the install
#: did not build it. :func:`chain_keys` checks its arguments and runs it (else
#: :func:`chain_keys_python`); both are public so that the two can be compared.
chain_keys_native: Callable[[ReadableBuffer, int, ReadableBuffer], list[bytes]] | None = (
    None if _chain is None else _chain.chain_keys
)


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two chunks of KV to be interchangeable.

    Args:
        model: model id and revision, e.g. ``"meta-llama/Llama-3.1-8B@5f0b02c"``.
        layout: the KV layout (its fingerprint covers geometry and dtype).
        tp_rank: tensor-parallel rank whose heads the KV holds (None: unsharded).
        tp_size: tensor-parallel world size (None: unsharded).
        adapter: LoRA/adapter id, if any.
        salt: a user salt (e.g. per-tenant isolation).
        tenant: the kvstore-server tenant the chunks belong to (the AUTH reply names
            it): the same prompt under two tenants gives different keys. None
            leaves the seed exactly as it was before tenants existed.
    """

    model: str
    layout: KVLayout
    tp_rank: int | None = None
    tp_size: int | None = None
    adapter: str | None = None
    salt: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidInputError(f"namespace model must be a non-empty str, got {self.model!r}")
        if not isinstance(self.layout, KVLayout):
            raise InvalidInputError("namespace layout must be a KVLayout")
        for name in ("tp_rank", "tp_size"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise InvalidInputError(f"namespace {name} must be an int >= 0, got {value!r}")
        for name in ("adapter", "salt", "tenant"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"namespace {name} must be a str, got {value!r}")

    @property
    def seed(self) -> bytes:
        """The 16-byte fingerprint that seeds every key chain in this namespace."""
        return _namespace_seed(self)

    def check_layout(self, layout: KVLayout) -> None:
        """Raise :class:`LayoutMismatchError` if this namespace is for another layout."""
        if self.layout.fingerprint != layout.fingerprint:
            raise LayoutMismatchError(
                f"namespace {self.model!r} was made for layout {self.layout.describe()}, "
                f"not {layout.describe()}"
            )


@lru_cache(maxsize=1024)
def _namespace_seed(ns: Namespace) -> bytes:
    fields: tuple[str | None, ...] = (
        "kvstore.ns.v1",
        ns.model,
        ns.layout.fingerprint.hex(),
        str(ns.layout.dtype).removeprefix("torch."),
        None if ns.tp_rank is None else str(ns.tp_rank),
        None if ns.tp_size is None else str(ns.tp_size),
        ns.adapter,
        ns.salt,
    )
    if ns.tenant is not None:  # only then: seeds without a tenant stay what they were
        fields = (*fields, "tenant", ns.tenant)
    # Length-prefixed fields, so ("ab", "c") and ("a", "bc") differ; an absent
    # field (None) is encoded apart from an empty string.
    packed = b"".join(
        b"\xff\xff\xff\xff" if f is None else struct.pack("<I", len(f.encode())) + f.encode()
        for f in fields
    )
    return xxhash.xxh3_128_digest(packed)


def tokens_to_bytes(token_ids: Any, limit: int | None = None) -> bytes | memoryview:
    """Little-endian int32 bytes of ``token_ids`` (list, numpy array or tensor).

    For an int32 array or CPU tensor this is a view of its memory, not a copy;
    hash it before changing the tokens.

    ``limit`` keeps only the first ``limit`` tokens (before conversion, so a
    long list's unused tail costs nothing).
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise InvalidInputError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex:
            raise InvalidInputError(f"token_ids must be integers, got {token_ids.dtype}")
        token_ids = token_ids[:limit].cpu().numpy()
    elif not isinstance(token_ids, np.ndarray):
        if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(
            token_ids, Sequence | Iterable
        ):
            raise InvalidInputError(
                f"token_ids must be a list, numpy array or tensor of ints, "
                f"got {type(token_ids).__name__}"
            )
        seq = token_ids if isinstance(token_ids, Sequence) else list(token_ids)
        _check_tail(seq, limit)
        return _list_to_bytes(seq[:limit])
    return _array_to_bytes(token_ids[:limit])


def _list_to_bytes(seq: Sequence[Any]) -> bytes | memoryview:
    """int32 bytes of a list of token ids; 1.5 or "7" are rejected, not converted.

    ``array.array`` converts in C and is strict about types (it takes ints,
    including numpy ints and bools, and raises on floats, strings and
    out-of-range values): the fastest strict path, ~3.5 ms per 128K tokens.
    """
    try:
        arr = array.array("i", seq)
    except TypeError:
        bad = next((x for x in seq if not _is_int(x)), None)
        raise InvalidInputError(f"token_ids must all be ints, got {bad!r}") from None
    except OverflowError:
        raise InvalidInputError("token_ids must fit in int32") from None
    if arr.itemsize != 4:  # pragma: no cover - C int is 32-bit on every supported platform
        return _array_to_bytes(np.asarray(arr, dtype=np.int64))
    if sys.byteorder == "big":  # pragma: no cover - keys are little-endian everywhere
        arr.byteswap()
    return memoryview(arr).cast("B")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_tail(seq: Sequence[Any], limit: int | None) -> None:
    """Validate the partial chunk after ``limit`` that gets no key but must be token ids."""
    if limit is None:
        return
    for x in seq[limit:]:
        if not _is_int(x) or not _INT32_MIN <= int(x) <= _INT32_MAX:
            raise InvalidInputError(f"token_ids must all be int32 ints, got {x!r}")


def _array_to_bytes(arr: np.ndarray) -> memoryview:
    """The int32 little-endian bytes of ``arr`` -- a view of it when it already is
    that (no copy of a long prompt), else of a converted copy."""
    if arr.ndim != 1:
        raise InvalidInputError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
            raise InvalidInputError("token_ids must fit in int32")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr).data.cast("B")


def chain_keys(token_bytes: bytes | memoryview, block_tokens: int, parent: bytes) -> list[BlockKey]:
    """Chained keys of the full chunks in ``token_bytes``:
    ``key[i] = xxh3_128(key[i-1], seed=xxh3_64(chunk[i]))``.

    ``parent`` is the namespace seed for a chain from the start of a prompt,
    or the key of the chunk just before ``token_bytes`` to continue a chain.
    Runs in C (``kvstore.native._chain``) where the install built it, else in Python:
    the same keys, byte for byte.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidInputError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    if _chain is not None:
        return _chain.chain_keys(token_bytes, block_tokens * 4, parent)  # type: ignore[return-value]
    return chain_keys_python(token_bytes, block_tokens, parent)


def chain_keys_python(
    token_bytes: bytes | memoryview, block_tokens: int, parent: bytes
) -> list[BlockKey]:
    """:func:`chain_keys` in Python (no argument checks), what runs in an install without
    the C extension: the same keys as :data:`chain_keys_native`, byte for byte."""
    step = block_tokens * 4
    view = memoryview(token_bytes).cast("B")
    full = len(view) - len(view) % step
    # Every step runs in C (iter_unpack, starmap, accumulate, the hashes): no Python
    # bytecode per chunk. xxh3_128's seed argument carries the chunk's digest along.
    digests = starmap(xxhash.xxh3_64_intdigest, struct.iter_unpack(f"{step}s", view[:full]))
    chain: list[bytes] = list(accumulate(digests, xxhash.xxh3_128_digest, initial=parent))
    del chain[0]
    return chain  # type: ignore[return-value]  # BlockKey is bytes at run time


def tail_key(parent: BlockKey, token_bytes: bytes | memoryview) -> BlockKey:
    """The key of a *tail*: the first tokens of a chunk (fewer than a chunk) after the
    chunk whose key is ``parent``, ``token_bytes`` their int32 bytes.

    ``xxh3_128(b"kvstore-tail|" + parent + tokens)``: a construction no full chunk's
    key shares, so a tail is never served as a whole chunk, and two tails share a key
    only if they continue the same prefix with the same tokens.
    """
    data = b"kvstore-tail|" + bytes(parent) + bytes(token_bytes)
    return BlockKey(xxhash.xxh3_128_digest(data))


def _opaque_bytes(value: Any) -> bytes:
    """The engine hash as bytes, tagged by type so "a", b"a" and 97 stay distinct."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b" + bytes(value)
    if isinstance(value, str):
        return b"s" + value.encode()
    if isinstance(value, int) and not isinstance(value, bool):
        return b"i" + value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    raise InvalidInputError(
        f"engine block hash must be bytes, str or int, got {type(value).__name__}"
    )


def engine_keys(hashes: Iterable[Any], namespace: Namespace) -> list[BlockKey]:
    """Keys for block hashes an engine computed itself (vLLM, SGLang).

    The engine's hash is folded with the namespace seed so that hashes from
    different models, layouts or ranks never collide in a shared store.
    """
    seed = namespace.seed
    digest = xxhash.xxh3_128_digest
    return [BlockKey(digest(seed + b"|engine|" + _opaque_bytes(h))) for h in hashes]


def check_keys(keys: Any, what: str = "keys") -> list[BlockKey]:
    """Validate a sequence of keys; return it as a list of 16-byte bytes."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Iterable):
        raise InvalidInputError(f"{what} must be a sequence of 16-byte keys")
    if (  # the usual case, checked in C: no Python loop
        isinstance(keys, (list, tuple))
        and set(map(type, keys)) <= {bytes}
        and set(map(len, keys)) <= {KEY_BYTES}
    ):
        return list(keys)
    out: list[BlockKey] = []
    for i, key in enumerate(keys):
        if type(key) is not bytes:
            if not isinstance(key, (bytes, bytearray, memoryview)):
                raise InvalidInputError(
                    f"{what}[{i}] must be a 16-byte key (bytes), got {type(key).__name__}"
                )
            key = bytes(key)
        if len(key) != KEY_BYTES:
            raise InvalidInputError(f"{what}[{i}] has {len(key)} bytes, keys have {KEY_BYTES}")
        out.append(BlockKey(key))
    return out


@dataclass(frozen=True)
class ChunkTokens:
    """Which tokens a run of chunks holds, for KV events (routers index token ids).

    ``keys``: the chunks, in prompt order; ``tokens``: the little-endian int32
    bytes of exactly ``len(keys) * block_tokens`` tokens; ``parent``: the key of
    the chunk before ``keys[0]`` (None: ``keys[0]`` is a prompt's first chunk).
    Build it with :meth:`of`, which checks all three.
    """

    keys: tuple[BlockKey, ...]
    tokens: bytes
    parent: BlockKey | None
    block_tokens: int

    @classmethod
    def of(
        cls, keys: Sequence[BlockKey], token_ids: Any, parent: Any, block_tokens: int
    ) -> ChunkTokens:
        """Checked: ``token_ids`` (list, array or tensor) must cover exactly the chunks of
        ``keys``; ``parent`` must be a key or None. Raises :class:`InvalidInputError`."""
        checked = tuple(check_keys(keys))
        data = bytes(tokens_to_bytes(token_ids))
        want = len(checked) * block_tokens
        if len(data) != 4 * want:
            raise InvalidInputError(
                f"tokens: {len(checked)} chunks of {block_tokens} tokens need {want} token "
                f"ids, got {len(data) // 4}"
            )
        up = None if parent is None else check_keys([parent], "parent")[0]
        return cls(checked, data, up, block_tokens)

    def chunk(self, i: int) -> list[int]:
        """The token ids of chunk ``i``."""
        step = 4 * self.block_tokens
        return [int(t) for t in np.frombuffer(self.tokens[i * step : (i + 1) * step], dtype="<i4")]

    def parent_of(self, i: int) -> BlockKey | None:
        """The key of the chunk before chunk ``i``."""
        return self.parent if i == 0 else self.keys[i - 1]


def format_key(key: bytes) -> str:
    """Readable form of a key (its hex)."""
    return bytes(key).hex()
