"""The TP bug catalogue: every injectable fault (`freetoken_verify.faults.FAULTS`) with the bundled
case
and TP sizes where it bites, the checks that must catch it and the words its failing row must
contain. `tests/verify/test_catalogue.py` proves each entry; `python -m
freetoken_verify.running.catalogue_run` prints the verdicts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One TP bug class: inject `fault` into `model` and run `checks` at `tp` (TP=1 too when
    `tp1_green`) on `device`: every TP size in `tp` must fail a row whose message matches
    `words` (a regex naming the module, tensor or rank); at TP=1 every row must pass. The run
    is bitwise wherever the tp_invariant mode runs, as on the command line, in `dtype`;
    `bitwise_only`: the same run with `--no-bitwise` passes (measured; docs/verification.md)."""

    bug_class: str
    fault: str
    model: str
    tp: tuple[int, ...]
    checks: tuple[str, ...]
    words: str
    tp1_green: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    bitwise_only: bool = False


CATALOGUE: tuple[Entry, ...] = (
    Entry("row-parallel bias added on every rank", "row-bias-before-allreduce", "tiny-llama",
          (2,), ("golden",), r"first divergence: prefill/model\.layers\.0\.self_attn\.o_proj"),
    Entry("ranks sample independently", "sample-per-rank", "tiny-qwen3", (2,), ("golden",),
          r"rank 1 produced"),
    Entry("GDN value dims sized from key dims", "gdn-value-dim-from-key-dim", "tiny-qwen3.5-moe",
          (1, 2), ("golden",), r"linear_attn", tp1_green=False),
    Entry("vocab range check off by one", "embedding-range-inclusive", "tiny-qwen3", (2, 4),
          ("golden",), r"first divergence: prefill/model\.embed_tokens"),
    Entry("embedding all-reduce missing", "embedding-missing-allreduce", "tiny-llama", (2,),
          ("bisect",), r"model\.embed_tokens \(rank 1 holds a different"),
    Entry("shared expert added after the MoE all-reduce", "shared-expert-after-allreduce",
          "tiny-qwen3.5-moe", (2,), ("golden",), r"divergence: prefill/model\.layers\.0\.mlp "),
    Entry("LM head keeps the vocab padding", "lm-head-padding-kept", "tiny-llama", (2,),
          ("bisect",), r"lm_head"),
    Entry("one layer family misses its all-reduce", "gdn-out-proj-unreduced", "tiny-qwen3.5-moe",
          (2,), ("bisect",), r"linear_attn\.out_proj \(rank 1 holds a different"),
    Entry("row-parallel input columns from the wrong rank", "o-proj-next-rank", "tiny-llama",
          (2,), ("bisect",), r"self_attn\.o_proj"),
    Entry("expert down_proj split on the wrong dim", "expert-down-split-rows", "tiny-qwen3-moe",
          (2,), ("golden",), r"down_proj"),
    Entry("row-parallel all-reduce dropped", "drop-allreduce", "tiny-qwen3", (2,), ("bisect",),
          r"self_attn\.o_proj \(rank 1 holds a different"),
    Entry("MoE routed and shared reduced separately", "moe-reduce-separately",
          "tiny-qwen3.5-moe", (2,), ("collectives",), r"model\.layers\.0\.mlp: .*doubled"),
    Entry("embedding reduced twice", "embedding-extra-allreduce", "tiny-llama", (2,),
          ("collectives",), r"model\.embed_tokens: .*doubled"),
    Entry("LM head gather missing", "lm-head-no-gather", "tiny-qwen3", (2,), ("collectives",),
          r"lm_head: .*missing"),
    Entry("all-reduce on a contiguous copy", "allreduce-contiguous-copy", "tiny-llama", (2,),
          ("collectives",), r"Communicator\.all_reduce on a"),
    Entry("A_log / dt_bias from the first value heads", "gdn-heads-from-first",
          "tiny-qwen3.5-moe", (2,), ("shards",), r"linear_attn\.A_log rank 1"),
    Entry("GDN z|b|a packed and cut in plain chunks", "plain-chunk-gdn-zba", "tiny-qwen3.5-moe",
          (2,), ("golden", "shards"), r"in_proj_[zba]\.weight rank"),
    Entry("shared-expert gate|up split as one plain chunk", "plain-chunk-shared-gate-up",
          "tiny-qwen3.5-moe", (2,), ("golden", "shards"), r"shared_expert"),
    Entry("NVFP4 block scales split off their 16-input group", "block-scale-group-shifted",
          "tiny-qwen3.5-moe-nvfp4", (2,), ("shards",), r"weight_scale rank 1"),
    Entry("torch NVFP4 backend reads nibbles swapped", "torch-nvfp4-nibble-swap", "tiny-llama",
          (1,), ("kernels",), r"torch NVFP4 backend disagrees", tp1_green=False),
    Entry("torch NVFP4 backend drops the w13 global scale", "torch-nvfp4-drop-w13-global",
          "tiny-llama", (1,), ("kernels",), r"torch NVFP4 backend disagrees", tp1_green=False),
    Entry("dense gate|up split as one plain chunk", "plain-chunk-gate-up", "tiny-llama", (2,),
          ("golden",), r"first divergence: prefill/model\.layers\.0\.mlp\.gate_up_proj"),
    Entry("expert gate|up split as one plain chunk", "plain-chunk-expert-gate-up",
          "tiny-qwen3-moe", (2,), ("golden",), r"mlp\.experts"),
    Entry("KV head on the wrong rank", "kv-head-wrong-rank", "tiny-llama", (4,), ("golden",),
          r"self_attn\.qkv_proj"),
    Entry("GDN in_proj_qkv split as one plain chunk", "plain-chunk-gdn-qkv", "tiny-qwen3.5-moe",
          (2,), ("golden",), r"linear_attn\.in_proj"),
    Entry("GDN conv1d split as one plain chunk", "plain-chunk-gdn-conv1d", "tiny-qwen3.5-moe",
          (2,), ("golden",), r"linear_attn\.conv1d"),
    Entry("gated-attention q|gate split at the midpoint", "plain-chunk-q-gate", "tiny-qwen3.5-moe",
          (2,), ("golden",), r"self_attn\.qkv_proj", tp1_green=False),
    Entry("replicated tensors split", "split-replicated", "tiny-qwen3", (2,),
          ("golden", "shards"), r"layernorm|norm\.weight"),
    Entry("vocab padding dropped", "vocab-pad-dropped", "tiny-llama", (2, 4),
          ("golden", "shards"), r"embed_tokens|lm_head"),
    Entry("shards are views of the checkpoint", "shard-views", "tiny-llama", (1, 2),
          ("shards",), r"view", tp1_green=False),
    Entry("loader pins the checkpoint", "pin-checkpoint-views", "tiny-llama", (1, 2),
          ("memory",), r"pins", tp1_green=False),
    Entry("KV cache sized with the global KV heads", "kv-cache-global-heads", "tiny-llama",
          (2,), ("memory",), r"KV cache is \d+ bytes"),
    Entry("GatedDeltaNet state sized with the global value heads", "gdn-state-global-heads",
          "tiny-qwen3.5-moe", (2,), ("memory",), r"GatedDeltaNet recurrent state is \d+ bytes"),
    Entry("NVFP4 nibbles swapped", "nvfp4-nibble-swap", "tiny-llama", (1,), ("kernels",),
          r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 down global scale dropped", "nvfp4-drop-global-scale", "tiny-llama", (1,),
          ("kernels",), r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 gate/up global scales swapped", "nvfp4-gate-up-globals-swapped", "tiny-llama",
          (1,), ("kernels",), r"kernel|nvfp4", tp1_green=False),
    Entry("NVFP4 intermediate size off by a group", "nvfp4-intermediate-off-by-group",
          "tiny-llama", (1,), ("kernels",), r"kernel|nvfp4", tp1_green=False),
    Entry("paged attention reads the block table with a wrong row stride",
          "paged-attention-table-stride", "tiny-llama", (1,), ("kernels",),
          r"engine kernels .*paged_attention tp=\d \((decode|prefill), heads \d+, kv heads",
          tp1_green=False),
    Entry("bf16 fused MoE multiplies the next expert's weights", "fused-moe-expert-offset",
          "tiny-llama", (1,), ("kernels",),
          r"engine kernels .*fused_moe tp=\d \(experts \d+, top_k", tp1_green=False),
    Entry("GatedDeltaNet decode kernel on the wrong state slot", "gdn-decode-state-slot",
          "tiny-llama", (1,), ("kernels",),
          r"engine kernels .*gated_delta_decode tp=\d \(key heads \d+, value heads",
          tp1_green=False),
    Entry("NVFP4 gate/up global scales swapped at load", "nvfp4-load-globals-swapped",
          "tiny-qwen3.5-moe-nvfp4", (1, 2), ("golden", "shards"), r"weight_scale_2",
          tp1_green=False),
    Entry("CUDA graph static input not refreshed", "graph-stale-positions", "tiny-llama", (1,),
          ("golden",), r"CUDA graph replay differs from eager decode at batch \d+: prompt \d+ "
          r"step \d+", tp1_green=False, device="cuda"),
    Entry("invariant reduction summed left to right on one rank",
          "invariant-leaves-left-to-right", "tiny-qwen3-moe", (2,), ("golden",),
          r"tp=1: .*differ bit for bit", bitwise_only=True),
    Entry("one fused segment's per-tensor FP8 scale used for every segment",
          "fp8-tensor-first-scale-for-all", "tiny-llama", (1,), ("kernels",),
          r"quantized GEMMs in float32: 8 / \d+ .*first: FP8 per-tensor \(modelopt\) "
          r"qkv_proj \(q \| gate \| k \| v\) tp=1 rank 0", tp1_green=False),
    Entry("one fused segment's NVFP4 global used for every segment",
          "nvfp4-linear-first-global-for-all", "tiny-llama", (1,), ("kernels",),
          r"quantized GEMMs in float32: 16 / \d+ .*first: NVFP4 \(modelopt\) qkv_proj",
          tp1_green=False),
    Entry("compressed-tensors NVFP4 divisor global used as a multiplier",
          "nvfp4-divisor-as-multiplier", "tiny-llama", (1,), ("kernels",),
          r"quantized GEMMs in float32: .*first: NVFP4 \(compressed-tensors\) ",
          tp1_green=False),
    Entry("block-FP8 partial block's scale read one block early",
          "fp8-block-partial-off-by-one", "tiny-llama", (1,), ("kernels",),
          r"quantized GEMMs in float32: .*first: FP8 block 24x40 \(fp8\) ", tp1_green=False),
    Entry("block-FP8 routed experts scaled by the next expert's block scales",
          "fp8-moe-scale-wrong-expert", "tiny-llama", (1,), ("kernels",),
          r"quantized GEMMs in float32: 4 / \d+ .*first: FP8 block 24x40 \(fp8\) routed "
          r"experts tp=1 rank 0", tp1_green=False),
    Entry("a fused destination's per-tensor FP8 scales all written into its first segment",
          "fp8-scale-first-segment", "tiny-qwen3.5-moe-mixed", (1, 2), ("memory", "shards"),
          r"weight_scale", tp1_green=False),
    Entry("block-scale rows of a rank taken at rank x rows instead of its first block",
          "block-scale-rank-offset", "tiny-qwen3.5-moe-fp8", (8,), ("memory", "shards"),
          r"weight_scale_inv"),
    Entry("a rank sharing a scale block with its neighbour reads the next block",
          "block-scale-shared-neighbour", "tiny-qwen3.5-moe-fp8", (8,), ("memory", "shards"),
          r"weight_scale_inv"),
    Entry("q|gate block-scale rows not moved with their head", "q-gate-scale-rows-unmoved",
          "tiny-qwen3.5-moe-fp8", (1, 2), ("memory", "shards"), r"q_proj\.weight_scale_inv",
          tp1_green=False),
    Entry("one segment's NVFP4 global scale loaded for every segment",
          "nvfp4-global-first-segment", "tiny-qwen3.5-moe-nvfp4-ct", (1, 2),
          ("memory", "shards"), r"weight_global_scale", tp1_green=False),
    Entry("quantized weights dequantized at load", "dequantize-at-load", "tiny-qwen3.5-moe-fp8",
          (1, 2), ("memory",), r"expected \d+ bytes from the config", tp1_green=False),
    Entry("quantized shards kept as views of the full checkpoint tensors",
          "quantized-shard-views", "tiny-qwen3.5-moe-fp8", (2,), ("memory",), r"view|pins|own"),
    Entry("a split-name ignore list not mapped onto the fused module",
          "ignore-split-names-unmapped", "tiny-qwen3.5-moe-nvfp4-ct", (1, 2),
          ("golden", "shards"), r"linear_attn\.in_proj", tp1_green=False),
    Entry("GatedDeltaNet in_proj_b / in_proj_a given in_proj_qkv's quantized format",
          "gdn-ba-takes-qkv-format", "tiny-qwen3.5-moe-fp8", (1, 2), ("golden",),
          r"in_proj_[ba]", tp1_green=False),
    Entry("GDN post-conv split with the global key/value sizes (a crash)",
          "gdn-split-global-sizes", "tiny-qwen3.5-moe", (2,), ("golden",),
          r"rank \d: RuntimeError: split_with_sizes .*\[in model\.layers\.0\.linear_attn; "
          r"freetoken/models/qwen3_5_moe/gdn\.py:\d+ in _heads\]"),
    Entry("block tables one row off when several sequences decode together",
          "decode-block-tables-row-offset", "tiny-llama", (1, 2), ("golden",),
          r"first divergence: batched step \d+ \(decode of prompts 0, 1, 2\)/"
          r"model\.layers\.0\.self_attn\.o_proj", tp1_green=False),
    Entry("invariant all-reduce sums bf16 partials", "invariant-bf16-wire", "tiny-qwen3-moe",
          (2,), ("golden",), r"prefill/model\.layers\.0\.self_attn\.o_proj "
          r"\(\d+ / \d+ elements differ bit for bit from TP=1", dtype="bfloat16",
          bitwise_only=True),
    Entry("a rank's subtree sum rounded to bf16 before the reduction", "invariant-subtree-bf16",
          "tiny-qwen3-moe", (2,), ("golden",), r"prefill/model\.layers\.0\.self_attn\.o_proj "
          r"\(\d+ / \d+ elements differ bit for bit from TP=1.*the reduction differs",
          dtype="bfloat16", bitwise_only=True),
    Entry("tree order swapped on one rank", "invariant-tree-order-swapped", "tiny-qwen3-moe",
          (2,), ("golden",), r"prefill/model\.layers\.0\.self_attn\.o_proj "
          r"\(\d+ / \d+ elements differ bit for bit from TP=1.*the reduction differs",
          dtype="float32", bitwise_only=True),
    Entry("column tiling that depends on the number of columns", "invariant-tiles-by-width",
          "tiny-llama", (2,), ("golden",),
          r"first divergence: prefill/lm_head \(\d+ / \d+ elements differ bit for bit",
          dtype="float32", bitwise_only=True),
    Entry("rotary angles in bf16 on ranks > 0", "rotary-bf16-on-ranks", "tiny-llama", (2,),
          ("golden",), r"prefill/model\.layers\.0\.self_attn\.attn "
          r"\(\d+ / \d+ elements differ bit for bit from TP=1", dtype="bfloat16",
          bitwise_only=True),
    Entry("q/k norm variance in bf16 on ranks > 0", "qk-norm-variance-bf16-on-ranks",
          "tiny-qwen3", (2,), ("golden",), r"prefill/model\.layers\.0\.self_attn\.q_norm "
          r"\(\d+ / \d+ elements differ bit for bit from TP=1", dtype="bfloat16",
          bitwise_only=True),
)
