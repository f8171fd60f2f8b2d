"""The memory check: parameters must own their storage, each rank holds exactly the bytes the
config implies (parameters, KV cache of the local KV heads, GatedDeltaNet state of the local
value heads), and load-time memory growth per rank stays within the expected bytes plus what
the loader needs on the side (nothing on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from freetoken_verify.cli import main


def _memory_results(capsys, tmp_path, *args: str) -> tuple[int, list[dict]]:
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--checks", "memory", "--report-json", str(report)])
    capsys.readouterr()
    return exit_info.value.code, json.loads(report.read_text())["results"]


def _make_deep_llama(folder, layers=4, hidden=512, inter=2048, vocab=32768):
    """A ~190 MiB Llama checkpoint (embedding and head 64 MiB each, the rest mid-sized),
    written straight with safetensors (fast): pinning it whole on every rank, or one extra
    copy of its largest shard, cannot hide inside the budget."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=256).save_pretrained(folder)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (128, hidden),
            p + "self_attn.v_proj.weight": (128, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=gen) for k, s in shapes.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """`_make_deep_llama`'s checkpoint, written once for the tests that only read it."""
    return _make_deep_llama(tmp_path_factory.mktemp("deep"))


def test_bundled_cases_within_budget_at_every_tp(capsys, tmp_path):
    """Every bundled case loads within budget at TP 1, 2, 4 and 8 and owns all its storage;
    each result reports expected and measured bytes for every rank."""
    code, results = _memory_results(capsys, tmp_path, "--tp", "1,2,4,8")
    assert code == 0, [r["message"] for r in results if r["status"] != "pass"]
    for r in results:
        per_rank = r["metrics"]["per_rank"]
        assert len(per_rank) == r["tp"], r
        for rank in per_rank:
            assert 0 < rank["expected"] and rank["peak_host"] <= rank["budget_host"], rank


def test_pinned_views_fail_ownership_naming_the_parameter(capsys, tmp_path):
    """Parameters left as views of checkpoint tensors fail (a), naming the parameter."""
    code, results = _memory_results(capsys, tmp_path, "--model", "tiny-llama", "--tp", "2",
                                    "--inject", "pin-checkpoint-views")
    assert code == 1 and results[0]["status"] == "fail", results
    message = results[0]["message"]
    assert "does not own its storage" in message or "memory-mapped" in message, message
    assert "model." in results[0]["message"] or "lm_head" in results[0]["message"]


def test_kept_shard_copies_blow_the_budget(capsys, tmp_path, deep_llama):
    """A loader that keeps its shards after copying them holds the weights twice: on a ~190
    MiB checkpoint at TP 2 measured growth exceeds the budget (b) and the message says by how
    much, while the honest loader stays inside it."""
    folder = deep_llama
    code, results = _memory_results(capsys, tmp_path, "--model", str(folder), "--tp", "2")
    assert code == 0, results[0]["message"]
    code, results = _memory_results(capsys, tmp_path, "--model", str(folder), "--tp", "2",
                                    "--inject", "keep-shard-copies")
    per_rank = results[0]["metrics"]["per_rank"]
    assert code == 1 and all(r["peak_host"] > r["budget_host"] for r in per_rank), per_rank
    assert "host memory grew" in results[0]["message"], results[0]["message"]


def test_double_copy_fails_naming_the_tensor_at_the_peak(capsys, tmp_path, deep_llama):
    """The loader copies each shard straight into its parameter, so host growth stays within
    the expected bytes plus slack; the old path (build each shard, then copy it) overshoots by
    the largest shard, and the message names the tensor being copied at the peak."""
    folder = deep_llama
    code, results = _memory_results(capsys, tmp_path, "--model", str(folder), "--tp", "1")
    assert code == 0, results[0]["message"]
    code, results = _memory_results(capsys, tmp_path, "--model", str(folder), "--tp", "1",
                                    "--inject", "double-copy-load")
    message = results[0]["message"]
    assert code == 1 and "host memory grew" in message and "while copying" in message, message
    assert "copying model.embed_tokens.weight" in message or "copying lm_head.weight" in message, \
        message


@pytest.mark.parametrize("fault, model, part", [
    ("kv-cache-global-heads", "tiny-llama", "KV cache"),
    ("gdn-state-global-heads", "tiny-qwen3.5-moe", "GatedDeltaNet recurrent state"),
])
def test_cache_sized_from_global_heads_fails_naming_the_part(capsys, tmp_path, fault, model,
                                                              part):
    """A per-rank cache sized with a global head count is what TP=1 holds: green at TP 1, red
    at TP 2 with a message naming the part and its expected and actual bytes (expected from
    the config, not from what the engine allocated)."""
    code, results = _memory_results(capsys, tmp_path, "--model", model, "--tp", "1,2",
                                    "--inject", fault)
    by_tp = {r["tp"]: r for r in results}
    assert code == 1 and by_tp[1]["status"] == "pass", by_tp[1]
    assert by_tp[2]["status"] == "fail", by_tp[2]
    rank = by_tp[2]["metrics"]["per_rank"][0]
    actual, expected = rank["actual_parts"][part], rank["expected_parts"][part]
    assert actual == 2 * expected, rank
    message = by_tp[2]["message"]
    assert f"{part} is {actual} bytes" in message and f"expected {expected} bytes" in message, \
        message


