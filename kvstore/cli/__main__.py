"""``python -m kvstore.cli``: the ``kvstore`` command."""

from __future__ import annotations

import sys

from kvstore.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
