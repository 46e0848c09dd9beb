"""A memory soak: one embedded store and one ``kvstore-server`` under mixed load at
capacity for minutes, sampled at an interval; does memory or any count grow?

>>> result = run_soak(SoakConfig(minutes=3, warmup_minutes=1, interval_s=5), workdir)
>>> result["rss_growth"], result["wrong_bytes"], result["errors"]

What runs (:mod:`kvharness.soak.work` has the operations):

- the **store process** (a child, spawned): one :class:`~kvstore.KVStore` with a 2 MiB
  host tier over an 8 MiB disk tier, so both evict and demote all the time; worker
  threads put, get, get_prefix, prefetch, write layer by layer (a quarter abandoned
  half-way: they expire), hint, pin with leases never released, lend, evict and look up;
  every ``restart_s`` the store is closed and reopened on its disk directory;
- a **kvstore-server** (a child, :class:`~kvstore.cli.kvserver.KVStoreServerProcess`)
  with the same tiers, and ``clients`` client threads in this process (half over the
  Unix socket with shared memory, half over TCP), each with its own connections: put,
  get, get of a layer range, lookup, hint, delete;
- every ``vanish_s`` a client **process** that puts and gets large batches is killed
  (SIGKILL) in the middle of a transfer, alternately over shared memory and TCP.

Every block's bytes follow from its key, so every block read is checked
(``wrong_bytes``). An operation that raises is an error (``errors``).

The server publishes KV events; ``tokens_share`` of the clients' puts (and the canon
blocks of each sample) tell it their tokens, so they are announced. A subscriber's view
built from the events alone runs all along, restarted every ``view_restart_s`` on
average; once the clients stop it must equal a fresh one (``events_phantom``,
``events_missed``, ``events_wrong_medium``: :mod:`kvharness.soak.events`).

**A sample** (every ``interval_s``) stops every worker between two operations, waits
for the leases of pins, loans, reservations and abandoned writes to end, then settles
each store into one known state: everything deleted, then the same ``canon`` blocks
put again (so at every sample a store holds exactly ``canon`` index entries in
``canon`` host slots, unless something leaked); it reads the store's index entries,
slab slots in use, slots held without a block and live leases. The embedded store is
then restarted and its process read before the new store runs anything (its thread
pools start lazily: only then is their thread count fixed); the canon blocks must come
back from disk. For each process: RSS, shared memory (``RssShmem``), pinned bytes (host
tiers that report ``pinned``; 0 without CUDA), open fds and threads, read once they
hold still. Growth of a figure is last ÷ first sample after the warm-up - 1 (the
larger of the two processes'; a figure below 1 MiB or 1 is taken against that floor).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from kvharness import child_env
from kvharness.chaos.events import chunk_tokens
from kvharness.soak.events import EVENT_FIELDS, SoakEvents, server_events_config
from kvharness.soak.work import (
    LAYOUT,
    ClientWork,
    Gate,
    Keys,
    StoreWork,
    Tally,
    block_for,
    wrong_bytes,
)
from kvstore.cli import KVStoreServerProcess, server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.store import KVStore

__all__ = [
    "GROWTH_FIELDS",
    "SoakConfig",
    "growth",
    "proc_figures",
    "run_soak",
    "steady_figures",
    "store_config",
    "summarize",
]

#: The tiers of both stores: 64 host slots over ~110 disk blocks of 32 KiB.
TIERS: tuple[dict[str, str], ...] = (
    {"kind": "host", "capacity": "2MiB"},
    {"kind": "disk", "capacity": "4MiB"},
)
#: The growth figures reported, each the larger of the two processes'.
GROWTH_FIELDS = ("rss", "shared", "pinned", "fds", "threads", "index", "slots")
_LEASE_S = 1.0
_SETTLE_WAIT_S = 2.0  # past every lease (pins and loans 0.5 s, the stores' lease_s 1 s)


@dataclass(frozen=True)
class SoakConfig:
    """How long and how hard the soak runs (see the module docstring)."""

    minutes: float = 60.0
    warmup_minutes: float = 5.0
    interval_s: float = 60.0
    seed: int = 0
    clients: int = 8
    store_workers: int = 3
    restart_s: float = 45.0
    vanish_s: float = 20.0
    canon: int = 32
    tokens_share: float = 0.5
    view_restart_s: float = 10.0


#: Below these, a figure's growth is taken against the floor (a figure of 0 that became
#: 4 KiB has not grown infinitely): 1 MiB for bytes, 1 for counts.
_FLOORS = {"rss": 1 << 20, "shared": 1 << 20, "pinned": 1 << 20}


def growth(first: float, last: float, floor: float = 1.0) -> float:
    """(last - first) ÷ max(first, floor): last ÷ first - 1 for any figure above its floor."""
    return (last - first) / max(first, floor)


def proc_figures(pid: int) -> dict[str, int]:
    """RSS and shared memory (bytes), threads and open fds of process ``pid``."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssShmem"):
            fields[name] = int(value.split()[0]) * 1024
        elif name == "Threads":
            fields[name] = int(value)
    return {
        "rss": fields.get("VmRSS", 0),
        "shared": fields.get("RssShmem", 0),
        "threads": fields.get("Threads", 0),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def steady_figures(pid: int, timeout: float = 10.0) -> dict[str, int]:
    """:func:`proc_figures` once three reads 0.5 s apart agree on fds and threads (a
    thread that just finished, a socket a killed client left, are gone by then)."""
    last = proc_figures(pid)
    same = 0
    end = time.monotonic() + timeout
    while same < 2 and time.monotonic() < end:
        time.sleep(0.5)
        now = proc_figures(pid)
        same = same + 1 if (now["fds"], now["threads"]) == (last["fds"], last["threads"]) else 0
        last = now
    return last


def _store_figures(stats: dict[str, Any]) -> dict[str, int]:
    """Index entries, host slots in use, slots held without a block, live leases and
    pinned bytes, from a store's ``stats()``."""
    host = next(t for t in stats["tiers"] if t["kind"] == "host")
    pinned = sum(t.get("capacity_bytes", 0) for t in stats["tiers"] if t.get("pinned"))
    return {
        "index": int(stats["blocks"]),
        "slots": int(host["slots_used"]),
        "slots_unbacked": int(host["slots_used"]) - int(host["blocks"]),
        "leases_live": int(stats["leases_live"]),
        "pinned": int(pinned),
    }


def _canon_keys(seed: int, canon: int) -> list[BlockKey]:
    return Keys(f"{seed}:canon").new(canon)


# -- the store process ------------------------------------------------------------------
def store_config(workdir: Path) -> dict[str, Any]:
    """The embedded store's config: :data:`TIERS`, its disk in ``workdir/store``."""
    tiers = [dict(t) for t in TIERS]
    tiers[1]["path"] = str(workdir / "store")
    return {"tiers": tiers, "lease_s": _LEASE_S}


class _StoreSide:
    """The store process's parts: the store, its workers, the restarter."""

    def __init__(self, config: SoakConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.tally = Tally()
        self.gate = Gate()
        self.control = threading.Lock()  # a restart and a sample never overlap
        self.stop = threading.Event()
        self.work = StoreWork(
            KVStore(LAYOUT, store_config(workdir)), Keys(f"{config.seed}:store"), self.tally
        )

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(
                target=self.work.run,
                args=(self.gate, self.stop, random.Random(f"{self.config.seed}:store:{n}")),
                name=f"soak-store-{n}",
            )
            for n in range(self.config.store_workers)
        ]
        threads.append(threading.Thread(target=self._restarts, name="soak-restarts"))
        for thread in threads:
            thread.start()
        return threads

    def _restarts(self) -> None:
        while not self.stop.wait(self.config.restart_s):
            with self.control, self.gate.closed():
                try:
                    self.work.store.close()
                    self.work.store = KVStore(LAYOUT, store_config(self.workdir))
                    self.tally.add("store_restarts")
                except Exception as exc:  # counted: the soak reports it
                    self.tally.add("errors.store.restart")
                    self.tally.note("errors.store.restart", f"{type(exc).__name__}: {exc}")

    def sample(self) -> dict[str, Any]:
        """Stop the workers, settle the store (see the module docstring), read it."""
        with self.control, self.gate.closed():
            store = self.work.store
            store.drain(30.0)
            time.sleep(_SETTLE_WAIT_S)
            busy = _store_figures(store.stats())  # as the load left it, for the record
            store.clear()
            canon = _canon_keys(self.config.seed, self.config.canon)
            store.put(canon, _blocks_tensor(canon))
            store.drain(30.0)
            figures = _store_figures(store.stats())
            # Then a restart, and the process is read before anything runs in the new
            # store: its thread pools start lazily, so only now is their count fixed.
            store.close()
            store = self.work.store = KVStore(LAYOUT, store_config(self.workdir))
            self.tally.add("store_restarts")
            for tier in store.engine.datapath.tiers:
                wait = getattr(tier, "wait_prefault", None)
                if wait is not None:
                    wait(30.0)
            process = steady_figures(os.getpid())
            _verify_store(store, canon, self.tally)  # what the restart found on disk
        names = sorted({t.name.rstrip("0123456789_-") for t in threading.enumerate()})
        return {
            **process,
            **figures,
            "python_threads": threading.active_count(),
            "names": names,
            "busy": busy,
        }


def _blocks_tensor(keys: list[BlockKey]) -> torch.Tensor:
    """The blocks of ``keys`` as one tensor of ``LAYOUT.tensor_shape(len(keys))``."""
    return torch.cat([block_for(k) for k in keys], dim=2)


def _verify_store(store: KVStore, keys: list[BlockKey], tally: Tally) -> None:
    """The settled blocks must all be there, byte-exact, after the restart."""
    got = store.get(keys)
    step = LAYOUT.block_tokens
    found = LAYOUT.tokens_to_blocks(got.shape[2])
    for i, key in enumerate(keys[:found]):
        tally.add("wrong_bytes", wrong_bytes(key, got[:, :, i * step : (i + 1) * step]))
    if found < len(keys):
        tally.add("errors.store.settled_blocks_lost", len(keys) - found)


def _store_main(conn: Connection, config: SoakConfig, workdir: str) -> None:
    """The store process: answers ``sample`` and ``stop`` from the soak."""
    # torch starts its intra-op threads at the first large operation, whenever that
    # comes; started now, they are not counted as growth later (they live as long as
    # the process, whatever the store does).
    _blocks_tensor(_canon_keys(config.seed, 256)).view(-1).float().sum()
    side = _StoreSide(config, Path(workdir))
    threads = side.start()
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "sample":
            try:
                conn.send(side.sample())
            except Exception as exc:  # the soak reports it as an error
                side.tally.add("errors.store.sample")
                side.tally.note("errors.store.sample", f"{type(exc).__name__}: {exc}")
                conn.send({})
        elif command == "stop":
            side.stop.set()
            for thread in threads:
                thread.join()
            side.work.store.close()
            conn.send(side.tally.snapshot())
            return


# -- the server side ----------------------------------------------------------------------
class _ServerSide:
    """The server, its client threads and the vanishing clients, in this process."""

    def __init__(self, config: SoakConfig, workdir: Path) -> None:
        self.config = config
        tiers = [dict(t) for t in TIERS]
        server_config = server_test_config(workdir / "server", tiers)
        server_config["lease_s"] = _LEASE_S
        server_config["events"] = server_events_config(workdir / "server")
        self.server = KVStoreServerProcess(server_config, workdir / "server")
        self.events = SoakEvents(server_config["events"], config.seed, config.view_restart_s)
        self.event_figures: dict[str, int] = {}
        self.tally = Tally()
        self.gate = Gate()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def options(self, shm: bool) -> ClientOptions:
        address = self.server.unix_address if shm else self.server.address
        return ClientOptions(address=address, shared_memory=shm)

    def start(self) -> None:
        self.server.start()
        self.events.start()
        keys = Keys(f"{self.config.seed}:clients")
        for n in range(self.config.clients):
            work = ClientWork(self.options(n % 2 == 0), keys, self.tally, self.config.tokens_share)
            rng = random.Random(f"{self.config.seed}:client:{n}")
            self.threads.append(
                threading.Thread(
                    target=work.run, args=(self.gate, self.stop, rng), name=f"soak-client-{n}"
                )
            )
        self.threads.append(threading.Thread(target=self._vanishers, name="soak-vanishers"))
        for thread in self.threads:
            thread.start()

    def _vanishers(self) -> None:
        rng = random.Random(f"{self.config.seed}:vanish")
        n = 0
        while not self.stop.wait(self.config.vanish_s):
            with self.gate.passage():
                if not self.stop.is_set():
                    self._vanish(n, rng)
            n += 1

    def _vanish(self, n: int, rng: random.Random) -> None:
        """A client process killed mid-transfer (SIGKILL) once it is connected."""
        shm = n % 2 == 0
        address = self.server.unix_address if shm else self.server.address
        code = "from kvharness.soak.work import vanisher_main; vanisher_main()"
        args = [sys.executable, "-c", code, address, "1" if shm else "0", f"{self.config.seed}:{n}"]
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env()
        )
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() == b"ready":
                time.sleep(rng.uniform(0.05, 0.6))  # in the middle of a put or get
                self.tally.add("clients_vanished")
            else:
                self.tally.add("errors.vanisher.start")
        finally:
            proc.kill()
            proc.wait()

    def sample(self) -> dict[str, Any]:
        """Stop the clients, settle the server's store, read it; {} (an error, with the
        server's last words) when the server does not answer."""
        try:
            return self._sample()
        except KVStoreError as exc:
            self.failed("sample", exc)
            return {}

    def failed(self, what: str, exc: BaseException) -> None:
        """Count an error of the server itself, with the end of its log."""
        self.tally.add(f"errors.server.{what}")
        self.tally.note(f"errors.server.{what}", f"{type(exc).__name__}: {exc}")
        self.tally.note("server_log", self.server.log_tail(3000))

    def _sample(self) -> dict[str, Any]:
        with self.gate.closed():
            time.sleep(_SETTLE_WAIT_S)  # loans and reservations of killed clients end
            control = Client(LAYOUT, self.options(False))
            try:
                busy = _store_figures(control.server_stats()["stores"][0])
                keys = control.list_keys()
                for start in range(0, len(keys), 512):
                    control.delete(keys[start : start + 512])
                canon = _canon_keys(self.config.seed, self.config.canon)
                control.note_tokens(chunk_tokens(canon, 0, LAYOUT.block_tokens))  # announced
                control.put(canon, [block_for(k) for k in canon])
                stats = control.server_stats()
                figures = _store_figures(stats["stores"][0])
                figures["connections_open"] = int(stats["server"]["connections_open"])
                outs = [block_for(k).clone().fill_(0) for k in canon]
                found = control.get(canon, outs)
                for key, out, ok in zip(canon, outs, found, strict=True):
                    self.tally.add("wrong_bytes", wrong_bytes(key, out) if ok else 0)
                self.tally.add("errors.server.settled_blocks_lost", found.count(False))
                _wait_moves(control)
            finally:
                control.close()
            pid = self.server.pid
            assert pid is not None, "the server exited"
            process = steady_figures(pid)  # still paused: the clients' sockets hold still
        return {**process, **figures, "busy": busy}

    def _announce_canon(self) -> None:
        """Put the canon blocks again, their tokens told: what the clients did after the
        last sample may have evicted every announced block, and a check of a view with
        nothing in it would prove nothing (``events_blocks`` 0 in a loaded CI run)."""
        control = Client(LAYOUT, self.options(False))
        try:
            canon = _canon_keys(self.config.seed, self.config.canon)
            control.note_tokens(chunk_tokens(canon, 0, LAYOUT.block_tokens))
            control.put(canon, [block_for(k) for k in canon])
        finally:
            control.close()

    def close(self) -> dict[str, object]:
        """Stop the clients, check the events view (the server still up), stop the server."""
        self.stop.set()
        for thread in self.threads:
            thread.join()
        try:
            self._announce_canon()
            self.event_figures = self.events.finish()
        except Exception as exc:  # the check could not run: an error of the soak
            self.events.close()
            self.tally.add("errors.events.check")
            self.tally.note("errors.events.check", f"{type(exc).__name__}: {exc}")
        try:
            self.server.stop()
        except KVStoreError as exc:  # it hung: kill()ed by stop(); say so in the result
            self.failed("stop", exc)
        return self.tally.snapshot()


