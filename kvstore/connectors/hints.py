"""Session hints through an engine's requests: ``kv_transfer_params={"kvstore_hint": {...}}``.

A vLLM request may carry ``{"kvstore_hint": {"retain_s": 600, "priority": 5,
"session": "agent-7"}}`` in its ``kv_transfer_params``. When the request finishes
(its chunks saved), the scheduler side applies the hint to the request's chunks
in the stores it sees (the shared tiers) and the next step's workers apply it in
theirs (memory). Retention fits here; ``demote`` and ``prefetch`` are about the
time *between* requests and go through the library or the server
(``store.hint(session=...)``), though a request may carry them too. A malformed
hint never fails the request: it is counted (``hints_rejected``) and logged. The
answer goes back with the request's output, in its ``kv_transfer_params``:
``{"kvstore_hint": {"status": ..., "reason": ..., "blocks": ...}}`` (the shared
tiers' answer; a malformed hint's rejection and why).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvstore.connectors.plan import FinishedOutput, HintSpec, Planner
from kvstore.connectors.settings import Counters
from kvstore.hints import Hint, HintAnswer, parse_hint
from kvstore.store import KVStore

__all__ = ["PARAM", "apply_hints", "finish_with_hint", "request_hint"]

log = logging.getLogger(f"vllm.{__name__}")

#: The key of a hint in a request's ``kv_transfer_params``.
PARAM = "kvstore_hint"


def request_hint(
    request: Any, counters: Counters
) -> tuple[tuple[Hint, str | None] | None, dict[str, Any] | None]:
    """The well-formed hint a request carries, and the answer to a malformed one
    (``(None, None)``: it carries none)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or PARAM not in params:
        return None, None
    hint, session, problem = parse_hint(params[PARAM])
    if hint is None:
        counters.add("hints_rejected")
        log.warning("kvstore: request %s: hint ignored: %s", request.request_id, problem)
        return None, {"status": "rejected", "reason": problem or "malformed"}
    counters.add("hints_received")
    return (hint, session), None


def finish_with_hint(
    planner: Planner,
    request: Any,
    store: KVStore | None,
    counters: Counters,
    output: FinishedOutput | None = None,
) -> tuple[bool, dict[str, Any] | None]:
    """The scheduler side forgets a finished request; its hint, if any, is applied to
    every rank's chunks in ``store`` (the shared tiers) now and queued for the workers,
    and ``output``'s chunks are queued for saving (:meth:`Planner.finished`).

    Returns whether the engine must keep the request's blocks for that save, and the
    ``kv_transfer_params`` vLLM hands back with the request's output: ``{"kvstore_hint":
    answer}`` (``HintAnswer.as_dict()`` of the shared tiers' answer, or the rejection of a
    malformed hint), None for a request without a hint."""
    hint, rejected = request_hint(request, counters)
    state = planner.requests.get(request.request_id)
    answer = rejected
    if hint is not None and state is not None and store is not None:
        spec = HintSpec(state.keys, *hint)
        for key_index in state.keys:
            got = apply_hints(store, key_index, [spec], counters)
            answer = answer or (got[0].as_dict() if got else None)
    keep = planner.finished(request.request_id, hint, output)
    if keep:
        counters.add("output_saves_queued")
    if answer is None and hint is not None:
        answer = {"status": "accepted", "reason": "queued for the workers' tiers"}
    return keep, None if answer is None else {PARAM: answer}


def apply_hints(
    store: KVStore, key_index: int, hints: Sequence[HintSpec], counters: Counters
) -> list[HintAnswer]:
    """Apply each hint to this process's keys (``key_index`` in each spec); never raises.
    The answers of the hints applied (one whose store failed has none)."""
    answers = []
    for spec in hints:
        keys = spec.keys.get(key_index)
        if not keys:
            continue
        h = spec.hint
        try:
            answer = store.hint(
                keys,
                session=spec.session,
                retain_s=h.retain_s,
                priority=h.priority,
                prefetch=h.prefetch,
                demote=h.demote,
            )
        except Exception:  # a hint is advice: never break the engine's step
            log.exception("kvstore: applying a hint failed")
            counters.add("hints_failed")
            continue
        counters.add(f"hints_{answer.status}")
        answers.append(answer)
    return answers
