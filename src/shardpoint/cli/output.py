"""What every command's output shares: the exit codes, errors on stderr, strict JSON,
a console as wide as the terminal (or ``COLUMNS``), byte counts, progress bars."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from ..interop._progress import Progress

#: Exit codes: ok; a finding (damaged, incomplete, they differ); a usage or environment error.
OK, DIFFERS, USAGE = 0, 1, 2


def error(msg: str) -> None:
    print(f"shardpoint: error: {msg}", file=sys.stderr)


def print_json(doc: object) -> None:
    """Strict JSON: a NaN or an infinity is null (``json.dumps`` would write ``NaN``, which no JSON parser reads)."""
    print(json.dumps(_finite(doc), indent=2, allow_nan=False, default=repr))


def _finite(x: Any) -> Any:  # Any: a JSON-shaped document
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def make_console(stderr: bool = False) -> Console:
    """Output as wide as the terminal, or ``COLUMNS`` when set; not a terminal (a pipe,
    a test) and no ``COLUMNS``: wide and plain, so nothing is cut or coloured."""
    from rich.console import Console

    f = sys.stderr if stderr else sys.stdout
    tty = f.isatty()
    cols = os.environ.get("COLUMNS", "")
    width = int(cols) if cols.isdigit() and int(cols) > 0 else None if tty else 200
    return Console(file=f, width=width, no_color=not tty, highlight=False)


def human(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return str(n)  # pragma: no cover


def short_dtype(d: object) -> str:
    return str(d).removeprefix("torch.")


def progress_bar(what: str, total: int, quiet: bool) -> Progress:
    from ..interop._progress import Progress

    return Progress(total, what, enabled=not quiet)


class BarMeter:
    """A progress bar started once the total is known (a :class:`shardpoint.verify.Meter`)."""

    def __init__(self, what: str, quiet: bool) -> None:
        self.what, self.quiet = what, quiet
        self.bar: Progress | None = None

    def start(self, total: int) -> None:
        self.bar = progress_bar(self.what, total, self.quiet).__enter__()

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
