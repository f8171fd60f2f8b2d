"""SIGINT and SIGTERM for commands that run rank groups: both unwind the parent like an
exception, so every rank group is killed at once and its temp directory removed, and the
command exits 130 / 143 with one line instead of a traceback."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager

from freetoken.distributed.launch import close_all_groups

EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, like KeyboardInterrupt: no `except Exception` in a
    check may swallow it)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def stop_on_signals(say: Callable[[str], None] | None = None):
    """Run the body; on SIGINT or SIGTERM kill every rank group, print one line and exit
    130 / 143. Only the main thread can install handlers; elsewhere the body just runs."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: signals are the main thread's business
        yield
        return
    try:
        yield
    except (KeyboardInterrupt, Terminated) as e:
        # A second signal while ranks die must not interrupt the cleanup below.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        name, code = ("SIGINT", EXIT_SIGINT) if isinstance(e, KeyboardInterrupt) else \
            ("SIGTERM", EXIT_SIGTERM)
        close_all_groups()
        say(f"interrupted by {name}: rank processes stopped")
        sys.exit(code)
    finally:
        signal.signal(signal.SIGTERM, previous)
