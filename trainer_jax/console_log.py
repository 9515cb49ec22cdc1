"""Log records in the trainer's console, written like its other lines.

Nothing in ``mixrl-train`` configures logging, but absl (imported with orbax) calls
``logging.basicConfig()`` on its first record, and from then on every warning of the service or a
library reached stderr as ``WARNING:mixrl.service:...``. ``console_logging`` puts one handler in
place of that default one that prints through the run's console: ``warning: ...`` in yellow,
``error: ...`` in red, like the lines the trainer prints itself. A handler someone configured on
purpose (a test's log capture, an embedding application's) is left alone.
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.markup import escape

_PREFIX = {logging.WARNING: "[yellow]warning:[/yellow] ", logging.ERROR: "[red]error:[/red] ",
           logging.CRITICAL: "[red]error:[/red] "}


class ConsoleHandler(logging.Handler):
    """Each record as one console line; the message is printed as text, never as rich markup."""

    def __init__(self, console: Console, level: int = logging.NOTSET):
        super().__init__(level)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self.console.print(_PREFIX.get(record.levelno, "") + escape(text), highlight=False)
        except Exception:  # noqa: BLE001 - logging must never raise into the code that logs
            self.handleError(record)


def _default_stderr(handler: logging.Handler) -> bool:
    """The handler ``logging.basicConfig()`` makes without arguments (what absl installs)."""
    return (type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__)
            and handler.formatter is not None and handler.formatter._fmt == logging.BASIC_FORMAT)


def console_logging(console: Console) -> ConsoleHandler:
    """Route the root logger's default output through ``console`` (replacing an earlier run's
    handler; the root level, WARNING unless someone set it, is kept)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if _default_stderr(handler) or isinstance(handler, ConsoleHandler):  # one trainer a process
            root.removeHandler(handler)
    handler = ConsoleHandler(console)
    root.addHandler(handler)
    return handler


__all__ = ["ConsoleHandler", "console_logging"]
