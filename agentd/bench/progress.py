"""A rich progress display for the benchmark: one bar per phase, on stderr (one line per phase
when stderr is not a terminal).

Invariant: it only draws; the runner's figures never depend on it (``NullProgress`` runs the
same benchmark silently).
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


class RichProgress:
    def __init__(self, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=self._console,
                                  disable=not self._console.is_terminal)
        self._task: int | None = None

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish_task()
        self._progress.stop()

    def phase(self, label: str, total: int) -> None:
        self._finish_task()
        self._task = self._progress.add_task(label, total=total)
        if not self._console.is_terminal:  # no live display in a log: one line per phase
            self._console.print(f"{label}: {total} request{'s' * (total != 1)}", highlight=False)

    def advance(self) -> None:
        if self._task is not None:
            self._progress.advance(self._task)

    def _finish_task(self) -> None:
        if self._task is not None:
            done = next(t.completed for t in self._progress.tasks if t.id == self._task)
            self._progress.update(self._task, total=done)  # a phase may end short
            self._task = None
