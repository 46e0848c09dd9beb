"""Encryption at rest: put and get throughput with encryption on vs off, same run.

Three media, each with a plain and an encrypting instance side by side, fresh
(new directories, prefixes, servers) and timed in interleaved rounds:

- ``disk``: two disk tiers (``page_cache: bypass``, so O_DIRECT where the
  filesystem takes it; codec raw; ``--io-threads``), a batch of ``--blocks``
  blocks per rep; gets land in page-aligned memory (as the host tier's slots).
- ``s3``: two S3 tiers on moto's server (a child process), concurrency 8.
- ``server``: two ``kvstore-server`` processes whose only tier is such a disk
  tier, one with ``encryption`` on; a client puts (``durable``: acknowledged
  once on disk) and gets the batch over TCP.

Ratios: ``encrypt_put_ratio`` / ``encrypt_get_ratio`` per medium = encrypted
throughput / plain throughput (medians of the reps); target >= 0.8 each. For
context, raw AES-256-GCM throughput of one core here (``cryptography``'s
``AESGCM.encrypt_into`` / ``decrypt_into`` on 1 MiB buffers).

Blocks: ``--layers`` layers x 8 KV heads x head_dim 128 x ``--tokens`` tokens,
bf16 (16 x 128: 8 MiB). Puts use new keys every rep (the rep before's are
deleted untimed); gets read one stored batch.

Run: ``python benchmarks/bench_encrypt.py [--json] [--quick] [--dir PATH]``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import Rep, base_parser, emit, environment, log, median, run_rounds
from bench_codec import make_block

from kvharness import new_key, write_keyring
from kvstore import KVLayout
from kvstore.keys import BlockKey
from kvstore.testing import make_keys

TARGET = 0.8
MEDIA = ("disk", "s3", "server")


def bench_layout(layers: int, tokens: int) -> KVLayout:
    return KVLayout(
        num_layers=layers, num_kv_heads=8, head_dim=128, block_tokens=tokens, dtype=torch.bfloat16
    )


def aligned_empty(layout: KVLayout) -> torch.Tensor:
    """A block-shaped tensor in page-aligned memory (as the host tier's slots are)."""
    region = mmap.mmap(-1, layout.block_nbytes)
    flat = torch.from_numpy(np.frombuffer(region, dtype=np.uint8))
    return flat.view(layout.dtype).view(layout.block_shape)


def aes_gbps(reps: int) -> dict[str, float]:
    """One core's AES-256-GCM encrypt and decrypt GB/s on 1 MiB buffers."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, nonce, n = AESGCM(os.urandom(32)), os.urandom(12), 1 << 20
    data, sealed, back = bytearray(os.urandom(n)), bytearray(n + 16), bytearray(n)
    out = {}
    for name, fn in (
        ("aes_gcm_encrypt_gbps", lambda: aead.encrypt_into(nonce, data, b"", sealed)),
        ("aes_gcm_decrypt_gbps", lambda: aead.decrypt_into(nonce, sealed, b"", back)),
    ):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(16):
                fn()
            times.append(time.perf_counter() - start)
        out[name] = 16 * n / median(times) / 1e9
    return out


class Pair:
    """A plain and an encrypting instance of one medium: put and get reps of each."""

    def __init__(self, layout: KVLayout, blocks: list[torch.Tensor], ends: dict[str, Any]) -> None:
        self.layout, self.blocks, self.ends = layout, blocks, ends
        self.stored = make_keys(len(blocks), salt=1)
        self.outs = [aligned_empty(layout) for _ in blocks]
        self._salt = 100
        self._last: dict[str, list[BlockKey]] = {}
        for end in ends.values():
            assert all(end.put(self.stored, blocks)), "fill failed"

    def put_rep(self, which: str) -> Rep:
        end = self.ends[which]

        def rep() -> float:
            if which in self._last:  # untimed: keep the medium's size flat
                end.delete(self._last.pop(which))
            self._salt += 1
            keys = make_keys(len(self.blocks), salt=self._salt)
            start = time.perf_counter()
            done = end.put(keys, self.blocks)
            elapsed = time.perf_counter() - start
            assert all(done), f"{which}: a put failed"
            self._last[which] = keys
            return elapsed

        return rep

    def get_rep(self, which: str) -> Rep:
        end = self.ends[which]

        def rep() -> float:
            start = time.perf_counter()
            done = end.get(self.stored, self.outs)
            elapsed = time.perf_counter() - start
            assert all(done), f"{which}: a get missed"
            return elapsed

        return rep

    def check(self) -> None:
        for which, end in self.ends.items():
            assert all(end.get(self.stored, self.outs)), which
            for out, block in zip(self.outs, self.blocks, strict=True):
                assert torch.equal(out, block), f"{which}: wrong bytes"


class ClientEnd:
    """A kvstore client as a put / get / delete medium."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def put(self, keys: list[BlockKey], blocks: list[torch.Tensor]) -> list[bool]:
        return list(self.client.put(keys, blocks, durable=True))

    def get(self, keys: list[BlockKey], outs: list[torch.Tensor]) -> list[bool]:
        return list(self.client.get(keys, outs))

    def delete(self, keys: list[BlockKey]) -> None:
        self.client.delete(keys)


def time_pair(name: str, pair: Pair, rounds: int, reps: int) -> tuple[dict[str, Any], dict]:
    subjects = {
        f"{name}_{w}_{op}": (getattr(pair, f"{op}_rep")(w), reps)
        for op in ("put", "get")
        for w in ("plain", "encrypted")
    }
    times = run_rounds(subjects, rounds)
    pair.check()
    nbytes = len(pair.blocks) * pair.layout.block_nbytes
    out: dict[str, Any] = {}
    for op in ("put", "get"):
        plain, enc = median(times[f"{name}_plain_{op}"]), median(times[f"{name}_encrypted_{op}"])
        out[f"plain_{op}_gbps"] = nbytes / plain / 1e9
        out[f"encrypted_{op}_gbps"] = nbytes / enc / 1e9
        out[f"encrypt_{op}_ratio"] = plain / enc
    return out, {k: len(v) for k, v in times.items()}


@contextlib.contextmanager
def disk_pair(
    layout: KVLayout, blocks: list[torch.Tensor], root: Path, key_file: str, threads: int
) -> Iterator[tuple[Pair, bool]]:
    from kvstore.config import DiskTierConfig, EncryptionConfig
    from kvstore.format import BlockCipher
    from kvstore.tiers import DiskTier

    def tier(name: str) -> DiskTier:
        config = DiskTierConfig(
            path=str(root / name),
            capacity=4 * len(blocks) * (layout.block_nbytes + 8192),
            codec="raw",
            page_cache="bypass",
            io_threads=threads,
        )
        return DiskTier(config, layout)

    plain, enc = tier("plain"), tier("encrypted")
    keys = EncryptionConfig(key_file=key_file).keyring().tenant("default")
    enc.encrypt_with(BlockCipher("default", keys))
    try:
        yield (
            Pair(layout, blocks, {"plain": plain, "encrypted": enc}),
            bool(plain.stats()["o_direct"]),
        )
    finally:
        plain.close()
        enc.close()


@contextlib.contextmanager
def s3_pair(layout: KVLayout, blocks: list[torch.Tensor], key_file: str) -> Iterator[Pair]:
    from kvstore.cli import DUMMY_AWS_ENV, S3Server
    from kvstore.config import EncryptionConfig, S3TierConfig
    from kvstore.format import BlockCipher
    from kvstore.tiers import S3Tier

    os.environ.update(DUMMY_AWS_ENV)
    with S3Server(bucket="kvstore-bench-encrypt", mode="process") as server:

        def tier(prefix: str) -> S3Tier:
            config = S3TierConfig(
                bucket=server.bucket,
                prefix=f"{prefix}{os.getpid()}",
                endpoint_url=server.url,
                region="us-east-1",
                concurrency=8,
                codec="raw",
            )
            return S3Tier(config, layout)

        plain, enc = tier("plain"), tier("encrypted")
        keys = EncryptionConfig(key_file=key_file).keyring().tenant("default")
        enc.encrypt_with(BlockCipher("default", keys))
        try:
            yield Pair(layout, blocks, {"plain": plain, "encrypted": enc})
        finally:
            plain.close()
            enc.close()


@contextlib.contextmanager
def server_pair(
    layout: KVLayout, blocks: list[torch.Tensor], root: Path, key_file: str
) -> Iterator[Pair]:
    from kvstore.cli import KVStoreServerProcess
    from kvstore.client import Client, ClientOptions

    def config(name: str, encrypted: bool) -> dict[str, Any]:
        disk = {"kind": "disk", "path": str(root / name / "disk"), "capacity": "4GiB"}
        disk.update(codec="raw", page_cache="bypass")
        doc: dict[str, Any] = {"tiers": [disk], "server": {}}
        if encrypted:
            doc["encryption"] = {"key_file": key_file, "tiers": ["disk"]}
        return doc

    with contextlib.ExitStack() as stack:
        ends = {}
        for which in ("plain", "encrypted"):
            work = tempfile.mkdtemp(prefix="kvs-enc-", dir="/tmp")  # short Unix socket path
            stack.callback(shutil.rmtree, work, ignore_errors=True)
            server = stack.enter_context(
                KVStoreServerProcess(config(which, which == "encrypted"), work)
            )
            options = ClientOptions(address=server.address, namespace="bench")
            ends[which] = ClientEnd(stack.enter_context(Client(layout, options)))
        yield Pair(layout, blocks, ends)


def parse_args(argv: list[str] | None) -> Any:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks per rep")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2, help="reps per subject per round")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--dir", default=None, help="directory on the disk to test")
    parser.add_argument("--media", default=",".join(MEDIA), help="of: " + ",".join(MEDIA))
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.layers, args.tokens, args.reps = 4, 8, 64, 1
    args.rounds = args.rounds or (1 if args.quick else 7)  # quick: a smoke run only
    return args


