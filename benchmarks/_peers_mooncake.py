"""bench_peers.py's server rows: Mooncake Store vs a kvstore-server, over TCP and on the same host.

One run starts, on 127.0.0.1: a ``kvstore-server`` whose only tier is host memory (one
store per block size, ``capacity`` each), and Mooncake's ``mooncake_master`` plus its
store process ``mooncake_client`` holding one global segment of twice that (both block
sizes share it): the two hold the same bytes in memory. Then ``clients`` worker
processes per system (``benchmarks/peers/store_worker.py``; Mooncake's under
``.venv-mooncake``'s Python), each with a TCP client and a same-host client.

Before timing: worker 0 of each system puts the get sets (every block size, checked by
reading them back), then fills the store's memory with throwaway blocks up to 80% and
removes them (Mooncake touches its segment lazily: its first puts run at 0.1-0.3 GB/s;
kvstore's host tier prefaults its own). Timed, interleaved in rounds (each subject next to
its counterpart; order reversed on odd rounds; one untimed warm-up rep each):

- put: fresh keys (removed after the rep, untimed), ``rep_bytes`` in all, 1 or N clients;
- get: the get set into buffers zeroed before the rep, every byte compared after it;
- lookup: ``lookup_reps`` prefix lookups of the 1 MiB get set's keys (kvstore ``lookup``,
  Mooncake ``batch_is_exist``), one client;
- memcpy: the same blocks copied in a kvstore worker (``torch._foreach_copy_``), the
  same-host path's floor.

First fill: each system's servers started fresh (``first_fill_reps`` times per path,
systems alternating), one worker puts the get set of each block size right away.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import Rep, run_rounds
from _peer_procs import (
    MooncakeServers,
    MooncakeVenv,
    PeerUnavailable,
    WorkerError,
    WorkerPool,
    kvstore_python,
    kvstore_worker_env,
    say,
)

from kvstore.cli import KVStoreServerProcess

MiB = 1 << 20
#: Block sizes: Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16) in 256-token
#: chunks (32 MiB) and 8-token chunks (1 MiB).
LAYOUTS = {
    "32MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_tokens": 256},
    "1MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_tokens": 8},
}
BLOCK_BYTES = {name: 32 * 2 * g["block_tokens"] * 8 * 128 * 2 for name, g in LAYOUTS.items()}
PATHS = {"tcp": "TCP loopback", "shm": "same host (shared memory)"}
SYSTEMS = ("kvstore", "mooncake")
LOOKUP_SIZE = "1MiB"


@dataclass(frozen=True)
class ServerPlan:
    """What the server rows move, and how often."""

    rep_bytes: int
    clients: int
    capacity: int  #: kvstore's host tier per block size; Mooncake's segment is twice it
    rounds: int
    reps: int
    first_fill_reps: int
    lookup_reps: int
    plant: str | None = None  #: the system whose gets hand back a wrong byte (tests)

    def count(self, size: str, clients: int) -> int:
        """Blocks each of ``clients`` clients moves per rep."""
        return self.rep_bytes // BLOCK_BYTES[size] // clients

    def nbytes(self, size: str, clients: int) -> int:
        """Bytes one rep of ``clients`` clients moves in all."""
        return self.count(size, clients) * clients * BLOCK_BYTES[size]

    def worker_plan(self, ends: dict[str, str]) -> dict[str, Any]:
        """What every worker is told (its index is added per worker)."""
        return {
            "clients": self.clients,
            "sizes": dict(BLOCK_BYTES),
            "counts": {
                s: {"1": self.count(s, 1), "N": self.count(s, self.clients)} for s in LAYOUTS
            },
            "layouts": {s: {**g, "dtype": "bfloat16"} for s, g in LAYOUTS.items()},
            "ends": ends,
        }

    def problem(self) -> str | None:
        """Why these rows cannot run as planned (None: they can): every rep must move at
        least one block per client, and the stores hold the get set and a put rep."""
        for size in LAYOUTS:
            if self.count(size, self.clients) < 1:
                need = BLOCK_BYTES[size] * self.clients // MiB
                return (
                    f"--rep-mib {self.rep_bytes // MiB} is too small for the Mooncake rows: "
                    f"{self.clients} clients of {size} blocks need at least {need}"
                )
        if 2 * self.rep_bytes > 0.6 * self.capacity:
            return (
                f"--capacity {self.capacity // MiB}MiB must hold the get set and a put rep "
                f"({2 * self.rep_bytes // MiB} MiB) under 60%"
            )
        return None


def kvstore_config(capacity: int) -> dict[str, Any]:
    """A kvstore-server holding everything in host memory (one store per block size)."""
    return {"tiers": [{"kind": "host", "capacity": capacity}], "server": {}}


@dataclass
class Timings:
    """Every rep's seconds per subject name, and what the byte checks found."""

    times: dict[str, list[float]]
    wrong: dict[str, list[str]]