def _wait_moves(control: Client, timeout: float = 10.0) -> None:
    """Until the server's background moves (write-through, eviction) are done: their
    open block files would count among its fds."""
    end = time.monotonic() + timeout
    while control.server_stats()["stores"][0].get("moves_pending", 0) and time.monotonic() < end:
        time.sleep(0.1)


# -- the soak ---------------------------------------------------------------------------------
def run_soak(
    config: SoakConfig,
    workdir: str | os.PathLike[str],
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the soak in ``workdir``; the result (see :func:`summarize`)."""
    work = Path(workdir)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    store_proc = ctx.Process(target=_store_main, args=(child, config, str(work)), name="soak-store")
    server = _ServerSide(config, work)
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    store_proc.start()
    child.close()  # so a store process that dies ends recv() with EOFError
    try:
        if parent.recv() != "ready":
            raise RuntimeError("the store process did not start")
        server.start()
        end = start + config.minutes * 60
        due = start + config.interval_s
        while due <= end + 1e-6:
            time.sleep(max(0.0, due - time.monotonic()))
            at = round(time.monotonic() - start, 1)
            parent.send("sample")  # both sides settle at once
            server_row = server.sample()
            row = {"t": at, "store": parent.recv(), "server": server_row}
            samples.append(row)
            if log is not None:
                log(_brief(row))
            due += config.interval_s
    finally:
        try:
            client_tally = server.close()
        finally:  # the store process is stopped whatever the server did
            parent.send("stop")
            store_tally = parent.recv()
            store_proc.join(60)
    return summarize(config, samples, [store_tally, client_tally], server.event_figures)


def _brief(row: dict[str, Any]) -> str:
    parts = [f"t={row['t']:.0f}s"]
    for side in ("store", "server"):
        s = row[side]
        if s:
            parts.append(
                f"{side}: rss {s['rss'] / 2**20:.1f} MiB fds {s['fds']} threads {s['threads']} "
                f"index {s['index']} slots {s['slots']} unbacked {s['slots_unbacked']}"
            )
    return "  ".join(parts)


def _merged(tallies: list[Any]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """The counts of ``tallies`` (:meth:`Tally.snapshot`) summed, and their examples."""
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for tally in tallies:
        for name, n in tally["counts"].items():
            counts[name] = counts.get(name, 0) + n
        examples.update(tally["examples"])
    return counts, examples


def summarize(
    config: SoakConfig,
    samples: list[dict[str, Any]],
    tallies: list[Any],
    events: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The soak's JSON: growth fields, errors, wrong bytes, the events check
    (:mod:`kvharness.soak.events`), operation counts, samples."""
    whole = [s for s in samples if s["store"] and s["server"]]
    measured = [s for s in whole if s["t"] >= config.warmup_minutes * 60 - 1]
    counts, examples = _merged(tallies)
    errors = sum(n for name, n in counts.items() if name.startswith(("errors.", "unexpected.")))
    errors += len(samples) - len(whole)
    result: dict[str, Any] = {"minutes": config.minutes, "warmup_minutes": config.warmup_minutes}
    by_process: dict[str, dict[str, float]] = {}
    for side in ("store", "server"):
        first, last = (measured[0][side], measured[-1][side]) if len(measured) >= 2 else ({}, {})
        by_process[side] = {
            f: growth(first.get(f, 0), last.get(f, 0), _FLOORS.get(f, 1)) for f in GROWTH_FIELDS
        }
    for field in GROWTH_FIELDS:
        result[f"{field}_growth"] = max(by_process[s][field] for s in by_process)
    last = measured[-1] if measured else {"store": {}, "server": {}}
    result.update(
        {
            "wrong_bytes": counts.get("wrong_bytes", 0),
            "errors": errors,
            "samples_measured": len(measured),
            "slots_unbacked_last": max(
                last[s].get("slots_unbacked", 0) for s in ("store", "server")
            ),
            "leases_live_last": max(last[s].get("leases_live", 0) for s in ("store", "server")),
            **dict.fromkeys(("events_blocks", *EVENT_FIELDS), 0),
            **(events or {}),
            "growth_by_process": by_process,
            "pinned_note": ""
            if any(s["store"].get("pinned") for s in measured)
            else ("no host tier reports pinned memory (no CUDA here): pinned bytes are 0"),
            "config": asdict(config),
            "ops": {
                k: v for k, v in counts.items() if not k.startswith(("errors.", "unexpected."))
            },
            "error_counts": {
                k: v for k, v in counts.items() if k.startswith(("errors.", "unexpected."))
            },
            "examples": examples,
            "samples": samples,
        }
    )
    return result
