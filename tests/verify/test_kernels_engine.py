"""The `kernels` check's engine-kernel part: its shapes are the rank-local shapes the engine's
layers build at TP 1, 2, 4 and 8; its CPU matrix reaches every kernel at every TP size and its
GPU matrix Qwen3.5-MoE's real dimensions; on the real kernels (Triton's interpreter, float32)
every case passes; each injected fast-path fault fails every case of its kernel with a row
naming the kernel, TP size, shape and worst element, and leaves the other kernels passing."""

from __future__ import annotations

import re

import pytest
import torch

from freetoken_verify.checks.kernels import check as kernels
from freetoken_verify.checks.kernels import engine as engine_kernels
from freetoken_verify.checks.kernels.engine_cases import (
    TP_SIZES,
    cpu_matrix,
    gpu_matrix,
    local_shapes,
)
from freetoken_verify.checks.kernels.engine_runs import RUNNERS, Output
from freetoken_verify.faults import FAULTS


@pytest.fixture(scope="module")
def interpreter():
    """Kernels in this process run interpreted (sets TRITON_INTERPRET=1 for the process)."""
    from freetoken.kernels import use_interpreter

    use_interpreter()


@pytest.fixture()
def restore_launchers(interpreter, monkeypatch):
    """Faults replace launchers; re-setting every function of the modules they patch
    through monkeypatch first makes pytest put the originals back after the test (a fault
    added later on another launcher of these modules included)."""
    import inspect

    from freetoken.kernels import delta_rule, fused_moe, moe_rows, paged_attention
    from freetoken.models.qwen3_5_moe import gdn

    for module in (paged_attention, fused_moe, moe_rows, delta_rule, gdn):
        for name, value in vars(module).items():
            if inspect.isfunction(value):
                monkeypatch.setattr(module, name, value)


def _make_layers(cfg, tp: int) -> dict:
    """The rank-local sizes of `cfg`'s layers built on rank 0 of `tp` (meta device)."""
    from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
    from freetoken.layers.moe import FusedExperts
    from freetoken.models.llama import MLP, Attention

    reset_tp_info()
    set_tp_info(TPInfo(0, tp))
    try:
        with torch.device("meta"):
            if cfg.arch != "qwen3_5_moe":
                attn = Attention(cfg)
                sizes = {"mlp": MLP(cfg.hidden_size, cfg.intermediate_size)
                         .gate_up_proj.local_sizes[0]}
            else:
                from freetoken.models.qwen3_5_moe.attention import GatedAttention
                from freetoken.models.qwen3_5_moe.gdn import GatedDeltaNet
                from freetoken.models.qwen3_5_moe.moe import SharedExpert

                attn, gdn = GatedAttention(cfg), GatedDeltaNet(cfg)
                sizes = {"mlp": SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
                         .gate_up_proj.local_sizes[0],
                         "gdn": (gdn.num_k_heads, gdn.num_v_heads, gdn.conv1d.channels)}
            if cfg.num_experts:
                sizes["experts"] = FusedExperts(cfg.num_experts, cfg.hidden_size,
                                                cfg.moe_intermediate_size).local_intermediate
    finally:
        reset_tp_info()
    return {**sizes, "attention": (attn.num_heads, attn.num_kv_heads)}


def _dims(shapes, kernel: str) -> list[dict]:
    return [dict(d) for k, d in shapes if k == kernel]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_local_shapes_are_the_layers_shapes(tp):
    """For every bundled case: attention heads and KV heads (replicated below one per rank),
    the dense / shared-expert and expert intermediate sizes, and GatedDeltaNet's key heads,
    value heads and conv channels equal those of the layers built on a rank of `tp`."""
    from freetoken_verify.checks.kernels.engine_cases import model_configs

    for name, cfg in model_configs("cpu").items():
        shapes, layers = local_shapes(cfg, tp, "cpu"), _make_layers(cfg, tp)
        attention = _dims(shapes, "paged_attention")[0]
        assert (attention["heads"], attention["kv heads"]) == layers["attention"], name
        moe = _dims(shapes, "fused_moe")
        if moe:
            assert {d["intermediate"] for d in moe} == {layers["experts"]}, name
        assert _dims(shapes, "silu_and_mul")[0]["intermediate"] == layers["mlp"], name
        if "gdn" in layers:
            gdn, conv = _dims(shapes, "gated_delta_decode")[0], _dims(shapes, "conv_update")[0]
            assert (gdn["key heads"], gdn["value heads"], conv["channels"]) == layers["gdn"]


