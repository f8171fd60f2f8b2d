"""Safetensors files: the header read once and checked against the file, the data mapped.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, data_offsets relative to the data section), then the data. The loader maps each file
copy-on-write and hands out tensors that are views of the mapping: no byte is read until a
shard is copied out of it, and a stray write into one stays private to the process."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or inconsistent."""


# Bytes per element of every dtype safetensors writes (sub-byte ones count as packed bytes).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
               "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "C64": 8, "U64": 8, "U32": 4, "U16": 2}
# The torch dtype of each, where this torch has it (older ones lack the newer float8 kinds).
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
                "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
                "F8_E8M0": "float8_e8m0fnu", "C64": "complex64", "U64": "uint64",
                "U32": "uint32", "U16": "uint16"}
TORCH_DTYPES = {k: getattr(torch, v) for k, v in _TORCH_NAMES.items() if hasattr(torch, v)}
# A header larger than this is garbage, not a checkpoint (real ones are a few MB at most).
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class Header:
    """One file's tensor entries (name -> dtype, shape, data_offsets) and where its data
    section starts."""

    entries: dict[str, dict]
    data_start: int

    def offset(self, name: str) -> int:
        """File offset of tensor `name`'s first byte."""
        return self.data_start + self.entries[name]["data_offsets"][0]


def read_header(path: Path) -> Header:
    """The header of one safetensors file, every entry checked against the file's size;
    CheckpointError naming the file and tensor otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: header length {length} exceeds the file "
                                  f"({size} bytes): truncated or not a safetensors file")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for name, entry in header.items():
        _check_entry(path, name, entry, data_size)
    return Header(header, 8 + length)


def _check_entry(path: Path, name: str, entry, data_size: int) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: tensor {name!r} has no dtype/shape/offsets entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_is_size(d) for d in shape)):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    if offsets[1] > data_size:
        raise CheckpointError(f"{path}: tensor {name!r} ends at byte {offsets[1]} of a "
                              f"{data_size}-byte data section: the file is truncated")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(f"{path}: tensor {name!r} {dtype} {tuple(shape)} needs "
                              f"{expected} bytes, its offsets span {offsets[1] - offsets[0]}")


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class MappedFile:
    """One safetensors file: its checked header, and its bytes mapped copy-on-write."""

    def __init__(self, path: Path):
        self.path = path
        self.header = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            # Copy-on-write, as safetensors maps: pages are the page cache's until written.
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        # The tensor holds the mapping: views of it stay valid after this object is gone.
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        # The whole mapping viewed as each dtype met so far: a tensor is then one slice of it.
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as stored: a view of the mapping (a copy where its offset is not a
        multiple of its element size, which a view cannot have)."""
        entry = self.header.entries[name]
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, "
                                  f"which torch {torch.__version__} does not have")
        begin, end = entry["data_offsets"]
        start, size = self.header.data_start + begin, dtype.itemsize
        if start % size:
            return self._bytes[start : start + end - begin].clone().view(dtype).view(
                entry["shape"])
        typed = self._typed.get(dtype)
        if typed is None:
            whole = len(self._bytes) - len(self._bytes) % size
            typed = self._typed[dtype] = self._bytes[:whole].view(dtype)
        return typed[start // size : (start + end - begin) // size].view(entry["shape"])
