"""The three producers' quantization configs read into one `QuantScheme`:

- ModelOpt (`hf_quant_config.json`'s `quantization`, or config.json's `quantization_config`
  with `quant_method: modelopt`): `quant_algo` NVFP4, W4A16_NVFP4 (the same weights; the
  engine is weight-only anyway), FP8 (per tensor), or MIXED_PRECISION with `quantized_layers`
  keyed by module or by a container such as `...mlp.experts`; `exclude_modules`.
- compressed-tensors: `config_groups` (each with `targets` and `weights`: NVFP4
  `tensor_group` of 16, FP8 `tensor` or `block`; an FP8 group's `input_activations` with
  `dynamic: false` stores static input scales), `ignore` (expanded names or `re:`).
- HF `fp8` (Qwen's block-FP8 releases): `fmt` e4m3, `weight_block_size`,
  `modules_to_not_convert`, `activation_scheme` (`static` stores activation scales).

Anything else is refused naming the file and key: a config read wrongly loads garbage."""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.formats.quant.format import (
    COMPRESSED_TENSORS,
    FP8_BLOCK,
    FP8_TENSOR,
    HF_FP8,
    MODELOPT,
    NVFP4,
    ModuleFormat,
    QuantConfigError,
)
from freetoken.formats.quant.scheme import (
    CT_STYLE,
    HF_STYLE,
    MODELOPT_STYLE,
    FormatRule,
    Patterns,
    QuantScheme,
)

NVFP4_GROUP = 16
_MODELOPT_ALGOS = {"NVFP4": NVFP4, "W4A16_NVFP4": NVFP4, "FP8": FP8_TENSOR}


def read_quant_config(folder: str | Path) -> QuantScheme | None:
    """The scheme of a checkpoint folder: `hf_quant_config.json` if present, else
    config.json's `quantization_config`; None for an unquantized checkpoint."""
    folder = Path(folder)
    hf_quant = folder / "hf_quant_config.json"
    if hf_quant.exists():
        return parse_quant_config(_read_json(hf_quant), str(hf_quant))
    config = folder / "config.json"
    doc = _read_json(config) if config.exists() else {}
    raw = doc.get("quantization_config") if isinstance(doc, dict) else None
    return parse_quant_config(raw, f"{config} quantization_config")


def parse_quant_config(raw: dict | None, source: str = "quantization config"
                       ) -> QuantScheme | None:
    """An `hf_quant_config.json` document or a config.json `quantization_config` -> scheme;
    None when `raw` is None (an unquantized checkpoint). QuantConfigError naming `source`."""
    if raw is None:
        return None
    try:
        return _parse(raw, source)
    except QuantConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        raise QuantConfigError(f"{source}: malformed ({type(e).__name__}: {e})") from None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantConfigError(f"{path}: invalid JSON ({e})") from None


def _parse(raw: dict, source: str) -> QuantScheme:
    if not isinstance(raw, dict):
        raise QuantConfigError(f"{source}: not a JSON object")
    if "quantization" in raw and "quant_method" not in raw:
        raw = raw["quantization"]  # hf_quant_config.json wraps the settings
        if not isinstance(raw, dict):
            raise QuantConfigError(f"{source}: quantization is not a JSON object")
    method = str(raw.get("quant_method", MODELOPT)).lower()
    if method.startswith("modelopt"):
        return _modelopt(raw, source)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(raw, source)
    if method == HF_FP8:
        return _hf_fp8(raw, source)
    raise QuantConfigError(f"{source}: quant_method {method!r} is not supported (expected "
                           f"modelopt, compressed-tensors or fp8)")


