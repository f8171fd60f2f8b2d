"""The canonical reductions of the `tp_invariant` engine mode: every sum that tensor
parallelism splits is computed as one fixed decomposition that does not depend on the TP size,
so TP=N logits are bit-identical to TP=1 (CPU torch paths, fp32 and bf16).

- Row-parallel GEMMs (o_proj, GatedDeltaNet out_proj, down_proj, the experts' and the shared
  expert's down): the reduced dimension is cut into `chunks` canonical chunks (the largest
  power-of-two TP size the model supports); each chunk's partial product is one fp32 GEMM of
  the same shape at every TP size (a leaf); the leaves are combined by `tree_sum`'s fixed
  binary tree. At TP=N a rank holds `chunks / N` consecutive leaves, an aligned subtree: it
  sums that subtree and `Communicator.all_reduce_tree` combines the N subtree sums in the same
  tree order on every rank (fp32 on the wire). One rounding to the activation dtype at the end.
  The MoE block adds routed and shared leaves chunk by chunk before the tree.
- Elementwise ops over TP-split dimensions (sigmoid, silu and softplus; exp alongside them):
  torch's vectorised CPU loop leaves the tail of a launch (fewer than two vectors) to a scalar
  loop that rounds differently, so which elements land in the tail moves with the TP size.
  `pointwise` runs them on a padded flat buffer that has no tail.
- Column-parallel GEMMs and the LM head: torch's CPU matmul picks its algorithm by shape (an
  output element changes with the number of output columns in the launch) and by operand
  alignment, so the output is computed in tiles of `tile` weight rows, each tile one GEMM of
  the same shape on freshly allocated (equally aligned) operands at every TP size; the last
  tile is zero-padded. tests/layers/test_invariant.py holds the proof of both effects.
- Steps that take the CUDA (Triton) paths compute the column-parallel GEMMs and the leaves
  with `freetoken.kernels.canonical_gemm` instead (one fixed tiling, so an element does not
  depend on the launch's shape: no padding or fresh copies needed), and the routed experts
  with `freetoken.kernels.fused_moe.fused_moe_leaves`. Their elementwise kernels compute each
  element alone, and `pointwise`'s padding leaves them as they are.

Layers read the mode once, at construction (`active_reductions`), as they read the TP info.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.context import uses_kernels
from freetoken.distributed.comm import get_communicator, tree_sum
from freetoken.kernels import canonical_gemm

TILE = 64
POINTWISE_BLOCK = 128
"""Elements per block of `pointwise`'s padded buffer: a multiple of two vectors of every
dtype's widest CPU vector (2 x 32 bf16 lanes), so the vectorised loop covers every element."""
"""Weight rows per column-parallel tile; 64 rows keep every tile view of a fresh buffer at
the allocator's 64-byte alignment, whatever the input size and dtype."""


@dataclass(frozen=True)
class CanonicalReductions:
    """How this model's TP-split sums are cut: `chunks` canonical chunks per row-parallel
    reduced dimension (this rank holds `local_chunks` consecutive ones), column-parallel
    outputs in tiles of `tile` rows."""

    chunks: int
    tp_size: int
    tile: int = TILE

    def __post_init__(self) -> None:
        if self.chunks & (self.chunks - 1) or self.chunks < 1:
            raise ValueError(f"tp_invariant: the canonical chunk count must be a power of two, "
                             f"got {self.chunks}")
        if self.chunks % self.tp_size:
            raise ValueError(f"tp_invariant: tp_size={self.tp_size} does not divide the "
                             f"model's {self.chunks} canonical chunks (the largest "
                             f"power-of-two TP size it supports); use a power of two up to "
                             f"{self.chunks}")

    @property
    def local_chunks(self) -> int:
        return self.chunks // self.tp_size


# A context variable, not a global: two engines built at once on two threads keep their modes.
_ACTIVE: ContextVar[CanonicalReductions | None] = ContextVar("canonical_reductions",
                                                             default=None)


@contextmanager
def canonical_reductions(reductions: CanonicalReductions | None) -> Iterator[None]:
    """Layers built inside take the invariant paths of `reductions` (None: the default)."""
    token = _ACTIVE.set(reductions)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_reductions() -> CanonicalReductions | None:
    """The mode a layer under construction takes (None outside `canonical_reductions`)."""
    return _ACTIVE.get()


