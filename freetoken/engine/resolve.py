"""Turning a `--model` argument into a checkpoint folder: a local folder, or a Hugging Face hub
id `Org/Name` or `Org/Name@revision` (a branch, tag or commit hash).

Hub ids resolve from the local Hugging Face cache (`HF_HUB_CACHE`, else the library's default)
and never touch the network unless the caller asks for a download (`freetoken-verify
--download`); with `HF_HUB_OFFLINE` set, a download is refused rather than silently skipped.
Where a checkpoint came from (`source`: path, and for hub ids the id, the revision asked for and
the snapshot commit it resolved to) is returned for reports."""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

NAMED_CHECKPOINTS = "freetoken.checkpoints"
"""Entry-point group of checkpoints known by name: each entry is a callable taking a name and
returning its folder, or None. The harness registers its bundled cases (`tiny-llama`, ...),
so every command that takes `--model` takes their names without the engine importing it."""


class ModelNotFound(ValueError):
    """The model argument names no local folder and no cached hub snapshot."""


def resolve_model(model: str | Path) -> Path:
    """A local checkpoint folder, or a hub id (`Org/Name[@revision]`) from the local cache."""
    return resolve_checkpoint(str(model))[0]


DOWNLOADED = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt")
"""What a download fetches: configs, weights and tokenizer files, never other weight formats
(`*.bin`, `*.pth`, GGUF) a repository may also carry."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(arg: str) -> bool:
    """`Org/Name` or `Org/Name@revision`, not a relative or absolute path."""
    return bool(_HUB_ID.match(arg)) and not arg.startswith((".", "/", "~"))


def split_revision(arg: str) -> tuple[str, str | None]:
    """(`Org/Name`, revision or None) of a hub id."""
    repo, _, revision = arg.partition("@")
    return repo, revision or None


def resolve_checkpoint(arg: str, download: bool = False, hint: str = "") -> tuple[Path, dict]:
    """(folder, source) for a local folder or a hub id; ModelNotFound with one line if neither
    (`hint` ends the line when a hub id is not cached: how the caller's user fetches it).
    A folder wins over a hub id of the same spelling, as on the command line everywhere."""
    if not arg.strip():
        raise ModelNotFound("empty model name (an unset variable?)")
    path = Path(arg)
    if path.is_dir():
        return path, {"path": str(path.resolve())}
    named = named_checkpoint(arg)
    if named is not None:
        return named, {"path": str(named.resolve())}
    if is_hub_id(arg) and not Path(split_revision(arg)[0]).parent.is_dir():
        return resolve_hub_id(arg, download, hint)
    raise ModelNotFound(f"{arg}: no such checkpoint folder")


def named_checkpoint(name: str) -> Path | None:
    """The folder a `freetoken.checkpoints` entry point gives `name`, or None (also when an
    entry cannot be loaded: a broken plugin must not hide a folder or hub id)."""
    for entry in metadata.entry_points(group=NAMED_CHECKPOINTS):
        try:
            folder = entry.load()(name)
        except Exception:  # noqa: BLE001 - a third-party plugin's failure is not the user's
            continue
        if folder is not None:
            return Path(folder)
    return None


def resolve_hub_id(arg: str, download: bool = False, hint: str = "") -> tuple[Path, dict]:
    """The snapshot folder of hub id `arg` (`Org/Name[@revision]`) from the local cache, or
    downloaded when `download` is set; its source records the snapshot commit hash."""
    from huggingface_hub import snapshot_download

    repo, revision = split_revision(arg)
    if download and _offline():
        raise ModelNotFound(f"{arg}: --download given but HF_HUB_OFFLINE is set; unset it to "
                            "allow the download")
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        if download:
            _probe_hub(repo, revision)
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                        local_files_only=not download,
                                        allow_patterns=list(DOWNLOADED),
                                        etag_timeout=HUB_TIMEOUT))
    except Exception as e:  # the hub raises several types for "not cached" / "not found"
        at = f" at revision {revision!r}" if revision else ""
        if download and "timeout" in type(e).__name__.lower():
            raise ModelNotFound(f"{arg}: download failed{at}: {_endpoint()} did not answer "
                                f"within {HUB_TIMEOUT:g} s ({type(e).__name__})") from None
        if download:
            raise ModelNotFound(f"{arg}: download failed{at} ({type(e).__name__}: "
                                f"{_first_line(e)})") from None
        raise ModelNotFound(f"{arg}: not a local folder and not in the local Hugging Face "
                            f"cache{at} ({type(e).__name__}){hint}") from None
    return folder, {"path": str(folder), "hub_id": repo, "revision": revision or "main",
                    "snapshot": folder.name}


# Seconds the hub may take to connect or to send the next bytes of an answer. The hub client
# asks for the repository's metadata with no timeout at all (an endpoint that accepts and never
# answers hung `--download` for good); its file downloads have their own (HF_HUB_DOWNLOAD_TIMEOUT).
HUB_TIMEOUT = 30.0


def _probe_hub(repo: str, revision: str | None) -> None:
    """The repository's metadata asked for once with `HUB_TIMEOUT`, before the download asks
    again without one: an endpoint that does not answer fails here, named."""
    from huggingface_hub import HfApi

    HfApi(endpoint=_endpoint()).repo_info(repo, revision=revision, timeout=HUB_TIMEOUT)


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
