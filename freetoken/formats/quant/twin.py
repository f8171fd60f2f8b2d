"""A quantized checkpoint's dequantized twin: the same checkpoint folder with every quantized
module's weight dequantized in float64 from the format definition (`dequantize.py`) and
rounded once, its scales dropped and no quantization config left: the unquantized model the
quantized one must compute. A harness runs HF on it as the reference for a quantized
checkpoint, because HF's own loaders are not reliable for these (CPU block-FP8 dequantization
is wrong on partial blocks, compressed-tensors NVFP4 experts come out times their global
scale, ModelOpt is not read).

Written from one `model.safetensors` or a sharded folder (an index and several files), one
tensor at a time: a writer holds one module and one band of its float64 values, whatever the
checkpoint's size."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

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
    write_safetensors,
)
from freetoken.formats.quant.format import NVFP4, ModuleFormat, QuantConfigError

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
    consumed = set()
    for name in table:
        module, _, suffix = name.rpartition(".")
        if module in modules and suffix in modules[module].suffixes():
            consumed.add(name)
    return TwinLayout(modules, frozenset(consumed))


def _copied_files(folder: Path) -> list[Path]:
    """The folder's files a twin carries (config, tokenizer, generation config and the like):
    not the weights in any format, an index, subfolders, nor the ModelOpt quantization
    config."""
    skip = set(weight_files(folder)) | {INDEX, _QUANT_CONFIG}
    return [p for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip
            and not p.name.endswith(_NOT_CARRIED)
            and not (p.name.startswith("model") and p.name.endswith(".safetensors"))]


@dataclass(frozen=True)
class _Out:
    """One tensor of the twin: its `name`, the checkpoint tensor it comes from (`source`:
    the stored weight of a dequantized module) and its dtype and shape in the twin."""

    name: str
    source: str
    info: TensorInfo


def _planned(table: Mapping[str, TensorInfo], layout: TwinLayout, dtype: torch.dtype,
             keep: Callable[[str], bool] | None) -> list[_Out]:
    """The twin's tensors in writing order (checkpoint file by file, names sorted)."""
    outs: dict[str, _Out] = {}
    files = sorted({info.file for info in table.values()})
    for name in sorted(table, key=lambda n: (files.index(table[n].file), n)):
        info = table[name]
        module, _, suffix = name.rpartition(".")
        if keep is not None and not keep(name):
            continue
        if name not in layout.consumed:
            out = _Out(name, name, info)
        elif layout.modules[module].suffixes()[suffix] == "weight":
            shape = layout.weight_shape(module, info)
            out = _Out(f"{module}.weight", name,
                       TensorInfo(info.file, stored_dtype(dtype), shape))
        else:
            continue
        if out.name in outs:
            raise QuantConfigError(f"{module}: the checkpoint holds both {outs[out.name].source}"
                                   f" and {out.source}, which would both be {out.name}")
        outs[out.name] = out
    return list(outs.values())


def _cut(outs: list[_Out], limit: int) -> list[list[_Out]]:
    """The twin's tensors grouped into files of about `limit` bytes (at least one file)."""
    groups, size = [[]], 0
    for out in outs:
        if size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(out)
        size += out.info.nbytes
    return groups


def twin_bytes(folder: str | Path, scheme, dtype: torch.dtype = torch.float32,
               keep: Callable[[str], bool] | None = None) -> int:
    """What `write_dequantized_twin` with these arguments writes, in bytes, from the headers
    alone (an allowance for the headers included): what a cache must have free."""
    folder = Path(folder)
    table = tensor_table(folder)
    outs = _planned(table, twin_layout(table, scheme), dtype, keep)
    copied = sum(p.stat().st_size for p in _copied_files(folder))
    return copied + sum(o.info.nbytes + len(o.name) + 96 for o in outs) + (1 << 20)


def _unquantized_config(src: Path, dst: Path) -> None:
    """config.json without its `quantization_config` (top level or in `text_config`)."""
    config = json.loads(src.read_text())
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    dst.write_text(json.dumps(config, indent=2) + "\n")


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


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

    Tensors are read and written one at a time (each file's header is made from the shapes
    first), so memory holds one module and one band of its float64 values, whatever the
    checkpoint's size; a module whose tensors lie in different files is read from both.
    `keep(name)` (default: all) picks the checkpoint tensors the twin holds (a truncated
    model's layers). The twin is one `model.safetensors`, or files of about `max_file_bytes`
    (default: the larger of MIN_FILE_BYTES and the largest weight file) and an index.
    Returns `dst`."""
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
    limit = max_file_bytes or max([MIN_FILE_BYTES] + [(folder / f).stat().st_size
                                                      for f in weight_files(folder)])
    groups = _cut(_planned(table, layout, dtype, keep), limit)
    names = _file_names(len(groups))
    with TensorSource(folder, table) as source:

        def tensors(group: list[_Out]):
            for out in group:
                if out.source not in layout.consumed:
                    yield source.get(out.source)
                    continue
                module = out.source.rpartition(".")[0]
                stored = {s: source.get(n) for s, n in parts[module].items()}
                yield dequantized_weight(layout.modules[module], stored, module, dtype)

        for file, group in zip(names, groups):
            write_safetensors(dst / file, [o.info for o in group], [o.name for o in group],
                              tensors(group))
    if len(groups) > 1:
        weight_map = {o.name: file for file, group in zip(names, groups) for o in group}
        total = sum(o.info.nbytes for group in groups for o in group)
        (dst / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    for path in _copied_files(folder):
        if path.name == "config.json":
            _unquantized_config(path, dst / path.name)
        else:
            shutil.copyfile(path, dst / path.name)
    return dst
