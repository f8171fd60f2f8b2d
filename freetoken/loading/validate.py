"""Checkpoint files checked from their headers alone, before any rank starts: every
safetensors header parses, its dtypes are known, every tensor's bytes lie inside the file and
match its shape; an index has a `weight_map` whose files exist and hold the tensors it names.
Reads a few kilobytes per file, so it costs nothing on a 35B checkpoint."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from freetoken.loading.checkpoint import CheckpointError

INDEX = "model.safetensors.index.json"
# Bytes per element of every dtype safetensors writes (sub-byte ones count as packed bytes).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
               "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "C64": 8, "U64": 8, "U32": 4, "U16": 2}
# A header larger than this is garbage, not a checkpoint (real ones are a few MB at most).
_MAX_HEADER = 100 << 20


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries of one safetensors file (name -> dtype, shape, data_offsets), each
    checked against the file's size; CheckpointError naming the file and tensor otherwise."""
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
    return header


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


def _index_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX
    try:
        doc = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: invalid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no `weight_map` (tensor name -> file)")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or "/" in v]
    if bad:
        raise CheckpointError(f"{index}: weight_map entry {bad[0]!r} does not name a file")
    return weight_map


def validate_checkpoint(folder: str | Path) -> int:
    """Check every checkpoint file's header (and the index, when there is one); returns the
    number of tensors. Raises CheckpointError naming the file and, where it applies, the
    tensor."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = _index_map(folder)
        headers = {}
        for file in sorted(set(weight_map.values())):
            if not (folder / file).is_file():
                raise CheckpointError(f"{folder / INDEX} names {file}, which is missing")
            headers[file] = read_header(folder / file)
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise CheckpointError(f"{folder / INDEX} puts tensor {name!r} in {file}, "
                                      "which does not hold it")
        return len(weight_map)
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no model*.safetensors files and no {INDEX}")
    seen: dict[str, str] = {}
    for file in files:
        for name in read_header(file):
            if name in seen:
                raise CheckpointError(f"tensor {name!r} is in both {seen[name]} and "
                                      f"{file.name}")
            seen[name] = file.name
    return len(seen)
