"""The weight files of a checkpoint folder as the formats layer reads and writes them: one
`model.safetensors`, several `model*.safetensors`, or the files `model.safetensors.index.json`
names; each tensor's file, dtype and shape from the headers alone, tensors read one at a
time, and a safetensors file written one tensor at a time (its header first, from the
shapes). What the dequantized twin is written from and with (`twin.py`); the engine's own
reader, with its checks, is `freetoken.loading`, one layer up."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"

_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U64": 8, "U32": 4, "U16": 2}
_STORED_AS = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class FolderError(ValueError):
    """A checkpoint folder whose weight files cannot be read; the message names the file."""


def stored_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a dtype (`torch.uint8` -> `U8`)."""
    if dtype not in _STORED_AS:
        raise FolderError(f"dtype {dtype} has no safetensors name here")
    return _STORED_AS[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor, from its file's header: `file` (relative to the folder), the
    safetensors `dtype` string (`BF16`, `F8_E4M3`, `U8`...), `shape`."""

    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype not in _ITEM_BYTES:
            raise FolderError(f"{self.file}: dtype {self.dtype} has no known size")
        return math.prod(self.shape) * _ITEM_BYTES[self.dtype]


def weight_files(folder: Path) -> list[str]:
    """The weight files, relative to `folder`: the index's, else every `model*.safetensors`
    (a bundled case also holds `reference.safetensors`, which is no weight file)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FolderError(f"{index}: no readable weight_map ({type(e).__name__})") from None
        return sorted(set(weight_map.values()))
    files = sorted(p.name for p in folder.glob("model*.safetensors"))
    if not files:
        raise FolderError(f"{folder}: no model*.safetensors files and no {INDEX}")
    return files


def tensor_table(folder: Path) -> dict[str, TensorInfo]:
    """Every weight tensor of `folder` by name, from the headers (no data is read)."""
    table: dict[str, TensorInfo] = {}
    for file in weight_files(folder):
        try:
            with safe_open(folder / file, "pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    if name in table:
                        raise FolderError(f"tensor {name!r} is in both {table[name].file} "
                                          f"and {file}")
                    table[name] = TensorInfo(file, piece.get_dtype(), tuple(piece.get_shape()))
        except (OSError, RuntimeError) as e:
            raise FolderError(f"{folder / file}: unreadable safetensors file ({e})") from None
    return table


class TensorSource:
    """Tensors of a checkpoint folder, one at a time, each file opened once (a `with` block
    closes them)."""

    def __init__(self, folder: Path, table: dict[str, TensorInfo]):
        self.folder, self.table = folder, table
        self._open: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.table[name].file
        if file not in self._open:
            self._open[file] = safe_open(self.folder / file, "pt")
        return self._open[file].get_tensor(name)

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()


def write_safetensors(path: Path, entries: list[TensorInfo], names: list[str],
                      tensors: Iterable[torch.Tensor]) -> None:
    """Write safetensors file `path` holding `names[i]` with the dtype and shape of
    `entries[i]`, its data the i-th of `tensors`, each written as it comes: the header is
    made from the entries first, so no more than one tensor is held at a time (a
    safetensors `save_file` holds every tensor and copies them once more). FolderError
    naming the tensor when one comes in another dtype or shape than its entry."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, info in zip(names, entries, strict=True):
        header[name] = {"dtype": info.dtype, "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, info, t in zip(names, entries, tensors, strict=True):
            if stored_dtype(t.dtype) != info.dtype or tuple(t.shape) != info.shape:
                raise FolderError(f"{path}: tensor {name!r} came as {t.dtype} "
                                  f"{tuple(t.shape)}, its header says {info.dtype} "
                                  f"{info.shape}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
