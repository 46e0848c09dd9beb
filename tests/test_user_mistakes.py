"""Every user mistake gets one line (issue 31): the command line and the library over bad
inputs, as a table.

A row of the command line runs ``python -m kvstore`` (or the ``kvstore`` entry point) as
a process, with HOME, the cache directory and the working directory in the test's own
directory, and asserts: exit 2, nothing on stdout, exactly one line on stderr,
``kvstore: error: ...``, naming the thing and saying what to do (each row's ``says``),
no traceback, and not one file written, changed or removed anywhere in that directory.

A row of the library makes a bad call on a store that holds blocks on disk and asserts:
a :class:`KVStoreError` of the row's class, a one-line message naming the thing, the disk
tier's directory unchanged, and every block still read back bit-exact. Rows that open a
store against something wrong outside it (a server of another protocol version, a
refused token, Redis down, a missing S3 bucket, a full or read-only disk, a disk path
under a regular file) use the real thing: servers on free ports, a tiny tmpfs where this
machine lets the tests mount one. The server's own rows: tests/server/test_server_mistakes.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharness.commands import files_under, one_error_line, prepare_home, run_command
from kvharness.mounts import remount_read_only
from kvstore import KVLayout, KVStore
from kvstore.cli.servers import RedisServer, free_port
from kvstore.errors import (
    AccessDeniedError,
    BlockNotFoundError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    TierError,
)
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import FRAME, MAGIC, VERSION, Flag

Stocked = tuple[KVStore, list[bytes], torch.Tensor]

LAYOUT = small_layout()  # 3 layers x 2 KV heads x 16, 8-token chunks, bfloat16
BLOCKS = 4


# -- the command line ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Cli:
    """A command line, the files it needs (path -> text or bytes, relative to the test's
    directory), variables, and what its one line must say. ``{tmp}`` in ``args`` and
    ``env`` is the test's directory."""

    args: tuple[str, ...]
    says: tuple[str, ...]
    files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


#: A cluster config whose Redis is on a port nobody listens on ({port}: filled in).
CLUSTER = "cluster:\n  redis_url: redis://127.0.0.1:{port}/0\n"
KEY = "00" * 16 + "\n"

