"""Reading safetensors checkpoints: one file, or several with `model.safetensors.index.json`.
Each file's header is read once and its data mapped (`freetoken.loading.files`): `get` returns
a view of the mapping, so a tensor costs a dictionary lookup and no bytes are read until its
shard is copied out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from freetoken.loading.files import CheckpointError, MappedFile

__all__ = ["CheckpointError", "CheckpointReader", "layer_index"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for embeddings, final norm, head."""
    m = _LAYER.search(name)
    return int(m[1]) if m else None


class CheckpointReader:
    """Names and tensors of a checkpoint folder, one tensor at a time."""

    def __init__(self, folder: str | Path, max_layers: int | None = None):
        """`max_layers=K` hides the tensors of decoder layers K and above (a truncated model)."""
        self.folder = Path(folder)
        self._handles: dict[str, MappedFile] = {}
        self._files = self._weight_map()
        if max_layers is not None:
            self._files = {n: f for n, f in self._files.items()
                           if (layer := layer_index(n)) is None or layer < max_layers}

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for file in sorted(set(weight_map.values())):
                if not (self.folder / file).is_file():
                    raise CheckpointError(f"{index} names {file}, which is missing")
            return weight_map
        # Only model*.safetensors: a case folder also holds reference.safetensors.
        files = sorted(self.folder.glob("model*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no model*.safetensors files and no "
                                  "model.safetensors.index.json")
        weight_map = {}
        for file in files:
            self._handles[file.name] = mapped = MappedFile(file)
            for key in mapped.header.entries:
                if key in weight_map:
                    raise CheckpointError(f"tensor {key!r} is in both {weight_map[key]} "
                                          f"and {file.name}")
                weight_map[key] = file.name
        return weight_map

    def names(self) -> list[str]:
        """Tensor names, grouped by file so each file is opened once."""
        return sorted(self._files, key=lambda n: (self._files[n], n))

    def file_of(self, name: str) -> str:
        """The file (relative to the folder) holding tensor `name` (GPU staging reads it)."""
        return self._files[name]

    def _handle(self, name: str) -> MappedFile:
        """The mapped file holding tensor `name` (mapped on first use)."""
        file = self._files[name]
        mapped = self._handles.get(file)
        if mapped is None:
            mapped = self._handles[file] = MappedFile(self.folder / file)
        if name not in mapped.header.entries:
            raise CheckpointError(f"{self.folder / 'model.safetensors.index.json'} puts "
                                  f"tensor {name!r} in {file}, which does not hold it")
        return mapped

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` as stored (a view of the mapped file)."""
        if name not in self._files:
            raise CheckpointError(f"{self.folder}: no tensor {name!r}")
        return self._handle(name).tensor(name)

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) without reading the data."""
        entry = self._handle(name).header.entries[name]
        return tuple(entry["shape"]), entry["dtype"]

    def offset(self, name: str) -> int:
        """Offset of tensor `name`'s first byte in its file (`file_of`)."""
        return self._handle(name).header.offset(name)

    def extent(self, name: str) -> tuple[int, int]:
        """(first, past-the-last) byte of tensor `name` in its file (`file_of`)."""
        header = self._handle(name).header
        begin, end = header.entries[name]["data_offsets"]
        return header.data_start + begin, header.data_start + end

    def close(self) -> None:
        """Forget the mapped files; tensors handed out keep their mapping alive."""
        self._handles.clear()
