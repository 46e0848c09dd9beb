"""The kvstore-server command: starts on defaults, says where it listens, drains on
SIGTERM, refuses an exposed address without a token; and `kvstore config` hides secrets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.cli import main as kvstore_main
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.cli.servers import free_port


def env_with(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env.update(extra)
    return env


def test_no_arguments_serve_the_embedded_defaults(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server.cli"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env_with(tmp_path, KVSTORE_SERVER_LISTEN=f"127.0.0.1:{port}"),
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "tiers: [{kind: remote" in line or not line:
                break
        text = "".join(lines)
        assert f"listening on 127.0.0.1:{port}" in text, text
        assert "host 4.00 GiB" in text and str(tmp_path / "cache" / "kvstore") in text
        assert "no token (loopback only)" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # drained and stopped cleanly


def test_an_exposed_address_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvstore.server.cli", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        env=env_with(tmp_path),
        timeout=60,
    )
    assert run.returncode == 2
    assert "refusing to start" in run.stderr and "--token-file" in run.stderr


def test_kvstore_server_subcommand_and_bad_settings(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "server", "--listen", "nowhere"],
        capture_output=True,
        text=True,
        env=env_with(tmp_path),
        timeout=60,
    )
    assert run.returncode == 2 and "HOST:PORT" in run.stderr


def test_kvstore_config_hides_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "do-not-print-this-token-123"
    path = tmp_path / "c.yaml"
    path.write_text(
        f"tiers: [{{kind: remote, address: '127.0.0.1:7070', token: {secret}}}]\n"
        f"server: {{token: {secret}, tokens: [{{name: a, token: {secret}x}}]}}\n"
    )
    assert kvstore_main(["config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert secret not in out and out.count("***") == 3


def test_sigusr2_traces_memory_then_logs_what_grew(tmp_path: Path) -> None:
    """A leak hunt without a restart: the first ``kill -USR2`` starts tracing Python's
    allocations, each next one logs the sites that grew; the server goes on serving."""
    config = server_test_config(tmp_path, [{"kind": "host", "capacity": "4MiB"}])
    with KVStoreServerProcess(config, tmp_path) as server:
        assert server.pid is not None
        for said in ("tracing memory allocations", "grew most", "grew most"):
            seen = server.log_tail(100_000).count(said)
            os.kill(server.pid, signal.SIGUSR2)
            deadline = time.monotonic() + 20
            while server.log_tail(100_000).count(said) == seen:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.05)
        assert "traced memory" in server.log_tail(100_000) and server.running
