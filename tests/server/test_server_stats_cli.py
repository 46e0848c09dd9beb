"""``kvstore stats --server``: a running server's own figures from the command line -- each
tier's live read speed (measured by the reads it served), its restore figures, and the
tenants' bytes, quotas and counters as the token may see them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvharness.commands import one_error_line, prepare_home, run_command
from kvstore.cli import main
from kvstore.client import Client, ClientOptions
from kvstore.config import format_size
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
BLOCK = LAYOUT.block_nbytes
OPS = "ops-token-0123456789abcdef"
TEAM = "team-token-0123456789abcdef"


def blocks(n: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, 5)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


@pytest.fixture
def server(kv_server: Start) -> ServerThread:
    tenants = {
        "ops": {"tokens": [{"name": "ops", "token": OPS, "scopes": ["read", "write", "admin"]}]},
        "team": {
            "namespaces": ["team"],
            "tokens": [{"name": "t", "token": TEAM}],
            "quotas": {"host": {"share": 8 * BLOCK, "limit": 16 * BLOCK}},
        },
    }
    tiers = [{"kind": "host", "capacity": 32 * BLOCK}, {"kind": "disk", "capacity": "16MiB"}]
    server = kv_server(tiers, tenants=tenants)
    keys = make_keys(24, salt=4)
    options = ClientOptions(server.address, "team", TEAM.encode(), shared_memory=False)
    with Client(LAYOUT, options) as team:
        assert all(team.put(keys, blocks(24)))  # past the host limit: some go to the disk
        outs = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in keys]
        assert team.get(keys, outs) == [True] * 24
    return server


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["stats", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def token_file(tmp_path: Path, secret: str) -> str:
    path = tmp_path / "token"
    path.write_text(secret + "\n")
    return str(path)


def test_the_operator_sees_live_speeds_and_every_tenants_figures(
    server: ServerThread, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ops = token_file(tmp_path, OPS)
    code, text, _ = run(capsys, "--server", server.address, "--token-file", ops)
    assert code == 0
    assert f"kvstore-server {server.address}: 1 store(s) open" in text
    disk = next(line for line in text.splitlines() if line.strip().startswith("disk"))
    assert "(measured," in disk  # the reads the server served set the disk's speed
    assert "priced x1)" in disk  # no restore corrected its price, none erred
    assert "restore planning on" in text
    team = next(line for line in text.splitlines() if line.strip().startswith("team:"))
    assert "hits" in team and "reclaimed 0" in team
    quota = f"(share {format_size(8 * BLOCK)}, limit {format_size(16 * BLOCK)})"
    assert any(line.strip().startswith("host") and quota in line for line in text.splitlines())
    code, raw, _ = run(capsys, "--server", server.address, "--token-file", ops, "--json")
    stats = json.loads(raw)
    assert code == 0 and set(stats["tenants"]) >= {"team"}
    tiers = {t["kind"]: t for t in stats["stores"][0]["tiers"]}
    assert tiers["disk"]["read_speed_source"] == "measured"
    assert stats["tenants"]["team"]["tiers"]["host"]["bytes"] <= 16 * BLOCK


def test_a_tenants_token_sees_its_own_figures_only(
    server: ServerThread, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    team = token_file(tmp_path, TEAM)
    argv = ["--server", server.address, "--namespace", "team", "--token-file", team]
    code, raw, _ = run(capsys, *argv, "--json")
    stats = json.loads(raw)
    assert code == 0 and set(stats["tenants"]) == {"team"} and "server" not in stats
    assert {s["namespace"] for s in stats["stores"]} == {"team"}


def test_a_missing_token_file_or_a_dead_server_is_one_line(
    server: ServerThread, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "nope")
    code, out, err = run(capsys, "--server", server.address, "--token-file", missing)
    assert code == 2 and out == "" and err.startswith("kvstore: error: --token-file:")
    assert len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, "--server", "127.0.0.1:1")
    assert code == 2 and out == "" and err.startswith("kvstore: error:")
    assert len(err.strip().splitlines()) == 1


def test_a_token_on_a_namespace_it_does_not_open_is_refused_naming_the_ones_it_does(
    server: ServerThread, tmp_path: Path
) -> None:
    """Issue 50, item 6: ``kvstore stats --server ... --token-file team.token --namespace
    other`` printed "0 store(s) open" and exited 0. The command, as a user runs it: one
    line naming the namespace and the one the token opens, exit 2; the namespace the token
    does open still works, and so does leaving ``--namespace`` out."""
    prepare_home(tmp_path)
    team = token_file(tmp_path, TEAM)
    argv = [sys.executable, "-m", "kvstore", "stats", "--server", server.address]
    wrong = run_command([*argv, "--token-file", team, "--namespace", "team-b"], tmp_path, {})
    one_error_line(
        wrong,
        "kvstore",
        (server.address, "namespace 'team-b'", "it opens namespace 'team'"),
    )
    for extra in (["--namespace", "team"], []):
        right = run_command([*argv, "--token-file", team, *extra], tmp_path, {})
        assert right.returncode == 0, right.stderr
        assert "1 store(s) open" in right.stdout
    # The operator's token opens every namespace: nothing to refuse.
    ops = tmp_path / "ops.token"
    ops.write_text(OPS + "\n")
    anyone = run_command([*argv, "--token-file", str(ops), "--namespace", "team-b"], tmp_path, {})
    assert anyone.returncode == 0, anyone.stderr
