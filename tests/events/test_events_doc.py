"""docs/events.md's copy-paste set-up for a kvstore-server and Dynamo's indexer, run as
written: the shell block starts the server and the indexer in the background and registers
the server with the indexer; a client then puts a prompt through the server (the next
block), and the indexer's ``/query`` (the block after) finds the server's worker.

The block runs in bash, as pasted into a terminal whose environment is kvstore's: this
checkout's ``.venv/bin`` first on ``PATH`` (``kvstore-server``). Dynamo's indexer lives in a
virtualenv of its own, which the block names by its path: ai-dynamo-runtime pins another
pydantic, and installing it into kvstore's environment swapped kvstore's (issue 50). The
test checks that kvstore's environment is left as it was.
What the test changes, and why: the block's fixed ports (7070, 5557, 5558, 8090) become
free ones and its paths (/tmp/kvstore-events.yaml, /var/tmp/kvstore) paths in a temporary
directory, so that runs never collide; its indexer virtualenv (~/.venvs/dynamo-indexer) is
``.venv-dynamo``, which ``scripts/setup-dynamo.sh`` built the same way (so the block's
``pip install ai-dynamo-runtime==1.6.1`` finds it installed, offline);
``KVSTORE_HOST_PREFAULT=false`` keeps the 4 GiB host tier from being committed on a shared
test machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dynamo_indexer import DYNAMO_VENV, dynamo_marks

from kvstore import KVStore
from kvstore.cli.servers import free_port
from kvstore.testing.data import random_blocks, small_layout

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

pytestmark = dynamo_marks(240)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "events.md"
PORTS = (7070, 5557, 5558, 8090)  # server, events, replay, indexer HTTP
CHUNK = 32  # tokens per kvstore chunk (the block's block_size is 16: two blocks a chunk)


def setup_block() -> str:
    """The first bash block of docs/events.md's "Three set-ups" (the server + indexer)."""
    text = DOC.read_text()
    section = text[text.index("## Three set-ups") :]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)
    return next(b for b in blocks if "dynamo.indexer" in b)


def localize(block: str, ports: dict[int, int], work: Path) -> str:
    """``block`` with its fixed ports and paths replaced by the test's."""
    for fixed, free in ports.items():
        block = re.sub(rf"(?<![0-9]){fixed}(?![0-9])", str(free), block)
    block = block.replace("/tmp/kvstore-events.yaml", str(work / "kvstore-events.yaml"))
    block = block.replace("~/.venvs/dynamo-indexer", str(DYNAMO_VENV))
    return block.replace("/var/tmp/kvstore", str(work / "kvstore"))


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    shutil.rmtree(tmp_path / "kvstore", ignore_errors=True)


class Shell:
    """bash running a block as a terminal would, its ``&`` jobs kept as its children:
    the block's exit status is written to a file, then bash waits; SIGTERM makes it
    stop every job (each in its own process group: the indexer's threads too) and reap it.
    """

    def __init__(self, work: Path, block: str) -> None:
        (work / "block.sh").write_text(block)
        self.status = work / "block.status"
        runner = (
            "set -m\n"  # each & job in its own process group, so `kill -- -PID` ends all of it
            "trap 'for p in $(jobs -p); do kill -TERM -- -$p; done; wait; exit 0' TERM\n"
            f"source {work / 'block.sh'}\n"
            f"echo $? > {self.status}\n"
            "wait\n"
        )
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
            "PATH": path,
            "KVSTORE_HOST_PREFAULT": "false",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        self.log = (work / "block.log").open("wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", runner],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = work / "block.log"

    def wait_block(self, timeout: float = 180.0) -> int:
        """The block's exit status, once it has run to its end."""
        end = time.monotonic() + timeout
        while not self.status.exists() or not self.status.read_text().strip():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < end, f"the block did not finish:\n{self.output()}"
            time.sleep(0.1)
        return int(self.status.read_text())

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        finally:
            self.log.close()


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


def wait_listening(port: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def kvstore_environment() -> dict[str, str]:
    """What of kvstore's environment the indexer's install would change: pydantic's
    version, and whether Dynamo's runtime is in it."""
    found = {"pydantic": importlib.metadata.version("pydantic")}
    try:
        found["ai-dynamo-runtime"] = importlib.metadata.version("ai-dynamo-runtime")
    except importlib.metadata.PackageNotFoundError:
        found["ai-dynamo-runtime"] = "absent"
    return found


def test_the_copy_paste_block_registers_the_server_and_the_query_finds_it(work: Path) -> None:
    ports = {fixed: free_port() for fixed in PORTS}
    before = kvstore_environment()
    shell = Shell(work, localize(setup_block(), ports, work))
    try:
        status = shell.wait_block()
        assert status == 0, shell.output()
        assert kvstore_environment() == before  # the indexer went to its own venv
        indexer = f"http://127.0.0.1:{ports[8090]}"
        with urllib.request.urlopen(f"{indexer}/workers", timeout=10) as reply:
            assert [w["instance_id"] for w in json.loads(reply.read())] == [1]
        # The next block: a client puts a prompt through the server, with its tokens.
        wait_listening(ports[7070])
        layout = small_layout(block_tokens=CHUNK)
        token_ids = (torch.arange(4 * CHUNK) + 100).tolist()
        remote = {"kind": "remote", "address": f"127.0.0.1:{ports[7070]}"}
        with KVStore(layout, {"tiers": [remote]}) as store:
            keys = store.hash_tokens(token_ids, "my-model")
            n = store.lookup(keys)
            bt = layout.block_tokens
            kv = random_blocks(layout, len(keys) - n)
            store.put(
                keys[n:],
                kv,
                tokens=token_ids[n * bt : len(keys) * bt],
                parent=keys[n - 1] if n else None,
            )
        # The block after: the indexer's /query finds worker 1 holding the whole prompt.
        end = time.monotonic() + 30
        found: dict[str, Any] = {}
        while time.monotonic() < end:
            answer = post(f"{indexer}/query", {"token_ids": token_ids, "model_name": "default"})
            found = answer.get("instances", {}).get("1", {})
            if found.get("longest_matched") == len(token_ids):
                break
            time.sleep(0.1)
        assert found.get("longest_matched") == len(token_ids), (found, shell.output())
        assert found.get("cpu") == len(token_ids)
    finally:
        shell.close()
