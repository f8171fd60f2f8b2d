"""The shards check catches each load-time TP bug before any forward pass, naming the tensor,
the rank, the first wrong local row, the global row it holds and the one the layout puts
there: packed rows in the wrong slot (conv1d, in_proj_qkv, q|gate, [z|b|a], dense, expert and
shared-expert gate|up), per-head tensors from the wrong heads (A_log / dt_bias, KV heads),
NVFP4 block scales on the wrong group, the vocab pad dropped; also a shard returned as a view
and a replicated tensor split. With each TP-only fault injected TP=1 stays green, and without
faults every bundled case passes at every TP size."""

from __future__ import annotations

import json

import pytest

from freetoken_verify.cli import main

QWEN35 = "tiny-qwen3.5-moe"
L0 = "model.language_model.layers.0"


def _results(capsys, tmp_path, *args: str) -> tuple[int, list[dict]]:
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--report-json", str(report)])
    capsys.readouterr()
    results = json.loads(report.read_text())["results"]
    return exit_info.value.code, [r for r in results if r["check"] == "shards"]


# Bugs that bite at TP=1 too: the engine holds q_proj de-interleaved ([q | gate] of its heads)
# whatever the TP size, and a view pins its checkpoint tensor at any size.
NOT_TP_ONLY = ("plain-chunk-q-gate", "shard-views")


def _assert_caught(code: int, rows: list[dict], fault: str, tp: int, words: str) -> None:
    by_tp = {r["tp"]: r for r in rows}
    assert code == 1, f"{fault}: expected exit 1, got {code}: {rows}"
    tp1 = "fail" if fault in NOT_TP_ONLY else "pass"
    assert by_tp[1]["status"] == tp1, f"{fault}: TP=1 should {tp1}: {by_tp[1]}"
    bad = by_tp[tp]
    assert bad["status"] == "fail" and bad["metrics"]["problems"] > 0, f"{fault}: {bad}"
    assert words in bad["message"], f"{fault}: message does not say {words!r}: {bad['message']}"


# Faults in the shard plan (or its specs): the check sees them without loading the engine.
PLAN_FAULTS = [
    ("plain-chunk-gdn-conv1d", QWEN35, 2,
     f"{L0}.linear_attn.conv1d.weight rank 0 (planned for model.layers.0.linear_attn.conv1d"
     ".weight): local row 64 holds global row 64 (q keys, key head 4), expected global row 128 "
     "(k keys, key head 0); 160 / 224 rows wrong"),
    ("plain-chunk-gdn-qkv", QWEN35, 2,
     f"{L0}.linear_attn.in_proj_qkv.weight rank 0 (planned for model.layers.0.linear_attn"
     ".in_proj.weight[0:224]): local row 64 holds global row 64 (q keys, key head 4), expected "
     "global row 128 (k keys, key head 0)"),
    ("plain-chunk-q-gate", QWEN35, 2,
     "model.language_model.layers.1.self_attn.q_proj.weight rank 0 (planned for model.layers.1"
     ".self_attn.qkv_proj.weight[0:256]): local row 32 holds global row 32 (gate, head 0), "
     "expected global row 64 (q, head 1)"),
    ("gdn-heads-from-first", QWEN35, 2,
     f"{L0}.linear_attn.A_log rank 1 (planned for model.layers.0.linear_attn.A_log): local row "
     "0 holds global row 0 (A_log, value head 0), expected global row 8 (A_log, value head 8); "
     "8 / 8 rows wrong; its shard is identical to rank 0's, whose layout rows differ"),
    ("block-scale-group-shifted", "tiny-qwen3.5-moe-nvfp4", 2,
     f"{L0}.mlp.experts.0.down_proj.weight_scale rank 1 (planned for model.layers.0.mlp.experts"
     ".w2_weight_scale[0]): local column 0 holds global column 5 (intermediate, 16-input group "
     "5), expected global column 4 (intermediate, 16-input group 4)"),
    ("kv-head-wrong-rank", "tiny-qwen3-moe", 4,
     "model.layers.0.self_attn.k_proj.weight rank 0 (planned for model.layers.0.self_attn"
     ".qkv_proj.weight[32:48]): local row 0 holds global row 16 (k, KV head 1), expected global "
     "row 0 (k, KV head 0)"),
    ("vocab-pad-dropped", "tiny-qwen3-moe", 4,
     "lm_head.weight rank 3 (planned for lm_head.weight): holds shape (73, 64) torch.float32, "
     "the layout gives (76, 64)"),
    ("shard-views", "tiny-qwen3-moe", 2, "view pinning"),
    ("split-replicated", "tiny-qwen3-moe", 2, "input_layernorm.weight"),
]

