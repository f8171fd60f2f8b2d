"""Checkpoint reading, shard plans and strict loading."""

from freetoken.loading.checkpoint import CheckpointError, CheckpointReader
from freetoken.loading.loader import LoadError, load_weights, observe_loading
from freetoken.loading.plan import Rule, ShardPlan, Target
from freetoken.loading.specs import (
    Heads,
    PaddedSplit,
    Replicate,
    Segments,
    ShardError,
    Split,
    shard_into,
)

__all__ = [
    "CheckpointError", "CheckpointReader", "LoadError", "load_weights", "observe_loading", "Rule",
    "ShardPlan", "Target", "Heads", "PaddedSplit", "Replicate", "Segments", "ShardError", "Split",
    "shard_into",
]
