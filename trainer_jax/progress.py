"""Step progress: a live bar on a terminal, a plain line every N steps (with an ETA) in logs."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepProgress:
    """``with StepProgress(console, total, done, every) as p: p.advance(summary)`` per step.

    When the console is not a terminal (a log file, CI) the bar would print nothing until the
    end, so every ``every`` steps (and at the last) one line says where the run is and how long
    the rest should take at the rate since this process started.
    """

    def __init__(self, console: Console, total: int, done: int, every: int):
        self.console, self.total, self.done, self.every = console, total, done, every
        self.first, self.t0 = done, time.monotonic()
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), console=console)

    def __enter__(self) -> StepProgress:
        if self._bar is not None:
            self._bar.__enter__()
            self._task = self._bar.add_task("", total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def print(self, text: str) -> None:
        (self._bar.console if self._bar is not None else self.console).print(text)

    def advance(self, summary: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=summary)
            return
        if self.done % self.every == 0 or self.done == self.total:
            elapsed = time.monotonic() - self.t0
            rate = (self.done - self.first) / max(elapsed, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            self.console.print(f"step {self.done}/{self.total} {summary} "
                               f"[{_clock(elapsed)} elapsed, ETA {_clock(eta)}]", markup=False)


def _clock(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
