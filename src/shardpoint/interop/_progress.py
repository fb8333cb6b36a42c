"""One progress bar for every converter: rich, on stderr, and silent where nobody
watches (stderr is not a terminal) or where the caller asked for quiet."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress as _RichProgress
    from rich.progress import TaskID


class Progress:
    """A byte- or item-counting bar. ``with Progress(total, "importing", enabled=...) as bar:
    bar.advance(n)``. Does nothing when disabled, when stderr is not a terminal, or
    when rich is not installed (it is a dependency; a stripped environment still converts)."""

    def __init__(self, total: int, what: str, *, enabled: bool = True, unit: str = "bytes") -> None:
        self._bar: _RichProgress | None = None
        self._task: TaskID | None = None
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as _RichProgress
        except ImportError:  # pragma: no cover - rich is a dependency
            return
        count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
        self._bar = _RichProgress(
            TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=False,
        )
        self._task = self._bar.add_task(what, total=max(total, 1))

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        if self._bar is not None and self._task is not None:  # both set together
            self._bar.advance(self._task, n)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
