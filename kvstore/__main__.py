"""``python -m kvstore``: the ``kvstore`` command (kvstore/cli/commands.py), for a Python whose
scripts directory is not on ``PATH``."""

from __future__ import annotations

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
