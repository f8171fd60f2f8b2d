"""Bugs whose symptom alone says nothing about where they are, for `--fault`: a rank that
crashes inside a layer (the row must name the module and the engine frame, not only the
exception), and block tables that go wrong only when several sequences decode together (the
row must name the batched step and the first module, which a one-sequence bisect never sees).
Each is the one-line mistake a port makes in real source."""

from __future__ import annotations

from freetoken.context import ForwardContext
from freetoken.distributed import get_tp_info
from freetoken.models.qwen3_5_moe import gdn
from freetoken_verify.faults.registry import Entry, fault


@fault("gdn-split-global-sizes",
       Entry("GDN post-conv split with the global key/value sizes (a crash)", "tiny-qwen3.5-moe",
             (2,), ("golden",),
             r"rank \d: RuntimeError: split_with_sizes .*\[in model\.layers\.0\.linear_attn; "
             r"freetoken/models/qwen3_5_moe/gdn\.py:\d+ in _heads\]"))
def gdn_split_global_sizes() -> None:
    """GatedDeltaNet splits its conv output `[q | k | v]` with the config's global key and
    value sizes instead of the rank's own (`split([key_total, key_total, value_total])`):
    right at TP=1, `split_with_sizes` fails inside the layer at TP > 1."""
    original = gdn.GatedDeltaNet._heads

    def heads(self, mixed, *args):
        size = get_tp_info().size
        local = self.key_dim, self.value_dim
        self.key_dim, self.value_dim = local[0] * size, local[1] * size
        try:
            return original(self, mixed, *args)
        finally:
            self.key_dim, self.value_dim = local

    gdn.GatedDeltaNet._heads = heads


@fault("decode-block-tables-row-offset",
       Entry("block tables one row off when several sequences decode together", "tiny-llama",
             (1, 2), ("golden",),
             r"first divergence: batched step \d+ \(decode of prompts 0, 1, 2\)/"
             r"model\.layers\.0\.self_attn\.o_proj", tp1_green=False))
def decode_block_tables_row_offset() -> None:
    """A decode step over more than one sequence lays the block tables out one row off:
    sequence i attends through sequence i + 1's blocks (the last through the first's). One
    sequence alone, and every prefill, is right."""
    original = ForwardContext.decode_layout

    def decode_layout(self, block_size, device):
        if len(self.block_tables) < 2 or block_size in self._decode:
            return original(self, block_size, device)
        tables = self.block_tables
        self.block_tables = tables[1:] + tables[:1]
        try:
            return original(self, block_size, device)
        finally:
            self.block_tables = tables

    ForwardContext.decode_layout = decode_layout