CLI_ROWS: dict[str, Cli] = {
    # -- the config file
    "config-missing": Cli(("config", "--config", "{tmp}/nope.yaml"), ("nope.yaml", "No such")),
    "config-is-a-directory": Cli(("config", "--config", "{tmp}"), ("Is a directory",)),
    "config-under-a-file": Cli(
        ("config", "--config", "{tmp}/hostname/store.yaml"),
        ("hostname/store.yaml", "Not a directory"),
        files={"hostname": "box\n"},
    ),
    "config-not-text": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("store.yaml", "is not UTF-8 text", "give the YAML file"),
        files={"store.yaml": b"\xff\xfe\x00t\x00i"},
    ),
    "config-bad-yaml": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("store.yaml", "is not valid YAML: line 2, column 1"),
        files={"store.yaml": "tiers: [\n"},
    ),
    "config-tab-indent": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("not valid YAML: line 2", "'\\t'"),
        files={"store.yaml": "tiers:\n\t- kind: host\n"},
    ),
    "config-not-a-mapping": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("config: expected a mapping, got list",),
        files={"store.yaml": "- kind: host\n"},
    ),
    "config-unknown-key": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].capacty: unknown key", "allowed keys: ", "capacity"),
        files={"store.yaml": "tiers:\n  - kind: host\n    capacty: 1GiB\n"},
    ),
    "config-unknown-section": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tierz: unknown key", "allowed keys: "),
        files={"store.yaml": "tierz: []\n"},
    ),
    "config-unknown-tier-kind": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].kind: unknown tier kind 'nvme'", "known kinds: ", "register_tier"),
        files={"store.yaml": "tiers:\n  - kind: nvme\n"},
    ),
    "config-size-of-a-wrong-type": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].capacity", "as a size (e.g. "),
        files={"store.yaml": "tiers:\n  - kind: host\n    capacity: [1, 2]\n"},
    ),
    "config-number-of-a-wrong-type": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("lease_s: expected a number, got 'soon'",),
        files={"store.yaml": "lease_s: soon\n"},
    ),
    "config-tiers-not-a-list": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers: expected a list",),
        files={"store.yaml": "tiers: host\n"},
    ),
    "config-impossible-value": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].capacity: must be > 0",),
        files={"store.yaml": "tiers:\n  - kind: host\n    capacity: 0\n"},
    ),
    "config-bad-listen": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("server.listen: expected HOST:PORT", "'7070'"),
        files={"store.yaml": "server:\n  listen: '7070'\n"},
    ),
    # -- KVSTORE_* variables
    "env-config-missing": Cli(
        ("config",),
        ("$KVSTORE_CONFIG={tmp}/nope.yaml", "No such"),
        env={"KVSTORE_CONFIG": "{tmp}/nope.yaml"},
    ),
    "env-bad-value": Cli(
        ("config",),
        ("KVSTORE_HOST_CAPACITY: tiers[0].capacity", "'lots'", "as a size"),
        env={"KVSTORE_HOST_CAPACITY": "lots"},
    ),
    "env-unknown-variable": Cli(
        ("config",),
        ("KVSTORE_HOTS_CAPACITY: unknown setting", "KVSTORE_<KIND>_<FIELD>"),
        env={"KVSTORE_HOTS_CAPACITY": "1GiB"},
    ),
    "env-tiers-bad-yaml": Cli(
        ("config",),
        ("KVSTORE_TIERS is not valid YAML/JSON: line 1",),
        env={"KVSTORE_TIERS": "[{kind: host"},
    ),
    "env-tiers-unknown-key": Cli(
        ("config",),
        ("KVSTORE_TIERS: tiers[0].size: unknown key", "allowed keys"),
        env={"KVSTORE_TIERS": "[{kind: host, size: 1GiB}]"},
    ),
    # -- commands and options
    "unknown-command": Cli(("stat",), ("invalid choice: 'stat'", "see kvstore --help")),
    "no-command": Cli((), ("required: command", "see kvstore --help")),
    "unknown-option": Cli(("config", "--colour"), ("unrecognized arguments: --colour",)),
    "not-a-number": Cli(
        ("stats", "--layers", "many"),
        ("--layers: invalid int value: 'many'", "kvstore stats --help"),
    ),
    "zero-layers": Cli(("stats", "--layers", "0"), ("--layers 0: must be at least 1",)),
    "bad-dtype": Cli(
        ("stats", "--dtype", "float13"),
        ("layout flags: unknown dtype 'float13'", "expected one of", "bfloat16"),
    ),
    "flags-and-layout-disagree": Cli(
        ("stats", "--layers", "2", "--layout", "00000000"),
        ("--layout 00000000: the layout flags name layout", "give the flags or --layout"),
    ),
    "demo-no-sessions": Cli(("demo", "--sessions", "0"), ("--sessions 0: must be at least 1",)),
    "demo-negative-turns": Cli(("demo", "--turns", "-1"), ("--turns -1: must be at least 1",)),
    "local-cluster-no-nodes": Cli(("local-cluster", "--nodes", "0"), ("--nodes 0: must be",)),
    # -- a disk path under a regular file (issue 31, item 3)
    "stats-disk-under-a-file": Cli(
        ("stats", "--config", "{tmp}/store.yaml", "--layers", "2"),
        ("disk tier path {tmp}/hostname/kv: {tmp}/hostname is a file", "set the tier's path"),
        files={
            "store.yaml": "tiers:\n  - kind: disk\n    path: {tmp}/hostname/kv\n",
            "hostname": "box\n",
        },
    ),
    "demo-cache-dir-under-a-file": Cli(
        ("demo", "--layers", "1", "--sessions", "1", "--cache-dir", "{tmp}/hostname/kv"),
        ("disk tier path {tmp}/hostname/kv: {tmp}/hostname is a file",),
        files={"hostname": "box\n"},
    ),
    # -- a key given twice in a YAML file or variable (issue 50, item 15)
    "config-duplicate-key": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        (
            "config file '{tmp}/store.yaml': line 4: duplicate key 'capacity' (first on line 3)",
            "give each key once",
        ),
        files={"store.yaml": "tiers:\n  - kind: host\n    capacity: 1GiB\n    capacity: 64GiB\n"},
    ),
    "config-duplicate-section": Cli(
        ("stats", "--config", "{tmp}/store.yaml", "--layers", "2"),
        ("store.yaml': line 4: duplicate key 'tiers' (first on line 1)",),
        files={"store.yaml": "tiers:\n  - kind: host\nlease_s: 5\ntiers:\n  - kind: disk\n"},
    ),
    "env-tiers-duplicate-key": Cli(
        ("config",),
        ("KVSTORE_TIERS: line 1: duplicate key 'capacity' (first on line 1)",),
        env={"KVSTORE_TIERS": "[{kind: host, capacity: 1GiB, capacity: 2GiB}]"},
    ),
    # -- two disk tiers on one directory (issue 50, item 2): they delete each other's blocks
    "two-disk-tiers-one-path": Cli(
        ("stats", "--config", "{tmp}/store.yaml", "--layers", "2"),
        ("tiers[2].path: ", "is also the directory of tiers[1]", "a directory of its own"),
        files={
            "store.yaml": "tiers:\n  - kind: host\n  - kind: disk\n    path: {tmp}/kv\n"
            "  - kind: disk\n    path: {tmp}/kv\n"
        },
    ),
    "two-disk-tiers-one-path-spelled-twice": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[1].path: ", "of tiers[0] (kv and {tmp}/work/./kv/ both lead there)"),
        files={
            "store.yaml": "tiers:\n  - kind: disk\n    path: kv\n"
            "  - kind: disk\n    path: {tmp}/work/./kv/\n"
        },
    ),
    "disk-tier-inside-another": Cli(
        ("stats", "--config", "{tmp}/store.yaml", "--layers", "2"),
        ("tiers[1].path: ", "are one inside the other", "a directory of its own"),
        files={
            "store.yaml": "tiers:\n  - kind: disk\n    path: kv\n  - kind: disk\n    path: kv/big\n"
        },
    ),
    # -- a remote tier's address that is no address (issue 50, item 4)
    "remote-http-url": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].address: http://127.0.0.1:7070 is an HTTP URL", "not HTTP", "HOST:PORT"),
        files={"store.yaml": "tiers:\n  - kind: remote\n    address: http://127.0.0.1:7070\n"},
    ),
    "remote-redis-url": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].address: a Redis URL is not a kvstore-server address", "kind: redis"),
        files={"store.yaml": "tiers:\n  - kind: remote\n    address: redis://h:6379/0\n"},
    ),
    "remote-tcp-url-without-a-port": Cli(
        ("config", "--config", "{tmp}/store.yaml"),
        ("tiers[0].address: expected tcp://HOST:PORT, got 'tcp://kvstore-host'",),
        files={"store.yaml": "tiers:\n  - kind: remote\n    address: tcp://kvstore-host\n"},
    ),
    "route-without-a-cluster": Cli(
        ("route", "--keys", "-"), ("cluster.redis_url: not set", "needs a cluster config")
    ),
    "route-keys-missing": Cli(
        ("route", "--config", "{tmp}/c.yaml", "--keys", "{tmp}/keys.txt"),
        ("--keys {tmp}/keys.txt: No such file",),
        files={"c.yaml": CLUSTER},
    ),
    "route-keys-not-hex": Cli(
        ("route", "--config", "{tmp}/c.yaml", "--keys", "{tmp}/keys.txt"),
        ("--keys: expected one hex key per line",),
        files={"c.yaml": CLUSTER, "keys.txt": "not-a-key\n"},
    ),
    "route-tokens-without-model": Cli(
        ("route", "--config", "{tmp}/c.yaml", "--tokens", "{tmp}/t.txt"),
        ("--tokens needs --model",),
        files={"c.yaml": CLUSTER, "t.txt": "1 2 3\n"},
    ),
    "route-redis-down": Cli(
        ("route", "--config", "{tmp}/c.yaml", "--keys", "{tmp}/keys.txt"),
        ("cluster index (Redis) unavailable", "127.0.0.1:{port}"),
        files={"c.yaml": CLUSTER, "keys.txt": KEY},
    ),
}


