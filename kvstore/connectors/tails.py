"""Tails: the first tokens of a partial chunk, stored so the next turn need not recompute
them.

A finished request whose output is saved (``save_outputs``, vllm_requests.py) also
leaves the first tokens of its last, partial chunk as a tail block, in whole tail
units (:func:`tail_unit`: a quarter chunk in whole engine blocks), keyed by the chunk
before it and those tokens (:func:`~kvstore.keys.tail_key`): :func:`output_tail`. The
next turn of the conversation extends those tokens: after the chunks its lookup
found, the longest tail whose tokens its prompt continues with is loaded too, so the
partial chunk is not recomputed (:func:`find_tail`: at most three lengths asked for,
longest first, each of every rank's keys). Both sides key a tail with :func:`tail_at`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.keys import BlockKey, tail_key, tokens_to_bytes

__all__ = ["Tail", "find_tail", "output_tail", "tail_at", "tail_unit"]


@dataclass(frozen=True)
class Tail:
    """A tail: the first ``tokens`` tokens of the chunk after some full chunks, and its
    key per key index."""

    tokens: int
    keys: dict[int, BlockKey]


def tail_unit(chunk_tokens: int, block_size: int) -> int:
    """Tails are stored and found in multiples of this many tokens: a quarter chunk in
    whole engine blocks (at most three lengths to look for after a chunk)."""
    return max(block_size, chunk_tokens // 4 // block_size * block_size)


def tail_at(
    keys: dict[int, list[BlockKey]], tokens: Sequence[int], chunks: int, sizes: tuple[int, int]
) -> Callable[[int], Tail]:
    """The tails after chunk ``chunks - 1`` of ``tokens`` (``keys``: every key index's
    chunk keys, ``chunks`` >= 1 of them; ``sizes``: chunk and engine block size): a
    function of the tail's length (at most the tokens given past those chunks)."""
    start = chunks * sizes[0]
    data = bytes(tokens_to_bytes(list(tokens[start : start + sizes[0]])))

    def of(n: int) -> Tail:
        return Tail(n, {r: tail_key(ks[chunks - 1], data[: n * 4]) for r, ks in keys.items()})

    return of


def output_tail(
    keys: dict[int, list[BlockKey]], tokens: Sequence[int], chunks: int, sizes: tuple[int, int]
) -> Tail | None:
    """The tail to save after the ``chunks`` full chunks of a finished request's computed
    ``tokens``: its tokens past them in whole tail units (None: no chunk before it, or
    less than a unit)."""
    unit = tail_unit(*sizes)
    n = (len(tokens) - chunks * sizes[0]) // unit * unit
    if chunks < 1 or n <= 0:
        return None
    return tail_at(keys, tokens, chunks, sizes)(n)


def find_tail(
    exists: Callable[[BlockKey], bool],
    keys: dict[int, list[BlockKey]],
    tokens: Sequence[int],
    loaded: int,
    sizes: tuple[int, int],
) -> Tail | None:
    """The longest stored tail after chunk ``loaded - 1`` that ``tokens`` continue with,
    for every key index of ``keys`` (``exists``: is a key stored). The engine computes a
    prompt's last token itself, so a tail never reaches it."""
    chunk, block = sizes
    if loaded < 1 or any(len(ks) < loaded for ks in keys.values()):
        return None
    unit = tail_unit(chunk, block)
    most = min(chunk - 1, len(tokens) - 1 - loaded * chunk) // unit * unit
    at = tail_at(keys, tokens, loaded, sizes)
    for n in range(most, 0, -unit):
        found = at(n)
        if all(exists(key) for key in found.keys.values()):
            return found
    return None
