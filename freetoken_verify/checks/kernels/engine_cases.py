"""The `kernels` check's engine-kernel cases (`freetoken_verify.checks.kernels.engine` runs them):
every
Triton kernel the engine takes on CUDA, at the TP-local shapes each model has at TP 1, 2, 4 and
8, derived from its config with the arithmetic its layers use (`divide`, `local_kv_heads`).

The models are the bundled cases and, on GPU, `qwen3.5-moe-realdims` (Qwen3.5-MoE's real
dimensions). The CPU matrix keeps one case per kernel and TP size, the models taking turns, and
one case for kernels whose shapes do not depend on TP (routing, alignment, the decoder norm);
the GPU matrix runs every distinct shape of every model at every TP size, with more tokens."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.distributed import divide
from freetoken.kernels.moe_align import ALIGN_MAX_PAIRS
from freetoken.layers.linear import local_kv_heads
from freetoken.models.qwen3_5_moe.config import qwen3_5_moe_config
from freetoken_verify.cases.catalogue import CASES, resolve_case
from freetoken_verify.cases.qwen3_5_moe import REAL_TEXT

TP_SIZES = (1, 2, 4, 8)
BLOCK_SIZE = 16
REALDIMS = "qwen3.5-moe-realdims"
FAMILIES = {"paged_attention": "paged_attention", "decode_rope": "paged_attention",
            "fused_moe": "fused_moe", "fused_moe_shared": "fused_moe", "route": "fused_moe",
            "align": "fused_moe",
            "gated_delta_decode": "delta_rule", "conv_update": "delta_rule",
            "rms_norm": "norm_rope", "gated_rms_norm": "norm_rope",
            "silu_and_mul": "norm_rope", "rotary": "norm_rope"}
"""Launcher -> the kernel family its metrics are grouped under."""

# Token counts (not part of a config). Attention: (query lens, context lens) per sequence,
# prefill covering a fresh prompt, a prompt continued from a cached prefix and one longer than
# a program's queries; decode contexts of one position, a block boundary and several blocks.
DECODE_CONTEXTS = {"cpu": (1, 16, 37), "cuda": (1, 16, 37, 300, 1300)}
PREFILL = {"cpu": ((7, 3, 37), (7, 19, 37)), "cuda": ((7, 3, 300), (7, 19, 300))}
# MoE tokens: one token (its own layout), decode tiles with the one-launch alignment, and more
# than 1024 (token, slot) pairs (the torch alignment and the prefill tiles).
MOE_TOKENS = {"cpu": (1, 7, 40, 600), "cuda": (1, 7, 64, 600)}


@dataclass(frozen=True)
class EngineCase:
    """One launch to check: `kernel` (a launcher of `freetoken.kernels`), the TP size whose
    rank-local shape it has (None: the shape is the same at every TP size), and its sizes."""

    kernel: str
    tp: int | None
    dims: tuple[tuple[str, object], ...]
    model: str

    def __getitem__(self, name: str):
        return dict(self.dims)[name]

    @property
    def family(self) -> str:
        return FAMILIES[self.kernel]

    @property
    def label(self) -> str:
        """`paged_attention tp=4 (decode, heads 2, kv heads 1, head_dim 32, block 16, ...)`."""
        sizes = ", ".join(_fmt(k, v) for k, v in self.dims)
        tp = "tp=any" if self.tp is None else f"tp={self.tp}"
        return f"{self.kernel} {tp} ({sizes})"


def _hashable(scaling: dict | None) -> tuple:
    """A rope scaling dict as sorted (key, value) pairs (nested values dropped)."""
    return tuple(sorted((k, v) for k, v in (scaling or {}).items()
                        if isinstance(v, (int, float, str))))


def _fmt(name: str, value) -> str:
    if name == "scaling":
        return f"{dict(value).get('rope_type', 'default')} scaling"
    if isinstance(value, bool):
        return name if value else f"no {name}"
    if isinstance(value, tuple):
        return f"{name} {'/'.join(str(v) for v in value)}"
    return value if name == "mode" else f"{name} {value}"


def model_configs(device_type: str) -> dict:
    """Model name -> ModelConfig: the bundled cases, and on GPU the real dimensions."""

    configs = {name: resolve_case(name).model_config for name in CASES}
    if device_type == "cuda":
        configs[REALDIMS] = qwen3_5_moe_config({"text_config": dict(REAL_TEXT)})
    return configs


def local_shapes(cfg, tp: int, device_type: str) -> list[tuple[str, tuple]]:
    """(kernel, dims) of every engine kernel launch `cfg`'s layers make on one rank of `tp`."""

    heads = divide(cfg.num_attention_heads, tp, "num_attention_heads")
    kv = local_kv_heads(cfg.num_key_value_heads, tp)
    qwen35 = cfg.arch == "qwen3_5_moe"  # its decoder and q/k norms weight by 1 + w
    attn = (("heads", heads), ("kv heads", kv), ("head_dim", cfg.head_dim))
    queries, contexts = PREFILL[device_type]
    out = [("paged_attention", (("mode", "decode"), *attn, ("block", BLOCK_SIZE),
                                ("contexts", DECODE_CONTEXTS[device_type]))),
           ("paged_attention", (("mode", "prefill"), *attn, ("block", BLOCK_SIZE),
                                ("queries", queries), ("contexts", contexts)))]
    rope = (("rotary_dim", cfg.rotary_dim), ("theta", cfg.rope_theta),
            ("scaling", _hashable(cfg.rope_scaling)))
    out.append(("rotary", (*attn, *rope)))
    # Decode attention with the rotary and the cache write folded in (the engine's decode),
    # and the model's q/k norms and Qwen3.5's output gate where it has them.
    qk_norm = ("1 + w" if qwen35 else "w") if cfg.qk_norm else "none"
    out.append(("decode_rope", (*attn, ("block", BLOCK_SIZE),
                                ("contexts", DECODE_CONTEXTS[device_type]), *rope,
                                ("qk_norm", qk_norm), ("gate", qwen35))))
    if cfg.qk_norm:
        out.append(("rms_norm", (("heads", heads), ("head_dim", cfg.head_dim),
                                 ("offset", qwen35))))
    out.append(("rms_norm", (("rows", cfg.hidden_size), ("offset", qwen35))))
    out += [("silu_and_mul", (("intermediate", divide(size, tp, what)),))
            for what, size in _gated_mlps(cfg)]
    if cfg.num_experts and not getattr(cfg, "nvfp4_experts", False):
        inter = divide(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
        out += [("fused_moe", (("experts", cfg.num_experts), ("top_k", cfg.num_experts_per_tok),
                               ("hidden", cfg.hidden_size), ("intermediate", inter),
                               ("tokens", t))) for t in MOE_TOKENS[device_type]]
        if qwen35:
            # One token's routed experts with the shared expert and its gate as one more slot
            # of the row kernels (the 16-bit decode step at batch 1), with and without the
            # decoder layer's residual added in the down launch.
            shared = divide(cfg.shared_expert_intermediate_size, tp,
                            "shared_expert_intermediate_size")
            out.append(("fused_moe_shared", (("experts", cfg.num_experts),
                                             ("top_k", cfg.num_experts_per_tok),
                                             ("hidden", cfg.hidden_size),
                                             ("intermediate", inter),
                                             ("shared intermediate", shared))))
        out.append(("route", (("experts", cfg.num_experts),
                              ("top_k", cfg.num_experts_per_tok), ("tokens", 9))))
        # Several blocks per expert where the experts are few, at most what the one-launch
        # alignment takes (the engine sorts more pairs with torch ops).
        out.append(("align", (("experts", cfg.num_experts),
                              ("pairs", min(130 * cfg.num_experts_per_tok, ALIGN_MAX_PAIRS)),
                              ("block", 16))))
    if qwen35:
        out += _gdn_shapes(cfg, tp)
    return out


def _gated_mlps(cfg) -> list[tuple[str, int]]:
    """(config key, full intermediate size) of the SiLU-gated MLPs outside the routed
    experts: Qwen3.5's shared expert, the dense MLP of any layer that is not MoE."""
    if cfg.arch == "qwen3_5_moe":
        return [("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)]
    if all(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers)):
        return []
    return [("intermediate_size", cfg.intermediate_size)]


def _gdn_shapes(cfg, tp: int) -> list[tuple[str, tuple]]:
    """GatedDeltaNet's decode launches: key and value heads split by rank, whole groups."""

    nk = divide(cfg.linear_num_key_heads, tp, "linear_num_key_heads")
    nv = divide(cfg.linear_num_value_heads, tp, "linear_num_value_heads")
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return [("gated_delta_decode", (("key heads", nk), ("value heads", nv), ("dk", dk),
                                    ("dv", dv), ("batch", 3), ("slots", 5))),
            ("conv_update", (("channels", 2 * nk * dk + nv * dv),
                             ("kernel", cfg.linear_conv_kernel_dim), ("batch", 3))),
            ("gated_rms_norm", (("heads", nv), ("dv", dv)))]


def _all_cases(device_type: str) -> list[EngineCase]:
    """Every distinct (kernel, TP size, dims), in model then TP order; a shape that does not
    change with TP (the same dims at every TP size) once, as tp=None."""
    by_key: dict[tuple, EngineCase] = {}
    for name, cfg in model_configs(device_type).items():
        per_tp = {tp: local_shapes(cfg, tp, device_type) for tp in TP_SIZES}
        for tp, shapes in per_tp.items():
            for kernel, dims in shapes:
                invariant = all((kernel, dims) in s for s in per_tp.values())
                key = (kernel, None if invariant else tp, dims)
                by_key.setdefault(key, EngineCase(kernel, key[1], dims, name))
    return list(by_key.values())


def gpu_matrix() -> list[EngineCase]:
    """Every distinct shape of every model (the real dimensions included) at every TP size."""
    return _all_cases("cuda")


def cpu_matrix() -> list[EngineCase]:
    """One case per kernel (and attention mode) and TP size, the models (and MoE token
    counts) taking turns across TP sizes; the TP-invariant shapes once each."""
    cases = _all_cases("cpu")
    groups: dict[tuple, list[EngineCase]] = {}
    for case in cases:
        mode = dict(case.dims).get("mode")
        groups.setdefault((case.kernel, mode, case.tp), []).append(case)
    picked = []
    for (_, _, tp), group in groups.items():
        picked += group if tp is None else [group[TP_SIZES.index(tp) % len(group)]]
    return picked

