"""Checkpoint reading, shard plans and strict loading (the shard specs the plans use live in
`freetoken.formats`)."""

from freetoken.loading.checkpoint import CheckpointError, CheckpointReader
from freetoken.loading.loader import LoadError, load_weights, observe_loading
from freetoken.loading.plan import Rule, ShardPlan, Target

__all__ = [
    "CheckpointError", "CheckpointReader", "LoadError", "load_weights", "observe_loading", "Rule",
    "ShardPlan", "Target",
]