def test_split_part_compared_with_tp1_over_n():
    """A split part that is not 1/N of TP=1's fails twice: against the config's bytes, and as
    a ratio to TP=1's share; a part whose padding explains the excess passes."""
    from freetoken_verify.checks.memory.check import _expectation_failures
    from freetoken_verify.checks.memory.expected import Part

    kv = Part("KV cache", 1000, "formula", 1000, 2000)
    failures = _expectation_failures({"KV cache": 2000}, {"KV cache": kv}, rank=1, size=2)
    assert len(failures) == 2, failures
    assert "KV cache is 2000 bytes" in failures[0] and "expected 1000 bytes" in failures[0]
    assert "2.00x TP=1's x 1/2" in failures[1], failures[1]
    padded = Part("parameters", 1100, "formula", 1010, 2000)
    assert _expectation_failures({"parameters": 1100}, {"parameters": padded}, 0, 2) == []


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from quant_folders import harness_folders

    return harness_folders(tmp_path_factory.mktemp("quantized"))


def test_quantized_bytes_follow_the_format_rules(quantized):
    """Bytes from the config alone, counted by hand for block FP8 (24 x 40 blocks) at TP 8 on
    rank 2: q_proj's scale one float32 row per weight row (64 rows x 2 column blocks);
    in_proj_qkv's q, k, v scale rows counted per segment, blocks shared with a neighbour
    rank counted (q 2, k 2, v 2), every rank holding the most any needs; the e4m3 weight one
    byte an element; the ModelOpt NVFP4 lm_head packed two to a byte with one e4m3 scale per
    16 inputs and a float32 global."""
    from freetoken.models.registry import load_config
    from freetoken_verify.checks.memory.quantized import owners, tensor_bytes

    p = "model.language_model.layers"
    cfg = load_config(quantized["block-fp8"])
    owner = owners(cfg)

    def size(module: str, suffix: str, cfg=cfg, owner=owner, rank=2, tp=8) -> int:
        return tensor_bytes(cfg, owner[module], f"{module}.{suffix}", rank, tp)[0]

    assert size(f"{p}.1.self_attn.q_proj", "weight_scale_inv") == 64 * 2 * 4
    assert size(f"{p}.1.self_attn.q_proj", "weight") == 64 * 64
    assert size(f"{p}.0.linear_attn.in_proj_qkv", "weight_scale_inv") == (2 + 2 + 2) * 2 * 4
    assert size(f"{p}.0.linear_attn.in_proj_z", "weight_scale_inv") == 1 * 2 * 4
    assert size(f"{p}.0.mlp.experts.3.down_proj", "weight_scale_inv") == 3 * 1 * 4
    mixed = load_config(quantized["modelopt-mixed"])
    head = owners(mixed)["lm_head"]
    assert tensor_bytes(mixed, head, "lm_head.weight", 7, 8)[0] == 38 * 64 // 2
    assert tensor_bytes(mixed, head, "lm_head.weight_scale", 7, 8)[0] == 38 * 4
    assert tensor_bytes(mixed, head, "lm_head.weight_scale_2", 7, 8)[0] == 4


def test_quantized_folders_within_budget_at_every_tp(capsys, tmp_path, quantized):
    """Block FP8 (Qwen3.5-MoE and Llama), ModelOpt mixed NVFP4 + FP8, compressed-tensors
    NVFP4 and ModelOpt FP8 Llama load at TP 1, 2, 4 and 8 in bf16 holding exactly the bytes
    their formats give every parameter (scales float32 while the rest is bf16), within
    budget; each rank reports its parameter bytes per format."""
    code, results = _memory_results(capsys, tmp_path, "--model",
                                    ",".join(str(f) for f in quantized.values()),
                                    "--tp", "1,2,4,8", "--dtype", "bfloat16")
    assert code == 0, [r["message"] for r in results if r["status"] != "pass"]
    assert len(results) == 4 * len(quantized)
    formats = {f for r in results for rank in r["metrics"]["per_rank"]
               for f in rank["parameter_formats"]}
    assert {"FP8 block 24x40 (fp8)", "FP8 per-tensor (modelopt)", "NVFP4 (modelopt)",
            "NVFP4 (compressed-tensors)", "bf16 (unquantized)"} <= formats, formats


def test_dequantize_at_load_fails_naming_the_parameter(capsys, tmp_path, quantized):
    """Quantized layers that dequantize at load (outputs unchanged, weights 4x to 8x larger
    in fp32) fail memory at TP 1 and 2 in every format, naming a parameter of a quantized
    layer with its dtype, shape and the bytes its format gives it."""
    models = [quantized[n] for n in ("block-fp8", "modelopt-mixed", "ct-nvfp4")]
    code, results = _memory_results(capsys, tmp_path, "--model",
                                    ",".join(map(str, models)), "--tp", "1,2",
                                    "--inject", "dequantize-at-load")
    assert code == 1 and all(r["status"] == "fail" for r in results), results
    for r in results:
        message = r["message"]
        assert "rank 0: parameter " in message and "(float32 [" in message, message
        assert "expected" in message and "from the config: " in message, message
        assert any(f in message for f in ("FP8 block", "NVFP4")), message


def test_quantized_shard_views_fail_ownership(capsys, tmp_path, quantized):
    """Quantized weights kept as narrow() views of a full-size buffer fail (a) at TP 2,
    naming the parameter and the bytes its view pins."""
    code, results = _memory_results(capsys, tmp_path, "--model", str(quantized["block-fp8"]),
                                    "--tp", "2", "--inject", "quantized-shard-views")
    assert code == 1 and results[0]["status"] == "fail", results
    message = results[0]["message"]
    assert "does not own its storage" in message and ".weight" in message, message