def test_cpu_matrix_reaches_every_kernel_at_every_tp_size():
    """Every launcher runs; each one whose shape depends on TP runs at TP 1, 2, 4 and 8
    (attention in both modes), and TP 4 attention has a replicated KV head."""
    cases = cpu_matrix()
    assert {c.kernel for c in cases} == set(RUNNERS)
    for kernel in set(RUNNERS) - {"route", "align"}:
        modes = {dict(c.dims).get("mode") for c in cases if c.kernel == kernel}
        for mode in modes:
            tps = {c.tp for c in cases if c.kernel == kernel and dict(c.dims).get("mode") == mode}
            assert set(TP_SIZES) <= tps, (kernel, mode, tps)
    assert any(c.kernel == "paged_attention" and c.tp == 4 and c["kv heads"] == 1
               for c in cases)


def test_gpu_matrix_has_the_real_dimensions():
    """The GPU matrix holds Qwen3.5-MoE's real shapes at TP 1 and 8: attention 16 / 2 heads of
    256, 256 experts top-8 over hidden 2048 with I = 512 / tp, GatedDeltaNet 16 x 128 key and
    32 x 128 value heads split by rank."""
    labels = {c.label for c in gpu_matrix() if c.model == "qwen3.5-moe-realdims"}
    for want in ("paged_attention tp=1 (decode, heads 16, kv heads 2, head_dim 256",
                 "paged_attention tp=8 (prefill, heads 2, kv heads 1, head_dim 256",
                 "fused_moe tp=1 (experts 256, top_k 8, hidden 2048, intermediate 512",
                 "fused_moe tp=8 (experts 256, top_k 8, hidden 2048, intermediate 64",
                 "gated_delta_decode tp=1 (key heads 16, value heads 32, dk 128, dv 128",
                 "gated_delta_decode tp=8 (key heads 2, value heads 4, dk 128, dv 128"):
        assert any(label.startswith(want) for label in labels), want


def test_engine_matrix_passes_on_the_real_kernels(interpreter):
    """Every case of the CPU matrix agrees with its torch reference in float32; the metrics
    give each kernel family its cases and 100 % of elements within tolerance."""
    rows = engine_kernels.run_matrix(cpu_matrix(), "cpu", torch.float32)
    assert engine_kernels.verdict(rows, "float32") == "", [r["failure"] for r in rows]
    families = kernels.metrics([], rows)["families"]
    assert set(families) == {"nvfp4", "paged_attention", "fused_moe", "delta_rule",
                             "norm_rope"}
    for name in ("paged_attention", "fused_moe", "delta_rule", "norm_rope"):
        assert families[name]["failed_cases"] == 0 and families[name]["cases"] >= 4, name
        assert families[name]["pct_within_tol"] == 100.0, name


