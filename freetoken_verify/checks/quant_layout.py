"""The TP-local layout of every quantized GEMM, from the model's config and the TP conventions
alone (never from the engine's layers or shard specs): the output segments of each engine
destination, which checkpoint tensor each comes from, which rows and inputs of it rank r
holds, and how many block-scale rows / columns that takes. The `kernels` check builds its
quantized cases from it (and checks the engine's linear methods against it); the `memory`
check counts each rank's quantized bytes with it.

A segment is described as the engine's layers describe it to their linear method
(`freetoken.layers.quantization.Split`: full size, KV-head replication, start inside a
packed checkpoint tensor, scale expanded per row, the checkpoint tensor it comes from); the
arithmetic on it here is the design's TP conventions:

- a dim of `full` elements in `tp` equal chunks, rank r holding chunk r; with `heads` set and
  fewer heads than ranks, rank r holds head `r * heads // tp` (KV heads replicated);
- a block-FP8 scale row (column) covers `B` weight rows (inputs); a rank holds the blocks
  covering its slice, a block two ranks' slices fall into counted on both, and every rank
  the most blocks any rank needs (the parameter has one shape on every rank);
- Qwen3.5's q_proj interleaves `[q_h | gate_h]` per head, so its block scale is held one row
  per weight row (a row block of 1) whatever the head size (the design's "expand at load")."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.layers.quantization import Split


class LayoutError(ValueError):
    """A quantized destination this module has no layout for; the message names it."""


def rows_on(split: Split, rank: int, size: int) -> tuple[int, int]:
    """(first element inside its checkpoint tensor, elements) of `split` on `rank` of
    `size` (rank-dependent: its chunk, or its replicated head)."""
    parts = split.heads if split.heads is not None and split.heads < size else size
    step = split.full_size // parts
    return split.start + (rank * parts // size) * step, step


def blocks_on(split: Split, rank: int, size: int, block: int) -> tuple[int, int]:
    """(first block, blocks) covering `split`'s slice on `rank` (rank-dependent)."""
    first, count = rows_on(split, rank, size)
    return first // block, (first + count - 1) // block - first // block + 1


def held_blocks(split: Split, size: int, block: int) -> int:
    """Scale blocks every rank holds for `split`: the most any rank's slice spans."""
    return max(blocks_on(split, r, size, block)[1] for r in range(size))


def tensor_of(rows: tuple[Split, ...], i: int) -> int:
    """Which checkpoint tensor output segment `i` comes from (its index among the
    destination's parts)."""
    return i if rows[i].group is None else rows[i].group


@dataclass(frozen=True)
class Layout:
    """One GEMM: its output segments `rows` and its input `cols` (`Split.whole`: not split);
    `label` names it in messages (`qkv_proj (q | gate | k | v)`)."""

    label: str
    rows: tuple[Split, ...]
    cols: Split

    def segments_of(self, part: int) -> tuple[Split, ...]:
        """The output segments checkpoint tensor `part` fills."""
        return tuple(s for i, s in enumerate(self.rows) if tensor_of(self.rows, i) == part)

    def row_block(self, seg: Split, block: int) -> int:
        """The row block `seg`'s scale is held in: 1 where it is expanded per row."""
        return 1 if seg.per_row else block

    def cols_split(self) -> bool:
        return self.cols.heads != 1


@dataclass(frozen=True)
class Experts:
    """Routed experts: `experts` of gate | up [I, H] and down [H, I], I split across ranks."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int

    def gate_up(self) -> Layout:
        return Layout("experts gate | up", (Split(self.intermediate),) * 2,
                      Split.whole(self.hidden))

    def down(self) -> Layout:
        return Layout("experts down", (Split.whole(self.hidden),), Split(self.intermediate))


def _padded_vocab(vocab: int, size: int) -> int:
    return -(-vocab // size) * size


def destination_layout(cfg, dest: str, tp: int) -> Layout | Experts:
    """The layout of engine destination `dest` (e.g. `model.layers.1.self_attn.qkv_proj`; the
    GatedDeltaNet `in_proj` means its quantized [qkv | z] GEMM) of model config `cfg` at TP
    size `tp` (the LM head's padded vocab depends on it). LayoutError for a destination no
    quantized format reaches."""
    hidden = cfg.hidden_size
    whole = Split.whole(hidden)
    name = dest.rsplit(".", 2)
    kind = ".".join(name[-2:]) if len(name) > 1 else dest
    if dest == "lm_head":
        return Layout("lm_head", (Split(_padded_vocab(cfg.vocab_size, tp)),), whole)
    if kind == "self_attn.qkv_proj":
        return _attention(cfg)
    if kind == "self_attn.o_proj":
        return Layout("o_proj", (whole,), Split(cfg.num_attention_heads * cfg.head_dim))
    if kind == "linear_attn.in_proj":
        return _gdn_in_proj(cfg)
    if kind == "linear_attn.out_proj":
        value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return Layout("GatedDeltaNet out_proj", (whole,), Split(value))
    if kind in ("shared_expert.gate_up_proj", "mlp.gate_up_proj"):
        inter = _mlp_intermediate(cfg, kind)
        return Layout(kind.replace("mlp.", "") + " (gate | up)", (Split(inter),) * 2, whole)
    if kind in ("shared_expert.down_proj", "mlp.down_proj"):
        return Layout(kind.replace("mlp.", ""), (whole,), Split(_mlp_intermediate(cfg, kind)))
    if kind == "mlp.experts":
        return Experts(cfg.num_experts, cfg.num_experts_per_tok, hidden,
                       cfg.moe_intermediate_size)
    raise LayoutError(f"{dest}: no quantized layout is known for this destination (a format "
                      "the harness cannot check yet)")


def _mlp_intermediate(cfg, kind: str) -> int:
    return (cfg.shared_expert_intermediate_size if kind.startswith("shared_expert")
            else cfg.intermediate_size)


def _attention(cfg) -> Layout:
    """q | k | v by head, KV heads replicated when fewer than ranks; Qwen3.5's q_proj gives
    two segments (its heads' q rows, then their gate rows) from one checkpoint tensor,
    its block scale held per row."""
    q, kv_heads = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads
    kv = cfg.num_key_value_heads * cfg.head_dim
    if cfg.arch != "qwen3_5_moe":
        return Layout("qkv_proj (q | k | v)",
                      (Split(q), Split(kv, heads=kv_heads), Split(kv, heads=kv_heads)),
                      Split.whole(cfg.hidden_size))
    gated = Split(q, per_row=True, group=0)
    return Layout("qkv_proj (q | gate | k | v)",
                  (gated, gated, Split(kv, heads=kv_heads, group=1),
                   Split(kv, heads=kv_heads, group=2)), Split.whole(cfg.hidden_size))


def _gdn_in_proj(cfg) -> Layout:
    """in_proj_qkv's q, k and v (each split on its own, k and v starting inside the packed
    tensor), then in_proj_z."""
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    total = 2 * key + value
    return Layout("GatedDeltaNet in_proj (q | k | v | z)",
                  (Split(key, start=0, total=total, group=0),
                   Split(key, start=key, total=total, group=0),
                   Split(value, start=2 * key, total=total, group=0), Split(value, group=1)),
                  Split.whole(cfg.hidden_size))
