"""The weight files of a checkpoint folder as the formats layer reads them: one
`model.safetensors`, several `model*.safetensors`, or the files `model.safetensors.index.json`
names; each tensor's file, dtype and shape from the headers alone, and tensors read one at a
time. What the dequantized twin is written from (`twin.py`); the engine's own reader, with its
checks, is `freetoken.loading`, one layer up."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"

_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U64": 8, "U32": 4, "U16": 2}
_STORED_AS = {torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2"}


class FolderError(ValueError):
    """A checkpoint folder whose weight files cannot be read; the message names the file."""


def stored_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a quantized-data dtype (`torch.uint8` -> `U8`)."""
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

    def release(self, file: str) -> None:
        """Close `file` (its tensors handed out stay valid)."""
        self._open.pop(file, None)

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()
