"""The collectives check: the expected collectives follow from the module structure, every
recorded collective is attributed to the module that issued it, and each collective bug
(dropped, doubled, extra, missing gather, a Communicator that loses a non-contiguous
reduction) fails the row with a message naming the module or the Communicator op."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.core import EngineCore
from freetoken.models.registry import build_model, load_config
from freetoken_verify.checks.collectives.check import compare_steps
from freetoken_verify.checks.collectives.sites import expected_sites, moe_blocks
from freetoken_verify.checks.collectives.trace import SAMPLER, Call, Step, trace_generation
from freetoken_verify.cli import main

GOLDEN = Path(__file__).resolve().parents[2] / "freetoken_verify" / "golden"
CASES = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5-moe",
         "tiny-qwen3.5-moe-nvfp4", "tiny-qwen3.5-moe-nvfp4-ct", "tiny-qwen3.5-moe-mixed",
         "tiny-qwen3.5-moe-fp8", "tiny-qwen3-fp8")


def _collectives_rows(capsys, tmp_path, *args: str) -> tuple[int, list[dict]]:
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--checks", "collectives", "--report-json", str(report)])
    capsys.readouterr()
    results = json.loads(report.read_text())["results"]
    return exit_info.value.code, [r for r in results if r["check"] == "collectives"]


def _assert_fails_naming(rows: list[dict], tp: int, needle: str, fault: str) -> None:
    row = next(r for r in rows if r["tp"] == tp)
    assert row["status"] == "fail", f"{fault} tp={tp}: collectives did not fail: {row}"
    assert needle in row["message"], f"{fault} tp={tp}: message lacks {needle!r}: {row['message']}"


def test_sites_follow_the_module_structure():
    """Qwen3.5-MoE: one all-reduce per attention / GDN output projection and per MoE block,
    none inside the block (experts, shared expert's reduce=False down_proj), one for the
    embedding, one LM head gather, one sampler broadcast; nothing else."""
    cfg = load_config(GOLDEN / "tiny-qwen3.5-moe")
    sites = expected_sites(build_model(cfg), torch.float32, batch=1)
    layers = cfg.num_hidden_layers
    attention = [f"model.layers.{i}.linear_attn.out_proj" if kind == "linear_attention"
                 else f"model.layers.{i}.self_attn.o_proj" for i, kind in
                 enumerate(cfg.layer_types)]
    want = {"model.embed_tokens": "all_reduce", "lm_head": "all_gather", SAMPLER: "broadcast",
            **dict.fromkeys(attention, "all_reduce"),
            **{f"model.layers.{i}.mlp": "all_reduce" for i in range(layers)}}
    got = {name: site.kind for name, site in sites.items()}
    assert got == want, f"sites: {sorted(got.items())}"
    assert all(site.count == 1 for site in sites.values()), sites


def test_every_routed_expert_format_makes_a_moe_block():
    """Bf16, NVFP4 and block-FP8 routed experts each make their MoE block one all-reduce site
    with nothing inside it reducing."""
    for case in ("tiny-qwen3.5-moe", "tiny-qwen3.5-moe-nvfp4", "tiny-qwen3.5-moe-fp8"):
        cfg = load_config(GOLDEN / case)
        model = build_model(cfg)
        blocks = moe_blocks(model)
        sites = expected_sites(model, torch.float32, batch=1)
        for i in range(cfg.num_hidden_layers):
            block = f"model.layers.{i}.mlp"
            assert sites[block].kind == "all_reduce", (case, block)
            assert blocks[f"{block}.experts"] == block, (case, block)
            assert f"{block}.shared_expert.down_proj" not in sites, (case, block)


def test_trace_attributes_each_call_to_its_module():
    """At TP=1 (in-process) every call reaches the recording communicator from the module
    whose site predicts it, once per step, with the predicted shape and dtype (the embedding
    and the sampler's broadcast skip the Communicator at TP=1 and are not expected there)."""
    folder = GOLDEN / "tiny-qwen3-moe"
    cfg = EngineConfig(dtype="float32", progress=False, max_num_seqs=2)
    core = EngineCore(folder, load_config(folder), cfg, torch.device("cpu"))
    steps = trace_generation(core, [3, 1, 4, 1, 5])
    sites = expected_sites(core.model, torch.float32, batch=1)
    assert len(steps) == 2, f"prefill + decode expected, got {len(steps)} steps"
    for index, (step, tokens) in enumerate(zip(steps, (5, 1))):
        expected_names = {n for n in sites if n not in ("model.embed_tokens", SAMPLER)}
        assert set(step.calls) == expected_names, f"step {index}: {sorted(step.calls)}"
        for name, calls in step.calls.items():
            shape = step.input_shapes.get(name, ())
            want = sites[name].expected(shape)
            got = [(c.kind, c.shape, c.dtype, c.dim) for c in calls]
            assert got == [(want.kind, want.shape, want.dtype, want.dim)], f"{name}: {got}"
        assert step.input_shapes["model.embed_tokens"] == (tokens,), step.input_shapes


def _make_step(calls: dict[str, list[Call]], shapes: dict[str, tuple]) -> Step:
    return Step(calls, dict.fromkeys(shapes, 1), shapes)


def test_compare_names_extra_wrong_shape_and_missing_modules():
    """On a hand-made prefill step of the Qwen3.5-MoE structure: a reduction inside a MoE
    block is an extra naming its block, a gather along the wrong dim and a reduction of the
    wrong width are named with both shapes, a site whose module never ran is missing; a
    step that matches every site has no problem."""
    cfg = load_config(GOLDEN / "tiny-qwen3.5-moe")
    model = build_model(cfg)
    sites, blocks = expected_sites(model, torch.float32, batch=1), moe_blocks(model)
    h, vocab = cfg.hidden_size, model.lm_head.local_vocab
    shapes = {name: (5, h) for name in sites}
    shapes.update({"model.embed_tokens": (5,), "lm_head": (1, h)})
    good = {name: [sites[name].expected(shapes.get(name, ()))] for name in sites}
    assert compare_steps([_make_step(good, shapes)], sites, blocks, model) == []
    down = "model.layers.0.mlp.shared_expert.down_proj"
    bad = {**good, down: [Call("all_reduce", (5, h), "float32")],
           "lm_head": [Call("all_gather", (1, vocab), "float32", 0)],
           "model.layers.1.mlp": [Call("all_reduce", (5, h // 2), "float32")]}
    del bad["model.layers.2.mlp"]
    ran = {k: v for k, v in shapes.items() if k != "model.layers.2.mlp"}
    lines = [line for line, _ in compare_steps([_make_step(bad, ran)], sites, blocks, model)]
    assert lines == [
        f"{down}: expected 0 all_reduce per forward, saw 1 (extra: inside MoE block "
        "model.layers.0.mlp, whose routed + shared sum is reduced once) in prefill (5 tokens)",
        f"model.layers.1.mlp: expected all_reduce of [5, {h}] float32, saw all_reduce of "
        f"[5, {h // 2}] float32 in prefill (5 tokens)",
        "model.layers.2.mlp: expected 1 all_reduce per forward, saw 0 (missing: the module "
        "did not run) in prefill (5 tokens)",
        f"lm_head: expected all_gather of [1, {vocab}] float32 along dim 1, saw all_gather of "
        f"[1, {vocab}] float32 along dim 0 in prefill (5 tokens)",
    ], lines


def test_clean_run_passes_on_every_bundled_case(capsys, tmp_path):
    """Without faults every bundled case passes at TP 1 and 2 with every Communicator probe
    case passing; at TP 2 the recorded counts equal the derived ones, at TP 1 they are
    reported but not compared."""
    code, rows = _collectives_rows(capsys, tmp_path, "--model", ",".join(CASES), "--tp", "1,2")
    assert code == 0, rows
    assert sorted((r["model"], r["tp"]) for r in rows) == sorted(
        (c, tp) for c in CASES for tp in (1, 2)), rows
    for r in rows:
        m = r["metrics"]
        assert r["status"] == "pass" and m["problems"] == 0 and m["comm_failed"] == 0, r
        assert m["counts_compared"] == (r["tp"] > 1), r
        if r["tp"] > 1:
            for kind in ("all_reduce", "all_gather", "broadcast"):
                assert m[kind] == m[f"expected_{kind}"] > 0, (kind, r)


@pytest.mark.parametrize("fault, case, tp, needle", [
    ("drop-allreduce", "tiny-qwen3.5-moe", "2",
     "model.layers.0.linear_attn.out_proj: expected 1 all_reduce per forward, saw 0 (missing"),
    ("moe-reduce-separately", "tiny-qwen3.5-moe", "2",
     "model.layers.0.mlp: expected 1 all_reduce per forward, saw 2 (doubled: 2 different "
     "tensors"),
    # Block-FP8 routed experts make a MoE block too (their block was taken for none).
    ("moe-reduce-separately", "tiny-qwen3.5-moe-fp8", "2",
     "model.layers.0.mlp: expected 1 all_reduce per forward, saw 2 (doubled: 2 different "
     "tensors"),
    ("embedding-extra-allreduce", "tiny-llama", "2",
     "model.embed_tokens: expected 1 all_reduce per forward, saw 2 (doubled: the same tensor"),
    ("lm-head-no-gather", "tiny-qwen3", "2",
     "lm_head: expected 1 all_gather per forward, saw 0 (missing"),
    ("allreduce-contiguous-copy", "tiny-qwen3-moe", "1,2",
     "Communicator.all_reduce on a transposed (dims reversed) [3, 5, 7] float32 input"),
    ("drop-allreduce", "tiny-llama", "4",
     "model.layers.0.self_attn.o_proj: expected 1 all_reduce per forward, saw 0 (missing"),
    ("sample-per-rank", "tiny-qwen3", "1,2",
     "sampler (EngineCore._sample): rank 1 went on with tokens "),
])
def test_collective_bug_fails_naming_the_module(capsys, tmp_path, fault, case, tp, needle):
    """With the fault injected the collectives row at the largest TP size fails and names the
    module (or the Communicator op and input layout); a TP=1 row, where run, stays green."""
    code, rows = _collectives_rows(capsys, tmp_path, "--model", case, "--tp", tp,
                                   "--inject", fault)
    assert code == 1, f"{fault}: expected exit 1, got {code}: {rows}"
    _assert_fails_naming(rows, int(tp.split(",")[-1]), needle, fault)
    assert all(r["status"] == "pass" for r in rows if r["tp"] == 1), f"{fault}: tp=1 {rows}"
