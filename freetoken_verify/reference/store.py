"""A saved HF reference for one model (`--save-reference DIR`, reused with `--reference DIR`):
on a large checkpoint, HF's float32 run (and its low-precision baseline) costs more than the
engine's, so it is computed once and kept.

DIR holds `reference.safetensors` (per prompt: the ids, prefill logits at every position, the
greedy continuation's ids and logits), `bisect.safetensors` (HF's output of every module on the
bisect prompt and HF's first greedy token, in float32 and at the engine's low precision: the
bisect check reads them instead of running HF) and `reference.json`: the prompts, the
continuation length, the truncation depth, the seed, the reference dtype (float32) and the
engine dtypes a baseline was measured for, the bisect prompt and token, the versions of torch
and transformers, the model's source, a fingerprint of every `*.safetensors` file of the
checkpoint (for a quantized checkpoint, its quantized files) and, for a quantized checkpoint,
the dequantized twin HF ran on (`twin`: key, path, dtype, depth;
`freetoken_verify.reference.twin`). Reuse refuses, before any rank starts, a checkpoint whose
fingerprints differ (naming the file), and prompts, continuation length, depth or dtype the
store does not cover.

Fingerprints: files up to `FULL_HASH_LIMIT` bytes get a full sha256 (the bundled cases' code);
larger files get `sampled-sha256`, a sha256 of the file size, the whole safetensors header
(tensor names, dtypes, shapes, offsets) and `SAMPLES` blocks of `SAMPLE_BYTES` spread evenly
over the data, so that checking a multi-hundred-GB checkpoint takes seconds. It catches a
re-saved, re-quantized, truncated, re-sharded or re-laid-out checkpoint; a change confined to
bytes between the samples is not caught."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.engine.core import resolve_dtype
from freetoken.loading.files import CheckpointError, read_header
from freetoken_verify.cases import bisect_file
from freetoken_verify.cases.bisect_file import BISECT
from freetoken_verify.cases.catalogue import sha256_file
from freetoken_verify.compare import LogitMetrics
from freetoken_verify.reference.data import BisectActivations, Reference

FORMAT = 1
META = "reference.json"
TENSORS = "reference.safetensors"
FULL_HASH_LIMIT = 1 << 30
SAMPLES = 256
SAMPLE_BYTES = 1 << 16


def umask_mode(path: Path) -> None:
    """Give `path` the mode a plain open() would (0666 less the umask): safetensors writes
    0600, so a saved reference shared on a team's disk was readable by its writer only."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


class StoreError(ValueError):
    """A saved reference that does not fit the run (one line naming the file or field)."""


def fingerprint(path: Path, method: str | None = None) -> dict:
    """{"size", "method", "digest"} of one weights file; `method` defaults by size."""

    size = path.stat().st_size
    method = method or ("sha256" if size <= FULL_HASH_LIMIT else "sampled-sha256")
    digest = sha256_file(path) if method == "sha256" else _sampled_sha256(path, size)
    return {"size": size, "method": method, "digest": digest}


def _sampled_sha256(path: Path, size: int) -> str:
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(f.read(min(header_len, size)))
        start = 8 + header_len
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weights_fingerprints(folder: Path) -> dict[str, dict]:
    """Fingerprint of every `*.safetensors` file of a checkpoint folder, by file name."""
    return {p.name: fingerprint(p) for p in sorted(folder.glob("*.safetensors"))}


_KEYS = ("prompts", "num_greedy", "num_layers", "baselines", "weights")