def filled(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``{name}`` of ``values`` replaced (YAML's own braces stay)."""
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    return text


@dataclass
class Ran:
    """A row's command line as run: its directory, what it held before, the result."""

    tmp: Path
    values: dict[str, str]
    before: dict[str, tuple[bool, int, int]]
    result: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every row of CLI_ROWS run, a few at a time (each is a short-lived process, most of
    it Python starting up), each in a directory of its own."""
    prepared = {}
    for row, cli in CLI_ROWS.items():
        tmp = tmp_path_factory.mktemp(row)
        values = {"tmp": str(tmp), "port": str(free_port())}
        for name, content in cli.files.items():
            data = filled(content, values).encode() if isinstance(content, str) else content
            (tmp / name).write_bytes(data)
        prepare_home(tmp)
        argv = [sys.executable, "-m", "kvstore", *(filled(a, values) for a in cli.args)]
        env = {k: filled(v, values) for k, v in cli.env.items()}
        prepared[row] = (tmp, values, files_under(tmp), argv, env)
    with ThreadPoolExecutor(max_workers=4) as pool:
        running = {
            row: pool.submit(run_command, argv, tmp, env)
            for row, (tmp, _, _, argv, env) in prepared.items()
        }
        return {
            row: Ran(prepared[row][0], prepared[row][1], prepared[row][2], future.result())
            for row, future in running.items()
        }


@pytest.mark.parametrize("row", list(CLI_ROWS), ids=list(CLI_ROWS))
def test_a_command_line_mistake_is_one_line(row: str, cli_runs: dict[str, Ran]) -> None:
    ran = cli_runs[row]
    one_error_line(ran.result, "kvstore", tuple(filled(s, ran.values) for s in CLI_ROWS[row].says))
    assert files_under(ran.tmp) == ran.before  # nothing written, changed or removed


def test_the_entry_point_says_the_same_one_line(tmp_path: Path) -> None:
    """The ``kvstore`` script that pip installs, not only ``python -m kvstore``."""
    script = Path(sys.executable).with_name("kvstore")
    if not script.exists():
        pytest.skip(f"no kvstore entry point beside {sys.executable} (not pip-installed)")
    prepare_home(tmp_path)
    (tmp_path / "work" / "store.yaml").write_text("tiers:\n  - kind: host\n    capacty: 1GiB\n")
    before = files_under(tmp_path)
    result = run_command([str(script), "config", "--config", "store.yaml"], tmp_path, {})
    one_error_line(result, "kvstore", ("tiers[0].capacty: unknown key", "allowed keys"))
    assert files_under(tmp_path) == before


# -- the library: bad calls ------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A bad call on a store that holds ``BLOCKS`` blocks on disk (``call(store, keys, kv)``),
    the error class it must raise and what its one line must say."""

    call: Callable[[KVStore, list[bytes], torch.Tensor], object]
    error: type[KVStoreError]
    says: tuple[str, ...]
    #: What the user did before the mistake (not part of it: it may write).
    setup: Callable[[KVStore], object] | None = None


def chunks_of(layout: KVLayout, kv: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The KV of chunks ``start`` to ``stop`` of ``kv``."""
    bt = layout.block_tokens
    return kv[:, :, start * bt : stop * bt]


def chunks(kv: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The KV of chunks ``start`` to ``stop`` of ``kv`` (LAYOUT)."""
    return chunks_of(LAYOUT, kv, start, stop)


SHAPE = str(tuple(LAYOUT.tensor_shape(BLOCKS)))
OTHER_KEY = bytes(range(16))

LIBRARY_ROWS: dict[str, Call] = {
    "put-wrong-shape": Call(
        lambda s, k, kv: s.put(k, chunks(kv, 0, BLOCKS - 1)),
        LayoutMismatchError,
        ("kv has shape", f"expected {SHAPE}"),
    ),
    "put-wrong-dtype": Call(
        lambda s, k, kv: s.put(k, kv.float()),
        LayoutMismatchError,
        ("kv has dtype float32", "layout expects bfloat16"),
    ),
    "put-not-a-tensor": Call(
        lambda s, k, kv: s.put(k, kv.float().numpy()),
        InvalidInputError,
        ("kv must be a torch.Tensor, got ndarray",),
    ),
    "put-more-keys-than-chunks": Call(
        lambda s, k, kv: s.put([*k, OTHER_KEY], kv), LayoutMismatchError, ("kv has shape",)
    ),
    "put-text-keys": Call(
        lambda s, k, kv: s.put([key.hex() for key in k], kv),
        InvalidInputError,
        ("keys[0] must be a 16-byte key (bytes), got str",),
    ),
    "put-short-key": Call(
        lambda s, k, kv: s.put([b"k", *k[1:]], kv), InvalidInputError, ("keys[0] has 1 bytes",)
    ),
    "put-a-key-not-a-list": Call(
        lambda s, k, kv: s.put(k[0], chunks(kv, 0, 1)),
        InvalidInputError,
        ("keys must be a sequence of 16-byte keys",),
    ),
    "put-parent-without-tokens": Call(
        lambda s, k, kv: s.put(k[1:], chunks(kv, 1, BLOCKS), parent=k[0]),
        InvalidInputError,
        ("parent: given without tokens",),
    ),
    "get-text-keys": Call(
        lambda s, k, kv: s.get([key.hex() for key in k]),
        InvalidInputError,
        ("keys[0] must be a 16-byte key",),
    ),
    "get-not-stored": Call(
        lambda s, k, kv: s.get([OTHER_KEY]),
        BlockNotFoundError,
        (f"key {OTHER_KEY.hex()}) is not stored", "lookup(keys)"),
    ),
    "get-into-a-wrong-buffer": Call(
        lambda s, k, kv: s.get(k, out=torch.empty(LAYOUT.tensor_shape(1), dtype=LAYOUT.dtype)),
        LayoutMismatchError,
        ("out has shape", f"expected {SHAPE}"),
    ),
    "get-out-and-device": Call(
        lambda s, k, kv: s.get(k, out=torch.empty_like(kv), device="cpu"),
        InvalidInputError,
        ("give out or device, not both",),
    ),
    "get-no-such-device": Call(
        lambda s, k, kv: s.get(k, device="tpu"), InvalidInputError, ("device: ", "tpu")
    ),
    "lookup-a-string": Call(
        lambda s, k, kv: s.lookup(k[0].hex()),
        InvalidInputError,
        ("keys must be a sequence of 16-byte keys",),
    ),
    "hash-float-tokens": Call(
        lambda s, k, kv: s.hash_tokens([0.5] * 8, "m"),
        InvalidInputError,
        ("token_ids must all be ints, got 0.5",),
    ),
    "hash-text": Call(
        lambda s, k, kv: s.hash_tokens("hello world", "m"),
        InvalidInputError,
        ("token_ids must be a list, numpy array or tensor of ints, got str",),
    ),
    "namespace-not-a-string": Call(
        lambda s, k, kv: s.hash_tokens([1] * 8, 7),
        InvalidInputError,
        ("namespace must be a model id string or a Namespace, got int",),
    ),
    "put-layer-out-of-range": Call(
        lambda s, k, kv: s.put_layer(k, LAYOUT.num_layers, kv[0]),
        InvalidInputError,
        (f"layer must be in [0, {LAYOUT.num_layers}), got {LAYOUT.num_layers}",),
    ),
    "put-layer-whole-kv": Call(
        lambda s, k, kv: s.put_layer(k, 0, kv), LayoutMismatchError, ("kv_layer has shape",)
    ),
    "pin-negative-lease": Call(
        lambda s, k, kv: s.pin(k, lease_s=-1), InvalidInputError, ("lease_s must be > 0",)
    ),
    "evict-negative": Call(
        lambda s, k, kv: s.evict(-1), InvalidInputError, ("n must be an int >= 0, got -1",)
    ),
    "prefetch-bad-order": Call(
        lambda s, k, kv: s.prefetch(k, order="random"),
        InvalidInputError,
        ("order must be 'layer' or 'block', got 'random'",),
    ),
    "layout-bad-dtype": Call(
        lambda s, k, kv: KVLayout(3, 2, 16, 8, dtype="float13"),
        InvalidInputError,
        ("unknown dtype 'float13'; expected one of", "bfloat16"),
    ),
    "layout-zero-layers": Call(
        lambda s, k, kv: KVLayout(0, 2, 16, 8),
        InvalidInputError,
        ("KVLayout.num_layers must be a positive int, got 0",),
    ),
    "store-without-a-layout": Call(
        lambda s, k, kv: KVStore("llama-3-8b"),  # type: ignore[arg-type]
        InvalidInputError,
        ("layout must be a KVLayout, got str",),
    ),
    "store-config-a-number": Call(
        lambda s, k, kv: KVStore(LAYOUT, 5),  # type: ignore[arg-type]
        ConfigError,
        ("config: expected a StoreConfig, a mapping or the path of a YAML file, got int",),
    ),
    "store-config-typo": Call(
        lambda s, k, kv: KVStore(LAYOUT, {"tiers": [{"kind": "host", "capacty": "1MiB"}]}),
        ConfigError,
        ("tiers[0].capacty: unknown key", "allowed keys"),
    ),
    "store-config-file-missing": Call(
        lambda s, k, kv: KVStore(LAYOUT, "/nonexistent/kvstore.yaml"),
        ConfigError,
        ("config file '/nonexistent/kvstore.yaml': No such file",),
    ),
    "store-second-disk-tier-on-the-same-directory": Call(
        lambda s, k, kv: KVStore(LAYOUT, with_disk(s, os.path.join(disk_of(s), "..", "disk"))),
        ConfigError,
        ("tiers[2].path: ", "is also the directory of tiers[1]", "delete each other's blocks"),
    ),
    "store-second-disk-tier-through-a-symlink": Call(
        lambda s, k, kv: KVStore(LAYOUT, with_disk(s, str(Path(disk_of(s)).parent / "link"))),
        ConfigError,
        ("tiers[2].path: ", "is also the directory of tiers[1]", "/link both lead there)"),
        setup=lambda s: (Path(disk_of(s)).parent / "link").symlink_to(disk_of(s)),
    ),
    "store-disk-tier-inside-the-other": Call(
        lambda s, k, kv: KVStore(LAYOUT, with_disk(s, os.path.join(disk_of(s), "kvstore-v1"))),
        ConfigError,
        ("tiers[2].path: ", "are one inside the other"),
    ),
    "used-after-close": Call(
        lambda s, k, kv: s.get(k), ClosedError, ("the store is closed",), setup=KVStore.close
    ),
}


def disk_of(store: KVStore) -> str:
    """The directory of the stocked store's disk tier."""
    return str(store.config.tiers[1].path)  # type: ignore[attr-defined]


def with_disk(store: KVStore, path: str) -> dict[str, Any]:
    """The stocked store's config with one more disk tier, in ``path``."""
    config = store_config(Path(disk_of(store)))
    config["tiers"].append({"kind": "disk", "path": path, "capacity": "1MiB"})
    return config


def store_config(disk: Path) -> dict[str, Any]:
    """Host memory for every block over a disk tier in ``disk``."""
    return {
        "tiers": [
            {"kind": "host", "capacity": 2 * BLOCKS * LAYOUT.block_nbytes},
            {"kind": "disk", "path": str(disk), "capacity": "1MiB"},
        ]
    }


@pytest.fixture
def stocked(tmp_path: Path) -> Iterator[Stocked]:
    """A store with ``BLOCKS`` blocks, on disk too, and nothing left moving."""
    store = KVStore(LAYOUT, store_config(tmp_path / "disk"))
    keys = store.hash_tokens(list(range(BLOCKS * LAYOUT.block_tokens)), "mistakes")
    kv = random_blocks(LAYOUT, BLOCKS)
    assert store.put(keys, kv) == BLOCKS
    store.flush()
    assert store.drain(timeout=60)
    yield store, keys, kv
    store.close()


@pytest.mark.parametrize("row", list(LIBRARY_ROWS), ids=list(LIBRARY_ROWS))
def test_a_bad_call_is_one_line_and_changes_nothing(
    row: str, stocked: Stocked, tmp_path: Path
) -> None:
    store, keys, kv = stocked
    case = LIBRARY_ROWS[row]
    if case.setup is not None:
        case.setup(store)
    before = files_under(tmp_path)
    with pytest.raises(KVStoreError) as raised:
        case.call(store, keys, kv)
    assert type(raised.value) is case.error, repr(raised.value)
    message = str(raised.value)
    assert "\n" not in message
    for part in case.says:
        assert part in message, (part, message)
    assert files_under(tmp_path) == before  # nothing written on disk
    if store.closed:  # what the closed store held is on disk, whole
        with KVStore(LAYOUT, store_config(tmp_path / "disk")) as reopened:
            assert torch.equal(reopened.get(keys), kv)
        return
    assert store.lookup(keys) == BLOCKS and store.lookup([OTHER_KEY]) == 0
    assert torch.equal(store.get(keys), kv)  # nothing lost


# -- the library: a store opened against something wrong outside it ------------------------------
@dataclass(frozen=True)
class Opening:
    """A store opened with host memory over the tier ``tier(world)``; ``world`` holds the
    fixtures the row ``needs`` by name, and ``tmp``. The error class, and what its one line
    says (``says(world)``)."""

    tier: Callable[[dict[str, Any]], dict[str, Any]]
    error: type[KVStoreError]
    says: Callable[[dict[str, Any]], tuple[str, ...]]
    needs: tuple[str, ...] = ()


WRONG_TOKEN = "wrong-token-0123456789abcdef"
MISSING_BUCKET = "no-such-bucket-for-kvstore"

OPENING_ROWS: dict[str, Opening] = {
    "remote-of-another-protocol-version": Opening(
        lambda w: {"kind": "remote", "address": w["newer_server"]},
        ProtocolError,
        lambda w: (
            f"kvstore-server at {w['newer_server']} does not speak this client's protocol",
            f"a frame of protocol version {VERSION + 1}",
            "the same kvstore release",
        ),
        needs=("newer_server",),
    ),
    "remote-not-a-kvstore-server": Opening(
        lambda w: {"kind": "remote", "address": w["http_server"]},
        ProtocolError,
        lambda w: (f"kvstore-server at {w['http_server']}", "not a kvstore frame", "address"),
        needs=("http_server",),
    ),
    "remote-refused-token": Opening(
        lambda w: {"kind": "remote", "address": w["token_server"], "token": WRONG_TOKEN},
        AccessDeniedError,
        lambda w: (f"kvstore-server at {w['token_server']} refused the token", "use a token"),
        needs=("token_server",),
    ),
    "remote-bad-address": Opening(
        lambda w: {"kind": "remote", "address": "localhost"},
        ConfigError,
        lambda w: ("address", "'localhost'"),
    ),
    "remote-http-url": Opening(
        lambda w: {"kind": "remote", "address": "http://127.0.0.1:7070"},
        ConfigError,
        lambda w: ("tiers[1].address: http://127.0.0.1:7070 is an HTTP URL", "not HTTP"),
    ),
    "disk-path-under-a-file": Opening(
        lambda w: {"kind": "disk", "path": str(w["tmp"] / "hostname" / "kv"), "capacity": "1MiB"},
        ConfigError,
        lambda w: (
            f"disk tier path {w['tmp'] / 'hostname' / 'kv'}: {w['tmp'] / 'hostname'} is a file",
            "set the tier's path",
        ),
        needs=("a_regular_file",),
    ),
    "disk-smaller-than-a-block": Opening(
        lambda w: {"kind": "disk", "path": str(w["tmp"] / "disk"), "capacity": 100},
        ConfigError,
        lambda w: ("capacity 100 bytes is smaller than one block file", "capacity of at least"),
    ),
    "remote-token-file-missing": Opening(
        lambda w: {
            "kind": "remote",
            "address": "127.0.0.1:7070",
            "token_file": str(w["tmp"] / "token"),
        },
        ConfigError,
        lambda w: (f"token_file '{w['tmp'] / 'token'}': No such file",),
    ),
    "device-without-cuda": Opening(
        lambda w: {"kind": "device", "device": "cuda:0", "capacity": "1MiB"},
        ConfigError,
        lambda w: ("device tier: cuda:0 requested but CUDA is not available",),
        needs=("no_cuda",),
    ),
    "s3-bucket-missing": Opening(
        lambda w: {
            "kind": "s3",
            "bucket": MISSING_BUCKET,
            "endpoint_url": w["s3_server"].url,
            "region": "us-east-1",
            "deadline": 3.0,
        },
        TierError,
        lambda w: (f"bucket {MISSING_BUCKET!r} at {w['s3_server'].url} does not exist",),
        needs=("s3_server", "aws_env"),
    ),
    "redis-wrong-password": Opening(
        lambda w: {"kind": "redis", "url": f"redis://:not-it@127.0.0.1:{w['locked_redis']}/0"},
        TierError,
        lambda w: (f"redis://:***@127.0.0.1:{w['locked_redis']}/0 refused the credentials",),
        needs=("locked_redis",),
    ),
}


def recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client left")
        data += chunk
    return data


@contextlib.contextmanager
def answering(reply: Callable[[bytes], bytes], port: int = 0) -> Iterator[str]:
    """A TCP server on ``port`` (0: a free one) that reads a client's first frame and
    answers ``reply(its header)``: a server of another kind, or of another protocol version."""
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    head = recv_exact(conn, FRAME.size)
                    recv_exact(conn, FRAME.unpack(head)[6])  # its meta
                    conn.sendall(reply(head))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def newer_reply(head: bytes) -> bytes:
    """HELLO's answer from a server of the next protocol version."""
    _, _, op, _, _, rid, _, _ = FRAME.unpack(head)
    return FRAME.pack(MAGIC, VERSION + 1, op, Flag.REPLY, 0, rid, 2, 0) + b"{}"


@pytest.fixture
def newer_server() -> Iterator[str]:
    with answering(newer_reply) as address:
        yield address


@pytest.fixture
def http_server() -> Iterator[str]:
    with answering(lambda head: b"HTTP/1.0 400 Bad Request\r\n\r\n") as address:
        yield address


@pytest.fixture
def token_server(kv_server: Callable[..., Any]) -> str:
    return str(kv_server(token="admin-token-0123456789abcdef").address)


@pytest.fixture
def locked_redis() -> Iterator[int]:
    with RedisServer(extra_args=["--requirepass", "the-right-one-0123"]) as redis:
        yield redis.port


@pytest.fixture
def no_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: a device tier opens")


@pytest.fixture
def a_regular_file(tmp_path: Path) -> Path:
    path = tmp_path / "hostname"
    path.write_text("box\n")
    return path


@pytest.mark.parametrize("row", list(OPENING_ROWS), ids=list(OPENING_ROWS))
def test_a_store_that_cannot_work_refuses_to_open_in_one_line(
    row: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    case = OPENING_ROWS[row]
    world = {name: request.getfixturevalue(name) for name in case.needs}
    world["tmp"] = tmp_path
    config = {"tiers": [{"kind": "host", "capacity": "1MiB"}, case.tier(world)]}
    before = files_under(tmp_path)
    with pytest.raises(KVStoreError) as raised:
        KVStore(LAYOUT, config)
    assert type(raised.value) is case.error, repr(raised.value)
    message = str(raised.value)
    assert "\n" not in message
    for part in case.says(world):
        assert part in message, (part, message)
    assert files_under(tmp_path) == before
    assert not [r for r in caplog.records if r.exc_info]  # no traceback in the log either


def test_a_server_of_another_version_in_its_place_is_a_miss_and_one_logged_line(
    kv_server: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The server is upgraded under a running store: what only it held is a miss, said
    once (not a traceback per call), and the store serves on from memory."""
    server = kv_server()
    remote = {"kind": "remote", "address": server.address, "retry_interval": 60}
    config = {"tiers": [{"kind": "host", "capacity": 8 * LAYOUT.block_nbytes}, remote]}
    kv = random_blocks(LAYOUT, 4)
    with KVStore(LAYOUT, config) as store:
        keys = store.hash_tokens(list(range(4 * LAYOUT.block_tokens)), "upgrade")
        assert store.put(keys[:2], chunks(kv, 0, 2)) == 2
        assert store.flush() == 2
        store.evict(2)  # only the server holds them now
        server.stop()
        port = int(server.address.rpartition(":")[2])
        with answering(newer_reply, port):
            caplog.clear()
            caplog.set_level(logging.WARNING, logger="kvstore")
            out = torch.empty_like(chunks(kv, 0, 2))
            assert store.get_prefix(keys[:2], out) == 0  # a miss, not an error
            assert store.get_prefix(keys[:2], out) == 0
            assert store.put(keys[2:], chunks(kv, 2, 4)) == 2  # memory serves on
            assert torch.equal(store.get(keys[2:]), chunks(kv, 2, 4))
            lines = [
                r.getMessage()
                for r in caplog.records
                if r.levelno >= logging.WARNING and not r.name.startswith("kvstore.server")
            ]
            assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"
    assert len(lines) == 1, lines
    assert f"kvstore-server at {server.address} does not speak this client's protocol" in lines[0]
    assert f"protocol version {VERSION + 1}" in lines[0]


# -- the library: a medium down or full is a miss and one logged line ------------------------------
def warnings_from_the_store(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The store's warnings and errors (each must be one line, without a traceback)."""
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in records if r.exc_info], "a traceback in the log"
    lines = [r.getMessage() for r in records]
    assert all("\n" not in line for line in lines), lines
    return lines


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("redis", ("redis tier: redis://127.0.0.1:{port}/0 unavailable", "retrying every")),
        (
            "remote",
            (
                "tier remote unavailable",
                "kvstore-server at 127.0.0.1:{port}",
                "refused",
                "misses while",
            ),
        ),
    ],
)
def test_a_server_that_is_down_is_a_miss_and_one_logged_line(
    kind: str, says: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """Redis or a kvstore-server that does not answer when the store opens: the store opens
    (it reconnects by itself), says so once, and serves from memory."""
    caplog.set_level(logging.WARNING, logger="kvstore")
    port = free_port()
    where = {
        "redis": {"url": f"redis://127.0.0.1:{port}/0"},
        "remote": {"address": f"127.0.0.1:{port}"},
    }
    tiers = [
        {"kind": "host", "capacity": "1MiB"},
        {"kind": kind, **where[kind], "retry_interval": 60},
    ]
    with KVStore(LAYOUT, {"tiers": tiers}) as store:
        keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), "down")
        kv = random_blocks(LAYOUT, 2)
        assert store.put(keys, kv) == 2
        assert torch.equal(store.get(keys), kv)
        lines = warnings_from_the_store(caplog)
    assert len(lines) == 1, lines
    for part in says:
        assert part.replace("{port}", str(port)) in lines[0], (part, lines[0])


BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=64)  # 256 KiB chunks
BIG_FILE = BIG.block_nbytes + 4096  # a block file: the chunk and its header


