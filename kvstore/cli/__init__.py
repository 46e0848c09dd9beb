"""The ``kvstore`` command and what it runs: ``kvstore = kvstore.cli:main``.

- :mod:`kvstore.cli.commands` -- the command and its subcommands (``demo``, ``server``,
  ``route``, ``stats``, ``config``, ``bench``, ``calibrate-prefill``, ``calibrate-tiers``,
  ``local-cluster``)
- :mod:`kvstore.cli.demo` -- the demo workload
- :mod:`kvstore.cli.survey` -- the offline ``kvstore stats`` of disk tiers
- :mod:`kvstore.cli.live_report` -- ``kvstore stats`` of a running server
- :mod:`kvstore.cli.local_cluster` -- ``kvstore local-cluster``: a whole cluster here
- :mod:`kvstore.cli.servers`, :mod:`kvstore.cli.kvserver` -- real servers (Redis, S3,
  ``kvstore-server``) on free local ports: local-cluster starts them, and tests and
  benchmarks import them from here

``python -m kvstore.cli`` runs the command too. Each name here is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.cli.commands import main
    from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
    from kvstore.cli.servers import (
        DUMMY_AWS_ENV,
        HOST,
        RedisCluster,
        RedisServer,
        S3Server,
        free_port,
        list_objects,
        redis_command,
        require_binary,
    )

__all__ = [
    "DUMMY_AWS_ENV",
    "HOST",
    "KVStoreServerProcess",
    "RedisCluster",
    "RedisServer",
    "S3Server",
    "free_port",
    "list_objects",
    "main",
    "redis_command",
    "require_binary",
    "server_test_config",
]

_EXPORTS = {
    "DUMMY_AWS_ENV": "kvstore.cli.servers",
    "HOST": "kvstore.cli.servers",
    "KVStoreServerProcess": "kvstore.cli.kvserver",
    "RedisCluster": "kvstore.cli.servers",
    "RedisServer": "kvstore.cli.servers",
    "S3Server": "kvstore.cli.servers",
    "free_port": "kvstore.cli.servers",
    "list_objects": "kvstore.cli.servers",
    "main": "kvstore.cli.commands",
    "redis_command": "kvstore.cli.servers",
    "require_binary": "kvstore.cli.servers",
    "server_test_config": "kvstore.cli.kvserver",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
