"""Checkpoint files mapped read-only and registered with CUDA, so the copy engine reads a
shard's bytes straight from the page cache (see `freetoken.loading.staging`)."""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from pathlib import Path

import torch

REGISTER_WINDOW = 256 << 20
"""Bytes of a mapped file registered at once: a thread registers the windows it reads."""
_HOST_REGISTER_READ_ONLY = 8
"""cudaHostRegisterReadOnly: pin the pages for reading only (a read-only mapping)."""


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
        cudart = torch.cuda.cudart()
        for w in range(start // REGISTER_WINDOW, -(-stop // REGISTER_WINDOW)):
            with self._locks[w]:
                if self._registered[w]:
                    continue
                window = self.bytes[w * REGISTER_WINDOW : (w + 1) * REGISTER_WINDOW]
                if int(cudart.cudaHostRegister(window.data_ptr(), window.numel(),
                                               _HOST_REGISTER_READ_ONLY)) != 0:
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
        for mapped in self._files.values():
            mapped.close()
        self._files.clear()
