"""kvstore-server's mistakes get one line (issue 31): a table of command lines that cannot
start a server, and frames of another protocol version or of no kvstore protocol at all.

A row runs the ``kvstore-server`` entry point (``python -m kvstore.server.cli`` where it is
not installed) with HOME, the cache directory and the working directory in the test's
own directory, and asserts: exit 2, nothing on stdout, one line on stderr,
``kvstore-server: error: ...``, naming the setting and saying what to do, no traceback,
and not one file written there. A port "in use" is one this test holds open.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvharness.commands import files_under, one_error_line, prepare_home, run_command
from kvstore import KVStore, StoreConfig
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.errors import ConfigError
from kvstore.server import ServerThread
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import VERSION, Frame, Op, Status

LAYOUT = small_layout()
HOST_ONLY = "tiers:\n  - kind: host\n    capacity: 1MiB\n"


@dataclass(frozen=True)
class Start:
    """Arguments of ``kvstore-server`` (``{tmp}``: the test's directory, ``{busy}``: a port
    this test listens on), the files they name, and what the one line must say."""

    args: tuple[str, ...]
    says: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)


START_ROWS: dict[str, Start] = {
    "port-in-use": Start(
        ("--config", "{tmp}/host.yaml", "--listen", "127.0.0.1:{busy}"),
        (
            "server.listen (--listen) 127.0.0.1:{busy}: cannot listen: Address already in use",
            "stop what listens there or choose another address",
        ),
        files={"host.yaml": HOST_ONLY},
    ),
    "metrics-port-in-use": Start(
        (
            *("--config", "{tmp}/host.yaml", "--listen", "127.0.0.1:0"),
            *("--metrics-listen", "127.0.0.1:{busy}"),
        ),
        ("server.metrics_listen (--metrics-listen) 127.0.0.1:{busy}", "Address already in use"),
        files={"host.yaml": HOST_ONLY},
    ),
    "unix-socket-under-a-file": Start(
        ("--config", "{tmp}/host.yaml", "--listen", "", "--unix-socket", "{tmp}/hostname/s.sock"),
        ("server.unix_socket (--unix-socket) {tmp}/hostname/s.sock", "Not a directory"),
        files={"host.yaml": HOST_ONLY, "hostname": "box\n"},
    ),
    "bad-listen": Start(("--listen", "7070"), ("server.listen: expected HOST:PORT", "'7070'")),
    "port-out-of-range": Start(
        ("--listen", "127.0.0.1:99999"), ("server.listen: port 99999", "not in 0..65535")
    ),
    "exposed-without-a-token": Start(
        ("--listen", "0.0.0.0:0"),
        ("listen 0.0.0.0:0 is reachable from other hosts and no token is set", "--token-file"),
    ),
    "token-file-missing": Start(
        ("--token-file", "{tmp}/token"), ("token_file '{tmp}/token'", "No such file")
    ),
    "token-too-short": Start(
        ("--config", "{tmp}/s.yaml"),
        ("server.token", "16"),
        files={"s.yaml": "server:\n  token: short\n"},
    ),
    "tls-cert-missing": Start(
        ("--tls-cert", "{tmp}/cert.pem", "--tls-key", "{tmp}/key.pem"),
        ("server.tls_cert: '{tmp}/cert.pem' is not a readable file",),
    ),
    "bad-log-level": Start(
        ("--log-level", "loud"),
        ("--log-level: invalid choice: 'LOUD'", "'DEBUG', 'INFO', 'WARNING', 'ERROR'"),
    ),
    "unknown-option": Start(
        ("--port", "7070"), ("unrecognized arguments: --port 7070", "see kvstore-server --help")
    ),
    "config-typo": Start(
        ("--config", "{tmp}/s.yaml"),
        ("server.lisen: unknown key", "allowed keys"),
        files={"s.yaml": "server:\n  lisen: 127.0.0.1:7070\n"},
    ),
    "listen-a-tcp-url": Start(
        ("--listen", "tcp://127.0.0.1:0"),
        ("server.listen: write '127.0.0.1:0' (HOST:PORT or unix:/path), not a URL",),
    ),
    "metrics-listen-an-http-url": Start(
        ("--metrics-listen", "http://127.0.0.1:9100/"),
        ("server.metrics_listen: write '127.0.0.1:9100' (HOST:PORT", "not a URL"),
    ),
    "disk-path-under-a-file": Start(
        ("--config", "{tmp}/s.yaml", "--listen", "127.0.0.1:0"),
        ("disk tier path {tmp}/hostname/kv: {tmp}/hostname is a file",),
        files={
            "s.yaml": "tiers:\n  - kind: disk\n    path: {tmp}/hostname/kv\n",
            "hostname": "box\n",
        },
    ),
}


def filled(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    return text


def server_command() -> list[str]:
    """The ``kvstore-server`` entry point pip installs, else its module."""
    script = Path(sys.executable).with_name("kvstore-server")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvstore.server.cli"]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        yield holder.getsockname()[1]


@dataclass
class Ran:
    values: dict[str, str]
    tmp: Path
    before: dict[str, tuple[bool, int, int]]
    says: tuple[str, ...]
    result: Any


@pytest.fixture(scope="module")
def start_runs(tmp_path_factory: pytest.TempPathFactory, busy_port: int) -> dict[str, Ran]:
    """Every row run, a few at a time (short-lived processes), each in its own directory."""
    prepared = {}
    for row, start in START_ROWS.items():
        tmp = tmp_path_factory.mktemp(row)
        values = {"tmp": str(tmp), "busy": str(busy_port)}
        for name, text in start.files.items():
            (tmp / name).write_text(filled(text, values))
        prepare_home(tmp)
        argv = [*server_command(), *(filled(a, values) for a in start.args)]
        says = tuple(filled(s, values) for s in start.says)
        prepared[row] = (argv, Ran(values, tmp, files_under(tmp), says, None))
    with ThreadPoolExecutor(max_workers=4) as pool:
        running = {
            row: pool.submit(run_command, argv, ran.tmp, None, 60)
            for row, (argv, ran) in prepared.items()
        }
        for row, future in running.items():
            prepared[row][1].result = future.result()
    return {row: ran for row, (_, ran) in prepared.items()}


@pytest.mark.parametrize("row", list(START_ROWS), ids=list(START_ROWS))
def test_a_server_that_cannot_start_says_why_in_one_line(
    row: str, start_runs: dict[str, Ran]
) -> None:
    ran = start_runs[row]
    one_error_line(ran.result, "kvstore-server", ran.says)
    assert files_under(ran.tmp) == ran.before  # nothing written, changed or removed


# -- frames a server does not speak ----------------------------------------------------------
def other_version(head: bytearray) -> bytes:
    head[2] = VERSION + 1
    return bytes(head)


@pytest.mark.parametrize(
    ("first_bytes", "status", "says"),
    [
        (
            other_version,
            Status.UNSUPPORTED_VERSION,
            f"a frame of protocol version {VERSION + 1}; this side speaks version {VERSION}",
        ),
        (lambda head: b"GET /metrics HTTP/1.0\r\n\r\n", Status.BAD_FRAME, "not a kvstore frame"),
    ],
    ids=["another-protocol-version", "not-a-kvstore-client"],
)
def test_a_client_of_another_protocol_gets_one_line_and_the_server_serves_on(
    kv_server: Callable[..., ServerThread],
    raw: Any,
    first_bytes: Callable[[bytearray], bytes],
    status: Status,
    says: str,
) -> None:
    server = kv_server()
    kv = random_blocks(LAYOUT, 2)
    with Client(LAYOUT, ClientOptions(address=server.address)) as client:
        keys = [bytes([i]) * 16 for i in range(2)]
        client.put(keys, [kv[:, :, i * 8 : (i + 1) * 8] for i in range(2)])
    conn = raw(server.address)
    conn.sock.sendall(first_bytes(bytearray(Frame(Op.HELLO, 0, 0, 1, 0, 0).pack())))
    frame, meta, _ = conn.read()
    assert frame.status == status
    message = meta.decode()
    assert "\n" not in message and says in message, message
    assert conn.closed_by_server()
    with Client(LAYOUT, ClientOptions(address=server.address)) as client:  # serves on
        outs = [kv[:, :, :8].clone().zero_() for _ in range(2)]
        assert client.get(keys, outs) == [True, True]
        assert all(o.equal(kv[:, :, i * 8 : (i + 1) * 8]) for i, o in enumerate(outs))


# -- two servers on one disk directory (issue 50, item 2) ------------------------------------------
def test_a_second_server_on_a_disk_directory_in_use_refuses_and_a_killed_one_restarts(
    tmp_path: Path,
) -> None:
    """Two servers on one directory would evict and delete each other's blocks: the second
    refuses in one line naming the directory and the first one's pid. The lock is the
    kernel's (flock), so a server killed with SIGKILL leaves none behind: started again
    on the same directory, it starts and serves what it had written. Library stores may
    still share a directory (several processes of one engine do)."""
    disk = tmp_path / "disk"
    tiers = [{"kind": "host", "capacity": "4MiB"}, {"kind": "disk", "path": str(disk)}]
    first = KVStoreServerProcess(server_test_config(tmp_path / "a", tiers), tmp_path / "a")
    kv = random_blocks(LAYOUT, 2)
    with first:
        remote = {"kind": "remote", "address": first.address, "durable": True}
        with KVStore(LAYOUT, {"tiers": [remote]}) as store:
            keys = store.hash_tokens(list(range(2 * LAYOUT.block_tokens)), "lock")
            assert store.put(keys, kv) == 2  # durable: on the server's disk when acknowledged
        (tmp_path / "link").symlink_to(disk)  # the same directory, spelled otherwise
        second = tmp_path / "b"
        second.mkdir()
        prepare_home(second)
        (second / "s.yaml").write_text(
            f"tiers:\n  - kind: disk\n    path: {tmp_path / 'link'}\n    capacity: 64MiB\n"
        )
        argv = [*server_command(), "--config", str(second / "s.yaml"), "--listen", "127.0.0.1:0"]
        one_error_line(
            run_command(argv, second, None, 60),
            "kvstore-server",
            (
                f"disk tier path {tmp_path / 'link'} is in use by another kvstore-server "
                f"(pid {first.pid})",
                "delete each other's blocks",
                "a disk path of its own",
            ),
        )
        with KVStore(LAYOUT, {"tiers": [{"kind": "disk", "path": str(disk)}]}) as beside:
            assert beside.lookup(keys) == 0  # a library store opens there (its own blocks)
        first.kill()  # SIGKILL: no flush, no unlock but the kernel's
        first.start()
        with KVStore(LAYOUT, {"tiers": [remote]}) as store:
            assert store.lookup(keys) == 2
            assert torch.equal(store.get(keys), kv)


def test_two_in_process_servers_on_one_disk_directory(tmp_path: Path) -> None:
    """The same for servers in one process (ServerThread): the second refuses, and once
    the first has stopped, a server starts there."""
    tiers = [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]
    configs = [
        StoreConfig.from_dict(server_test_config(tmp_path / name, tiers), environ={})
        for name in ("a", "b")
    ]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with (
        ServerThread(configs[0]),
        pytest.raises(ConfigError, match="is in use by another kvstore-server"),
    ):
        ServerThread(configs[1]).start()
    with ServerThread(configs[1]) as again:
        assert again.address
