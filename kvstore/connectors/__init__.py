"""Engine integrations: a vLLM KV connector and an SGLang HiCache storage backend.

- :mod:`kvstore.connectors.vllm` -- ``KVStoreConnector``, a ``KVConnectorBase_V1``
  (load it with ``kv_connector_module_path="kvstore.connectors.vllm"``).
- :mod:`kvstore.connectors.sglang` -- ``KVStoreHiCacheStorage``, a ``HiCacheStorage``
  (load it through SGLang's ``dynamic`` storage backend).

The engine-independent parts live beside them and import no engine:
:mod:`~kvstore.connectors.paged` (our block layout <-> an engine's paged cache),
:mod:`~kvstore.connectors.plan` (chunk and prefix arithmetic, what to load and save per
step), :mod:`~kvstore.connectors.transfer` (the worker-side loads and saves) and
:mod:`~kvstore.connectors.settings` (extra-config settings, counters). Importing this
package never imports vllm or sglang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.connectors.calibrate import (
        Calibration,
        calibrate_prefill,
        calibrate_tiers,
        format_table,
        format_tier_speeds,
        parse_lengths,
    )
    from kvstore.connectors.paged import PagedKV, PageMap
    from kvstore.connectors.plan import TransferSpec
    from kvstore.connectors.settings import ConnectorSettings
    from kvstore.connectors.sglang import KVStoreHiCacheStorage
    from kvstore.connectors.tails import find_tail, output_tail
    from kvstore.connectors.transfer import TransferWorker
    from kvstore.connectors.vllm import KVStoreConnector

__all__ = [
    "Calibration",
    "ConnectorSettings",
    "KVStoreConnector",
    "KVStoreHiCacheStorage",
    "PageMap",
    "PagedKV",
    "TransferSpec",
    "TransferWorker",
    "calibrate_prefill",
    "calibrate_tiers",
    "find_tail",
    "format_table",
    "format_tier_speeds",
    "output_tail",
    "parse_lengths",
]

_EXPORTS = {
    "Calibration": "kvstore.connectors.calibrate",
    "ConnectorSettings": "kvstore.connectors.settings",
    "KVStoreConnector": "kvstore.connectors.vllm",
    "KVStoreHiCacheStorage": "kvstore.connectors.sglang",
    "PageMap": "kvstore.connectors.paged",
    "PagedKV": "kvstore.connectors.paged",
    "TransferSpec": "kvstore.connectors.plan",
    "TransferWorker": "kvstore.connectors.transfer",
    "calibrate_prefill": "kvstore.connectors.calibrate",
    "calibrate_tiers": "kvstore.connectors.calibrate",
    "find_tail": "kvstore.connectors.tails",
    "format_table": "kvstore.connectors.calibrate",
    "format_tier_speeds": "kvstore.connectors.calibrate",
    "output_tail": "kvstore.connectors.tails",
    "parse_lengths": "kvstore.connectors.calibrate",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
