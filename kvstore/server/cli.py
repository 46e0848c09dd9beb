"""``kvstore-server`` (also ``kvstore server``): run the daemon in the foreground.

With no arguments it serves the embedded defaults -- host DRAM over a disk
tier under ``~/.cache/kvstore`` -- on 127.0.0.1:7070, and prints where it
listens and how a client connects. The command line overrides
``KVSTORE_SERVER_*`` variables, which override the config file's ``server:``
section (the order of every kvstore setting: docs/configuration.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import tracemalloc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.config import DaemonConfig

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's options (shared by ``kvstore-server`` and ``kvstore server``)."""
    parser.add_argument("--config", help="store config YAML (tiers and a server: section)")
    parser.add_argument("--listen", help="TCP HOST:PORT (default 127.0.0.1:7070; '' for none)")
    parser.add_argument("--unix-socket", help="also listen on this Unix socket path")
    parser.add_argument("--metrics-listen", help="HOST:PORT for Prometheus /metrics and /healthz")
    parser.add_argument("--token-file", help="file whose first line is the token clients need")
    parser.add_argument("--tls-cert", help="PEM certificate chain (enables TLS on TCP)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,  # --log-level debug works; a level that is none is refused
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )


def _config(args: argparse.Namespace) -> DaemonConfig:
    """The server's config by role: the file (environment overrides on top), then flags."""
    from kvstore.config import load_daemon_config

    config = load_daemon_config(args.config)
    overrides = {
        name: getattr(args, name)
        for name in ("listen", "unix_socket", "metrics_listen", "token_file", "tls_cert", "tls_key")
        if getattr(args, name) is not None
    }
    if overrides.get("listen") == "":
        overrides["listen"] = None  # --listen '': no TCP (a Unix socket only)
    if "token_file" in overrides:
        overrides["token"] = None
    server = dataclasses.replace(config.server, **overrides)
    server.validate("server")
    return config.with_server(server)


def _describe(config: DaemonConfig, addresses: dict[str, str], cluster: Any = None) -> str:
    """The start-up banner: where the server listens, its tiers (in bytes, with how a
    store counts them in blocks), its cluster (``cluster``: the node it runs as) and
    how a client connects."""
    from kvstore.config import format_size

    lines = [f"kvstore-server {_version()} (pid {os.getpid()})"]
    if "tcp" in addresses:
        tls = " (TLS)" if config.server.tls_cert else ""
        lines.append(f"  listening on {addresses['tcp']}{tls}")
    if "unix" in addresses:
        lines.append(f"  listening on unix:{addresses['unix']}")
    if "metrics" in addresses:
        lines.append(f"  metrics on http://{addresses['metrics']}/metrics (/healthz)")
    if "events" in addresses:
        replay = addresses.get("events_replay")
        lines.append(
            f"  KV events on {addresses['events']}" + (f" (replay {replay})" if replay else "")
        )
    tiers = ", ".join(
        f"{t.kind} {format_size(t.capacity)}" + (f" at {t.path}" if hasattr(t, "path") else "")
        for t in config.store.tiers
    )
    lines.append(f"  tiers per namespace and layout: {tiers}")
    # /metrics and `kvstore stats` count the same capacities in blocks, per layout.
    lines.append(
        "  each store counts them in blocks of its layout: capacity / the chunk's bytes "
        "(on disk, / the chunk + its 4 KiB header); /metrics: kvstore_tier_blocks"
    )
    if cluster is not None:
        lines.append(_describe_cluster(cluster.config))
    auth = "token required" if config.server.credentials() else "no token (loopback only)"
    lines.append(f"  authentication: {auth}")
    address = addresses.get("tcp") or f"unix:{addresses.get('unix')}"
    lines += [
        "connect a store (or the vLLM connector, or SGLang) with a remote tier:",
        f'  tiers: [{{kind: remote, address: "{address}", namespace: default}}]',
    ]
    return "\n".join(lines)


def _describe_cluster(cluster: Any) -> str:
    """The banner's cluster line: its name, the Redis of its index, this node's id and
    where its peers reach it."""
    from kvstore.runtime import mask_url

    # Where, not who: the user and password (and a password= parameter) stay out.
    redis = mask_url(cluster.redis_url or "", userinfo=False)
    if cluster.redis_cluster:
        redis += " (Redis Cluster)"
    served = f"peers fetch from {cluster.advertise}" if cluster.advertise else "serves no peers"
    return f"  cluster {cluster.name}: node {cluster.node}, index in Redis at {redis}; {served}"


def _version() -> str:
    from kvstore.version import __version__

    return __version__


async def _serve(config: DaemonConfig, args: argparse.Namespace) -> None:
    from kvstore.server.daemon import Server

    server = Server(config, reloader=lambda: _config(args))
    # Before start(): its port accepts before start() returns, and a SIGHUP in between
    # took the default action (the process ended) or, where ignored, did nothing.
    server.install_signal_handlers()
    await server.start()
    print(_describe(config, server.addresses, server.cluster), flush=True)
    await server.serve_forever()


def run(args: argparse.Namespace) -> int:
    """Run a server from parsed arguments until SIGTERM / SIGINT; the exit code."""
    from kvstore.errors import KVStoreError

    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    # --log-level is the server's own (the kvstore loggers): the libraries under it say
    # only warnings (botocore's INFO "Found credentials in environment variables" at each
    # S3 tier's open is not the operator's news), unless DEBUG asks for everything.
    logging.basicConfig(
        level=level if level <= logging.DEBUG else max(level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kvstore").setLevel(level)
    # kill -USR1 <pid> prints every thread's stack to the log: what is it waiting for?
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # kill -USR2 <pid> starts tracing Python's allocations; each next one logs what grew.
    signal.signal(signal.SIGUSR2, _MemoryGrowth().log)
    try:
        config = _config(args)
        config.server.check_startable()
        try:
            import uvloop

            runner: Any = uvloop.run
        except ImportError:
            runner = asyncio.run
        runner(_serve(config, args))
    except KVStoreError as exc:
        print(f"kvstore-server: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


class _MemoryGrowth:
    """A leak hunt: the first call starts tracing Python's allocations (``tracemalloc``,
    ``depth`` frames; it slows the server), each later one logs the allocation sites
    whose traced memory grew most since the call before (taking the snapshot holds the
    event loop for a moment)."""

    def __init__(self, top: int = 15, depth: int = 6) -> None:
        self.top, self.depth = top, depth
        self.before: tracemalloc.Snapshot | None = None

    def log(self, *_: object) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.depth)
            log.warning("tracing memory allocations: the next SIGUSR2 logs what grew")
            return
        now = tracemalloc.take_snapshot()
        stats = now.compare_to(self.before, "traceback") if self.before else None
        lines = []
        for stat in (stats or now.statistics("traceback"))[: self.top]:
            lines.append(str(stat))
            lines += ["    " + frame for frame in stat.traceback.format(limit=4)]
        traced, peak = tracemalloc.get_traced_memory()
        log.warning(
            "traced memory %.1f MiB (peak %.1f); grew most:\n%s",
            traced / 2**20,
            peak / 2**20,
            "\n".join(lines),
        )
        self.before = now


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore-server`` console script."""
    from kvstore.runtime import OneLineParser

    parser = OneLineParser(prog="kvstore-server", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
