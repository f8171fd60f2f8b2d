"""The memory check's measurement of a rank's anonymous memory (RSS minus file-backed and
shared pages: reading maps the checkpoint, and those pages are page cache, not the rank's).

Two measurements, the larger wins. A thread samples every millisecond; on a busy machine it
can miss a transient of tens of milliseconds. So, where Linux allows resetting the kernel's
own peak (`/proc/self/clear_refs`), each finished tensor copy also reads the peak RSS so far
(`VmHWM`) minus the file-backed and shared RSS now: the mapped checkpoint pages only grow
while the loader reads, so that difference is a lower bound of the anonymous peak, with no
sampling gap."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

KIB = 1024


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * KIB
    return fields


def _reset_kernel_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM" in _status()
    except OSError:
        return False


class PeakSampler:
    """Anonymous memory of this process: its peak overall (`peak`), and its peak while the
    loader was copying tensors (`load_peak`) with the tensors in flight then (`at_peak`)."""

    def __init__(self, period: float = 0.001):
        self._proc = psutil.Process()
        self.base = self.peak = self.load_peak = self.now()
        self.at_peak: tuple[str, ...] = ()
        self._in_flight: dict[str, None] = {}
        self._lock = threading.Lock()
        self._period = period
        self._kernel_peak = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def now(self) -> int:
        info = self._proc.memory_info()
        return info.rss - info.shared

    def copying(self, name: str, done: bool) -> None:
        """Loader observer: `name`'s copy starts (done=False) or ends."""
        bound = self._kernel_bound() if done else 0
        with self._lock:
            if bound > self.load_peak:
                self.load_peak, self.at_peak = bound, tuple(self._in_flight)
            if done:
                self._in_flight.pop(name, None)
            else:
                self._in_flight[name] = None

    def _kernel_bound(self) -> int:
        """Peak RSS so far minus the file-backed and shared RSS now (0 when unavailable)."""
        if not self._kernel_peak:
            return 0
        status = _status()
        return status["VmHWM"] - status.get("RssFile", 0) - status.get("RssShmem", 0)

    def sample(self) -> None:
        now = self.now()
        with self._lock:
            self.peak = max(self.peak, now)
            if self._in_flight and now > self.load_peak:
                self.load_peak, self.at_peak = now, tuple(self._in_flight)

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self._period):
                return

    def __enter__(self) -> PeakSampler:
        self._kernel_peak = _reset_kernel_peak()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.peak = max(self.peak, self.load_peak)
