"""The harnesses of kvstore's own tests and benchmarks; kept in the repository, not the wheel.

- :mod:`kvharness.chaos` -- the cluster's chaos soak (``run_chaos_soak``,
  ``ChaosSoakConfig``): real processes, injected faults, every byte checked.
- :mod:`kvharness.soak` -- the memory soak (``run_soak``): one store and one
  ``kvstore-server`` under mixed load at capacity; does anything grow?
- :mod:`kvharness.fuzz` -- the wire fuzzer (``run_fuzz``) of a live ``kvstore-server``.
- :mod:`kvharness.proxies` -- proxies that fail (``FaultProxy``), corrupt
  (``CorruptingProxy``) or throttle (``ThrottlingProxy``) what crosses them.
- :mod:`kvharness.traces` -- synthetic request traces and their replay.
- :mod:`kvharness.event_view` -- a KV event subscriber's view of the stores.
- :mod:`kvharness.commands`, :mod:`kvharness.keyring`, :mod:`kvharness.mounts`,
  :mod:`kvharness.workers` -- commands run as a user runs them, encryption keyrings,
  tmpfs mounts and child processes for crash tests.

What tier and policy authors need (the conformance suites, fault wrappers, the lock
checker, test data) ships in :mod:`kvstore.testing`. This package imports kvstore; kvstore
never imports it. Tests find it through pytest's ``pythonpath``; benchmarks put the
repository's root on ``sys.path`` (``benchmarks/_common.py``); a child ``python`` that
imports it gets :func:`child_env`. Names are imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvharness.chaos.config import SoakConfig as ChaosSoakConfig
    from kvharness.chaos.run import SoakReport as ChaosSoakReport
    from kvharness.chaos.run import run_soak as run_chaos_soak
    from kvharness.commands import (
        command_env,
        files_under,
        one_error_line,
        prepare_home,
        run_command,
    )
    from kvharness.event_view import EventView
    from kvharness.fuzz.run import FuzzReport, FuzzSettings, fuzz_server_config, run_fuzz
    from kvharness.keyring import encryption_section, new_key, write_keyring
    from kvharness.proxies.corrupting import CorruptingProxy
    from kvharness.proxies.fault import FaultProxy, flip_bytes
    from kvharness.proxies.throttle import ThrottlingProxy
    from kvharness.soak.events import EVENT_FIELDS
    from kvharness.soak.run import GROWTH_FIELDS, SoakConfig, run_soak
    from kvharness.traces import (
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
    "ROOT",
    "ChaosSoakConfig",
    "ChaosSoakReport",
    "CorruptingProxy",
    "EVENT_FIELDS",
    "EventView",
    "FaultProxy",
    "FuzzReport",
    "FuzzSettings",
    "GROWTH_FIELDS",
    "ReplayResult",
    "Request",
    "SoakConfig",
    "ThrottlingProxy",
    "Trace",
    "TraceSpec",
    "child_env",
    "command_env",
    "distinct_chunks",
    "encryption_section",
    "files_under",
    "flip_bytes",
    "fuzz_server_config",
    "generate_trace",
    "new_key",
    "one_error_line",
    "prepare_home",
    "replay",
    "run_chaos_soak",
    "run_command",
    "run_fuzz",
    "run_soak",
    "trace_layout",
    "write_keyring",
]

#: The folder that holds this package: the repository's root.
ROOT = Path(__file__).resolve().parent.parent

_EXPORTS = {
    "ChaosSoakConfig": "kvharness.chaos.config:SoakConfig",
    "ChaosSoakReport": "kvharness.chaos.run:SoakReport",
    "CorruptingProxy": "kvharness.proxies.corrupting",
    "EVENT_FIELDS": "kvharness.soak.events",
    "EventView": "kvharness.event_view",
    "FaultProxy": "kvharness.proxies.fault",
    "FuzzReport": "kvharness.fuzz.run",
    "FuzzSettings": "kvharness.fuzz.run",
    "GROWTH_FIELDS": "kvharness.soak.run",
    "ReplayResult": "kvharness.traces",
    "Request": "kvharness.traces",
    "SoakConfig": "kvharness.soak.run",
    "ThrottlingProxy": "kvharness.proxies.throttle",
    "Trace": "kvharness.traces",
    "TraceSpec": "kvharness.traces",
    "command_env": "kvharness.commands",
    "distinct_chunks": "kvharness.traces",
    "encryption_section": "kvharness.keyring",
    "files_under": "kvharness.commands",
    "flip_bytes": "kvharness.proxies.fault",
    "fuzz_server_config": "kvharness.fuzz.run",
    "generate_trace": "kvharness.traces",
    "new_key": "kvharness.keyring",
    "one_error_line": "kvharness.commands",
    "prepare_home": "kvharness.commands",
    "replay": "kvharness.traces",
    "run_chaos_soak": "kvharness.chaos.run:run_soak",
    "run_command": "kvharness.commands",
    "run_fuzz": "kvharness.fuzz.run",
    "run_soak": "kvharness.soak.run",
    "trace_layout": "kvharness.traces",
    "write_keyring": "kvharness.keyring",
}


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`ROOT` added to
    ``PYTHONPATH``, for a child ``python`` that imports this package (the harness is not
    installed, so a child started elsewhere would not find it)."""
    env = dict(os.environ if base is None else base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in parts:
        parts.append(str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
