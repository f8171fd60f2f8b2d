"""Per-module activations of one rank's engine, with the TP layout of each, so the parent can
rebuild the full tensor a TP=1 engine (or HF) would have produced.

Every module's output is recorded in execution order, flattened to `[tokens, features]`.
A layout says how the rank-local features relate to the full ones:

- `("full",)`: every rank holds the whole tensor (it must be bitwise equal across ranks);
- `("partial",)`: every rank holds a partial sum (the full tensor is their sum);
- `("segments", ((kind, full_size, unit), ...))`: the feature dim is a concatenation of
  segments, each split across ranks in rank order. `kind` is `split` (rank r holds the r-th
  chunk) or `kv` (heads of `unit` features; with fewer heads than ranks each rank holds head
  `r * heads // tp_size`, replicated).

Layouts are stated from the module's type, its place in the model and the config, the TP
conventions design.md fixes, not read back from the shard plan or the module's own flags: a
plan that puts rows in the wrong slot, or a row-parallel layer built without its all-reduce,
produces activations that do not match the statement.

Captures keep the module's own dtype (a bf16 output stays bf16), so that a bitwise comparison
counts ulps of that dtype. A row-parallel linear outside MoE blocks is also recorded before
its reduction: in the default mode its partial product (`:partial`, summed over ranks), in the
tp_invariant mode its canonical fp32 leaves (`:leaves`: rank r holds leaves r * C/N onwards,
so the ranks' leaves side by side are TP=1's, bit for bit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.layers import invariant

FULL = ("full",)
PARTIAL = ("partial",)


def _split(full: int) -> tuple:
    return ("split", full, 1)


def _kv(heads: int, head_dim: int) -> tuple:
    return ("kv", heads * head_dim, head_dim)


@dataclass
class Capture:
    """One recorded module output on one rank."""

    key: str
    """`prefill/<module name>` or `decode/<module name>` (a `#n` suffix for the n-th call of
    a module inside one forward, `:partial` for a row-parallel output before its all-reduce)."""
    layout: tuple
    tensor: torch.Tensor


def layout_of(name: str, module, parent, cfg, tp: int) -> tuple | None:
    """The TP layout of `module`'s output (None: not comparable, e.g. a tuple of q and k)."""
    kind = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    if kind.endswith("Experts") or kind == "SharedExpert":
        # Inside an MoE block the routed and shared partial sums meet before one all-reduce.
        return PARTIAL
    if kind == "RowParallelLinear":
        return PARTIAL if type(parent).__name__ == "SharedExpert" else FULL
    if kind == "QKVParallelLinear":
        kv = _kv(cfg.num_key_value_heads, module.head_dim)
        return ("segments", (_split(module.num_heads * module.head_dim * tp), kv, kv))
    if kind == "QGateKVParallelLinear":
        q = _split(module.local_sizes[0] * tp)
        kv = _kv(cfg.num_key_value_heads, cfg.head_dim)
        return ("segments", (q, q, kv, kv))
    if kind in ("MergedColumnParallelLinear", "ColumnParallelLinear"):
        sizes = getattr(module, "local_sizes", [module.local_out])
        return ("segments", tuple(_split(s * tp) for s in sizes))
    if type(parent).__name__ == "GatedDeltaNet":
        return _gdn_layout(leaf, parent, tp)
    if kind == "PagedAttention":
        return ("segments", (_split(module.num_heads * module.head_dim * tp),))
    if kind == "RMSNorm" and leaf in ("q_norm", "k_norm"):
        head_dim = parent.attn.head_dim
        if leaf == "q_norm":
            return ("segments", (_split(parent.num_heads * head_dim * tp),))
        return ("segments", (_kv(cfg.num_key_value_heads, head_dim),))
    if kind == "RotaryEmbedding":
        return None
    return FULL


def _gdn_layout(leaf: str, gdn, tp: int) -> tuple | None:
    """GatedDeltaNet's rank-local packings: in_proj `[q | k | v | z | b | a]` (or, where a
    quantized in_proj_qkv / in_proj_z splits it into two GEMMs, in_proj `[q | k | v | z]`
    and in_proj_ba `[b | a]`), conv1d `[q | k | v]`, the gated norm over the value heads;
    each part split by heads."""
    key, value, heads = gdn.key_dim * tp, gdn.value_dim * tp, gdn.num_v_heads * tp
    split = getattr(gdn, "in_proj_ba", None) is not None
    if leaf == "in_proj":
        parts = (key, key, value, value) + (() if split else (heads, heads))
    elif leaf == "in_proj_ba":
        parts = (heads, heads)
    elif leaf == "conv1d":
        parts = (key, key, value)
    elif leaf == "norm":
        parts = (value,)
    else:
        return FULL
    return ("segments", tuple(_split(p) for p in parts))


