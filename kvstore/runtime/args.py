"""Argument parsing shared by the ``kvstore`` and ``kvstore-server`` commands.

A mistake on the command line is one line, like every other mistake the
commands report (``kvstore: error: ...``, exit 2): argparse's own errors come
after a usage block of several lines, which buries the one line that says what
is wrong. ``--help`` still prints the usage.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, NoReturn

from kvstore.errors import InvalidInputError

__all__ = ["OneLineParser", "check_counts"]


class OneLineParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one line:
    ``PROG: error: MESSAGE; see PROG SUBCOMMAND --help``, exit status 2.
    Subparsers made with ``add_subparsers().add_parser`` are of this class too."""

    def error(self, message: str) -> NoReturn:
        """Print the one line and exit 2 (argparse calls this for every mistake)."""
        command = self.prog.split()[0]  # "kvstore stats" -> "kvstore"
        self.exit(2, f"{command}: error: {message}; see {self.prog} --help\n")


def check_counts(args: argparse.Namespace, minimums: Mapping[str, int]) -> None:
    """Raise :class:`InvalidInputError` naming the option for a count below its minimum
    (``minimums``: destination name -> least value; options not given are skipped)."""
    for name, least in minimums.items():
        value: Any = getattr(args, name, None)
        if value is not None and value < least:
            flag = "--" + name.replace("_", "-")
            raise InvalidInputError(f"{flag} {value}: must be at least {least}")
