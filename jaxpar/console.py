"""One rich console for the command-line tables: as wide as the table needs when output is not a
terminal (a pipe or a file would otherwise get 80 columns and squashed columns)."""

from __future__ import annotations

import sys

from rich.console import Console


def wide_console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=220)
