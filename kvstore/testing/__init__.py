"""Test support shipped with kvstore, for our tests and for authors of new tiers.

- :mod:`kvstore.testing.conformance` -- :class:`TierConformance`, the test
  suite every tier must pass (subclass it in a pytest module).
- :mod:`kvstore.testing.policy_conformance` -- :class:`PolicyConformance`, the
  suite every eviction policy must pass; :mod:`kvstore.testing.policies` drives a policy
  as the data path does (``evict``, ``access``).
- :mod:`kvstore.testing.faults` -- :class:`FaultyTier`, a wrapper that injects
  errors, misses and delays into a real tier.
- :mod:`kvstore.testing.lockcheck` -- :class:`LockCheckedTier`, a wrapper that
  records every tier call made while the books' lock is held (the lock rule).
- :mod:`kvstore.testing.data` -- deterministic KV tensors for tests.
- :mod:`kvstore.testing.commands` -- ``kvstore`` and ``kvstore-server`` run as a
  user runs them, and the one-line error a mistake must get.

- The harnesses of our own tests and benchmarks: the wire fuzzer (``run_fuzz``), the
  soak (``run_soak``) and the cluster's chaos soak (``run_chaos_soak``,
  ``ChaosSoakConfig``), proxies that fail, corrupt or throttle, request traces.

Code outside this package imports these names from here; each is imported on first use.
Importing :mod:`kvstore.testing.conformance` needs pytest, and
:mod:`kvstore.testing.policy_conformance` hypothesis too (the ``dev`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.testing.chaos import SoakReport as ChaosSoakReport
    from kvstore.testing.chaos import run_soak as run_chaos_soak
    from kvstore.testing.chaos_config import SoakConfig as ChaosSoakConfig
    from kvstore.testing.commands import (
        command_env,
        files_under,
        one_error_line,
        prepare_home,
        run_command,
    )
    from kvstore.testing.conformance import TierConformance, make_keys
    from kvstore.testing.data import (
        block_list,
        empty_blocks,
        host_config,
        random_blocks,
        small_layout,
    )
    from kvstore.testing.event_view import EventView
    from kvstore.testing.faults import DAMAGES, FaultyFileOps, FaultyTier, wait_for_tier
    from kvstore.testing.fuzz import FuzzReport, FuzzSettings, fuzz_server_config, run_fuzz
    from kvstore.testing.keyring import encryption_section, new_key, write_keyring
    from kvstore.testing.lockcheck import LockCheckedTier
    from kvstore.testing.policies import access, evict, key_ids, policy_key, queue_ids
    from kvstore.testing.policy_conformance import PolicyConformance
    from kvstore.testing.proxy import FaultProxy, flip_bytes
    from kvstore.testing.soak import GROWTH_FIELDS, SoakConfig, run_soak
    from kvstore.testing.soak_events import EVENT_FIELDS
    from kvstore.testing.tcpproxy import CorruptingProxy
    from kvstore.testing.throttle import ThrottlingProxy
    from kvstore.testing.traces import (
        ReplayResult,
        Request,
        Trace,
        TraceSpec,
        distinct_chunks,
        generate_trace,
        replay,
        trace_layout,
    )

__all__ = [
    "ChaosSoakConfig",
    "ChaosSoakReport",
    "CorruptingProxy",
    "DAMAGES",
    "EVENT_FIELDS",
    "EventView",
    "FaultProxy",
    "FaultyFileOps",
    "FaultyTier",
    "FuzzReport",
    "FuzzSettings",
    "GROWTH_FIELDS",
    "LockCheckedTier",
    "PolicyConformance",
    "ReplayResult",
    "Request",
    "SoakConfig",
    "ThrottlingProxy",
    "TierConformance",
    "Trace",
    "TraceSpec",
    "access",
    "block_list",
    "command_env",
    "distinct_chunks",
    "empty_blocks",
    "encryption_section",
    "evict",
    "files_under",
    "flip_bytes",
    "fuzz_server_config",
    "generate_trace",
    "host_config",
    "key_ids",
    "make_keys",
    "new_key",
    "one_error_line",
    "policy_key",
    "prepare_home",
    "queue_ids",
    "random_blocks",
    "replay",
    "run_chaos_soak",
    "run_command",
    "run_fuzz",
    "run_soak",
    "small_layout",
    "trace_layout",
    "wait_for_tier",
    "write_keyring",
]

_EXPORTS = {
    "ChaosSoakConfig": "kvstore.testing.chaos_config:SoakConfig",
    "ChaosSoakReport": "kvstore.testing.chaos:SoakReport",
    "CorruptingProxy": "kvstore.testing.tcpproxy",
    "DAMAGES": "kvstore.testing.faults",
    "EVENT_FIELDS": "kvstore.testing.soak_events",
    "EventView": "kvstore.testing.event_view",
    "FaultProxy": "kvstore.testing.proxy",
    "FaultyFileOps": "kvstore.testing.faults",
    "FaultyTier": "kvstore.testing.faults",
    "FuzzReport": "kvstore.testing.fuzz",
    "FuzzSettings": "kvstore.testing.fuzz",
    "GROWTH_FIELDS": "kvstore.testing.soak",
    "LockCheckedTier": "kvstore.testing.lockcheck",
    "PolicyConformance": "kvstore.testing.policy_conformance",
    "ReplayResult": "kvstore.testing.traces",
    "Request": "kvstore.testing.traces",
    "SoakConfig": "kvstore.testing.soak",
    "ThrottlingProxy": "kvstore.testing.throttle",
    "TierConformance": "kvstore.testing.conformance",
    "Trace": "kvstore.testing.traces",
    "TraceSpec": "kvstore.testing.traces",
    "access": "kvstore.testing.policies",
    "block_list": "kvstore.testing.data",
    "command_env": "kvstore.testing.commands",
    "distinct_chunks": "kvstore.testing.traces",
    "empty_blocks": "kvstore.testing.data",
    "encryption_section": "kvstore.testing.keyring",
    "evict": "kvstore.testing.policies",
    "files_under": "kvstore.testing.commands",
    "flip_bytes": "kvstore.testing.proxy",
    "fuzz_server_config": "kvstore.testing.fuzz",
    "generate_trace": "kvstore.testing.traces",
    "host_config": "kvstore.testing.data",
    "key_ids": "kvstore.testing.policies",
    "make_keys": "kvstore.testing.conformance",
    "new_key": "kvstore.testing.keyring",
    "one_error_line": "kvstore.testing.commands",
    "policy_key": "kvstore.testing.policies",
    "prepare_home": "kvstore.testing.commands",
    "queue_ids": "kvstore.testing.policies",
    "random_blocks": "kvstore.testing.data",
    "replay": "kvstore.testing.traces",
    "run_chaos_soak": "kvstore.testing.chaos:run_soak",
    "run_command": "kvstore.testing.commands",
    "run_fuzz": "kvstore.testing.fuzz",
    "run_soak": "kvstore.testing.soak",
    "small_layout": "kvstore.testing.data",
    "trace_layout": "kvstore.testing.traces",
    "wait_for_tier": "kvstore.testing.faults",
    "write_keyring": "kvstore.testing.keyring",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
