"""The memory check: parameters must own their storage, and load-time memory growth per rank
must stay within the budget computed from the rank's own bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from verify.cli import main


def _memory_results(capsys, tmp_path, *args: str) -> tuple[int, list[dict]]:
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--checks", "memory", "--report-json", str(report)])
    capsys.readouterr()
    return exit_info.value.code, json.loads(report.read_text())["results"]


def _make_deep_llama(folder, layers=8, hidden=512, inter=2048, vocab=8192):
    """A ~150 MiB Llama checkpoint of many mid-sized tensors (largest 16 MiB), written straight
    with safetensors (fast): pinning it whole on every rank cannot hide inside the budget."""
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


def test_kept_shard_copies_blow_the_budget(capsys, tmp_path):
    """A loader that keeps its shards after copying them holds the weights twice: on a ~150
    MiB checkpoint at TP 2 measured growth exceeds the budget (b) and the message says by how
    much, while the honest loader stays inside it."""
    folder = _make_deep_llama(tmp_path / "deep")
    code, results = _memory_results(capsys, tmp_path, "--model", str(folder), "--tp", "2")
    assert code == 0, results[0]["message"]
    code, results = _memory_results(capsys, tmp_path, "--model", str(folder), "--tp", "2",
                                    "--inject", "keep-shard-copies")
    per_rank = results[0]["metrics"]["per_rank"]
    assert code == 1 and all(r["peak_host"] > r["budget_host"] for r in per_rank), per_rank
    assert "host memory grew" in results[0]["message"], results[0]["message"]
