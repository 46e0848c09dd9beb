"""Every Python and shell block of README.md and docs/*.md runs as written, or says why not.

A block is marked by an HTML comment on the line before its fence (invisible when rendered):

    <!-- snippet: run session=quickstart ports=7070,9090 tmp=/tmp/qs -->

``run`` runs a ``python``/``bash`` block; ``skip="why"`` says why it cannot run here (a GPU,
a model download, the set-up CI itself runs). The blocks of one ``session`` run in order in
one shell, in one fresh directory (also ``$HOME``), with this checkout's ``.venv`` first on
``PATH``: a server started with ``&`` in one block serves the next, and ``kill %1`` stops it.
Other words a mark may carry:

- ``file=NAME``: write the block (any language: a YAML config, a script) to ``NAME`` first.
- ``output``: this block is what the previous block of the session prints. Its lines must
  appear in that order in what was printed; ``...`` stands for any text (a line of only
  ``...``: any number of lines).
- ``console``: a transcript; each ``$ command`` line runs, and the lines under it are its
  output, checked as ``output`` is.
- ``expect="text"``: the block's output contains ``text`` (repeatable).
- ``wait-port=P``: after the block, wait until something listens on port ``P``.
- ``ports=A,B``: these fixed ports of the docs become free ports in every block of the session.
- ``tmp=/tmp/x,/tmp/y``: these paths become paths inside the session's directory.
- ``timeout=S``: the session's time limit in seconds (default 300).
- ``prelude=NAME``: a fragment (a ``python`` block that uses names an earlier example made)
  runs after ``tests/snippet_preludes/NAME.py``, which makes them.
- ``venv=NAME``: run ``python`` with ``.venv-NAME/bin/python`` (``vllm``: vLLM's CPU build).
- ``cwd=repo``: run the block in the checkout (``python benchmarks/...``), not the session's
  directory.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "sh", "shell"}
MARK = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
END = "@@kvstore-snippet-end@@"


@dataclass
class Block:
    """One fenced block and its mark."""

    path: Path
    line: int
    lang: str
    text: str
    opts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def opt(self, name: str, default: str | None = None) -> str | None:
        values = self.opts.get(name)
        return values[-1] if values else default


def _parse_mark(text: str) -> dict[str, list[str]]:
    opts: dict[str, list[str]] = {}
    for word in shlex.split(text):
        name, _, value = word.partition("=")
        opts.setdefault(name, []).append(value)
    return opts


def parse(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the mark just above it (if any)."""
    lines = path.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: a code block never closed"
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev)
        opts = _parse_mark(mark.group(1)) if mark else {}
        blocks.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n", opts))
        i = end + 1
    return blocks


ALL = [block for path in DOCS for block in parse(path)]


def sessions() -> dict[str, list[Block]]:
    """The marked blocks that take part in a run, by session, in document order."""
    out: dict[str, list[Block]] = {}
    for b in ALL:
        if "skip" in b.opts or not ({"run", "file", "output", "console"} & set(b.opts)):
            continue
        name = f"{b.path.name}:{b.opt('session', str(b.line))}"
        out.setdefault(name, []).append(b)
    return out


def test_every_runnable_block_runs_or_says_why_not() -> None:
    unmarked = [
        b.where
        for b in ALL
        if b.lang in RUNNABLE
        and not ({"run", "file", "console"} & set(b.opts))
        and not (b.opt("skip") or "").strip()
    ]
    assert not unmarked, 'blocks with neither `run` nor `skip="why"`: ' + ", ".join(unmarked)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "yaml"], ids=lambda b: b.where)
def test_yaml_blocks_parse(block: Block) -> None:
    """Every YAML block of the docs is a config (or a part of one): a non-empty mapping."""
    data = yaml.safe_load(block.text)
    assert isinstance(data, dict) and data, f"{block.where}: not a mapping: {data!r}"


