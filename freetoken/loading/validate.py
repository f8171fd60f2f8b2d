"""Checkpoint files checked from their headers alone, before any rank starts: every
safetensors header parses, its dtypes are known, every tensor's bytes lie inside the file and
match its shape; an index has a `weight_map` whose files exist and hold the tensors it names.
Reads a few kilobytes per file, so it costs nothing on a 35B checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.loading.files import CheckpointError, read_header

INDEX = "model.safetensors.index.json"


def _index_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX
    try:
        doc = json.loads(index.read_text(), object_pairs_hook=_refuse_repeated(index))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: invalid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no `weight_map` (tensor name -> file)")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or "/" in v]
    if bad:
        raise CheckpointError(f"{index}: weight_map entry {bad[0]!r} does not name a file")
    return weight_map


def _refuse_repeated(index: Path):
    """A JSON object hook refusing a key given twice (json keeps the last silently: an index
    listing a tensor twice, in two files, loaded whichever came last)."""

    def pairs(items: list[tuple]) -> dict:
        seen: dict = {}
        for key, value in items:
            if key in seen:
                raise CheckpointError(f"{index}: tensor {key!r} is listed twice, in "
                                      f"{seen[key]} and in {value}")
            seen[key] = value
        return seen

    return pairs


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
            headers[file] = read_header(folder / file).entries
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise CheckpointError(f"{folder / INDEX} puts tensor {name!r} in {file}, "
                                      "which does not hold it")
            others = [f for f in sorted(headers) if f != file and name in headers[f]]
            if others:
                raise CheckpointError(f"tensor {name!r} is in both {file} and {others[0]} "
                                      f"({INDEX} names {file}): which one is meant?")
        return len(weight_map)
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no model*.safetensors files and no {INDEX}")
    seen: dict[str, str] = {}
    for file in files:
        for name in read_header(file).entries:
            if name in seen:
                raise CheckpointError(f"tensor {name!r} is in both {seen[name]} and "
                                      f"{file.name}")
            seen[name] = file.name
    return len(seen)


def tensor_dtypes(folder: str | Path) -> dict[str, str]:
    """Every tensor's safetensors dtype string (`BF16`, `F8_E4M3`, `U8`...), from the
    headers alone (call `validate_checkpoint` first: this assumes the files are sound)."""
    folder = Path(folder)
    files = sorted(folder.glob("model*.safetensors"))
    if (folder / INDEX).is_file():
        files = [folder / f for f in sorted(set(_index_map(folder).values()))]
    return {name: entry["dtype"] for file in files
            for name, entry in read_header(file).entries.items()}
