"""The live reference of a quantized checkpoint: HF on its dequantized twin
(`freetoken.formats.quant.twin`: every quantized weight dequantized in float64 from the format
definition, rounded once to float32), built once per checkpoint into a cache and reused.
HF's own loaders are not a reference for these formats (wrong on partial FP8 blocks, the
compressed-tensors NVFP4 experts times their global scale, ModelOpt not read).

The cache is `$FREETOKEN_TWIN_CACHE`, else `~/.cache/freetoken/twins`, one folder per twin
named by its key: a digest of the checkpoint's weight fingerprints
(`freetoken_verify.reference.store.weights_fingerprints`), its parsed quantization scheme, its
config.json and generation_config.json, the twin's dtype, depth and format version. An edited
checkpoint gets a new twin; an unchanged one reuses its twin. A twin is written under
`.building-<key>-<pid>-*` in the cache and renamed into place, so a run that dies leaves no
half twin (the next build of that key removes the leftover once its process is gone). Each
twin holds `twin.json`: its key, what it was built from, and the size of each file.

A twin costs 4 bytes per quantized parameter plus the checkpoint's unquantized tensors as
stored (a 35B-A3B checkpoint: about 140 GB); a run truncated with `--num-layers K` builds a
twin of the first K layers only, and uses a full-depth twin where one is cached. A build is
refused before it starts, naming the folder and the bytes, when the cache lacks the space."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.formats.quant import QuantConfigError
from freetoken.formats.quant.folder import FolderError
from freetoken.formats.quant.twin import twin_bytes, write_dequantized_twin
from freetoken.loading.checkpoint import layer_index
from freetoken_verify.reference.store import weights_fingerprints

CACHE_ENV = "FREETOKEN_TWIN_CACHE"
TWIN_FORMAT = 1
"""Bumped whenever the builder would write different bytes: old twins are then not reused."""
TWIN_DTYPE = torch.float32
_DTYPE_NAME = str(TWIN_DTYPE).removeprefix("torch.")
MANIFEST = "twin.json"
_BUILDING = ".building-"
_CONFIGS = ("config.json", "generation_config.json", "hf_quant_config.json")


class TwinError(ValueError):
    """A dequantized twin that cannot be built (no space, an unwritable cache, a module the
    format definition refuses); the message names the folder, bytes or module."""


@dataclass(frozen=True)
class Twin:
    """A dequantized twin in the cache: its `key`, `folder`, the depth it holds
    (`num_layers`, None for every layer) and whether it was there before this process
    asked for it (`reused`)."""

    key: str
    folder: Path
    num_layers: int | None
    reused: bool = True

    def entry(self) -> dict:
        """What a report or saved reference records of it."""
        return {"key": self.key, "path": str(self.folder), "dtype": _DTYPE_NAME,
                "num_layers": self.num_layers}


def cache_root() -> Path:
    """Where twins are kept: `$FREETOKEN_TWIN_CACHE`, else `~/.cache/freetoken/twins`."""
    root = os.environ.get(CACHE_ENV, "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "freetoken" / "twins"


def is_quantized(case) -> bool:
    return case.model_config.quantization is not None


def scheme_doc(scheme) -> dict:
    """The parsed scheme as canonical JSON data (sets sorted; the config's path left out, so
    the same checkpoint in another folder has the same twin)."""

    def patterns(p):
        return None if p is None else {"style": p.style, "exact": sorted(p.exact),
                                       "patterns": list(p.patterns)}

    return {"producer": scheme.producer, "exclude": patterns(scheme.exclude),
            "rules": [{"patterns": patterns(r.patterns), "kind": r.format.kind,
                       "format_producer": r.format.producer,
                       "block": list(r.format.block) if r.format.block else None}
                      for r in scheme.rules]}


@functools.lru_cache(maxsize=32)
def _fingerprints(folder: Path, stamp: tuple) -> dict:
    """weights_fingerprints once per version of the files (`stamp`: names, sizes, mtimes): a
    run asks for a twin's key several times, and hashing a 35B checkpoint takes seconds."""
    return weights_fingerprints(folder)


def _stamp(folder: Path) -> tuple:
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                 for p in sorted(folder.glob("*.safetensors")))


def key_doc(case, num_layers: int | None) -> dict:
    """Everything the twin of `case` at `num_layers` depends on."""
    configs = {name: hashlib.sha256((case.folder / name).read_bytes()).hexdigest()
               for name in _CONFIGS if (case.folder / name).is_file()}
    return {"format": TWIN_FORMAT, "dtype": _DTYPE_NAME, "num_layers": num_layers,
            "weights": _fingerprints(case.folder, _stamp(case.folder)),
            "scheme": scheme_doc(case.model_config.quantization), "configs": configs}


def twin_key(case, num_layers: int | None) -> str:
    doc = json.dumps(key_doc(case, num_layers), sort_keys=True).encode()
    return hashlib.sha256(doc).hexdigest()[:32]


