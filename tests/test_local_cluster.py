"""``kvstore local-cluster``, run as a user runs it: one command starts Redis, moto's S3 and
two kvstore-server nodes, prints how to use them (the printed commands are run as printed),
and a stop signal -- SIGTERM, Ctrl-C to the whole process group, or one that arrives while
it is still starting -- leaves no process and no directory behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMMAND = [sys.executable, "-m", "kvstore.cli", "local-cluster"]
DOC = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"
#: The columns of ``kvstore route``'s table that are estimates from the speeds each node
#: publishes (they depend on the machine): checked to be numbers, not against the doc.
TIMED = ("restore ms", "ready ms")
COLUMNS = ("node", "merit", "prefix chunks", "memory", "disk", "s3", *TIMED, "load", "address")


def doc_sample() -> list[str]:
    """The output docs/cluster.md shows for the two commands local-cluster prints: the
    first ``text`` block after "In a second terminal"."""
    text = DOC.read_text()
    rest = text[text.index("In a second terminal") :]
    block = rest[rest.index("```text\n") + len("```text\n") :]
    return block[: block.index("```")].strip("\n").splitlines()


def table(lines: list[str]) -> dict[str, dict[str, str]]:
    """``kvstore route``'s table, by node: column name -> cell."""
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["node", "merit"])
    assert lines[at].split() == " ".join(COLUMNS).split(), lines[at]
    rows = {}
    for line in lines[at + 1 :]:
        cells = line.split()
        assert len(cells) == len(COLUMNS), line
        rows[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def assert_route_as_documented(shown: list[str], addresses: dict[str, str]) -> None:
    """Every row of the doc's ``kvstore route`` sample, as ``shown``: every column the
    same but the timed ones (numbers there too) and the addresses (this run's)."""
    doc, got = table(doc_sample()), table(shown)
    assert sorted(got) == sorted(doc), shown
    for node, row in doc.items():
        want = {**row, "address": addresses[node]}
        for column in TIMED:  # a number, as in the doc (not "-")
            assert re.fullmatch(r"[0-9]+\.[0-9]+", got[node][column]), (node, column, shown)
            want[column] = got[node][column]
        assert got[node] == want, (node, shown)


def children(pid: int) -> dict[int, str]:
    """The child processes of ``pid`` (Linux /proc): pid -> command line."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_text()
        except (OSError, ValueError):
            continue
    return found


def running(pid: int, cmdline: str) -> bool:
    """Whether ``pid`` still runs that command (not a reused pid, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return (
            stat.rpartition(")")[2].split()[0] != "Z"
            and Path(f"/proc/{pid}/cmdline").read_text() == cmdline
        )
    except OSError:
        return False


def start(**popen: object) -> tuple[subprocess.Popen[str], list[str]]:
    """The command, and what it printed up to its ready line."""
    proc = subprocess.Popen(
        COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or "ready" not in lines[-1]:
        line = proc.stdout.readline()
        if not line:
            assert proc.stderr is not None
            pytest.fail(f"local-cluster exited before it was ready: {proc.stderr.read()}")
        lines.append(line.rstrip("\n"))
    return proc, lines


def after(lines: list[str], heading: str) -> str:
    """The line after the one that starts with ``heading``, unindented."""
    at = next(i for i, line in enumerate(lines) if line.startswith(heading))
    return lines[at + 1].strip()


def assert_all_gone(
    proc: subprocess.Popen[str], kids: dict[int, str], directory: Path | None
) -> None:
    """The command exited 0 and every process it started, and its directory, are gone."""
    assert proc.wait(timeout=120) == 0
    assert proc.stdout is not None and proc.stderr is not None
    tail = proc.stdout.read()
    assert "stopping" in tail and proc.stderr.read() == ""
    assert [pid for pid, cmd in kids.items() if running(pid, cmd)] == []
    assert children(proc.pid) == {}
    if directory is not None:
        assert f"removed {directory}" in tail
        assert not directory.exists()


def directory_of(lines: list[str]) -> Path:
    """The cluster's directory, as the banner's first line names it."""
    found = re.search(r"files in (\S+),", lines[1])
    assert found is not None, lines[1]
    return Path(found.group(1))


def refuses(server: str) -> bool:
    """Whether nothing listens at ``server`` (``redis://host:port/0``, ``host:port``, ...)."""
    host, port = server.split("://")[-1].split("/")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def test_one_command_starts_a_cluster_that_finds_chunks_through_another_node() -> None:
    proc, lines = start()
    kids = children(proc.pid)
    directory = directory_of(lines)
    try:
        servers = re.findall(r"^  (?:node \w|redis|s3)\s+(\S+)", "\n".join(lines), re.M)
        assert len(servers) == 4
        names = sorted(Path(cmd.split("\0")[0].split(" ")[0]).name for cmd in kids.values())
        assert names == sorted([Path(sys.executable).name] * 2 + ["redis-server"])
        assert "    - kind: remote" in lines  # the client config snippet is printed
        # The printed commands, as printed: store through node a, find through node b ...
        tried = subprocess.run(
            shlex.split(after(lines, "Store 6 chunks")),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert tried.returncode == 0, tried.stderr
        sample = doc_sample()
        assert tried.stdout.splitlines() == sample[:2]  # "stored 6 ...", "node b finds 6 ..."
        # ... and rank the nodes: a holds the prefix in its own tiers, b only through S3,
        # every row as the doc shows it (the blocks reach S3 by write-through in the
        # background and the shared index a heartbeat later: a second, give or take).
        route = shlex.split(after(lines, "Rank the nodes"))
        assert route[:2] == ["kvstore", "route"]
        addresses = dict(re.findall(r"^  node (\w)\s+(\S+)", "\n".join(lines), re.M))
        deadline = time.monotonic() + 20
        while True:
            ranked = subprocess.run(
                [*COMMAND[:-1], *route[1:]], capture_output=True, text=True, timeout=120
            )
            assert ranked.returncode == 0, ranked.stderr
            shown = ranked.stdout.splitlines()
            try:
                assert_route_as_documented(shown, addresses)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        as_json = subprocess.run(
            [*COMMAND[:-1], *route[1:], "--json"], capture_output=True, text=True, timeout=120
        )
        best, other = json.loads(as_json.stdout)
        assert (best["node_id"], best["prefix_blocks"], best["memory_blocks"]) == ("a", 6, 6)
        assert (other["node_id"], other["shared_blocks"], other["merit"]) == ("b", 6, 1.8)
    finally:
        proc.send_signal(signal.SIGTERM)
    assert_all_gone(proc, kids, directory)
    assert all(refuses(server) for server in servers)


def test_ctrl_c_to_the_process_group_stops_everything() -> None:
    """In a terminal Ctrl-C reaches every process of the group, the servers included."""
    proc, lines = start(start_new_session=True)
    directory = directory_of(lines)
    kids = children(proc.pid)
    assert len(kids) == 3
    os.killpg(proc.pid, signal.SIGINT)
    assert_all_gone(proc, kids, directory)


def test_a_stop_signal_while_it_starts_leaves_nothing_behind() -> None:
    proc = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # "starting ... in DIR", before any server starts
    directory = Path(first.split(" in ")[-1].strip())
    assert directory.is_dir(), first
    kids: dict[int, str] = {}
    while not kids and proc.poll() is None:  # redis-server, the first server, is starting
        kids = children(proc.pid)
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    kids.update(children(proc.pid))
    assert kids  # it was stopped while it was starting
    assert_all_gone(proc, kids, directory)


def test_without_redis_server_or_moto_it_says_what_to_install(tmp_path: Path) -> None:
    """One line naming both, exit 2, nothing started."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['moto'] = None\n")
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(COMMAND, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("kvstore: error: `kvstore local-cluster` needs redis-server")
    assert "apt-get install -y redis-server" in done.stderr
    assert "pip install 'moto[server]'" in done.stderr


def test_a_node_count_out_of_range_is_one_line() -> None:
    done = subprocess.run([*COMMAND, "--nodes", "1"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "kvstore: error: --nodes: expected 2 to 8, got 1\n"
