"""Turning a `--model` argument into a checkpoint folder."""

from __future__ import annotations

from pathlib import Path


class ModelNotFound(ValueError):
    """The model argument names no local folder and no cached hub snapshot."""


def resolve_model(model: str | Path) -> Path:
    """A local checkpoint folder, or a hub id (`org/name`) found in the local HF cache."""
    if not str(model).strip():
        raise ModelNotFound("empty model name (an unset variable?)")
    path = Path(model)
    if path.is_dir():
        return path
    text = str(model)
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if looks_like_hub_id and not path.parent.is_dir():
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(text, local_files_only=True))
        except Exception as e:  # the hub raises several types for "not cached"
            raise ModelNotFound(f"{text}: not a local folder and not in the local Hugging Face "
                                f"cache ({type(e).__name__})") from e
    raise ModelNotFound(f"{text}: no such checkpoint folder")
