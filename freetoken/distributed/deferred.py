"""Sections of the parent that a signal must not cut in half, and the fork server's start.

Starting a rank is one such section: a SIGINT (KeyboardInterrupt) or SIGTERM raised after the
fork server forked the rank but before the group recorded it leaves a rank that nobody
stops, which later prints an error about the group's directory, gone by then, after the
command's last line. Inside `signals_deferred` such a signal is held and delivered, to the
handler that was in place, as soon as the section ends (a rank's start takes milliseconds;
the first one of a process waits for the fork server to import torch).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM until the body is done, then deliver them; the same signal
    twice is delivered at once (the user insists: the body may be stuck, the fork server's
    first start waits for its preloads). Outside the main thread no Python handler can
    interrupt the body, so it just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous: dict = {}

    def release() -> None:
        handlers = dict(previous)
        previous.clear()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        pending = list(dict.fromkeys(held))
        held.clear()
        for signum in pending:
            _deliver(signum, handlers[signum])

    def hold(signum, _frame) -> None:
        if signum in held:
            release()
        held.append(signum)

    for signum in _SIGNALS:
        if signal.getsignal(signum) not in (signal.SIG_IGN, None):
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        release()


def _deliver(signum: int, handler) -> None:
    if callable(handler):
        handler(signum, None)
    else:  # SIG_DFL: the default action (terminate) now that it is back in place
        signal.raise_signal(signum)


def start_ignoring_sigint(start: Callable[[], None]) -> None:
    """Call `start` (which forks and execs a process: the fork server) with SIGINT ignored,
    so that the process, and every rank it forks, begins with SIGINT ignored: a Ctrl-C that
    reaches the terminal's process group while a rank still imports the main module cannot
    print a KeyboardInterrupt traceback from it. Meanwhile this thread blocks SIGINT, which
    keeps one that arrives pending until the handler is back (in a process with other
    threads one of them may take it, and it is lost: the window is one fork and exec)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is None:
        start()
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        start()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
