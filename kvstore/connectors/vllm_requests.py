"""What the vLLM connector's scheduler side reads of vLLM's steps and requests: the
requests one step schedules (with their blocks per KV cache group), and a finished
request's computed tokens (for saving the chunks its output completed)."""

from __future__ import annotations

from typing import Any

from kvstore.connectors.plan import FinishedOutput, Scheduled

__all__ = ["finished_output", "groups", "scheduled_requests"]


def scheduled_requests(scheduler_output: Any) -> list[Scheduled]:
    """vLLM's new and cached requests of one step (a ``SchedulerOutput``) as the
    :class:`Scheduled` entries the step planner reads, block ids per KV cache group."""
    counts = scheduler_output.num_scheduled_tokens
    out = [
        Scheduled(r.req_id, groups(r.block_ids), True, r.num_computed_tokens, counts[r.req_id])
        for r in scheduler_output.scheduled_new_reqs
        if r.req_id in counts
    ]
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if req_id not in counts:
            continue
        new_ids = cached.new_block_ids[i]
        blocks = groups(new_ids) if new_ids is not None else None
        resumed = req_id in cached.resumed_req_ids
        out.append(
            Scheduled(req_id, blocks, resumed, cached.num_computed_tokens[i], counts[req_id])
        )
    return out


def groups(block_ids: Any) -> tuple[list[int], ...]:
    """vLLM's per-group block ids (a tuple of lists) as plain lists."""
    return tuple(list(ids) for ids in block_ids)


def finished_output(
    request: Any, block_ids: tuple[list[int], ...], needs_hint: bool
) -> FinishedOutput | None:
    """A finished request's tokens whose KV the engine computed (its prompt and its
    output but the last sampled token) with its blocks, or None where it generated
    nothing past its prompt or vLLM does not say (``all_token_ids``)."""
    tokens = getattr(request, "all_token_ids", None)
    computed = int(getattr(request, "num_computed_tokens", 0) or 0)
    prompt = getattr(request, "prompt_token_ids", None)
    if tokens is None or prompt is None or computed <= len(prompt) or not block_ids:
        return None
    return FinishedOutput(list(tokens[:computed]), groups(block_ids), needs_hint)