def read_meta(folder: str | Path) -> dict:
    """The store's `reference.json`; StoreError when DIR is no (complete) saved reference."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StoreError(f"--reference: {str(folder)!r} is neither auto, golden, hf nor a "
                         "folder written by --save-reference")
    path = folder / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"--reference: {path} is not a saved reference "
                         f"({type(e).__name__}); write one with --save-reference") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise StoreError(f"--reference: {path} has format {found!r}, expected {FORMAT}; "
                         "save the reference again")
    missing = [k for k in _KEYS if k not in meta]
    if missing or not (folder / TENSORS).is_file():
        what = f"no {missing[0]!r}" if missing else f"no {TENSORS} beside it"
        raise StoreError(f"--reference: {path} has {what}; save the reference again")
    _check_fields(meta, path)
    _check_tensors(folder / TENSORS, meta)
    if "bisect" in meta:
        _check_bisect(folder, meta["bisect"], path)
    return meta


def _is_count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_fields(meta: dict, path: Path) -> None:
    """Every field the runs read has the type they read it as (an edited `reference.json`
    fails here, naming the field, instead of as a TypeError in a check or as an engine
    mismatch)."""
    prompts, weights, baselines = meta["prompts"], meta["weights"], meta["baselines"]
    checks = {
        "prompts": (isinstance(prompts, list) and prompts != [] and all(
            isinstance(p, list) and p and all(_is_count(t) for t in p) for p in prompts),
            "a non-empty list of token-id lists"),
        "num_greedy": (_is_count(meta["num_greedy"]), "a count"),
        "num_layers": (meta["num_layers"] is None or _is_count(meta["num_layers"], 1),
                       "null or a positive count"),
        "baselines": (isinstance(baselines, dict) and all(
            rows is None or (isinstance(rows, list) and all(isinstance(r, dict) for r in rows))
            for rows in baselines.values()), "an object of per-dtype lists of objects"),
        "weights": (isinstance(weights, dict) and all(
            isinstance(w, dict) and _is_count(w.get("size")) and isinstance(w.get("method"), str)
            and isinstance(w.get("digest"), str) for w in weights.values()),
            "an object of {size, method, digest} per weights file"),
    }
    for field, (ok, want) in checks.items():
        if not ok:
            raise StoreError(f"--reference: {path}: {field!r} is not {want}; save the "
                             "reference again")


def _check_tensors(path: Path, meta: dict) -> None:
    """reference.safetensors is whole (every entry inside the file) and holds, per prompt, the
    prompt, its prefill logits (a row per prompt token), and `num_greedy` greedy ids and
    logits rows: a truncated file or an edited `num_greedy` is named here, before any rank
    starts."""
    try:
        entries = read_header(path).entries
    except (OSError, CheckpointError) as e:
        raise StoreError(f"--reference: {path} is unreadable ({e}); save the reference "
                         "again") from None
    for i, prompt in enumerate(meta["prompts"]):
        rows = {f"prompt_{i}": len(prompt), f"prefill_logits_{i}": len(prompt),
                f"greedy_ids_{i}": meta["num_greedy"], f"greedy_logits_{i}": meta["num_greedy"]}
        for name, want in rows.items():
            shape = entries.get(name, {}).get("shape")
            if not shape or shape[0] != want:
                found = "missing" if shape is None else f"shape {shape}"
                raise StoreError(f"--reference: {path}: tensor {name!r} is {found}, expected "
                                 f"{want} rows from {META}; save the reference again")


def _check_bisect(folder: Path, info, path: Path) -> None:
    """The bisect entry of `reference.json` is well formed and its tensors file readable."""

    ok = (isinstance(info, dict) and isinstance(info.get("prompt"), list)
          and all(isinstance(t, int) for t in info["prompt"]) and info["prompt"]
          and isinstance(info.get("token"), int) and isinstance(info.get("dtypes"), list)
          and "float32" in info["dtypes"])
    if not ok:
        raise StoreError(f"--reference: {path} has a malformed 'bisect' entry; save the "
                         "reference again")
    try:
        read_header(folder / BISECT)
    except (OSError, CheckpointError) as e:
        raise StoreError(f"--reference: {folder / BISECT} is missing or unreadable "
                         f"({type(e).__name__}); save the reference again") from None


def check_writable(folder: str | Path) -> None:
    """DIR can receive a saved reference: new, empty, or an earlier saved reference."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise StoreError(f"--save-reference: {path} is not a directory")
    if path.is_dir():
        others = sorted(p.name for p in path.iterdir() if p.name not in (META, TENSORS, BISECT))
        if others:
            raise StoreError(f"--save-reference: {path} holds other files ({others[0]}, ...); "
                             "choose an empty or new folder")