def _valid(folder: Path, key: str) -> bool:
    """A complete twin of `key`: its manifest names it and every file has its size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest["key"] == key and all(
            (folder / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def cached_twin(case, num_layers: int | None) -> Twin | None:
    """The cached twin serving `case` at `num_layers`: a full-depth one, else one of exactly
    that depth; None when neither is in the cache."""
    for depth in dict.fromkeys((None, num_layers)):
        key = twin_key(case, depth)
        if _valid(cache_root() / key, key):
            return Twin(key, cache_root() / key, depth)
    return None


def _keep(num_layers: int | None):
    if num_layers is None:
        return None
    return lambda name: (layer := layer_index(name)) is None or layer < num_layers


def _writable_base(root: Path) -> Path:
    """The nearest existing folder at or above `root`, checked writable with a real file."""
    base = root
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise TwinError(f"twin cache {root}: {base} is not a directory (set {CACHE_ENV})")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise TwinError(f"twin cache {root}: cannot write under {base} ({e.strerror}); set "
                        f"{CACHE_ENV} to a writable folder") from None
    return base


def free_bytes(folder: Path) -> int:
    """The bytes free on `folder`'s file system for this user."""
    return shutil.disk_usage(folder).free


def check_twin_space(case, num_layers: int | None) -> None:
    """Nothing when the twin is cached; else TwinError unless the cache can receive it:
    writable, with at least the twin's bytes free (named, with the folder)."""
    if cached_twin(case, num_layers) is not None:
        return
    root = cache_root()
    base = _writable_base(root)
    try:
        need = twin_bytes(case.folder, case.model_config.quantization, TWIN_DTYPE,
                          _keep(num_layers))
    except (FolderError, OSError) as e:
        raise TwinError(f"{case.name}: cannot size its dequantized twin ({e})") from None
    free = free_bytes(base)
    if need > free:
        raise TwinError(f"{case.name}: its dequantized twin (HF's reference for a quantized "
                        f"checkpoint) needs {need} bytes ({need / 2**30:.2f} GiB) under "
                        f"{root}, which has {free} bytes ({free / 2**30:.2f} GiB) free; free "
                        f"space there or set {CACHE_ENV} to a folder on a larger disk")


def twin_for(case, num_layers: int | None) -> Twin:
    """The dequantized twin of quantized `case` at `num_layers`, from the cache or built
    into it now (checked for space first). TwinError naming what stopped the build."""
    found = cached_twin(case, num_layers)
    if found is not None:
        return found
    check_twin_space(case, num_layers)
    key = twin_key(case, num_layers)
    root = cache_root()
    final = root / key
    if final.exists():  # a twin of this key that is not whole: an interrupted copy, an edit
        shutil.rmtree(final)
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(root, key)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_BUILDING}{key}-{os.getpid()}-", dir=root))
    try:
        _write(case, num_layers, key, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _valid(final, key):
                raise
            shutil.rmtree(tmp)  # another run built the same twin first
    except (QuantConfigError, FolderError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TwinError(f"{case.name}: cannot build its dequantized twin in {root} "
                        f"({type(e).__name__}: {e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Twin(key, final, num_layers, reused=False)


def _write(case, num_layers: int | None, key: str, folder: Path) -> None:
    write_dequantized_twin(case.folder, folder, case.model_config.quantization, TWIN_DTYPE,
                           keep=_keep(num_layers))
    if num_layers is not None:
        _truncate_config(folder / "config.json", num_layers)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    manifest = {"key": key, "source": str(case.folder), "model": case.name,
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **key_doc(case, num_layers), "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    _share(folder)


def _truncate_config(path: Path, num_layers: int) -> None:
    """A truncated twin's config.json says its depth, so that loading it by hand builds no
    layer it has no weights for (HF would initialise those at random)."""
    config = json.loads(path.read_text())
    for text in (config, config.get("text_config")):
        if isinstance(text, dict) and "num_hidden_layers" in text:
            text["num_hidden_layers"] = num_layers
            if isinstance(text.get("layer_types"), list):
                text["layer_types"] = text["layer_types"][:num_layers]
    path.write_text(json.dumps(config, indent=2) + "\n")


def _share(folder: Path) -> None:
    """The modes a plain mkdir and open would give (mkdtemp makes the folder private; a cache
    shared by the users of one machine must be readable by them as the umask allows)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _remove_abandoned(root: Path, key: str) -> None:
    """Remove the half-written twins of `key` whose building process is gone."""
    for path in root.glob(f"{_BUILDING}{key}-*"):
        try:
            pid = int(path.name[len(_BUILDING) + len(key) + 1:].split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: an existence probe, nothing is delivered
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hf_folder(case, num_layers: int | None) -> Path:
    """The folder HF loads as `case`'s reference: the checkpoint itself, or for a quantized
    checkpoint its dequantized twin (`twin_for`)."""
    return twin_for(case, num_layers).folder if is_quantized(case) else case.folder


def planned_twin(case, num_layers: int | None) -> dict | None:
    """For a report: the twin a quantized `case` is referenced on (key, path, dtype, depth,
    and whether it is cached yet), computed without building it; None for an unquantized
    one."""
    if not is_quantized(case):
        return None
    found = cached_twin(case, num_layers)
    twin = found or Twin(twin_key(case, num_layers), cache_root() / twin_key(case, num_layers),
                         num_layers, reused=False)
    return {**twin.entry(), "cached": found is not None}
