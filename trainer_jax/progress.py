"""Progress a user can see: a live bar or spinner on a terminal, plain lines in a log file.

``StepProgress``: the training steps, a plain line every N steps with an ETA off a terminal.
``Phase``: anything else that may take a while (the warm start, samplers registering, an
evaluation, the first publish): off a terminal it prints a plain line every ``MIXRL_WAIT_REPORT_S``
seconds (30 by default) once the phase has run 10 s, so a redirected run is never silent for long.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: seconds between the plain lines of a wait or a long phase (tests set it to a second or two)
REPORT_ENV = "MIXRL_WAIT_REPORT_S"


def report_every_s(default: float = 30.0) -> float:
    """``$MIXRL_WAIT_REPORT_S`` when it is a positive number, else ``default``."""
    try:
        value = float(os.environ.get(REPORT_ENV, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


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


class Phase:
    """``with Phase(console, "supervised warm start", total=150) as p: p.update(done, note)``.

    On a terminal: a spinner line showing the latest update. Off one (a log file, CI, `nohup`):
    once the phase has run ``after_s`` (10 s, or ``every_s`` if shorter), one plain line every
    ``every_s`` (``report_every_s()``) from a background thread, so a phase whose single step
    is long still says it is alive: ``label: done/total unit, rate, ETA`` with a total, else
    the elapsed time; then ``note`` (the last update's) or what ``status()`` says now.
    """

    def __init__(self, console: Console, label: str, *, total: int | None = None, done: int = 0,
                 unit: str = "steps", status: Callable[[], str] | None = None,
                 every_s: float | None = None, after_s: float = 10.0):
        self.console, self.label, self.total, self.unit = console, label, total, unit
        self.done, self.first, self.note, self._status = done, done, "", status
        self.every_s = report_every_s() if every_s is None else every_s
        self.after_s = min(after_s, self.every_s)
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._spinner = None

    def __enter__(self) -> Phase:
        self.t0 = time.monotonic()
        if self.console.is_terminal:
            # Inside another live display (the step bar during an evaluation) that one shows life.
            if not getattr(self.console, "_live_stack", None):
                self._spinner = self.console.status(f"[bold]{self.label}")
                self._spinner.__enter__()
        else:
            self._thread = threading.Thread(target=self._report, name="mixrl-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._spinner is not None:
            self._spinner.__exit__(*exc)
        if self._thread is not None:
            self._thread.join()

    def update(self, done: int | None = None, note: str = "") -> None:
        if done is not None:
            self.done = done
        self.note = note
        if self._spinner is not None:
            self._spinner.update(f"[bold]{self.label}[/bold] {self.line(with_label=False)}")

    def line(self, with_label: bool = True) -> str:
        """Where the phase is: done / total, rate and ETA (or the elapsed time), and the note."""
        elapsed = time.monotonic() - self.t0
        if self.total:
            rate = (self.done - self.first) / max(elapsed, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            text = (f"{self.done}/{self.total} {self.unit}, {rate:.3g} {self.unit}/s, ETA {_clock(eta)} "
                    f"[{_clock(elapsed)} elapsed]")
        else:
            text = f"{_clock(elapsed)} elapsed"
        note = self.note or (self._status() if self._status is not None else "")
        return (f"{self.label}: " if with_label else "") + text + (f"; {note}" if note else "")

    def _report(self) -> None:
        wait = self.after_s
        while not self._stop.wait(wait):
            self.console.print(self.line(), markup=False, highlight=False)
            wait = self.every_s