def check_store(folder: str | Path, case, options, requested: tuple | None, dtype) -> dict:
    """The saved reference in `folder` covers this run of `case`: same weights (fingerprints
    recomputed by each file's stored method), depth, prompts and continuation length when the
    user asked for some (`requested`: (prompts, num_new) or None), and a baseline for a
    low-precision engine `dtype`. Returns the meta; StoreError names what differs."""
    meta = read_meta(folder)
    where = Path(folder) / META
    stored = meta.get("weights", {})
    actual = sorted(p.name for p in case.folder.glob("*.safetensors"))
    for name in sorted(set(stored) - set(actual)):
        raise StoreError(f"{case.name}: {case.folder / name} is missing but {where} recorded it")
    for name in sorted(set(actual) - set(stored)):
        raise StoreError(f"{case.name}: {case.folder / name} was not in the checkpoint {where} "
                         "was saved from")
    for name in actual:
        path, saved = case.folder / name, stored[name]
        if path.stat().st_size != saved["size"] or \
                fingerprint(path, saved["method"])["digest"] != saved["digest"]:
            raise StoreError(f"{case.name}: {path} differs from the checkpoint {where} was "
                             f"saved from ({saved['method']}); save the reference again")
    if meta["num_layers"] != options.num_layers:
        raise StoreError(f"{case.name}: {where} was saved at {_depth(meta['num_layers'])}, "
                         f"this run uses {_depth(options.num_layers)}")
    if requested is not None:
        prompts, num_new = requested
        if prompts is not None and prompts != meta["prompts"]:
            raise StoreError(f"{case.name}: the requested prompts differ from those saved in "
                             f"{where}; drop --prompts-file/--seed or save again")
        if num_new is not None and num_new != meta["num_greedy"]:
            raise StoreError(f"{case.name}: --max-new-tokens {num_new} differs from the "
                             f"{meta['num_greedy']} saved in {where}")
    name = str(dtype).removeprefix("torch.")
    if dtype != torch.float32 and meta["baselines"].get(name) is None:
        saved = ", ".join(sorted(meta["baselines"])) or "none"
        raise StoreError(f"{case.name}: {where} has no {name} baseline (saved for: {saved}); "
                         f"save it with --dtype {name}")
    return meta


def _depth(num_layers: int | None) -> str:
    return "full depth" if num_layers is None else f"--num-layers {num_layers}"


def save_reference(ref: Reference, case, options, device, folder: str | Path) -> Path:
    """Write the store of `ref` (HF's live reference on `case`, computed on `device`) into
    `folder`."""
    # transformers costs seconds to import; only writing cases and HF references need it.
    import transformers

    folder = Path(folder)
    dtype = str(resolve_dtype(options.dtype, case.model_config)).removeprefix("torch.")
    tensors = {}
    for i, prompt in enumerate(ref.prompts):
        tensors.update({f"prompt_{i}": torch.tensor(prompt),
                        f"prefill_logits_{i}": ref.prefill_logits[i],
                        f"greedy_ids_{i}": torch.tensor(ref.greedy_ids[i]),
                        f"greedy_logits_{i}": ref.greedy_logits[i]})
    meta = {
        "format": FORMAT, "model": case.name, "source": case.source, "dtype": "float32",
        "baselines": {dtype: [b.as_dict() for b in ref.baseline]} if ref.baseline else {},
        "prompts": ref.prompts, "num_greedy": len(ref.greedy_ids[0]) if ref.greedy_ids else 0,
        "num_layers": options.num_layers, "seed": options.seed,
        "prompts_file": Path(options.prompts_file).name if options.prompts_file else None,
        "device": str(device), "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "weights": weights_fingerprints(case.folder),
        "twin": ref.twin,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, folder / TENSORS)
    umask_mode(folder / TENSORS)
    (folder / BISECT).unlink(missing_ok=True)
    if ref.bisect is not None:
        meta["bisect"] = write_bisect(folder, ref.bisect)
    (folder / META).write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def write_bisect(folder: Path, bisect: BisectActivations) -> dict:
    """HF's bisect activations into `folder` (`bisect_file.save`), with the user's umask;
    returns the metadata entry that `read_bisect` takes back."""
    info = bisect_file.save(folder, bisect.prompt, bisect.token, bisect.by_dtype)
    umask_mode(folder / BISECT)
    return info


def stored_bisect(folder: str | Path) -> BisectActivations | None:
    """HF's saved activations for the bisect check, or None where the store has none (saved
    before they were kept: bisect then runs HF)."""
    return read_bisect(folder, read_meta(folder).get("bisect"))


def read_bisect(folder: str | Path, info) -> BisectActivations | None:
    """The activations kept in `folder` with metadata entry `info` (a saved reference's
    reference.json, a bundled case's meta.json); None where there are none."""
    found = bisect_file.load(folder, info)
    return None if found is None else BisectActivations(*found)


def stored_reference(folder: str | Path, case, options) -> Reference:
    """The saved reference, with its baseline at the engine's dtype (per prompt, measured by
    HF live on the saving run's device)."""

    meta = read_meta(folder)
    ref = Reference.from_tensors("stored", meta["prompts"], load_file(Path(folder) / TENSORS))
    ref.twin = meta.get("twin")
    dtype = resolve_dtype(options.dtype, case.model_config)
    rows = meta["baselines"].get(str(dtype).removeprefix("torch."))
    if dtype != torch.float32 and rows:
        ref.baseline = [LogitMetrics(**row) for row in rows]
    return ref