def fresh(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous copy of `t` (in `dtype`): MKL's result depends on where its operands
    start, and a new allocation starts at the same alignment at every TP size."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    return out.copy_(t)


def pointwise(fn, *xs: torch.Tensor) -> torch.Tensor:
    """`fn(*xs)` for an elementwise `fn`, every element computed by torch's vectorised loop:
    the broadcast inputs flattened into fresh buffers padded (with zeros) to a multiple of
    POINTWISE_BLOCK, the result cut back to the broadcast shape."""
    shape = torch.broadcast_shapes(*(x.shape for x in xs))
    count = shape.numel()
    pad = -count % POINTWISE_BLOCK
    flat = [F.pad(x.expand(shape).reshape(-1), (0, pad)) for x in xs]
    return fn(*flat)[:count].view(shape)


def elementwise(canonical: CanonicalReductions | None, fn, *xs: torch.Tensor) -> torch.Tensor:
    """`fn(*xs)`; through `pointwise` in the tp_invariant mode (`canonical` set)."""
    return fn(*xs) if canonical is None else pointwise(fn, *xs)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, the gated activation, for `pointwise`."""
    return F.silu(gate) * up


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  tile: int = TILE) -> torch.Tensor:
    """`x W^T (+ b)` in x's dtype, each output element computed by a GEMM whose shape does
    not depend on how many rows `weight` has: [.., K] x [K, tile] per tile of weight rows."""
    rows, inputs = weight.shape
    if uses_kernels():
        flat = x.reshape(-1, inputs)
        y = canonical_gemm.chunk_products(flat, weight, 1, x.dtype)[0]
        y = y.reshape(*x.shape[:-1], rows)
        return y + bias if bias is not None else y
    padded = torch.zeros(rows + -rows % tile, inputs, dtype=weight.dtype, device=weight.device)
    padded[:rows] = weight
    flat = fresh(x.reshape(-1, inputs))
    tiles = [F.linear(flat, padded[i : i + tile]) for i in range(0, padded.shape[0], tile)]
    y = torch.cat(tiles, dim=-1)[:, :rows].reshape(*x.shape[:-1], rows)
    return y + bias if bias is not None else y


def chunk_leaves(x: torch.Tensor, weight: torch.Tensor, local_chunks: int) -> torch.Tensor:
    """This rank's leaves of a row-parallel GEMM: fp32 [local_chunks, .., out], leaf c the
    partial product `x[.., chunk c] W[:, chunk c]^T` of x [.., local_in] and weight
    [out, local_in], both cut into `local_chunks` equal chunks of the canonical size."""
    inputs = weight.shape[1]
    if inputs % local_chunks or x.shape[-1] != inputs:
        raise ValueError(f"tp_invariant: input size {x.shape[-1]} (weight {tuple(weight.shape)})"
                         f" does not split into {local_chunks} canonical chunks")
    size = inputs // local_chunks
    flat = x.reshape(-1, inputs)
    if uses_kernels():
        leaves = canonical_gemm.chunk_products(flat, weight, local_chunks, torch.float32)
        return leaves.reshape(local_chunks, *x.shape[:-1], weight.shape[0])
    leaves = [F.linear(fresh(flat[:, c * size : (c + 1) * size], torch.float32),
                       fresh(weight[:, c * size : (c + 1) * size], torch.float32))
              for c in range(local_chunks)]
    return torch.stack(leaves).reshape(local_chunks, *x.shape[:-1], weight.shape[0])


def reduce_subtrees(subtree: torch.Tensor) -> torch.Tensor:
    """The full tree from every rank's fp32 subtree sum (rank order is tree order)."""
    return get_communicator().all_reduce_tree(subtree)


def finish(leaves: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The canonical sum of all ranks' leaves [local_chunks, ...], rounded once to `dtype`;
    the same bits on every rank and at every TP size."""
    return reduce_subtrees(tree_sum(list(leaves.unbind(0)))).to(dtype)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               reductions: CanonicalReductions, reduce: bool = True) -> torch.Tensor:
    """A row-parallel `x W^T (+ b)` in x's dtype: the canonical tree over all ranks when
    `reduce`, else this rank's subtree sum (rounded once)."""
    leaves = chunk_leaves(x, weight, reductions.local_chunks)
    y = finish(leaves, x.dtype) if reduce else tree_sum(list(leaves.unbind(0))).to(x.dtype)
    return y + bias if bias is not None else y


def expert_leaves(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  num_experts: int, expert_mlp, reductions: CanonicalReductions
                  ) -> torch.Tensor:
    """Routed experts' leaves, fp32 [local_chunks, T, H]: each token's weighted expert
    outputs, chunk by chunk, added in ascending expert order (the same order at every TP
    size: routing is replicated). `expert_mlp(e, x_rows)` -> the expert's down-projection
    leaves [local_chunks, rows, H] (fp32)."""
    out = torch.zeros(reductions.local_chunks, *x.shape, dtype=torch.float32, device=x.device)
    hit = torch.bincount(ids.flatten(), minlength=num_experts).nonzero().flatten()
    for e in hit.tolist():
        token, slot = torch.where(ids == e)
        down = expert_mlp(e, x[token]) * weights[token, slot, None].to(torch.float32)
        out.index_add_(1, token, down)
    return out