# Faults in the loader: the plan is right, the loaded parameters are not. memory loads the
# engine first, so shards compares the loaded parameters with the statements.
LOADER_FAULTS = [
    ("plain-chunk-gate-up", "tiny-qwen3-moe", 2,
     "model.layers.1.mlp.up_proj.weight rank 0 (loaded model.layers.1.mlp.gate_up_proj"
     ".weight[64:128]): local row 0 holds model.layers.1.mlp.gate_proj.weight global row 64 "
     "(gate, row 64), expected global row 0 (up, row 0)"),
    ("plain-chunk-expert-gate-up", QWEN35, 2,
     f"{L0}.mlp.experts.0.up_proj.weight rank 0 (loaded model.layers.0.mlp.experts.w13[0, "
     f"16:32]): local row 0 holds {L0}.mlp.experts.0.gate_proj.weight global row 16 (gate, row "
     "16), expected global row 0 (up, row 0)"),
    ("plain-chunk-shared-gate-up", QWEN35, 2,
     f"{L0}.mlp.shared_expert.up_proj.weight rank 0 (loaded model.layers.0.mlp.shared_expert"
     f".gate_up_proj.weight[24:48]): local row 0 holds {L0}.mlp.shared_expert.gate_proj.weight "
     "global row 24 (gate, row 24), expected global row 0 (up, row 0)"),
    ("plain-chunk-gdn-zba", QWEN35, 2,
     f"{L0}.linear_attn.in_proj_a.weight rank 0 (loaded model.layers.0.linear_attn.in_proj"
     f".weight[328:336]): local row 0 holds {L0}.linear_attn.in_proj_z.weight global row 104 "
     "(z, value head 8), expected global row 0 (a, value head 0)"),
]


@pytest.mark.parametrize("fault, model, tp, words", PLAN_FAULTS,
                         ids=[f[0] for f in PLAN_FAULTS])
def test_shards_names_a_wrong_plan(capsys, tmp_path, fault, model, tp, words):
    """With the fault injected the TP=N shards row fails with these words; TP=1 passes."""
    code, rows = _results(capsys, tmp_path, "--model", model, "--tp", f"1,{tp}",
                          "--checks", "shards", "--inject", fault)
    _assert_caught(code, rows, fault, tp, words)


@pytest.mark.parametrize("fault, model, tp, words", LOADER_FAULTS,
                         ids=[f[0] for f in LOADER_FAULTS])
def test_shards_names_a_wrong_loaded_parameter(capsys, tmp_path, fault, model, tp, words):
    """With the fault injected in the loader, the shards row after memory (which loads the
    engine) fails with these words; TP=1 passes."""
    code, rows = _results(capsys, tmp_path, "--model", model, "--tp", f"1,{tp}",
                          "--checks", "memory,shards", "--inject", fault)
    _assert_caught(code, rows, fault, tp, words)


def test_every_bundled_case_matches_its_layout_at_every_tp_size(capsys, tmp_path):
    """Without faults every bundled tensor the engine loads has a statement and every rank
    holds what it states, at TP 1, 2, 4 and 8."""
    models = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", QWEN35, "tiny-qwen3.5-moe-nvfp4"]
    code, rows = _results(capsys, tmp_path, *[a for m in models for a in ("--model", m)],
                          "--tp", "1,2,4,8", "--checks", "shards")
    assert code == 0, [r["message"] for r in rows if r["status"] != "pass"]
    assert len(rows) == len(models) * 4
    for r in rows:
        m = r["metrics"]
        assert r["status"] == "pass" and m["problems"] == 0, r
        assert m["stated"] == m["tensors"] - m["ignored"] > 0, r


def test_shards_check_passes_with_the_engine_loaded(capsys, tmp_path):
    """Without faults, after golden loaded the engine, every rank's loaded parameters match
    the statements (`loaded_compared` counts every tensor on every rank)."""
    code, rows = _results(capsys, tmp_path, "--model", "tiny-llama", "--tp", "1,2,4,8",
                          "--checks", "golden,shards")
    assert code == 0, rows
    assert [r["tp"] for r in rows] == [1, 2, 4, 8]
    for r in rows:
        assert r["status"] == "pass" and r["metrics"]["problems"] == 0, r
        assert r["metrics"]["loaded_compared"] == r["metrics"]["tensors"] * r["tp"], r
