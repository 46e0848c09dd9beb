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

__all__: list[str] = []
