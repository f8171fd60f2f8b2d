"""NVFP4 checkpoints from ModelOpt and compressed-tensors, read into one normalised form.

Normalised form (ModelOpt's): per quantized linear `M`, tensors `M.weight` (uint8, packed),
`M.weight_scale` (e4m3 blocks), `M.weight_scale_2` (float32 global multiplier) and optionally
`M.input_scale`. compressed-tensors names them `weight_packed`, `weight_scale`,
`weight_global_scale`, `input_global_scale`, with the same packing and the same block scales
but the RECIPROCAL global: CT's `weight_global_scale` = 6 * 448 / amax, and CT dequantizes as
code * weight_scale / weight_global_scale. Normalising takes 1 / g once, in float64, rounded
to float32: the two forms then dequantize identically up to that one rounding (at most one
float32 ulp of the global scale, a relative 2^-24 on every weight); no float32 global g has
1 / (1 / g) == g guaranteed, so bit equality is not available.

For loading through a shard plan (one checkpoint tensor at a time) `canonical_field` maps a
tensor suffix to the normalised field, and `NVFP4Config.global_scale_is_reciprocal` tells the
layer to invert its global scales at run time instead of in a shard spec, so that shard
specs stay bitwise invertible.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import torch

from freetoken.formats.nvfp4.format import GROUP, check_shapes
from freetoken.formats.nvfp4.quantizer import NVFP4Tensor

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_SUFFIXES = {
    MODELOPT: {f: f for f in FIELDS},
    COMPRESSED_TENSORS: {"weight_packed": "weight", "weight_scale": "weight_scale",
                         "weight_global_scale": "weight_scale_2",
                         "input_global_scale": "input_scale"},
}
_RECIPROCAL = {COMPRESSED_TENSORS: ("weight_global_scale", "input_global_scale")}
_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")


class NVFP4ConfigError(ValueError):
    """A quantization config or checkpoint tensor FreeToken cannot read as NVFP4."""


def _matches(module: str, pattern: str) -> bool:
    """HF-style module patterns: exact names, fnmatch wildcards, `re:` regexes (CT), each
    also covering the module's children."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    return (module == pattern or module.startswith(pattern + ".")
            or fnmatchcase(module, pattern) or fnmatchcase(module, pattern + ".*"))


@dataclass(frozen=True)
class NVFP4Config:
    """Which modules of a checkpoint are NVFP4, and in which producer's tensor naming."""

    producer: str
    group_size: int = GROUP
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] | None = None
    """None: every linear not excluded; else only modules matching one of these."""

    def is_quantized(self, module: str) -> bool:
        """Whether linear `module` (e.g. `model.layers.0.mlp.experts.3.gate_proj`) is NVFP4."""
        if any(_matches(module, p) for p in self.exclude):
            return False
        return self.include is None or any(_matches(module, p) for p in self.include)

    @property
    def global_scale_is_reciprocal(self) -> bool:
        """True when stored global scales divide (compressed-tensors) instead of multiply."""
        return self.producer == COMPRESSED_TENSORS


def tensor_suffixes(producer: str) -> dict[str, str]:
    """`producer`'s checkpoint tensor suffix -> normalised (ModelOpt) field."""
    if producer not in _SUFFIXES:
        raise NVFP4ConfigError(f"unknown NVFP4 producer {producer!r}; expected "
                               f"{MODELOPT!r} or {COMPRESSED_TENSORS!r}")
    return dict(_SUFFIXES[producer])


def _modelopt(q: dict, source: str) -> NVFP4Config:
    algo = str(q.get("quant_algo", "")).upper()
    group = _int(q.get("group_size", GROUP), "group_size", source)
    exclude = _names(q.get("exclude_modules") or q.get("ignore") or [], "exclude_modules",
                     source)
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers") or {}
        bad = {m: c.get("quant_algo") for m, c in layers.items()
               if str(c.get("quant_algo", "")).upper() not in _NVFP4_ALGOS}
        if bad:
            module, other = next(iter(bad.items()))
            raise NVFP4ConfigError(f"{source}: module {module!r} uses quant_algo {other!r}; "
                                   f"only {', '.join(_NVFP4_ALGOS)} are supported")
        return NVFP4Config(MODELOPT, group, exclude, tuple(layers))
    if algo not in _NVFP4_ALGOS:
        raise NVFP4ConfigError(f"{source}: ModelOpt quant_algo {algo!r} is not supported; "
                               f"expected one of {', '.join(_NVFP4_ALGOS)}")
    return NVFP4Config(MODELOPT, group, exclude)


