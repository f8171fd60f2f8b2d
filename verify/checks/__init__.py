"""The checks `freetoken-verify` runs, each in its own module, all with one signature:
`run(ctx: CheckContext) -> CheckResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from verify.cases import Case
from verify.ranks import RankRunner


@dataclass(frozen=True)
class VerifyOptions:
    """Options shared by every check."""

    device: str = "auto"
    dtype: str = "auto"
    reference: str = "auto"
    num_layers: int | None = None
    oversubscribe: bool = False
    timeout: float = 600.0
    prompts_file: str | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    save_reference: str | None = None
    download: bool = False


@dataclass
class CheckContext:
    """One model at one TP size, the rank runner for that size, and a cache shared across TP
    sizes (e.g. the TP=1 outputs later sizes are compared with)."""

    case: Case
    tp: int
    runner: RankRunner
    options: VerifyOptions
    cache: dict = field(default_factory=dict)

    @property
    def placement(self) -> str:
        return self.runner.placement.name


def available_checks() -> dict:
    """Check name -> run function, in the order they run."""
    from verify.checks import bisect, collectives, golden, kernels, memory, shards

    # memory reloads the engine under measurement; shards then compares the loaded engine.
    return {"golden": golden.run, "bisect": bisect.run, "memory": memory.run,
            "shards": shards.run, "kernels": kernels.run, "collectives": collectives.run}


ALL_CHECK_NAMES = ("golden", "shards", "memory", "kernels", "bisect", "collectives")
