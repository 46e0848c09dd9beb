"""Finding a stored *tail* after a prompt's stored chunks (the scheduler side).

A finished request whose output is saved (``save_outputs``, vllm_requests.py) also
leaves the first tokens of its last, partial chunk as a tail block, in whole tail
units (:func:`~kvstore.connectors.plan.tail_unit`: a quarter chunk), keyed by the
chunk before it and those tokens (:func:`~kvstore.keys.tail_key`). The next turn of
the conversation extends those tokens: after the chunks its lookup found, the longest
tail whose tokens its prompt continues with is loaded too, so the partial chunk is
not recomputed. At most three lengths are asked for, longest first, each of every
rank's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.connectors.plan import Tail, tail_unit
from kvstore.keys import BlockKey, tail_key, tokens_to_bytes

__all__ = ["find_tail"]


def find_tail(
    exists: Callable[[BlockKey], bool],
    keys: dict[int, list[BlockKey]],
    tokens: Sequence[int],
    loaded: int,
    sizes: tuple[int, int],
) -> Tail | None:
    """The longest stored tail after chunk ``loaded - 1`` that ``tokens`` continue with,
    for every key index of ``keys`` (``exists``: is a key stored). ``sizes``: the chunk
    and the engine's block size. The engine computes a prompt's last token itself, so a
    tail never reaches it."""
    chunk, block = sizes
    if loaded < 1 or any(len(ks) < loaded for ks in keys.values()):
        return None
    unit = tail_unit(chunk, block)
    start = loaded * chunk
    most = min(chunk - 1, len(tokens) - 1 - start) // unit * unit
    if most <= 0:
        return None
    data = tokens_to_bytes(list(tokens[start : start + most]))
    for n in range(most, 0, -unit):
        found = {r: tail_key(ks[loaded - 1], data[: n * 4]) for r, ks in keys.items()}
        if all(exists(key) for key in found.values()):
            return Tail(n, found)
    return None