@pytest.mark.parametrize("fault, kernel, other, output", [
    ("paged-attention-table-stride", "paged_attention", "fused_moe", "output"),
    ("decode-rope-next-position", "decode_rope", "paged_attention", "output"),
    ("fused-moe-expert-offset", "fused_moe", "gated_delta_decode", "output"),
    ("moe-shared-gate-dropped", "fused_moe_shared", "fused_moe", "output"),
    ("moe-residual-dropped", "fused_moe_shared", "fused_moe", "output + residual"),
    # the unscaled e4m3 codes drive the shared gate's sigmoid through exp's overflow
    pytest.param("moe-shared-fp8-unscaled", "fused_moe_shared", "fused_moe",
                 "block FP8 output + residual",
                 marks=pytest.mark.filterwarnings("ignore:overflow encountered in exp")),
    ("gdn-decode-state-slot", "gated_delta_decode", "paged_attention", "output"),
])
def test_fault_fails_its_kernel_naming_tp_shape_and_worst_element(restore_launchers, fault,
                                                                  kernel, other, output):
    """Every case of the faulted kernel fails; the verdict counts them, names the kernel and
    the first row its TP size, shape, output (the first that differs) and worst element;
    another kernel passes."""
    FAULTS[fault]()
    cases = [c for c in cpu_matrix() if c.kernel == kernel]
    rows = engine_kernels.run_matrix(cases, "cpu", torch.float32)
    message = engine_kernels.verdict(rows, "float32")
    n = len(cases)
    pattern = (rf"engine kernels in float32: {n} / {n} cases fail against their torch "
               rf"references \({kernel} x{n}\); first: {kernel} tp=1 \(.+\): "
               rf"{re.escape(output)}: rel L2 "
               rf"[0-9.e+-]+, \d+ / \d+ mismatched .*; worst abs .* at \(\d+, \d+(, \d+)?\)")
    assert re.match(pattern, message), message
    untouched = [c for c in cpu_matrix() if c.kernel == other][:1]
    assert engine_kernels.verdict(
        engine_kernels.run_matrix(untouched, "cpu", torch.float32), "float32") == ""


@pytest.mark.parametrize("fault, feature", [("decode-qk-norm-swapped", "qk_norm none"),
                                             ("decode-attention-gate-dropped", "no gate")])
def test_folded_norm_and_gate_faults_fail_the_cases_that_fold_them(restore_launchers, fault,
                                                                   feature):
    """The decode attention's folded q/k norm and output gate: a launch handed the norm
    weights swapped, or not handed the gate, fails every decode case of a model with that
    step, naming the first; a model without it (`feature` in its label) passes."""
    FAULTS[fault]()
    cases = [c for c in cpu_matrix() if c.kernel == "decode_rope"]
    folding = [c for c in cases if feature not in c.label]
    assert folding and len(folding) < len(cases), [c.label for c in cases]
    rows = engine_kernels.run_matrix(cases, "cpu", torch.float32)
    message = engine_kernels.verdict(rows, "float32")
    n = len(folding)
    first = re.escape(folding[0].label)
    assert re.match(rf"engine kernels in float32: {n} / {len(cases)} cases fail against their "
                    rf"torch references \(decode_rope x{n}\); first: {first}: output: rel L2 ",
                    message), message
    assert not [r for r in rows if r["failure"] and feature in r["failure"].split(":")[0]]


def test_exact_outputs_fail_on_one_differing_element():
    """Copies and integer results are compared bit for bit: one changed element fails,
    naming the output and its first differing index."""
    want = torch.arange(12, dtype=torch.int32).view(3, 4)
    got = want.clone()
    got[2, 1] = 99
    row = engine_kernels._exact("align tp=any (experts 8)", Output("rows", got, want, True))
    assert row["failure"] == ("align tp=any (experts 8): rows: 1 / 12 elements differ (must "
                              "be equal), first at [2, 1]: kernel 99, reference 9"), row
    assert engine_kernels._exact("x", Output("rows", want, want, True))["failure"] is None


# A fresh process: one that ran an interpreter test has TRITON_INTERPRET on for good.
_GPU_MATRIX = """
import torch
from freetoken_verify.checks.kernels import engine as engine_kernels
from freetoken_verify.checks.kernels.engine_cases import gpu_matrix
rows = engine_kernels.run_matrix(gpu_matrix(), "cuda", torch.bfloat16)
print(len(rows), "cases", engine_kernels.verdict(rows, "bfloat16") or "pass")
raise SystemExit(1 if any(r["failure"] for r in rows) else 0)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matrix_passes_in_bf16():
    """On a GPU every engine-kernel case, the real dimensions included, agrees with its float32
    torch reference within the bf16 rule (relative L2 <= 1e-2, 99.9 % of elements within)."""
    from conftest import run_compiled

    proc = run_compiled(["-c", _GPU_MATRIX])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
