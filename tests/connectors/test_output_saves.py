"""Saving a finished request's output (the chunks its generated tokens completed), so the
next turn of a conversation, whose prompt starts with this one's prompt and answer, hits
through the answer: planned by the scheduler side when the request finishes, done by the
workers in the next step while the engine keeps the blocks (vLLM's delayed free)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.connectors.hints import PARAM, finish_with_hint
from kvstore.connectors.plan import FinishedOutput, Found, Planner, Scheduled
from kvstore.connectors.settings import ConnectorSettings, Counters
from kvstore.connectors.tails import find_tail
from kvstore.connectors.vllm_requests import finished_output
from kvstore.errors import ConfigError
from kvstore.hints import parse_hint
from kvstore.keys import BlockKey, Namespace, chain_keys, tail_key, tokens_to_bytes
from kvstore.layout import KVLayout

C, BS = 32, 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=C)
PROMPT = list(range(100, 180))  # 80 tokens: 2 full chunks and 16 more
OUTPUT = list(range(500, 530))  # 30 generated: 110 tokens in all, 109 computed: 3 chunks


def keys_for(
    tokens: Sequence[int], adapter: str | None, salt: str | None
) -> dict[int, list[BlockKey]]:
    out = {}
    for rank in (0, 1):
        ns = Namespace("m", LAYOUT, tp_rank=rank, tp_size=2, adapter=adapter, salt=salt)
        full = len(tokens) - len(tokens) % C
        out[rank] = chain_keys(tokens_to_bytes(list(tokens), limit=full), C, ns.seed)
    return out


def prefilled() -> Planner:
    """A planner whose request ``r`` computed its whole prompt (2 chunks saved)."""
    planner = Planner(C, BS, keys_for, lambda keys, n, computed: Found(0, 0))
    assert planner.match("r", PROMPT, 0, salt="s") == 0
    blocks = list(range(10, 20))  # 80 tokens: 10 blocks of 8
    plan = planner.step([Scheduled("r", (blocks,), True, 0, len(PROMPT))])
    assert [s.first_chunk for s in plan.saves] == [0]
    return planner


def computed() -> FinishedOutput:
    tokens = (PROMPT + OUTPUT)[:109]
    return FinishedOutput(tokens, (list(range(10, 24)),), needs_hint=True)


def test_a_hinted_requests_output_chunk_is_saved_in_the_next_step() -> None:
    planner = prefilled()
    hint, session, _ = parse_hint({"retain_s": 60, "session": "s1"})
    assert hint is not None and planner.finished("r", (hint, session), computed())
    plan = planner.step([])  # an empty step: the engine runs one while it keeps the blocks
    (spec,) = plan.finishing
    all_keys = keys_for((PROMPT + OUTPUT)[:109], None, "s")
    assert spec.req_id == "r" and spec.first_chunk == 2
    assert (spec.token_start, spec.token_end) == (64, 96)  # prompt tail and 16 output tokens
    assert spec.keys == {rank: ks[2:3] for rank, ks in all_keys.items()}
    assert spec.keys[0][0] not in keys_for(PROMPT, None, "s")[0]  # a chunk the prompt lacked
    assert spec.blocks_of(64, 96, BS) == [18, 19, 20, 21]
    assert spec.token_ids == (PROMPT + OUTPUT)[64:96]
    assert spec.parents == {rank: ks[1] for rank, ks in all_keys.items()}
    (hint_spec,) = plan.hints  # the session's hint covers the output's chunk too
    assert hint_spec.keys == {rank: ks[:3] for rank, ks in all_keys.items()}
    assert not planner.step([]).finishing


def test_no_hint_no_output_save_unless_asked_always() -> None:
    planner = prefilled()
    assert not planner.finished("r", None, computed())
    assert not planner.step([]).finishing
    planner = prefilled()
    always = FinishedOutput(computed().tokens, computed().block_ids, needs_hint=False)
    assert planner.finished("r", None, always)
    assert len(planner.step([]).finishing) == 1


def test_an_output_that_completes_no_chunk_keeps_no_block() -> None:
    planner = prefilled()
    short = FinishedOutput((PROMPT + OUTPUT)[:90], (list(range(10, 22)),), needs_hint=False)
    assert not planner.finished("r", None, short)  # 90 tokens: still 2 full chunks
    assert not planner.step([]).finishing


def test_finish_with_hint_says_to_keep_the_blocks_and_answers() -> None:
    planner = prefilled()
    counters = Counters("scheduler")
    request = SimpleNamespace(request_id="r", kv_transfer_params={PARAM: {"retain_s": 60}})
    keep, answer = finish_with_hint(planner, request, None, counters, computed())
    assert keep and answer is not None and answer[PARAM]["status"] == "accepted"
    assert counters.snapshot()["output_saves_queued"] == 1
    planner = prefilled()
    malformed = SimpleNamespace(request_id="r", kv_transfer_params={PARAM: {"retain_s": -1}})
    keep, answer = finish_with_hint(planner, malformed, None, counters, computed())
    assert not keep and answer is not None and answer[PARAM]["status"] == "rejected"


def test_what_vllm_says_of_a_finished_request() -> None:
    done = SimpleNamespace(
        all_token_ids=PROMPT + OUTPUT, num_computed_tokens=109, prompt_token_ids=PROMPT
    )
    out = finished_output(done, ([1, 2], [3]), needs_hint=True)
    assert out is not None and out.tokens == (PROMPT + OUTPUT)[:109]
    assert out.block_ids == ([1, 2], [3]) and out.needs_hint
    prefill_only = SimpleNamespace(
        all_token_ids=PROMPT, num_computed_tokens=80, prompt_token_ids=PROMPT
    )
    assert finished_output(prefill_only, ([1],), needs_hint=True) is None
    assert finished_output(SimpleNamespace(), ([1],), needs_hint=True) is None


def test_the_setting_is_checked() -> None:
    assert ConnectorSettings.from_extra({}).save_outputs == "hinted"
    assert ConnectorSettings.from_extra({"save_outputs": "always"}).save_outputs == "always"
    with pytest.raises(ConfigError, match="save_outputs: use one of hinted, always, never"):
        ConnectorSettings.from_extra({"save_outputs": "sometimes"})


# -- tails: the first tokens of a partial last chunk ------------------------------------
def tailed(stored: set[BlockKey]) -> Planner:
    """A planner with tails on, over a store holding ``stored``."""

    def lookup(keys: dict[int, list[BlockKey]], n: int, computed: int) -> Found:
        counts = []
        for ks in keys.values():
            k = 0
            while k < len(ks) and ks[k] in stored:
                k += 1
            counts.append(k)
        return Found(min(counts), min(counts))

    def tails(keys: dict[int, list[BlockKey]], tokens: Sequence[int], loaded: int) -> Any:
        return find_tail(stored.__contains__, keys, tokens, loaded, (C, BS))

    return Planner(C, BS, keys_for, lookup, tails)


def test_a_finished_output_leaves_its_partial_chunk_as_a_tail_the_next_turn_loads() -> None:
    stored: set[BlockKey] = set()
    planner = tailed(stored)
    planner.match("r", PROMPT, 0, salt="s")
    planner.step([Scheduled("r", (list(range(10, 20)),), True, 0, len(PROMPT))])
    assert planner.finished(
        "r", None, FinishedOutput(computed().tokens, computed().block_ids, False)
    )
    full, tail = planner.step([]).finishing
    tokens = (PROMPT + OUTPUT)[:109]  # 3 full chunks, then 13 tokens: a tail of 8
    every = keys_for(tokens, None, "s")
    assert (full.first_chunk, full.token_end, full.tail) == (2, 96, False)
    assert (tail.first_chunk, tail.token_start, tail.token_end, tail.tail) == (3, 96, 104, True)
    expected = {r: tail_key(ks[2], tokens_to_bytes(tokens[96:104])) for r, ks in every.items()}
    assert tail.keys == {r: [k] for r, k in expected.items()}
    assert tail.blocks_of(96, 104, BS) == [22]
    # The workers stored them: the next turn (the same tokens and 20 more) finds the three
    # chunks and the tail, and loads 104 tokens, the tail's 8 through its own key.
    stored |= {k for ks in every.values() for k in ks} | set(expected.values())
    nxt = tokens + list(range(900, 920))
    assert planner.match("n", nxt, 0, salt="s") == 104
    planner.allocated("n", 104)
    (load,) = planner.step([Scheduled("n", (list(range(40, 57)),), True, 0, 129)]).loads
    assert (load.first_chunk, load.token_start, load.token_end, load.tail) == (0, 0, 104, True)
    assert load.keys == {r: [*ks[:3], expected[r]] for r, ks in every.items()}
    # Another continuation of the same three chunks shares no tail: 96 tokens only.
    other = tokens[:96] + list(range(700, 733))
    assert planner.match("o", other, 0, salt="s") == 96


def test_find_tail_takes_the_longest_stored_length_and_never_the_last_token() -> None:
    tokens = list(range(300, 300 + 3 * C))
    keys = keys_for(tokens, None, None)
    stored: set[BlockKey] = set()

    def at(n: int) -> dict[int, BlockKey]:
        return {r: tail_key(ks[0], tokens_to_bytes(tokens[C : C + n])) for r, ks in keys.items()}

    assert find_tail(stored.__contains__, keys, tokens, 1, (C, BS)) is None
    stored |= set(at(8).values()) | set(at(16).values())
    found = find_tail(stored.__contains__, keys, tokens, 1, (C, BS))
    assert found is not None and (found.tokens, found.keys) == (16, at(16))
    stored |= set(at(24).values())
    short = tokens[: C + 17]  # the engine computes token C + 16 itself: at most 16
    found = find_tail(stored.__contains__, keys, short, 1, (C, BS))
    assert found is not None and found.tokens == 16
    stored.discard(at(16)[1])  # one rank lacks it: the next length down
    found = find_tail(stored.__contains__, keys, short, 1, (C, BS))
    assert found is not None and found.tokens == 8
    assert find_tail(stored.__contains__, keys, tokens, 0, (C, BS)) is None  # no chunk before
