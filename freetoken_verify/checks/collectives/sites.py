"""Where the TP conventions put collectives, derived from a model's module types and layout,
never from a run: a row-parallel output, the vocab-parallel embedding and the LM head gather
each issue one; a MoE block (a module that owns routed experts) issues one all-reduce for
routed + shared, and everything inside it issues none; the engine's sampler broadcasts rank
0's sampled tokens once per step. Every other module, and the engine outside the model and
the sampler, issues none."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from freetoken.layers.linear import RowParallelLinear
from freetoken.layers.moe import FusedExperts
from freetoken.layers.quantization.fp8.moe import BlockFP8FusedExperts
from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts
from freetoken_verify.checks.collectives.trace import SAMPLER, Call, dtype_name

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Site:
    """`count` calls of `kind` per forward of one module, each on a tensor whose shape follows
    from the module's input shape (`shape`), in `dtype`; `why` is the convention it follows
    and `note` what about the module contradicts its declared attributes."""

    kind: str
    count: int
    why: str
    shape: Callable[[Shape], Shape]
    dtype: str
    dim: int | None = None
    note: str = ""

    def expected(self, input_shape: Shape | None) -> Call | None:
        """The call this site should issue for a forward on `input_shape`; None if unknown."""
        if input_shape is None:
            return None
        shape = self.shape(input_shape)
        dim = self.dim % len(shape) if self.dim is not None else None
        return Call(self.kind, shape, self.dtype, dim)


def _routed_expert_types() -> tuple[type, ...]:
    return (FusedExperts, NVFP4FusedExperts, BlockFP8FusedExperts)


def _is_row_parallel(module: torch.nn.Module) -> bool:
    return isinstance(module, RowParallelLinear)


def moe_blocks(model: torch.nn.Module) -> dict[str, str]:
    """Name of every module inside a MoE block -> the block's name (the block included)."""
    experts = _routed_expert_types()
    inside = {}
    for name, module in model.named_modules():
        if any(isinstance(child, experts) for child in module.children()):
            for sub, _ in module.named_modules(prefix=name):
                inside[sub] = name
    return inside


def expected_sites(model: torch.nn.Module, dtype: torch.dtype, batch: int) -> dict[str, Site]:
    """Module name -> its Site, for every module that must issue a collective in a step of
    `batch` sequences with activations in `dtype`; `SAMPLER` for the sampler's broadcast. A
    site's `why` names the collective it expects."""
    act = dtype_name(dtype)
    blocks = moe_blocks(model)
    sites = {}
    for name, module in model.named_modules():
        site = _site(name, module, blocks, act)
        if site is not None:
            sites[name] = site
    sites[SAMPLER] = Site("broadcast", 1, "the broadcast of rank 0's sampled tokens",
                         lambda _: (batch,), "int64")
    return sites


def _site(name: str, module: torch.nn.Module, blocks: dict[str, str], act: str) -> Site | None:
    if blocks.get(name) == name:
        return Site("all_reduce", 1, "the MoE block's one all-reduce of routed + shared",
                    lambda s: s, act)
    if _is_row_parallel(module) and name not in blocks:
        note = "" if module.reduce else "its reduce=False, but nothing else reduces its output"
        return Site("all_reduce", 1, "the all-reduce of a row-parallel output",
                    lambda s: (*s[:-1], module.local_out), act, note=note)
    if isinstance(module, VocabParallelEmbedding):
        hidden = module.weight.shape[1]
        return Site("all_reduce", 1, "the vocab-parallel embedding's all-reduce",
                    lambda s: (*s, hidden), act)
    if isinstance(module, ParallelLMHead):
        local = module.local_vocab
        return Site("all_gather", 1, "the LM head's gather of the vocab shards",
                    lambda s: (*s[:-1], local), act, dim=-1)
    return None


def inside_note(name: str, blocks: dict[str, str]) -> str:
    """Why a module inside a MoE block must not issue a collective of its own."""
    block = blocks.get(name)
    if block is None or block == name:
        return ""
    return f"inside MoE block {block}, whose routed + shared sum is reduced once"
