"""`freetoken plan`: a checkpoint's shard plan at one TP size, tensor by tensor, in words."""

from __future__ import annotations

import re
from collections.abc import Callable

from freetoken.engine.resolve import resolve_model
from freetoken.formats.shard import ShardError
from freetoken.loading.checkpoint import CheckpointReader
from freetoken.loading.describe import describe_tensor
from freetoken.models.registry import check_tp, load_config, shard_plan


def print_plan(model: str, tp: int, pattern: str | None, echo: Callable[[str], None]) -> int:
    """Print the layout of every checkpoint tensor of `model` (whose name matches `pattern`)
    at `tp` ranks through `echo`; returns the exit status: 0, or 1 when a tensor matches no
    rule (or two) or its rule cannot split it (each such tensor printed with the reason).
    ValueError (bad model, TP size or regex) for the caller to report."""
    try:
        wanted = re.compile(pattern or "")
    except re.error as e:
        raise ValueError(f"--tensor {pattern!r} is not a regex ({e})") from None
    folder = resolve_model(model)
    cfg = load_config(folder)
    check_tp(cfg, tp)
    plan = shard_plan(cfg, tp)
    reader = CheckpointReader(folder)
    names = sorted(n for n in reader.names() if wanted.search(n))
    if not names:
        raise ValueError(f"{folder}: no checkpoint tensor matches {pattern!r}")
    failed = 0
    for name in names:
        shape, _ = reader.meta(name)
        try:
            lines = describe_tensor(plan, name, shape).lines()
        except ShardError as e:
            failed += 1
            lines = [f"{name} {list(shape)}", f"  error: {e}"]
        for line in lines:
            echo(line)
    reader.close()
    return 1 if failed else 0