#: A host that binds every interface: ZMQ's ``tcp://*``, and the IPv4 / IPv6 wildcards.
_WILDCARD = r"(?:\*|0\.0\.0\.0|\[::\]|::)"
#: A ZMQ endpoint bound on every interface (a KV-event publisher's, vLLM's or kvstore's).
_ZMQ_WILDCARD = re.compile(rf"tcp://{_WILDCARD}:\d+")
#: A kvstore-server listening on every interface (``listen:`` in YAML, ``--listen``), not
#: ``metrics_listen`` (counters only: the server lets that be scraped from outside).
_LISTEN_WILDCARD = re.compile(rf"(?<![\w-])(?:listen\s*:|--listen[ =])\s*[\"']?{_WILDCARD}:\d+")
#: What authenticates the clients of such a socket, in the same block.
_SERVER_AUTH = re.compile(r"token_file|\btoken\s*:|\btokens\s*:|--token-file|KVSTORE_SERVER_TOKEN")
_EVENTS_AUTH = re.compile(r"events_auth\s*:\s*true")


def exposed(text: str) -> list[str]:
    """What in ``text`` binds every interface with nothing authenticating who connects."""
    found = []
    if not _SERVER_AUTH.search(text):
        found += [m.group(0) for m in _LISTEN_WILDCARD.finditer(text)]
    if not _EVENTS_AUTH.search(text):
        found += [m.group(0) for m in _ZMQ_WILDCARD.finditer(text)]
    return found


def test_the_exposure_check_finds_what_it_must() -> None:
    assert exposed('endpoint: tcp://*:5557\n"replay_endpoint": "tcp://0.0.0.0:5558"') == [
        "tcp://*:5557",
        "tcp://0.0.0.0:5558",
    ]
    assert exposed("server: {listen: 0.0.0.0:7070}") == ["listen: 0.0.0.0:7070"]
    assert exposed("kvstore-server --listen [::]:7070") == ["--listen [::]:7070"]
    assert exposed("listen: 0.0.0.0:7070\ntoken_file: /etc/kvstore/token") == []
    assert exposed("metrics_listen: 0.0.0.0:9090") == []
    assert exposed("endpoint: tcp://127.0.0.1:5557\nendpoint: ipc:///tmp/e") == []
    assert exposed("events_endpoint: tcp://*:6000\nevents_auth: true") == []


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_no_block_binds_every_interface_unauthenticated(block: Block) -> None:
    """A block a user copies binds loopback (or ``ipc://``), or authenticates whoever
    connects: a kvstore-server refuses to listen beyond loopback without a token, and KV
    events carry the prompts' token ids (issue 50). Prose may still name ``tcp://*``."""
    assert exposed(block.text) == [], f"{block.where} binds every interface unauthenticated"


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_dynamo_is_installed_in_a_virtualenv_of_its_own(block: Block) -> None:
    """``pip install ai-dynamo-runtime`` into kvstore's environment swapped its pydantic
    (issue 50): every block installs Dynamo with a virtualenv's own pip, by its path."""
    for line in block.text.splitlines():
        if re.search(r"pip3? install .*ai-dynamo", line):
            assert re.match(r"^\s*\S+/bin/pip3? install ", line), f"{block.where}: {line.strip()}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _substitute(blocks: list[Block], workdir: Path) -> dict[str, str]:
    """What the session's fixed ports and /tmp paths become."""
    subs: dict[str, str] = {}
    for b in blocks:
        for value in b.opts.get("ports", []):
            for port in filter(None, value.split(",")):
                subs.setdefault(port, str(_free_port()))
        for value in b.opts.get("tmp", []):
            for path in filter(None, value.split(",")):
                subs.setdefault(path, str(workdir / "tmp" / Path(path).name))
    return subs


def _apply(text: str, subs: dict[str, str]) -> str:
    for old in sorted(subs, key=len, reverse=True):
        text = re.sub(rf"(?<![\w/.]){re.escape(old)}(?![\w])", subs[old], text)
    return text


def _heredoc(text: str) -> str:
    return f"<<'KVSTORE_SNIPPET'\n{text}KVSTORE_SNIPPET\n"


def _wait_port(port: str) -> str:
    probe = (
        "import socket, sys, time\n"
        f"end = time.monotonic() + 60\n"
        "while time.monotonic() < end:\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), 0.5).close(); sys.exit(0)\n"
        "    except OSError: time.sleep(0.1)\n"
        f"sys.exit('nothing listens on port {port} after 60 s')\n"
    )
    return f"python - {_heredoc(probe)}"


def _console(text: str) -> tuple[str, list[tuple[int, str]]]:
    """A transcript's commands (as a script) and, per command, its expected output."""
    script, expected = [], []
    for line in text.splitlines():
        if line.startswith("$ "):
            script.append(line[2:])
            script.append(f"echo {END}")
            expected.append((len(expected), ""))
        elif expected:
            n, out = expected[-1]
            expected[-1] = (n, out + line + "\n")
    return "\n".join(script) + "\n", expected