def _int(value, key: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QuantConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _names(value, key: str, source: str) -> tuple[str, ...]:
    """A list of module names or patterns (a bare string would split into characters)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantConfigError(f"{source}: {key} must be a list of module names, got "
                               f"{value!r}")
    return tuple(value)


def _entries(key: str, patterns: Patterns) -> tuple[tuple[str, str], ...]:
    return tuple((key, name) for name in sorted(patterns.names()))


def _modelopt_format(algo, group, what: str, source: str) -> ModuleFormat:
    kind = _MODELOPT_ALGOS.get(str(algo).upper())
    if kind is None:
        raise QuantConfigError(f"{source}: {what} uses quant_algo {algo!r}; supported: "
                               f"{', '.join(_MODELOPT_ALGOS)}")
    if kind == NVFP4 and _int(group, f"{what} group_size", source) != NVFP4_GROUP:
        raise QuantConfigError(f"{source}: {what} has group_size {group}; NVFP4 uses "
                               f"{NVFP4_GROUP}")
    return ModuleFormat(kind, MODELOPT)


def _modelopt(q: dict, source: str) -> QuantScheme:
    algo = str(q.get("quant_algo", "")).upper()
    group = q.get("group_size", NVFP4_GROUP)
    key = "exclude_modules" if "exclude_modules" in q else "ignore"
    exclude = Patterns.of(_names(q.get(key) or [], "exclude_modules", source), MODELOPT_STYLE)
    entries = _entries(key, exclude)
    if algo != "MIXED_PRECISION":
        if not algo:
            raise QuantConfigError(f"{source}: ModelOpt config without quant_algo")
        rules = (FormatRule(None, _modelopt_format(algo, group, "the checkpoint", source)),)
        return QuantScheme(MODELOPT, source, rules, exclude, entries)
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise QuantConfigError(f"{source}: MIXED_PRECISION needs a quantized_layers object")
    by_format: dict[ModuleFormat, list[str]] = {}
    for module, layer in layers.items():
        if not isinstance(layer, dict):
            raise QuantConfigError(f"{source}: quantized_layers[{module!r}] is not an object")
        fmt = _modelopt_format(layer.get("quant_algo"), layer.get("group_size", group),
                               f"module {module!r}", source)
        by_format.setdefault(fmt, []).append(module)
    rules = tuple(FormatRule(Patterns.of(m, MODELOPT_STYLE), f) for f, m in by_format.items())
    named = sum((_entries("quantized_layers", r.patterns) for r in rules), ())
    return QuantScheme(MODELOPT, source, rules, exclude, entries + named)


def _ct_format(name: str, group: dict, source: str) -> ModuleFormat:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise QuantConfigError(f"{source}: compressed-tensors group {name!r} has no weights")
    bits, kind, strategy = (weights.get("num_bits"), weights.get("type"),
                            weights.get("strategy"))
    if (bits, kind, strategy) == (4, "float", "tensor_group"):
        size = _int(weights.get("group_size") or NVFP4_GROUP, "group_size", source)
        if size == NVFP4_GROUP:
            return ModuleFormat(NVFP4, COMPRESSED_TENSORS)
    static = _ct_static_inputs(name, group, source)
    if (bits, kind, strategy) == (8, "float", "tensor"):
        return ModuleFormat(FP8_TENSOR, COMPRESSED_TENSORS, static_inputs=static)
    if (bits, kind, strategy) == (8, "float", "block"):
        return ModuleFormat(FP8_BLOCK, COMPRESSED_TENSORS,
                            _block(weights.get("block_structure"), "block_structure", source),
                            static)
    raise QuantConfigError(f"{source}: compressed-tensors group {name!r} (weights "
                           f"{weights}) is neither NVFP4 (4-bit float tensor_group of 16) nor "
                           "FP8 (8-bit float, tensor or block)")


def _ct_static_inputs(name: str, group: dict, source: str) -> bool:
    """Whether a compressed-tensors group quantizes its inputs statically (`dynamic: false`),
    which stores one calibrated `input_scale` per module; dynamic or absent stores none."""
    inputs = group.get("input_activations")
    if inputs is None:
        return False
    if not isinstance(inputs, dict):
        raise QuantConfigError(f"{source}: compressed-tensors group {name!r} "
                               f"input_activations is not an object: {inputs!r}")
    return inputs.get("dynamic", False) is False


def _compressed_tensors(q: dict, source: str) -> QuantScheme:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError(f"{source}: compressed-tensors config without config_groups")
    exclude = Patterns.of(_names(q.get("ignore") or [], "ignore", source), CT_STYLE)
    exact, regex, linear = [], [], []
    for name, group in groups.items():
        fmt = _ct_format(name, group, source)
        targets = _names(group.get("targets") or ["Linear"], f"{name} targets", source)
        # compressed-tensors prefers a module's exact name over a regex over its class.
        for target in targets:
            if target == "Linear":
                linear.append(FormatRule(None, fmt))
            else:
                bucket = regex if target.startswith("re:") else exact
                bucket.append(FormatRule(Patterns.of([target], CT_STYLE), fmt))
    rules = tuple(exact + regex + linear)
    named = tuple(("targets", t) for r in exact for t in r.patterns.names())
    return QuantScheme(COMPRESSED_TENSORS, source, rules, exclude,
                       _entries("ignore", exclude) + named)


def _block(value, key: str, source: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise QuantConfigError(f"{source}: {key} must be [rows, inputs], got {value!r}")
    return _int(value[0], key, source), _int(value[1], key, source)


def _hf_fp8(q: dict, source: str) -> QuantScheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"{source}: fp8 fmt {fmt!r} is not supported (only e4m3)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantConfigError(f"{source}: activation_scheme {scheme!r} is neither dynamic "
                               "nor static")
    if q.get("weight_block_size") is None:
        raise QuantConfigError(f"{source}: fp8 without weight_block_size (per-tensor HF fp8) "
                               "is not supported yet")
    block = _block(q["weight_block_size"], "weight_block_size", source)
    exclude = Patterns.of(_names(q.get("modules_to_not_convert") or [],
                                 "modules_to_not_convert", source), HF_STYLE)
    rules = (FormatRule(None, ModuleFormat(FP8_BLOCK, HF_FP8, block, scheme == "static")),)
    return QuantScheme(HF_FP8, source, rules, exclude,
                       _entries("modules_to_not_convert", exclude))
