"""Checkpoint files mapped read-only and registered with CUDA, so the copy engine reads a
shard's bytes straight from the page cache (see `freetoken.loading.staging`)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import queue
import threading
import warnings
from pathlib import Path

import torch

REGISTER_WINDOW = 256 << 20
"""Bytes of a mapped file registered at once: a thread registers the windows it reads."""
_HOST_REGISTER_READ_ONLY = 8
"""cudaHostRegisterReadOnly: pin the pages for reading only (a read-only mapping)."""


@functools.cache
def _gil_free_register():
    """cudaHostRegister called through ctypes, which lets go of the GIL while the driver pins
    the pages (torch's binding keeps it: a registration stalls every Python thread of the
    process); None where libcudart is not a shared library of this process."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        if path is None:
            return None
        register = ctypes.CDLL(path).cudaHostRegister
    except (OSError, AttributeError):
        return None
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    register.restype = ctypes.c_int
    return register


def _host_register(address: int, nbytes: int) -> bool:
    register = _gil_free_register()
    if register is None:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes,
                                                        _HOST_REGISTER_READ_ONLY)) == 0
    return register(address, nbytes, _HOST_REGISTER_READ_ONLY) == 0


def _clear_last_error() -> None:
    """Consume the error a refused registration leaves as the CUDA runtime's last error, which
    torch's next kernel launch would otherwise raise as its own: torch's launch check reads
    (and so resets) it, so one tiny launch takes it. Whatever the refusal's code, the loader
    falls back to its pinned rings; a sticky device error would raise again at the next call."""
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        return


class _MappedFile:
    """One checkpoint file mapped read-only, as a uint8 tensor, registered by windows."""

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # The tensor is only ever read: copies from it, never into it.
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        windows = -(-size // REGISTER_WINDOW)
        self._locks = [threading.Lock() for _ in range(windows)]
        self._registered = [False] * windows

    def register(self, start: int, stop: int) -> bool:
        """Register the windows covering bytes [start, stop); False if CUDA refuses."""
        for w in range(start // REGISTER_WINDOW, -(-stop // REGISTER_WINDOW)):
            with self._locks[w]:
                if self._registered[w]:
                    continue
                window = self.bytes[w * REGISTER_WINDOW : (w + 1) * REGISTER_WINDOW]
                if not _host_register(window.data_ptr(), window.numel()):
                    _clear_last_error()
                    return False
                self._registered[w] = True
        return True

    def close(self) -> None:
        """Unregister (every copy from the file must have finished) and unmap."""
        cudart = torch.cuda.cudart()
        for w, registered in enumerate(self._registered):
            if registered:
                cudart.cudaHostUnregister(self.bytes[w * REGISTER_WINDOW :].data_ptr())
        self._registered = [False] * len(self._registered)
        self.bytes = None
        self._map = None  # unmapped once the last tensor over it is gone


class MappedCheckpoint:
    """The checkpoint's files mapped and registered with CUDA as the loader's threads need
    them, shared by all of them; `close` once every transfer has finished.

    Registration can fail (no read-only registration on this driver or GPU, a file system the
    driver cannot pin): then `view` returns None from there on and the stagers copy through
    their pinned rings."""

    def __init__(self, reader):
        self._reader = reader
        self._files: dict[str, _MappedFile] = {}
        self._lock = threading.Lock()
        self.usable = True
        self._stop = threading.Event()
        self._ahead: threading.Thread | None = None

    def register_ahead(self, device: torch.device) -> None:
        """Start a background thread that registers the windows `ahead` names, while the
        caller plans the load: the copies then mostly find their pages pinned (registering
        5 GB takes about 0.2 s). Only where the registration lets go of the GIL; otherwise
        `ahead` does nothing and the copies register as they go."""
        if _gil_free_register() is None:
            return
        self._queue = queue.SimpleQueue()
        self._queued: set[tuple[str, int]] = set()
        self._ahead = threading.Thread(target=self._register_windows, args=(device,),
                                       name="register-ahead", daemon=True)
        self._ahead.start()

    def ahead(self, name: str) -> None:
        """Queue the windows holding checkpoint tensor `name` for the background thread."""
        if self._ahead is None:
            return
        start, stop = self._reader.extent(name)
        file = self._reader.file_of(name)
        for w in range(start // REGISTER_WINDOW, -(-stop // REGISTER_WINDOW)):
            if (file, w) not in self._queued:
                self._queued.add((file, w))
                self._queue.put((file, w))

    def ahead_done(self) -> None:
        """No more names: the background thread ends once it has registered the queue."""
        if self._ahead is not None:
            self._queue.put(None)

    def _register_windows(self, device: torch.device) -> None:
        try:
            torch.cuda.set_device(device)
            while (item := self._queue.get()) is not None:
                if self._stop.is_set() or not self.usable:
                    return
                file, w = item
                if not self._file(file).register(w * REGISTER_WINDOW, (w + 1) * REGISTER_WINDOW):
                    self.usable = False
                    return
        except Exception:  # ahead of time only: the copies register what they need themselves
            return

    def segments(self, name: str, full: torch.Tensor, source: torch.Tensor
                 ) -> list[torch.Tensor] | None:
        """The bytes of `source` (a contiguous view of checkpoint tensor `name`, held as
        `full`) over registered file pages, as uint8 tensors in order, each within one
        registered window (a transfer cannot span two registrations); None if CUDA refuses."""
        if not self.usable:
            return None
        mapped = self._file(self._reader.file_of(name))
        start = self._reader.offset(name) + source.data_ptr() - full.data_ptr()
        stop = start + source.numel() * source.element_size()
        if not mapped.register(start, stop):
            self.usable = False
            return None
        bounds = [start, *range((start // REGISTER_WINDOW + 1) * REGISTER_WINDOW, stop,
                                REGISTER_WINDOW), stop]
        return [mapped.bytes[a:b] for a, b in zip(bounds, bounds[1:])]

    def _file(self, file: str) -> _MappedFile:
        with self._lock:
            if file not in self._files:
                self._files[file] = _MappedFile(Path(self._reader.folder) / file)
            return self._files[file]

    def close(self) -> None:
        """Unregister and unmap every file (every transfer from them must have finished)."""
        self._stop.set()
        if self._ahead is not None:
            self._queue.put(None)
            self._ahead.join()
            self._ahead = None
        for mapped in self._files.values():
            mapped.close()
        self._files.clear()
