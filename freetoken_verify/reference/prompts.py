"""The prompts the golden check's reference covers: seeded random token ids (the default), or
the user's own from `--prompts-file`, and the greedy continuation length (`--max-new-tokens`).

A prompts file ending in `.json` holds a list of lists of token ids; any other file is text,
one prompt per non-empty line, tokenized with the checkpoint's own tokenizer (special tokens
added as the tokenizer does by default, e.g. a BOS). Every problem is a `PromptError` whose
message names the file, and the prompt and position where it applies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SEED = 0


class PromptError(ValueError):
    """A prompts file that cannot serve as the reference's prompts for a model."""


@dataclass(frozen=True)
class PromptsFile:
    """A parsed `--prompts-file`: token ids (JSON) or lines of text, not yet tokenized."""

    path: Path
    ids: tuple[tuple[int, ...], ...] | None = None
    texts: tuple[str, ...] | None = None


def read_prompts_file(path: str | Path) -> PromptsFile:
    """Parse `path` (JSON lists of ids when it ends in `.json`, else one text prompt a line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"--prompts-file: cannot read {path} ({e})") from None
    if path.suffix.lower() != ".json":
        lines = tuple(line for line in text.splitlines() if line.strip())
        if not lines:
            raise PromptError(f"--prompts-file: {path} has no non-empty line")
        return PromptsFile(path, texts=lines)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PromptError(f"--prompts-file: {path} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise PromptError(f"--prompts-file: {path} must hold a non-empty list of lists of "
                          "token ids")
    prompts = []
    for i, prompt in enumerate(data):
        if not isinstance(prompt, list) or not prompt:
            raise PromptError(f"--prompts-file: {path}: prompt {i} is not a non-empty list of "
                              "token ids")
        for pos, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise PromptError(f"--prompts-file: {path}: prompt {i} position {pos}: {tok!r} "
                                  "is not a token id (a non-negative integer)")
        prompts.append(tuple(prompt))
    return PromptsFile(path, ids=tuple(prompts))


def tokenize_prompts(prompts: PromptsFile, case) -> list[list[int]]:
    """The prompts as token ids for `case`, each id checked against its vocab size."""
    vocab = case.model_config.vocab_size
    if prompts.ids is not None:
        out = [list(p) for p in prompts.ids]
    else:
        out = [_encode(tokenizer_of(case, prompts.path), line, prompts.path, i)
               for i, line in enumerate(prompts.texts)]
    for i, prompt in enumerate(out):
        for pos, tok in enumerate(prompt):
            if tok >= vocab:
                raise PromptError(f"--prompts-file: {prompts.path}: prompt {i} position {pos}: "
                                  f"token id {tok} is outside {case.name}'s vocab "
                                  f"(vocab_size={vocab})")
    return out


def tokenizer_of(case, path: Path):
    """`case`'s tokenizer; a checkpoint without one cannot take text prompts."""
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(case.folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PromptError(f"--prompts-file: {path} holds text, but {case.name} has no usable "
                          f"tokenizer ({type(e).__name__}); give token ids in a .json file "
                          "instead") from None


def _encode(tokenizer, line: str, path: Path, index: int) -> list[int]:
    ids = list(tokenizer(line)["input_ids"])
    if not ids:
        raise PromptError(f"--prompts-file: {path}: prompt {index} tokenizes to no tokens")
    return ids


def check_lengths(prompts: list[list[int]], num_new: int, case) -> None:
    """Every prompt plus its continuation fits the model's positions."""
    limit = case.model_config.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) + num_new > limit:
            raise PromptError(f"{case.name}: prompt {i} ({len(prompt)} tokens) plus "
                              f"{num_new} new tokens exceeds max_position_embeddings={limit}")
