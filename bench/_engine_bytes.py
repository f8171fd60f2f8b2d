"""What `engine_decode.py` needs beyond timing: the Qwen3.5-MoE real-dimension checkpoint
(written fast, on the GPU) and the bytes one decode step must read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from freetoken import SamplingParams


def _expert_modules(model) -> list:
    """The routed-expert modules (16-bit, NVFP4 or block FP8): each has `num_experts` and
    stacks its parameters on a leading expert dim."""
    return [m for m in model.modules() if hasattr(m, "num_experts") and
            any(p.dim() and p.shape[0] == m.num_experts for p in m.parameters(recurse=False))]


def write_qwen_realdims(folder: Path, num_layers: int, device: str) -> Path:
    """`qwen3.5-moe-realdims` (freetoken_verify.cases.qwen3_5_moe.REAL_TEXT, Qwen3.6-35B-A3B's text
    dimensions) cut to `num_layers` layers (GatedDeltaNet, full attention, alternating from
    the real 3:1 pattern's first and fourth), with HF's own random init built on `device`
    in bfloat16: seconds instead of the minutes `freetoken_verify.cases.catalogue --realdims` spends
    re-randomising on the CPU. HF's init leaves the router near uniform, so tokens hit
    experts about uniformly at random; `experts_hit` counts the experts actually hit."""
    from freetoken_verify.cases.qwen3_5_moe import REAL_TEXT, _conditional_generation

    pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    text = dict(REAL_TEXT, num_hidden_layers=num_layers,
                layer_types=[pattern[i % 4] if num_layers > 2 else REAL_TEXT["layer_types"][i]
                             for i in range(num_layers)])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = _conditional_generation(text, eos=1).eval()
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder, max_shard_size="1000GB")   # one file (the format writers')
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def experts_hit(llm, prompts: list[list[int]], new_tokens: int) -> float | None:
    """Mean distinct routed experts per MoE layer and decode step, counted by hooks in one
    eager run of the same prompts (in-process engine only; None without routed experts)."""
    core = llm._core
    experts = [] if core is None else _expert_modules(core.model)
    if not experts:
        return None
    counts: list[int] = []

    def hook(module, args):
        if args[0].shape[0] == len(prompts):
            counts.append(int(args[2].unique().numel()))

    handles = [m.register_forward_pre_hook(hook) for m in experts]
    graphs, core.graphs = core.graphs, None
    try:
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    finally:
        core.graphs = graphs
        for h in handles:
            h.remove()
    return sum(counts) / len(counts) if counts else None


def step_bytes(llm, batch: int, context_len: int, hit: float | None) -> float | None:
    """Bytes one decode step reads at least: every weight except the embedding table (of
    which `batch` rows), only the routed experts hit, each layer's cached keys and values
    of `context_len` positions per sequence and each linear-attention state once."""
    core = llm._core
    if core is None:
        return None
    model, total = core.model, 0.0
    expert_params = {id(p): m for m in _expert_modules(model)
                     for p in m.parameters(recurse=False) if p.shape[0] == m.num_experts}
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        elif id(p) in expert_params:
            total += size / expert_params[id(p)].num_experts * (hit or 0)
        else:
            total += size
    for attn in model.attention_layers():
        total += 2 * batch * context_len * attn.num_kv_heads * attn.head_dim * \
            attn.k_cache.element_size()
    for layer in getattr(model, "linear_state_layers", list)():
        per_slot = (layer.recurrent_state[0].numel() * 4
                    + layer.conv_state[0].numel() * layer.conv_state.element_size())
        total += batch * per_slot
    return total
