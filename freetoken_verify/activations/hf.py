"""HF transformers' per-module activations on one sequence, named as the engine's modules.

HF keeps q, k and v (and gate and up, and GatedDeltaNet's four input projections) as separate
modules where the engine fuses them; the engine's fused output is HF's outputs concatenated,
with the gated-attention q_proj's per-head `[q_h | gate_h]` rows regrouped as the engine holds
them (`[q | gate]`). Modules with no HF counterpart of the same shape are not compared."""

from __future__ import annotations

import torch

from freetoken_verify.activations.engine import flat

# Engine leaf name -> the HF leaves whose outputs, concatenated, are its output; where the
# engine may split a destination into GEMMs of different formats (GatedDeltaNet's in_proj as
# a quantized [qkv | z] and an unquantized in_proj_ba), the shorter spelling follows.
FUSED = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"),),
    "gate_up_proj": (("gate_proj", "up_proj"),),
    "in_proj": (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                ("in_proj_qkv", "in_proj_z")),
    "in_proj_ba": (("in_proj_b", "in_proj_a"),),
}


@torch.inference_mode()
def hf_activations(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """HF module name -> its first floating output on `ids` as float32 `[rows, features]` on
    the CPU (rows are tokens where the output is per token), flattened as the engine's
    captures are (`freetoken_verify.activations.engine.flat`)."""
    out: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(_keep(out, name, len(ids))))
    try:
        model(torch.tensor([ids], device=model.device))
    finally:
        for h in handles:
            h.remove()
    return out


def _keep(out: dict, name: str, tokens: int):
    def hook(module, inputs, output):
        t = output[0] if isinstance(output, tuple) else output
        if isinstance(t, torch.Tensor) and name not in out and t.is_floating_point() \
                and t.dim() >= 2:
            out[name] = flat(t, tokens)
    return hook


def _per_token(t: torch.Tensor, tokens: int) -> torch.Tensor:
    """HF flattens some outputs over tokens and heads (the GatedDeltaNet norm gives
    `[tokens * heads, head_dim]`); the engine keeps one row per token."""
    if t.shape[0] != tokens and t.numel() % tokens == 0:
        return t.reshape(tokens, -1)
    return t


class NameMap:
    """Engine module name -> HF activation, for one HF model."""

    def __init__(self, hf_names: set[str], num_heads: int, head_dim: int):
        self.prefix = "model.language_model." if "model.language_model" in hf_names else "model."
        self.num_heads, self.head_dim = num_heads, head_dim

    def hf_names(self, engine_name: str) -> tuple[tuple[str, ...], ...]:
        """The HF module names whose outputs, concatenated, may be the engine module's
        (each spelling the engine has, longest first)."""
        name = engine_name
        if name.startswith("model."):
            name = self.prefix + name[len("model."):]
        head, _, leaf = name.rpartition(".")
        if leaf in FUSED:
            return tuple(tuple(f"{head}.{part}" for part in parts) for parts in FUSED[leaf])
        return ((name,),)

    def lookup(self, acts: dict[str, torch.Tensor], engine_name: str, tokens: int,
               width: int | None = None) -> torch.Tensor | None:
        """HF's activation for the engine module over `tokens` tokens (of `width` features
        when given: the spelling of a fused module that has them), or None where HF has no
        counterpart."""
        found = None
        for names in self.hf_names(engine_name):
            if not all(n in acts for n in names):
                continue
            parts = [acts[n] for n in names]
            if names[0].endswith(".q_proj") and len(names) == 3:
                parts[0] = self._regroup_q_gate(parts[0])
            found = torch.cat([_per_token(p, tokens) for p in parts], dim=1)
            if width is None or found.shape[1] == width:
                return found
        return found

    def _regroup_q_gate(self, q: torch.Tensor) -> torch.Tensor:
        """A gated-attention q_proj output interleaves `[q_h | gate_h]` per head; the engine
        holds all q heads then all gates."""
        if q.shape[1] != 2 * self.num_heads * self.head_dim:
            return q
        per_head = q.view(q.shape[0], self.num_heads, 2, self.head_dim)
        return torch.cat([per_head[:, :, 0].reshape(q.shape[0], -1),
                          per_head[:, :, 1].reshape(q.shape[0], -1)], dim=1)