def subject(system: str, path: str, op: str, size: str, clients: int) -> str:
    return f"{system}/{path}/{op}/{size}/c{clients}"


# -- the steady-state rounds -------------------------------------------------------------------
class Steady:
    """Both systems' servers and worker pools, for the interleaved rounds."""

    def __init__(self, plan: ServerPlan, pools: dict[str, WorkerPool]) -> None:
        self.plan, self.pools = plan, pools
        self.wrong: dict[str, list[str]] = {}

    def rep(self, system: str, path: str, op: str, size: str, clients: int) -> Rep:
        name = subject(system, path, op, size, clients)
        reps = self.plan.lookup_reps if op == "lookup" else 1

        def run() -> float:
            out = self.pools[system].rep(op, path, size, clients, reps)
            if out["wrong"]:
                self.wrong.setdefault(name, []).extend(out["wrong"])
            return float(out["seconds"])

        return run

    def subjects(self) -> dict[str, tuple[Rep, int]]:
        """Each subject next to its counterpart (so they share the same moments)."""
        out: dict[str, tuple[Rep, int]] = {}
        k = self.plan.reps
        for size in LAYOUTS:
            for clients in sorted({1, self.plan.clients}):
                for op in ("put", "get"):
                    for path in PATHS:
                        for system in SYSTEMS:
                            name = subject(system, path, op, size, clients)
                            out[name] = (self.rep(system, path, op, size, clients), k)
                name = subject("kvstore", "local", "memcpy", size, clients)
                out[name] = (self.rep("kvstore", "local", "memcpy", size, clients), k)
        for path in PATHS:
            for system in SYSTEMS:
                out[subject(system, path, "lookup", LOOKUP_SIZE, 1)] = (
                    self.rep(system, path, "lookup", LOOKUP_SIZE, 1),
                    k,
                )
        return out

    def prepare(self) -> None:
        """Worker 0 of each system: the get sets in (checked), the memory touched."""
        plan = self.plan
        for system, pool in self.pools.items():
            for size in LAYOUTS:
                fill = pool.call(range(1), "fill", path="tcp", size=size)[0]
                if fill["wrong"]:
                    self.wrong.setdefault(subject(system, "tcp", "fill", size, 1), []).append(
                        fill["wrong"]
                    )
            # Mooncake: one segment for both sizes; kvstore: a host tier per size.
            per_store = {"mooncake": 2 * plan.capacity, "kvstore": plan.capacity}[system]
            for size in LAYOUTS if system == "kvstore" else ("32MiB",):
                held = plan.rep_bytes * (2 if system == "mooncake" else 1)
                pool.call(
                    range(1), "touch", path="tcp", size=size, nbytes=int(0.8 * per_store) - held
                )

    def verify(self) -> None:
        """After the rounds: fresh puts read back byte for byte, every path and size."""
        for system, pool in self.pools.items():
            for path in PATHS:
                for size in LAYOUTS:
                    wrong = pool.call(range(1), "verify", path=path, size=size)[0]
                    if wrong:
                        name = subject(system, path, "verify", size, 1)
                        self.wrong.setdefault(name, []).append(wrong)


def start_pools(
    plan: ServerPlan, venv: MooncakeVenv, ends: dict[str, str], workdir: Path, stack: Any
) -> dict[str, WorkerPool]:
    """``plan.clients`` workers per system, connected, their blocks made."""
    pools = {
        "kvstore": WorkerPool(
            "kvstore",
            plan.clients,
            kvstore_python(),
            kvstore_worker_env(),
            workdir,
            plan.plant == "kvstore",
        ),
        "mooncake": WorkerPool(
            "mooncake", plan.clients, venv.python, venv.env(), workdir, plan.plant == "mooncake"
        ),
    }
    for pool in pools.values():
        stack.callback(pool.close)
    for pool in pools.values():
        pool.setup(plan.worker_plan(ends))
    return pools


