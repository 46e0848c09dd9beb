"""FlushProgress: what close() is waiting for, as a bar on a terminal or log lines."""

from __future__ import annotations

import io
import logging

import pytest

from kvstore.datapath.progress import FlushProgress

GiB = 1 << 30


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_redrawn_in_place() -> None:
    out = Terminal()
    progress = FlushProgress(stream=out, redraw_s=0)
    progress.begin(2 * GiB, "the disk tier (/x)")
    progress.update(GiB)
    progress.end()
    text = out.getvalue()
    draws = text.split("\r")[1:]
    assert len(draws) == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "writing 2.00 GiB to the disk tier (/x)" in draws[0]
    assert "2.00 GiB left" in draws[0] and "1.00 GiB left" in draws[1]
    assert "[" + "#" * 15 + "." * 15 + "]" in draws[1]
    assert "done in" in draws[2]


def test_a_log_gets_the_bytes_left(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()  # not a terminal: nothing is drawn on it
    progress = FlushProgress(stream=out, interval_s=0)
    with caplog.at_level(logging.INFO, logger="kvstore.close"):
        progress.begin(4 * GiB, "the disk tier (/x)")
        progress.update(3 * GiB)
        progress.update(GiB)
        progress.end()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "close: writing 4.00 GiB that only memory holds to the disk tier (/x)"
    assert lines[1].startswith(
        "close: 1.00 GiB of 4.00 GiB written to the disk tier (/x), 3.00 GiB left"
    )
    assert "3.00 GiB of 4.00 GiB written" in lines[2] and "1.00 GiB left" in lines[2]
    assert lines[3].startswith("close: wrote 3.00 GiB to the disk tier (/x) in ")
    assert out.getvalue() == ""
    assert progress.summary()["bytes"] == 4 * GiB
    assert progress.summary()["bytes_written"] == 3 * GiB


def test_log_lines_are_spaced_out(caplog: pytest.LogCaptureFixture) -> None:
    progress = FlushProgress(stream=io.StringIO(), interval_s=3600)
    with caplog.at_level(logging.INFO, logger="kvstore.close"):
        progress.begin(GiB, "disk")
        for left in range(100):
            progress.update(GiB - left)
        progress.update(0)
        progress.end()
    assert len(caplog.records) == 2  # the start and the end only


def test_nothing_to_write_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    out = Terminal()
    progress = FlushProgress(stream=out)
    with caplog.at_level(logging.INFO, logger="kvstore.close"):
        progress.begin(0, "disk")
        progress.end()
    assert out.getvalue() == "" and not caplog.records
    assert progress.summary() == {"bytes": 0, "bytes_written": 0, "seconds": progress.seconds}


def test_what_did_not_fit_is_a_warning_that_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 50: a close onto a full disk said "wrote 160 MiB" of 480, and no more."""
    progress = FlushProgress(stream=Terminal(), redraw_s=0)  # a terminal: the bar, and this
    with caplog.at_level(logging.INFO, logger="kvstore.close"):
        progress.begin(3 * GiB, "the disk tier (/x)")
        progress.update(2 * GiB, force=True)
        progress.end("it is full (5 of its 5 blocks)")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "close: 2.00 GiB did not fit in the disk tier (/x): it is full (5 of its 5 blocks); "
        "it is lost when this process ends"
    ]
    assert progress.summary()["bytes_written"] == GiB
