"""Progress of a run on stderr: a line per finished step, and for a step that takes long (the
kernel matrix, loading a large checkpoint, computing the HF reference) either a line when it
starts (logs, CI: stderr is not a terminal) or one line that updates in place with the time
spent so far (a terminal)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Erase the current terminal line after returning to its start.
_CLEAR = "\r\x1b[K"


class Progress:
    """Where a run's progress goes. `say` receives whole lines (default: stderr); `live`
    (default: whether stderr is a terminal) turns step start lines into an updating line."""

    def __init__(self, say: Callable[[str], None] | None = None, live: bool | None = None,
                 interval: float = 1.0):
        self._say = say
        self._live = live if live is not None else (say is None and _stderr_is_terminal())
        self._interval = interval

    def line(self, text: str) -> None:
        """One finished line."""
        if self._say is not None:
            self._say(text)
        else:
            print(text, file=sys.stderr, flush=True)

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Show `label` while the body runs: `label ...` as a line, or live with the seconds
        elapsed, erased when the body ends (however it ends)."""
        if not self._live:
            self.line(f"{label} ...")
            yield
            return
        done = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(label, done), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            sys.stderr.write(_CLEAR)
            sys.stderr.flush()

    def _tick(self, label: str, done: threading.Event) -> None:
        start = time.monotonic()
        while True:
            sys.stderr.write(f"{_CLEAR}{label} ... {time.monotonic() - start:.0f}s")
            sys.stderr.flush()
            if done.wait(self._interval):
                return


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream: treat as a log
        return False


def quiet() -> Progress:
    """A Progress that says nothing (the Python API's default)."""
    return Progress(say=lambda line: None, live=False)