def _int(value, key: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise NVFP4ConfigError(f"{source}: {key} must be an integer, got {value!r}")
    return value


def _names(value, key: str, source: str) -> tuple[str, ...]:
    """A list of module names or patterns (a bare string would split into characters)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NVFP4ConfigError(f"{source}: {key} must be a list of module names, got "
                               f"{value!r}")
    return tuple(value)


def _ct_group_is_nvfp4(weights: dict) -> bool:
    return (weights.get("num_bits") == 4 and weights.get("type") == "float"
            and weights.get("strategy") == "tensor_group")


def _compressed_tensors(q: dict, source: str) -> NVFP4Config:
    groups = q.get("config_groups") or {}
    if not groups:
        raise NVFP4ConfigError(f"{source}: compressed-tensors config without config_groups "
                               "is not NVFP4")
    include: list[str] = []
    group_size = GROUP
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if not _ct_group_is_nvfp4(weights):
            raise NVFP4ConfigError(f"{source}: compressed-tensors group {name!r} is not NVFP4 "
                                   f"(weights {weights}); only nvfp4-pack-quantized is read")
        group_size = _int(weights.get("group_size") or GROUP, "group_size", source)
        include += _names(group.get("targets") or ["Linear"], "targets", source)
    # "Linear" targets every linear layer; other targets name modules or `re:` patterns.
    every_linear = "Linear" in include or not include
    return NVFP4Config(COMPRESSED_TENSORS, group_size,
                       _names(q.get("ignore") or [], "ignore", source),
                       None if every_linear else tuple(include))


def parse_quant_config(raw: dict | None, source: str = "quantization config"
                       ) -> NVFP4Config | None:
    """An `hf_quant_config.json` document or a config.json `quantization_config` -> config;
    None when `raw` is None (an unquantized checkpoint)."""
    if raw is None:
        return None
    try:
        return _parse(raw, source)
    except NVFP4ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        raise NVFP4ConfigError(f"{source}: malformed ({type(e).__name__}: {e})") from None


def _parse(raw: dict, source: str) -> NVFP4Config:
    if not isinstance(raw, dict):
        raise NVFP4ConfigError(f"{source}: not a JSON object")
    if "quantization" in raw and "quant_method" not in raw:
        raw = raw["quantization"]  # hf_quant_config.json wraps the settings
    method = str(raw.get("quant_method", MODELOPT)).lower()
    if method.startswith("modelopt"):
        config = _modelopt(raw, source)
    elif method == "compressed-tensors":
        config = _compressed_tensors(raw, source)
    else:
        raise NVFP4ConfigError(f"{source}: quant_method {method!r} is not NVFP4 "
                               f"(expected modelopt or compressed-tensors)")
    if config.group_size != GROUP:
        raise NVFP4ConfigError(f"{source}: group_size {config.group_size}; NVFP4 uses {GROUP}")
    return config


def read_quant_config(folder: str | Path) -> NVFP4Config | None:
    """The NVFP4 config of a checkpoint folder: `hf_quant_config.json` if present, else
    config.json's `quantization_config`; None for an unquantized checkpoint."""
    folder = Path(folder)
    hf_quant = folder / "hf_quant_config.json"
    if hf_quant.exists():
        return parse_quant_config(_read_json(hf_quant), str(hf_quant))
    config = folder / "config.json"
    doc = _read_json(config) if config.exists() else {}
    raw = doc.get("quantization_config") if isinstance(doc, dict) else None
    return parse_quant_config(raw, f"{config} quantization_config")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NVFP4ConfigError(f"{path}: invalid JSON ({e})") from None


def canonical_field(name: str, producer: str) -> tuple[str, str] | None:
    """`M.<suffix>` -> (M, normalised field), or None when `name` is no NVFP4 tensor."""
    module, _, suffix = name.rpartition(".")
    field = _SUFFIXES[producer].get(suffix)
    return (module, field) if field and module else None


def normalise_tensor(name: str, tensor: torch.Tensor, producer: str) -> torch.Tensor:
    """One checkpoint tensor in the normalised convention: CT's reciprocal global scales are
    inverted (float64, rounded once to float32); global scales become float32 scalars."""
    suffix = name.rpartition(".")[2]
    if suffix in _RECIPROCAL.get(producer, ()):
        return (1.0 / tensor.to(torch.float64)).to(torch.float32).reshape(())
    if _SUFFIXES[producer].get(suffix) in ("weight_scale_2", "input_scale"):
        return tensor.to(torch.float32).reshape(())
    return tensor


def _global(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.numel() != 1:
        raise NVFP4ConfigError(f"{name}: a per-tensor global scale has 1 element, got shape "
                               f"{tuple(tensor.shape)}")
    if not bool(torch.isfinite(tensor).all()) or float(tensor) < 0:
        raise NVFP4ConfigError(f"{name}: global scale {float(tensor)} is not finite and >= 0")
    return tensor


def read_nvfp4_weight(get: Callable[[str], torch.Tensor], names: Collection[str], module: str,
                      producer: str) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """Read linear `module`'s tensors via `get(name)` into the normalised form; `names` is
    what the checkpoint holds. Returns the weight and its input scale (None when absent).
    Errors name the offending tensor."""
    want = {field: f"{module}.{suffix}" for suffix, field in _SUFFIXES[producer].items()}
    missing = [want[f] for f in FIELDS[:3] if want[f] not in names]
    if missing:
        raise NVFP4ConfigError(f"{module}: NVFP4 ({producer}) tensors missing: "
                               f"{', '.join(missing)}")
    packed, block = get(want["weight"]), get(want["weight_scale"])
    check_shapes(packed, block, f"{want['weight']} / {want['weight_scale']}")
    g_name = want["weight_scale_2"]
    g = normalise_tensor(g_name, _global(get(g_name), g_name), producer)
    input_scale = None
    if want["input_scale"] in names:
        input_scale = normalise_tensor(want["input_scale"], get(want["input_scale"]), producer)
    return NVFP4Tensor(packed, block, g), input_scale


def to_checkpoint(weight: NVFP4Tensor, module: str, producer: str) -> dict[str, torch.Tensor]:
    """`weight` as `producer` stores it (for tests and tiny checkpoints): ModelOpt's global
    scale is a 0-dim float32 tensor, compressed-tensors' the float32 reciprocal, shape [1]."""
    g = weight.global_scale.to(torch.float32).reshape(())
    if producer == COMPRESSED_TENSORS:
        g = (1.0 / g.to(torch.float64)).to(torch.float32).reshape(1)
    tensors = {"weight": weight.packed, "weight_scale": weight.block_scale, "weight_scale_2": g}
    return {f"{module}.{suffix}": tensors[field].clone()
            for suffix, field in _SUFFIXES[producer].items() if field in tensors}
