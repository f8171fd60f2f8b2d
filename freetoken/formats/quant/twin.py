"""A quantized checkpoint's dequantized twin: the same checkpoint folder with every quantized
module's weight dequantized in float64 from the format definition (`dequantize.py`) and
rounded once, its scales dropped and no quantization config left: the unquantized model the
quantized one must compute. A harness runs HF on it as the reference for a quantized
checkpoint, because HF's own loaders are not reliable for these (CPU block-FP8 dequantization
is wrong on partial blocks, compressed-tensors NVFP4 experts come out times their global
scale, ModelOpt is not read).

Written from one `model.safetensors` or a sharded folder (an index and several files), one
weight file at a time: a writer holds at most one twin file's tensors (cut at the larger of
`MIN_FILE_BYTES` and the largest weight file) and one band of a module's float64 values."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from freetoken.formats.quant.dequantize import (
    check_scalar_scale,
    dequantize_module,
    dequantized_weight,
)
from freetoken.formats.quant.folder import (
    INDEX,
    TensorInfo,
    TensorSource,
    stored_dtype,
    tensor_table,
    weight_files,
)
from freetoken.formats.quant.format import NVFP4, ModuleFormat

__all__ = ["TwinLayout", "check_scalar_scale", "dequantize_module", "twin_bytes",
           "twin_layout", "write_dequantized_twin"]

MIN_FILE_BYTES = 2 << 30
"""The twin's files are cut at the larger of this and the checkpoint's largest weight file."""
_QUANT_CONFIG = "hf_quant_config.json"
_NOT_CARRIED = (".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".index.json")
"""Files of other weight formats (and their indexes), which a twin must not carry: a loader
finding them beside the twin's safetensors could read the quantized weights instead."""


@dataclass(frozen=True)
class TwinLayout:
    """Which tensors of a checkpoint the twin dequantizes: `modules` (module -> format, for
    every module whose `weight` is stored in its format's dtype: an embedding or norm a
    scheme's `Linear` target would call quantized still holds its plain weight), `consumed`
    (every tensor of those modules that the format reads: replaced by one weight)."""

    modules: dict[str, ModuleFormat]
    consumed: frozenset[str]

    def weight_shape(self, module: str, info: TensorInfo) -> tuple[int, int]:
        """The dequantized [out, in] of `module` from its stored weight's header entry."""
        rows, cols = info.shape
        return rows, cols * 2 if self.modules[module].kind == NVFP4 else cols


def twin_layout(table: Mapping[str, TensorInfo], scheme) -> TwinLayout:
    """The `TwinLayout` of a checkpoint's tensors (`tensor_table`) under `scheme`."""
    modules = {}
    for name, info in table.items():
        module, _, suffix = name.rpartition(".")
        fmt = scheme.format_of(module)
        if fmt.suffixes().get(suffix) == "weight" and info.dtype in {
                stored_dtype(d) for d in fmt.weight_dtypes()}:
            modules[module] = fmt
    consumed = frozenset(n for n in table if n.rpartition(".")[0] in modules
                         and n.rpartition(".")[2] in modules[n.rpartition(".")[0]].suffixes())
    return TwinLayout(modules, consumed)


def _copied_files(folder: Path) -> list[Path]:
    """The folder's files a twin carries (config, tokenizer, generation config and the like):
    not the weights in any format, an index, subfolders, nor the ModelOpt quantization
    config."""
    skip = set(weight_files(folder)) | {INDEX, _QUANT_CONFIG}
    return [p for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip
            and not p.name.endswith(_NOT_CARRIED)
            and not (p.name.startswith("model") and p.name.endswith(".safetensors"))]


def twin_bytes(folder: str | Path, scheme, dtype: torch.dtype = torch.float32,
               keep: Callable[[str], bool] | None = None) -> int:
    """What `write_dequantized_twin` with these arguments writes, in bytes, from the headers
    alone (a header allowance per tensor included): what a cache must have free."""
    folder = Path(folder)
    table = tensor_table(folder)
    layout = twin_layout(table, scheme)
    total = sum(p.stat().st_size for p in _copied_files(folder)) + (1 << 20)
    for name, info in table.items():
        module, _, suffix = name.rpartition(".")
        if keep is not None and not keep(name):
            continue
        if name not in layout.consumed:
            total += info.nbytes + len(name) + 96
        elif layout.modules[module].suffixes()[suffix] == "weight":
            rows, cols = layout.weight_shape(module, info)
            total += rows * cols * dtype.itemsize + len(name) + 96
    return total