def steady(plan: ServerPlan, venv: MooncakeVenv, workdir: Path) -> Timings:
    """Start both systems, prepare, time every subject in rounds, verify."""
    with contextlib.ExitStack() as stack:
        kv = stack.enter_context(
            KVStoreServerProcess(kvstore_config(plan.capacity), workdir / "kv")
        )
        mc = stack.enter_context(MooncakeServers(venv, 2 * plan.capacity, workdir))
        ends = {"kvstore_tcp": kv.address, "kvstore_unix": kv.unix_address, **mc.ends}
        say(f"starting {plan.clients} client processes per system")
        pools = start_pools(plan, venv, ends, workdir, stack)
        run = Steady(plan, pools)
        run.prepare()
        subjects = run.subjects()
        say(f"{len(subjects)} subjects, {plan.rounds} rounds x {plan.reps} reps")
        times = run_rounds(subjects, plan.rounds)
        run.verify()
        return Timings(times, run.wrong)


# -- first fill --------------------------------------------------------------------------------
@contextlib.contextmanager
def fresh(system: str, plan: ServerPlan, venv: MooncakeVenv, workdir: Path) -> Any:
    """``system``'s servers started just now and one worker connected to them."""
    with contextlib.ExitStack() as stack:
        if system == "kvstore":
            kv = stack.enter_context(
                KVStoreServerProcess(kvstore_config(plan.capacity), workdir / "kv")
            )
            ends = {"kvstore_tcp": kv.address, "kvstore_unix": kv.unix_address}
            python, env = kvstore_python(), kvstore_worker_env()
        else:
            ends = stack.enter_context(MooncakeServers(venv, 2 * plan.capacity, workdir)).ends
            python, env = venv.python, venv.env()
        pool = WorkerPool(system, 1, python, env, workdir, plan.plant == system)
        stack.callback(pool.close)
        pool.setup(plan.worker_plan(ends))
        yield pool


def first_fills(plan: ServerPlan, venv: MooncakeVenv, workdir: Path) -> Timings:
    """Puts of each get set into stores opened just before, ``first_fill_reps`` times."""
    out = Timings({}, {})
    for r in range(plan.first_fill_reps):
        for path in PATHS:
            order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
            for system in order:
                with (
                    tempfile.TemporaryDirectory(dir=workdir) as tmp,
                    fresh(system, plan, venv, Path(tmp)) as pool,
                ):
                    for size in LAYOUTS:
                        fill = pool.call(range(1), "fill", path=path, size=size)[0]
                        name = subject(system, path, "first_fill", size, 1)
                        out.times.setdefault(name, []).append(fill["seconds"])
                        if fill["wrong"]:
                            out.wrong.setdefault(name, []).append(fill["wrong"])
        say(f"first fill {r + 1}/{plan.first_fill_reps}")
    return out


# -- the section -------------------------------------------------------------------------------
def run_mooncake(plan: ServerPlan, venv_root: Path, workdir: Path) -> dict[str, Any]:
    """The server rows' raw data, or why they were skipped or failed."""
    try:
        venv = MooncakeVenv.find(venv_root)
    except PeerUnavailable as exc:
        return {"status": "skipped", "reason": str(exc)}
    say(f"Mooncake {venv.version} vs kvstore-server ({plan.rep_bytes // MiB} MiB per rep)")
    try:
        timings = steady(plan, venv, workdir)
        ff = first_fills(plan, venv, workdir)
    except PeerUnavailable as exc:
        return {"status": "skipped", "reason": f"Mooncake could not be started: {exc}"}
    except WorkerError as exc:
        return {"status": "failed", "error": f"a client process failed: {exc}"}
    return {
        "status": "ok",
        "version": venv.version,
        "times": {**timings.times, **ff.times},
        "wrong": {**timings.wrong, **ff.wrong},
    }


def row_keys(plan: ServerPlan) -> list[tuple[str, str, str, int]]:
    """(path, op, size, clients) of every server row."""
    keys = []
    for path in PATHS:
        for op in ("put", "get"):
            for size in LAYOUTS:
                keys += [(path, op, size, k) for k in sorted({1, plan.clients})]
        keys += [(path, "first_fill", size, 1) for size in LAYOUTS]
        keys.append((path, "lookup", LOOKUP_SIZE, 1))
    return keys


def samples(
    plan: ServerPlan, times: dict[str, list[float]], key: tuple[str, str, str, int]
) -> Callable[[str], list[float]]:
    """Per system: the key's figure per rep (GB/s; lookups: keys/s)."""
    path, op, size, clients = key

    def of(system: str) -> list[float]:
        seconds = times[subject(system, path, op, size, clients)]
        if op == "lookup":
            keys = plan.count(LOOKUP_SIZE, 1) * plan.lookup_reps
            return [keys / t for t in seconds]
        moved = plan.nbytes(size, 1 if op == "first_fill" else clients)
        return [moved / t / 1e9 for t in seconds]

    return of