@pytest.fixture
def small_disk(tmpfs: Callable[[str, str], Path]) -> Path:
    """A real 2 MiB filesystem (room for 7 block files of BIG), where this machine lets
    the tests mount one (as root, or with the capability)."""
    return tmpfs("small", "2m")


def disk_config(path: Path, host: bool = False) -> dict[str, Any]:
    """A disk tier of 6 block files in ``path`` (less than the free space: no clamp)."""
    disk = {"kind": "disk", "path": str(path), "capacity": 6 * BIG_FILE}
    return {"tiers": [{"kind": "host", "capacity": 8 * BIG.block_nbytes}, disk] if host else [disk]}


def block_files(root: Path) -> dict[str, int]:
    """The files under ``root`` and their sizes (a directory's mtime moves as a failed
    write's temp file comes and goes)."""
    return {path: size for path, (is_dir, size, _) in files_under(root).items() if not is_dir}


def test_a_full_disk_stores_what_fits_and_says_so_once(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore")
    kv = random_blocks(BIG, 5)
    with KVStore(BIG, disk_config(small_disk)) as store:
        keys = store.hash_tokens(list(range(5 * BIG.block_tokens)), "full")
        assert store.put(keys[:2], chunks_of(BIG, kv, 0, 2)) == 2
        # Someone else fills the disk: less than a block file of room is left.
        free = shutil.disk_usage(small_disk).free
        (small_disk / "filler").write_bytes(bytes(free - BIG_FILE // 2))
        before = block_files(small_disk)
        assert store.put(keys[2:], chunks_of(BIG, kv, 2, 5)) == 0  # a miss, not an error
        lines = warnings_from_the_store(caplog)
        assert len(lines) == 1, lines  # one line for the full disk, not one per block
        assert str(small_disk) in lines[0] and "No space left on device" in lines[0], lines
        assert block_files(small_disk) == before  # no temp file left behind
        assert torch.equal(store.get(keys[:2]), chunks_of(BIG, kv, 0, 2))  # nothing lost
        (small_disk / "filler").unlink()  # room again: the store stores again
        assert store.put(keys[2:], chunks_of(BIG, kv, 2, 5)) == 3
        assert torch.equal(store.get(keys), kv)


def test_a_read_only_disk_serves_what_it_holds_and_says_so_once(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = random_blocks(BIG, 4)
    with KVStore(BIG, disk_config(small_disk)) as store:
        keys = store.hash_tokens(list(range(4 * BIG.block_tokens)), "read-only")
        assert store.put(keys[:2], chunks_of(BIG, kv, 0, 2)) == 2
    remount_read_only(small_disk)
    caplog.set_level(logging.WARNING, logger="kvstore")
    before = files_under(small_disk)
    with KVStore(BIG, disk_config(small_disk, host=True)) as store:
        assert torch.equal(store.get(keys[:2]), chunks_of(BIG, kv, 0, 2))  # nothing lost
        assert store.put(keys[2:], chunks_of(BIG, kv, 2, 4)) == 2  # into memory only
        assert torch.equal(store.get(keys), kv)
    lines = warnings_from_the_store(caplog)
    assert len(lines) == 1, lines  # at open; not again for each put, nor at close
    assert str(small_disk) in lines[0] and "storing none" in lines[0], lines
    assert files_under(small_disk) == before


# -- the URL forms people write for a server's address (issue 50, item 4) -----------------------
def test_a_remote_tier_takes_tcp_and_unix_urls(kv_server: Callable[..., Any]) -> None:
    """``tcp://HOST:PORT`` and ``unix:///path`` reach the server (before, the first was
    looked up as a host named ``tcp``: "Name or service not known", every lookup 0)."""
    server = kv_server()
    unix_path = server.server.addresses["unix"]
    kv = random_blocks(LAYOUT, 2)
    for address, spelled in (
        (f"tcp://{server.address}", server.address),
        (f"unix://{unix_path}", f"unix:{unix_path}"),
    ):
        remote = {"kind": "remote", "address": address, "retry_interval": 60}
        config = {"tiers": [{"kind": "host", "capacity": 4 * LAYOUT.block_nbytes}, remote]}
        with KVStore(LAYOUT, config) as store:
            assert store.config.tiers[1].address == spelled  # type: ignore[attr-defined]
            keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), address)
            assert store.put(keys, kv) == 2
            assert store.flush() == 2
            store.evict(2, tier=0)  # only the server holds them now
            assert store.lookup(keys) == 2
            assert torch.equal(store.get(keys), kv)


# -- a disk of another layout (issue 50, item 8) ---------------------------------------------------
def test_a_store_of_another_layout_on_a_shared_disk_names_both_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A float16 writer, then a bfloat16 reader of the same model on the same directory:
    the reader finds nothing (it reads only its own layout's blocks), and says why once
    per other layout, naming what differs; the writer's layout opened again finds all."""
    disk = {"kind": "disk", "path": str(tmp_path / "shared"), "capacity": "1MiB"}
    tokens = list(range(4 * LAYOUT.block_tokens))
    writers = [small_layout(dtype=torch.float16), small_layout(block_tokens=4)]
    for layout in writers:
        with KVStore(layout, {"tiers": [disk]}) as writer:
            keys = writer.hash_tokens(tokens[: 4 * layout.block_tokens], "shared")
            assert writer.put(keys, random_blocks(layout, 4)) == 4
    caplog.clear()  # (the second writer found the first one's blocks: said as well)
    caplog.set_level(logging.WARNING, logger="kvstore")
    host = {"kind": "host", "capacity": 8 * LAYOUT.block_nbytes}
    with KVStore(LAYOUT, {"tiers": [host, disk]}) as reader:
        keys = reader.hash_tokens(tokens, "shared")
        assert reader.lookup(keys) == 0
        assert reader.get_prefix(keys, torch.empty(LAYOUT.tensor_shape(4), dtype=LAYOUT.dtype)) == 0
        assert reader.lookup(keys) == 0
    lines = warnings_from_the_store(caplog)
    assert len(lines) == 2, lines  # one per other layout, not one per lookup
    fp16, chunks4 = sorted(lines, key=lambda line: "dtype float16 there" not in line)
    shape = "3 layers x 2 KV heads x 16 head_dim"
    here = f"bfloat16, {shape}, 8-token chunks (layout {LAYOUT.fingerprint_hex})"
    for line in lines:
        assert f"disk tier {tmp_path / 'shared'}: holds blocks of another layout" in line
        assert f"none of this store's, {here}" in line and "open the store with the layout" in line
    assert f"float16, {shape}, 8-token chunks (layout {writers[0].fingerprint_hex})" in fp16
    assert "they differ in dtype float16 there, bfloat16 here" in fp16
    assert "they differ in block_tokens 4 there, 8 here" in chunks4
    caplog.clear()
    with KVStore(writers[0], {"tiers": [disk]}) as again:  # the writer's layout: every block
        keys = again.hash_tokens(tokens, "shared")
        assert again.lookup(keys) == 4
    assert warnings_from_the_store(caplog) == []