def run(args: Any) -> dict[str, Any]:
    layout = bench_layout(args.layers, args.tokens)
    blocks = [make_block(layout, "realish", seed=i) for i in range(args.blocks)]
    media = [m.strip() for m in args.media.split(",") if m.strip()]
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {
        "benchmark": "encrypt",
        "block_nbytes": layout.block_nbytes,
        "blocks_per_rep": args.blocks,
        "rounds": args.rounds,
        **aes_gbps(5 if args.quick else 20),
    }
    reps: dict[str, int] = {}
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-encrypt-", dir=args.dir))
    key_file = write_keyring(root / "keys.json", {"bench": new_key()}, "bench")
    runners: dict[str, Callable[[], Any]] = {
        "disk": lambda: disk_pair(layout, blocks, root, key_file, args.io_threads),
        "s3": lambda: s3_pair(layout, blocks, key_file),
        "server": lambda: server_pair(layout, blocks, root, key_file),
    }
    try:
        for name in media:
            log(f"{name}: plain vs encrypted, {args.rounds} rounds")
            with runners[name]() as opened:
                pair, o_direct = opened if isinstance(opened, tuple) else (opened, None)
                figures, counts = time_pair(name, pair, args.rounds, args.reps)
            if o_direct is not None:
                figures["o_direct"] = o_direct
            result[name] = figures
            reps.update(counts)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for op in ("put", "get"):
        result[f"encrypt_{op}_ratio"] = {m: result[m][f"encrypt_{op}_ratio"] for m in media}
    result["target_ratio"] = TARGET
    result["meets_target"] = {
        f"{m}_{op}": result[m][f"encrypt_{op}_ratio"] >= TARGET
        for m in media
        for op in ("put", "get")
    }
    result["reps"] = reps
    # Other jobs on the machine compete for the CPU that sealing needs: say how busy it was.
    result["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["environment"] = environment()
    return result


def table(result: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = [["medium", "op", "plain GB/s", "encrypted GB/s", "ratio", "ok"]]
    for m in MEDIA:
        if m not in result:
            continue
        for op in ("put", "get"):
            rows.append(
                [
                    m,
                    op,
                    result[m][f"plain_{op}_gbps"],
                    result[m][f"encrypted_{op}_gbps"],
                    result[m][f"encrypt_{op}_ratio"],
                    result["meets_target"][f"{m}_{op}"],
                ]
            )
    rows.append(["aes-gcm", "seal", "", result["aes_gcm_encrypt_gbps"], "", ""])
    rows.append(["aes-gcm", "open", "", result["aes_gcm_decrypt_gbps"], "", ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    emit(result, args.json, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