@dataclass
class Script:
    """A session as one bash script, and what each step's output must hold."""

    text: str = "set -eo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n"
    checks: list[tuple[str, str, list[str]]] = field(default_factory=list)  # where, output, expects
    steps: int = 0

    def step(self, code: str, where: str, expects: list[str]) -> None:
        self.text += code + f"echo {END}\n"
        self.checks.append((where, "", expects))
        self.steps += 1


def _code(block: Block, text: str) -> str:
    """The shell lines that run ``block`` (its text after substitution)."""
    if block.lang == "python":
        prelude = block.opt("prelude")
        if prelude:
            text = (ROOT / "tests" / "snippet_preludes" / f"{prelude}.py").read_text() + text
        venv = block.opt("venv")
        python = shlex.quote(str(ROOT / f".venv-{venv}" / "bin" / "python")) if venv else "python"
        text = f"{python} - {_heredoc(text)}"
    if block.opt("cwd") == "repo":
        text = f"cd {shlex.quote(str(ROOT))}\n{text}cd - >/dev/null\n"
    return text


def build(blocks: list[Block], subs: dict[str, str]) -> Script:
    script = Script()
    for b in blocks:
        text = _apply(b.text, subs)
        if b.opt("file") is not None:
            script.text += f"cat > {shlex.quote(str(b.opt('file')))} {_heredoc(text)}"
        if "output" in b.opts:
            assert script.checks, f"{b.where}: `output` with no block before it"
            where, out, expects = script.checks[-1]
            script.checks[-1] = (where, out + text, expects)
        elif "console" in b.opts:
            commands, expected = _console(text)
            script.text += commands
            script.checks += [(b.where, out, []) for _, out in expected]
            script.steps += len(expected)
        elif "run" in b.opts:
            code = _code(b, text)
            for port in b.opts.get("wait-port", []):
                code += _wait_port(subs.get(port, port)) + "\n"
            script.step(code, b.where, b.opts.get("expect", []))
    return script


def _matches(expected: str, actual: str) -> bool:
    """Whether ``expected``'s lines appear in order in ``actual`` (``...`` as wildcards)."""
    pattern = ""
    for line in expected.strip("\n").splitlines():
        if line.strip() == "...":
            pattern += r"(?:.*\n)*?"
            continue
        parts = [re.escape(p) for p in line.rstrip().split("...")]
        pattern += r"(?:.*\n)*?[ \t]*" + ".*".join(parts).lstrip() + r"[ \t]*\n"
    return re.match(pattern, actual.replace("\r", "") + "\n") is not None


SESSIONS = sessions()
#: Sessions that take tens of seconds (scripts/test.sh --fast leaves them out).
SLOW_SESSIONS = {"quickstart.md:demo"}  # the whole demo: 16 sessions x 4 turns


def session_marks(name: str) -> list[pytest.MarkDecorator]:
    """``slow`` for a long session, ``engine`` for one that runs an engine's venv."""
    marks = [pytest.mark.slow] if name in SLOW_SESSIONS else []
    if any(b.opt("venv") for b in SESSIONS[name]):
        marks.append(pytest.mark.engine)
    return marks


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=session_marks(n), id=n) for n in sorted(SESSIONS)]
)
def test_docs_session_runs_as_written(name: str, tmp_path: Path) -> None:
    blocks = SESSIONS[name]
    (tmp_path / "tmp").mkdir()
    subs = _substitute(blocks, tmp_path)
    script = build(blocks, subs)
    timeout = max(float(b.opt("timeout", "300") or 300) for b in blocks)
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("KVSTORE_CONFIG", None)
    (tmp_path / "session.sh").write_text(script.text)
    done = subprocess.run(
        ["bash", str(tmp_path / "session.sh")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    outputs = done.stdout.split(END + "\n")
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-4000:]}"
    assert len(outputs) == script.steps + 1, done.stdout[-4000:]
    for (where, expected, expects), actual in zip(script.checks, outputs, strict=False):
        for text in expects:
            assert _apply(text, subs) in actual, f"{where}: no {text!r} in:\n{actual}"
        if expected:
            assert _matches(_apply(expected, subs), actual), (
                f"{where} printed:\n{actual}\nthe docs say:\n{expected}"
            )
