"""Faults only a zero-tolerance comparison sees, for `--fault`: in the engine's tp_invariant
reductions (`freetoken.layers.invariant`: a subtree or the wire in bf16, another summation
order or tree on one rank, a column tiling that follows the launch's width) and in arithmetic
one rank does in lower precision than the others (rotary angles, the per-head q/k norm's
variance). Each moves TP=N's logits off TP=1's bits by less than the tolerance of the dtype it
is catalogued in, so `--bitwise` golden and bisect catch and name it where the tolerance
comparison passes (docs/verification.md records each one's tolerance-mode verdict)."""

from __future__ import annotations

import torch

from freetoken.distributed import get_communicator, get_tp_info
from freetoken.distributed.comm import tree_sum
from freetoken.layers import invariant
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken_verify.faults.registry import Entry, fault


@fault("invariant-leaves-left-to-right",
       Entry("invariant reduction summed left to right on one rank", "tiny-qwen3-moe", (2,),
             ("golden",), r"tp=1: .*differ bit for bit", bitwise_only=True))
def invariant_leaves_left_to_right() -> None:
    """Rank 1 sums its fp32 leaves of each row-parallel reduction left to right instead of in
    the canonical binary tree (a reduction order that differs on one rank)."""
    clean = invariant.finish

    def finish(leaves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if get_tp_info().rank != 1:
            return clean(leaves, dtype)
        parts = list(leaves.unbind(0))
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return invariant.reduce_subtrees(tree_sum([total])).to(dtype)

    invariant.finish = finish


@fault("invariant-bf16-wire",
       Entry("invariant all-reduce sums bf16 partials", "tiny-qwen3-moe", (2,), ("golden",),
             r"prefill/model\.layers\.0\.self_attn\.o_proj "
             r"\(\d+ / \d+ elements differ bit for bit from TP=1", dtype="bfloat16",
             bitwise_only=True))
def invariant_bf16_wire() -> None:
    """The invariant all-reduce sends bf16 partial sums and lets the backend add them (a
    partial sum rounded to bf16 before the all-reduce)."""

    def reduce_subtrees(subtree: torch.Tensor) -> torch.Tensor:
        return get_communicator().all_reduce(subtree.to(torch.bfloat16)).to(subtree.dtype)

    invariant.reduce_subtrees = reduce_subtrees


@fault("invariant-subtree-bf16",
       Entry("a rank's subtree sum rounded to bf16 before the reduction", "tiny-qwen3-moe", (2,),
             ("golden",), r"prefill/model\.layers\.0\.self_attn\.o_proj "
             r"\(\d+ / \d+ elements differ bit for bit from TP=1.*the reduction differs",
             dtype="bfloat16", bitwise_only=True))
def invariant_subtree_bf16() -> None:
    """Rank 1 rounds its fp32 subtree sum to bf16 before the reduction (a partial result
    stored in the activation dtype on one rank)."""
    clean = invariant.reduce_subtrees

    def reduce_subtrees(subtree: torch.Tensor) -> torch.Tensor:
        if get_tp_info().rank == 1:
            subtree = subtree.to(torch.bfloat16).to(subtree.dtype)
        return clean(subtree)

    invariant.reduce_subtrees = reduce_subtrees


@fault("invariant-tree-order-swapped",
       Entry("tree order swapped on one rank", "tiny-qwen3-moe", (2,), ("golden",),
             r"prefill/model\.layers\.0\.self_attn\.o_proj "
             r"\(\d+ / \d+ elements differ bit for bit from TP=1.*the reduction differs",
             dtype="float32", bitwise_only=True))
def invariant_tree_order_swapped() -> None:
    """Rank 1 builds its subtree with its two middle leaves swapped (leaves [0, 2, 1, 3]:
    chunk 0 paired with chunk 2, not 1), another tree over the same leaves; it needs four
    leaves per rank (TP 2 of 8 chunks). Swapping the operands of one node changes nothing
    (IEEE addition commutes): the tree's shape is the order."""
    clean = invariant.finish

    def finish(leaves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        parts = list(leaves.unbind(0))
        if get_tp_info().rank != 1 or len(parts) < 4:
            return clean(leaves, dtype)
        parts[1], parts[2] = parts[2], parts[1]
        return invariant.reduce_subtrees(tree_sum(parts)).to(dtype)

    invariant.finish = finish


@fault("invariant-tiles-by-width",
       Entry("column tiling that depends on the number of columns", "tiny-llama", (2,), ("golden",),
             r"first divergence: prefill/model\.layers\.0\.self_attn\.qkv_proj "
             r"\(\d+ / \d+ elements differ bit for bit", dtype="float32", bitwise_only=True))
def invariant_tiles_by_width() -> None:
    """Column-parallel GEMMs (and the LM head) choose their tiling by the launch's own width:
    the fewer weight rows a rank holds, the more K splits each output element is summed from
    (`ceil(1024 / rows)` of them, as a split-K heuristic filling the machine would), so an
    element's reduction order follows how many columns the rank holds."""

    def column_linear(x, weight, bias, tile=invariant.TILE):
        rows, inputs = weight.shape
        splits = min(-(-1024 // rows), max(1, inputs // 8))
        parts = [torch.nn.functional.linear(xs, ws) for xs, ws in
                 zip(x.float().tensor_split(splits, -1), weight.float().tensor_split(splits, -1))]
        y = sum(parts[1:], parts[0]).to(x.dtype)
        return y + bias if bias is not None else y

    invariant.column_linear = column_linear


@fault("rotary-bf16-on-ranks",
       Entry("rotary angles in bf16 on ranks > 0", "tiny-llama", (2,), ("golden",),
             r"prefill/model\.layers\.0\.self_attn\.attn "
             r"\(\d+ / \d+ elements differ bit for bit from TP=1", dtype="bfloat16",
             bitwise_only=True))
def rotary_bf16_on_ranks() -> None:
    """Ranks > 0 compute the rotary angles (position x inverse frequency), and so cos and
    sin, in bf16 instead of fp32: their heads rotate by slightly other angles."""
    clean = RotaryEmbedding.cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if get_tp_info().rank == 0:
            return clean(self, positions, dtype)
        inv_freq = self.inv_freq.to(positions.device, torch.bfloat16)
        freqs = positions.to(torch.bfloat16)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    RotaryEmbedding.cos_sin = cos_sin


@fault("qk-norm-variance-bf16-on-ranks",
       Entry("q/k norm variance in bf16 on ranks > 0", "tiny-qwen3", (2,), ("golden",),
             r"prefill/model\.layers\.0\.self_attn\.q_norm "
             r"\(\d+ / \d+ elements differ bit for bit from TP=1", dtype="bfloat16",
             bitwise_only=True))
def qk_norm_variance_bf16_on_ranks() -> None:
    """On ranks > 0 the per-head q/k RMSNorm (inputs [tokens, heads, head_dim]) takes the
    mean of squares in bf16 instead of fp32 (a norm kernel reducing in the activation dtype
    on the heads a rank holds)."""
    clean = RMSNorm.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_info().rank == 0 or x.dim() != 3:
            return clean(self, x)
        variance = x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).float()
        h = x.float() * torch.rsqrt(variance + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    RMSNorm.forward = forward
