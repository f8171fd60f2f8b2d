"""Vocab-parallel embedding and LM head. The vocabulary is padded to a multiple of tp_size;
padded rows are zero and padded logits are sliced off."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.distributed import get_communicator, get_tp_info
from freetoken.layers import invariant
from freetoken.layers.quantization import Split, linear_method


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocab rounded up to a multiple of tp_size."""
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * local, (r + 1) * local) of the padded table; lookups outside
    the range contribute zero and one all-reduce completes every row."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        self.local_vocab = padded_vocab(vocab_size, tp.size) // tp.size
        self.start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return get_communicator().all_reduce(out)


class ParallelLMHead(nn.Module):
    """Rank-local logits over its vocab rows, gathered so every rank has the full logits.
    `fmt`: the head's module format (NVFP4: packed rows and block scales padded with zero
    rows like the weight; padded logits are sliced off)."""

    def __init__(self, vocab_size: int, hidden: int, tied: VocabParallelEmbedding | None = None,
                 fmt=None):
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        self.local_vocab = padded_vocab(vocab_size, tp.size) // tp.size
        self.tied = tied
        self.canonical = invariant.active_reductions()
        self.quant = linear_method(fmt, [Split(padded_vocab(vocab_size, tp.size))],
                                   Split.whole(hidden))
        if self.quant is not None:
            self.quant.create_weights(self, hidden, self.local_vocab)
        elif tied is None:
            self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and self.canonical is None:
            local = self.quant.apply(self, hidden)
        else:
            weight = self.tied.weight if self.tied is not None else self.weight
            if self.quant is not None:
                weight = self.quant.dequantize(self, hidden.dtype)
            local = (invariant.column_linear(hidden, weight, None, self.canonical.tile)
                     if self.canonical is not None else F.linear(hidden, weight))
        return get_communicator().all_gather(local, dim=-1)[..., : self.vocab_size]
