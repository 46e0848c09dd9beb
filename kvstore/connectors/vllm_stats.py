"""The vLLM connector's counters as vLLM's ``KVConnectorStats``: deltas from the workers
(and the scheduler), summed across workers and steps, logged by vLLM and, for shadow
verification, exported to its ``/metrics`` (:class:`~kvstore.connectors.verify.
VerifyPromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["KVStoreConnectorStats"]


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counter deltas from the workers, summed across workers and steps."""

    def reset(self) -> None:
        """Start a new interval."""
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        """Sum ``other``'s counters into these."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not self.data