class _Writer:
    """The twin's tensors, saved a file at a time once `limit` bytes are pending."""

    def __init__(self, dst: Path, limit: int):
        self.dst, self.limit = dst, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str], int]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.pending and self.files:
            return
        part = f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, self.dst / part, metadata={"format": "pt"})
        self.files.append((part, sorted(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """One `model.safetensors`, or `model-0000i-of-0000n.safetensors` and an index."""
        self.flush()
        if len(self.files) == 1:
            os.replace(self.dst / self.files[0][0], self.dst / "model.safetensors")
            return
        weight_map, n = {}, len(self.files)
        for i, (part, names, _) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dst / part, self.dst / final)
            weight_map.update(dict.fromkeys(names, final))
        total = sum(size for _, _, size in self.files)
        (self.dst / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _unquantized_config(src: Path, dst: Path) -> None:
    """config.json without its `quantization_config` (top level or in `text_config`)."""
    config = json.loads(src.read_text())
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    dst.write_text(json.dumps(config, indent=2) + "\n")


def write_dequantized_twin(folder: str | Path, dst: str | Path, scheme,
                           dtype: torch.dtype = torch.float32, *,
                           keep: Callable[[str], bool] | None = None,
                           max_file_bytes: int | None = None) -> Path:
    """Write into `dst` (new or empty) the dequantized twin of checkpoint `folder` (one
    `model.safetensors`, several `model*.safetensors`, or an index and its files) under
    `scheme` (the folder's QuantScheme): every quantized module replaced by its `weight`
    dequantized in float64 and rounded once to `dtype`, its scales dropped, every other
    tensor as stored, the folder's other files copied with no quantization config left.

    float32 by default: FP8 code x a bf16 / fp16 block scale is exact in it (at most 12
    significant bits), NVFP4 values are rounded once, to half an ulp, and float32 is the dtype
    HF computes the reference in; bf16 would round the reference's weights away from the
    values the engine dequantizes. It costs 4 bytes per quantized parameter (`twin_bytes`).

    `keep(name)` (default: all) picks the checkpoint tensors the twin holds (a truncated
    model's layers). Files are cut at `max_file_bytes` (default: the larger of
    MIN_FILE_BYTES and the largest weight file); a module whose tensors lie in different
    files is read from both. Returns `dst`."""
    folder, dst = Path(folder), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if any(dst.iterdir()):
        raise FileExistsError(f"{dst} is not empty; a twin is written into a new or empty "
                              "folder")
    table = tensor_table(folder)
    layout = twin_layout(table, scheme) if scheme is not None else TwinLayout({}, frozenset())
    parts: dict[str, dict[str, str]] = {}
    for name in layout.consumed:
        module, _, suffix = name.rpartition(".")
        parts.setdefault(module, {})[suffix] = name
    files = weight_files(folder)
    limit = max_file_bytes or max([MIN_FILE_BYTES] + [(folder / f).stat().st_size
                                                      for f in files])
    writer = _Writer(dst, limit)
    with TensorSource(folder, table) as source:
        for file in files:
            for name in sorted(n for n, info in table.items() if info.file == file):
                module, _, suffix = name.rpartition(".")
                if keep is not None and not keep(name):
                    continue
                if name not in layout.consumed:
                    writer.add(name, source.get(name))
                elif (fmt := layout.modules[module]).suffixes()[suffix] == "weight":
                    tensors = {s: source.get(n) for s, n in parts[module].items()}
                    writer.add(f"{module}.weight",
                               dequantized_weight(fmt, tensors, module, dtype))
            source.release(file)
    writer.finish()
    for path in _copied_files(folder):
        if path.name == "config.json":
            _unquantized_config(path, dst / path.name)
        else:
            shutil.copyfile(path, dst / path.name)
    return dst
