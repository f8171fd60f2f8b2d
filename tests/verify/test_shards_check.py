"""The shards check catches each load-time TP bug before any forward pass, naming the tensor:
a shard returned as a view, a replicated tensor that got split, the vocab pad dropped, KV-head
replication off by one rank, and a packed gate|up filled with a plain chunk."""

from __future__ import annotations

import json

import pytest

from verify.cli import main


def _shards_results(capsys, tmp_path, *args: str) -> tuple[int, list[dict]]:
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--report-json", str(report)])
    capsys.readouterr()
    results = json.loads(report.read_text())["results"]
    return exit_info.value.code, [r for r in results if r["check"] == "shards"]


@pytest.mark.parametrize("fault, tp, checks, tensor", [
    ("shard-views", 2, "shards", "view pinning"),
    ("split-replicated", 2, "shards", "input_layernorm.weight"),
    ("vocab-pad-dropped", 4, "shards", "lm_head.weight: rank 3's shard has shape (73, 64)"),
    ("kv-head-wrong-rank", 4, "shards", "self_attn.k_proj.weight: rank 0 should hold KV head 0"),
    ("plain-chunk-gate-up", 2, "golden,shards", "mlp.up_proj.weight"),
])
def test_shards_check_fails_on_injected_load_bug(capsys, tmp_path, fault, tp, checks, tensor):
    """With the fault injected the shards row fails and its message names the tensor."""
    code, rows = _shards_results(capsys, tmp_path, "--model", "tiny-qwen3-moe", "--tp", str(tp),
                                 "--checks", checks, "--inject", fault)
    assert code == 1, f"{fault}: expected exit 1, got {code}"
    assert rows and rows[0]["status"] == "fail", f"{fault}: shards did not fail: {rows}"
    assert tensor in rows[0]["message"], f"{fault}: message does not name {tensor!r}: {rows}"
    assert rows[0]["metrics"]["problems"] > 0


def test_shards_check_passes_at_every_tp_size(capsys, tmp_path):
    """Without faults every bundled tensor round-trips at TP 1, 2, 4 and 8, replicated tensors
    agree, coverage is exact, and (golden having loaded the engine) loaded == planned."""
    code, rows = _shards_results(capsys, tmp_path, "--model", "tiny-llama", "--tp", "1,2,4,8",
                                 "--checks", "golden,shards")
    assert code == 0, rows
    assert [r["tp"] for r in rows] == [1, 2, 4, 8]
    for r in rows:
        assert r["status"] == "pass" and r["metrics"]["problems"] == 0, r
        assert r["metrics"]["loaded_compared"] == r["metrics"]["tensors"] * r["tp"], r
