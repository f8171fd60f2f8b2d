"""Re-randomised weights for the bundled cases: HF's init leaves norms at 0 or 1 and routers
near uniform, which hides bugs."""

from __future__ import annotations

import torch


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's init (norms at 1, routers near uniform) with values that make every
    parameter matter: norms 1 + N(0, 0.2) (for `1 + w` norms, which HF initialises at 0,
    w ~ N(0, 0.2): the same effective scale), embeddings N(0, 1), routers N(0, 2/sqrt(fan_in)),
    other matrices N(0, 1/sqrt(fan_in)). GatedDeltaNet decay parameters get
    A_log ~ N(-1.5, 0.8) and dt_bias ~ N(-1, 0.5), so heads range from forgetting within a
    few tokens to remembering across the whole prompt (HF's init forgets almost at once)."""
    gen = torch.Generator().manual_seed(seed)
    offset_norms = _offset_norm_weights(model)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            value = -1.5 + 0.8 * noise
        elif name.endswith("dt_bias"):
            value = -1.0 + 0.5 * noise
        elif name in offset_norms:
            value = 0.2 * noise
        elif p.dim() == 1:
            value = 1.0 + 0.2 * noise
        elif "embed_tokens" in name:
            value = noise
        elif name.endswith("mlp.gate.weight"):
            value = noise * 2.0 / p.shape[-1] ** 0.5
        else:
            value = noise / p.shape[-1] ** 0.5
        with torch.no_grad():
            p.copy_(value.to(p.dtype))


def _offset_norm_weights(model: torch.nn.Module) -> set[str]:
    """RMSNorm weights applied as `1 + w`: the ones HF initialises to zero."""
    return {f"{prefix}.weight" for prefix, m in model.named_modules()
            if "RMSNorm" in type(m).__name__ and isinstance(getattr(m, "weight", None),
                                                             torch.nn.Parameter)
            and not bool(m.weight.detach().any())}