class Recorder:
    """Forward hooks on every module of `model` that record outputs as `Capture`s. Call
    `phase(name)` before each forward; `remove()` when done.

    In the tp_invariant mode a MoE block computes its routed experts and shared expert as
    canonical leaves (their `leaves` method, no forward): those calls are recorded too, as
    `<module>:leaves` and (the leaves summed) as the module's own partial output, so a bug
    inside the block is named by the part it is in, against TP=1 and against HF."""

    def __init__(self, model: torch.nn.Module, cfg, tp: int):
        self.captures: list[Capture] = []
        self._phase, self._tokens = "prefill", 0
        self._calls: dict[str, int] = {}
        self._handles = []
        self._wrapped: list[torch.nn.Module] = []
        modules = dict(model.named_modules())
        for name, module in modules.items():
            if not name:
                continue
            parent = modules.get(name.rpartition(".")[0])
            layout = layout_of(name, module, parent, cfg, tp)
            if layout is not None:
                self._handles.append(module.register_forward_hook(self._hook(name, layout)))
            if layout == PARTIAL and _canonical(module) is not None:
                self._wrap_leaves(name, module)

    def phase(self, name: str, tokens: int) -> None:
        """Name the next forward (`prefill`, `decode`), which runs over `tokens` tokens."""
        self._phase, self._tokens, self._calls = name, tokens, {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for module in self._wrapped:
            del module.leaves
        self._wrapped.clear()

    def _key(self, name: str) -> str:
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        return f"{self._phase}/{name}" + (f"#{n}" if n else "")

    def _hook(self, name: str, layout: tuple):
        def record(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor):
                return
            key = self._key(name)
            row_parallel = layout == FULL and type(module).__name__ == "RowParallelLinear"
            canonical = _canonical(module)
            if row_parallel and canonical is not None:
                weight = module.dense_weight(inputs[0].dtype)
                leaves = invariant.chunk_leaves(inputs[0], weight, canonical.local_chunks)
                self._record_leaves(key, leaves, canonical)
            self.captures.append(Capture(key, layout, flat(out, self._tokens, True)))
            if row_parallel and canonical is None:
                # dense_weight: a quantized layer's weight dequantized as its GEMM sees it.
                partial = F.linear(inputs[0], module.dense_weight(inputs[0].dtype))
                self.captures.append(Capture(key + ":partial", PARTIAL,
                                             flat(partial, self._tokens, True)))
        return record

    def _wrap_leaves(self, name: str, module: torch.nn.Module) -> None:
        """Record every call of `module.leaves` (an instance attribute until `remove`)."""
        original, canonical = module.leaves, _canonical(module)

        def leaves(*args, **kwargs):
            out = original(*args, **kwargs)
            key = self._key(name)
            self._record_leaves(key, out, canonical)
            # The module's own partial output (its leaves summed), as its forward would give
            # in the default mode: the row HF's same module compares with (at TP 1 the only
            # reference), after the leaves row the bitwise comparison names first.
            partial = out.reshape(canonical.local_chunks, -1, out.shape[-1]).sum(0)
            self.captures.append(Capture(key, PARTIAL, flat(partial, self._tokens, True)))
            return out

        module.leaves = leaves
        self._wrapped.append(module)

    def _record_leaves(self, key: str, leaves: torch.Tensor, canonical) -> None:
        """A rank's canonical fp32 leaves [local chunks, .., features] as `key:leaves`,
        `[tokens, local chunks * features]`, chunk-major: rank r holds leaves r * C/N on, so
        the ranks' parts side by side are TP=1's leaves, bit for bit."""
        local, features = canonical.local_chunks, leaves.shape[-1]
        rows = leaves.reshape(local, -1, features).transpose(0, 1).reshape(-1, local * features)
        layout = ("segments", (_split(canonical.chunks * features),))
        self.captures.append(Capture(key + ":leaves", layout, flat(rows, self._tokens, True)))


def _canonical(module: torch.nn.Module):
    """The tp_invariant reductions `module` computes with (a shared expert: its down
    projection's), or None in the default mode."""
    canonical = getattr(module, "canonical", None)
    if canonical is None and isinstance(getattr(module, "down_proj", None), torch.nn.Module):
        canonical = getattr(module.down_proj, "canonical", None)
    return canonical


def flat(t: torch.Tensor, tokens: int, keep_dtype: bool = False) -> torch.Tensor:
    """`[rows, features]` on the CPU, floats in float32 (in their own dtype with
    `keep_dtype`): rows are the forward's `tokens` where the tensor is per token
    (`[tokens, ...]`, or `[1, tokens, ...]` for a one-sequence batch), else its first dim
    (the LM head on a prefill's last token); trailing dims (heads, head_dim) merged."""
    t = t.detach()
    if t.dim() >= 3 and t.shape[0] == 1 and t.shape[1] == tokens:
        t = t[0]
    t = t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(-1, 1)
    return t.float().cpu().clone() if t.is_floating_point() and not keep_dtype \
        else t.cpu().clone()


def unshard(layout: tuple, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full `[tokens, features]` tensor from every rank's part, by `layout`."""
    if layout == FULL:
        return parts[0]
    if layout == PARTIAL:
        return torch.stack([p.float() for p in parts]).sum(0)
    tp, out, offset = len(parts), [], 0
    for kind, full, unit in layout[1]:
        local = _local_size(kind, full, unit, tp)
        pieces = [p[:, offset : offset + local] for p in parts]
        if kind == "kv" and full // unit < tp:
            pieces = pieces[:: tp // (full // unit)]
        out.extend(pieces)
        offset += local
    return torch.cat(out, dim=1)


def _local_size(kind: str, full: int, unit: int, tp: int) -> int:
    if kind == "kv" and full // unit < tp:
        return unit
    return full // tp
