"""The engine-kernel part of the `kernels` check: every Triton kernel the engine takes on CUDA
(paged attention decode and prefill, the KV write, bf16 fused MoE with its routing and alignment,
GatedDeltaNet's decode step and conv update, RMSNorm, gated RMSNorm, SiLU-and-mul, rotary) against
the torch path the engine runs on CPU, at the TP-local shapes of
`freetoken_verify.checks.kernels.engine_cases` (`freetoken_verify.checks.kernels.engine_runs` runs
one case).

A row per case; a failing row names the kernel, its TP size and shape, the output (output,
state, k cache, ...) and its worst element. Metrics are grouped per kernel family
(paged_attention, fused_moe, delta_rule, norm_rope)."""

from __future__ import annotations

import math
import time

import torch

from freetoken_verify.checks.kernels.engine_cases import EngineCase
from freetoken_verify.checks.kernels.engine_runs import Output, run_case
from freetoken_verify.checks.kernels.judge import compare_output


def _exact(label: str, out: Output) -> dict:
    """Bit-for-bit equality (copies, integer results, untouched state)."""
    got, want = out.got.detach().cpu(), out.want.detach().cpu()
    row = {"case": label, "max_abs": 0.0, "rel_l2": 0.0, "numel": want.numel(),
           "within": want.numel(), "failure": None}
    if got.shape != want.shape:
        row.update(within=0, failure=f"{label}: {out.what}: shape {tuple(got.shape)}, "
                                     f"reference {tuple(want.shape)}")
        return row
    differ = got != want
    if bool(differ.any()):
        first = tuple(differ.nonzero()[0].tolist())
        worst = float((got.double() - want.double()).abs().max())
        row.update(within=want.numel() - int(differ.sum()), max_abs=worst, rel_l2=math.inf,
                   failure=f"{label}: {out.what}: {int(differ.sum())} / {want.numel()} "
                           f"elements differ (must be equal), first at {list(first)}: kernel "
                           f"{got[first].item():g}, reference {want[first].item():g}")
    return row


def check_case(case: EngineCase, device, dtype: torch.dtype, seed: int) -> dict:
    """One case: its outputs compared, the first failing one (or the worst) as the row."""
    rows = [_exact(case.label, out) if out.exact else
            compare_output(case.label, out.got, out.want, dtype, out.what)
            for out in run_case(case, device, dtype, seed)]
    failed = [r for r in rows if r["failure"]]
    row = dict(failed[0] if failed else max(rows, key=lambda r: r["rel_l2"]))
    row.update(numel=sum(r["numel"] for r in rows), within=sum(r["within"] for r in rows),
               max_abs=max(r["max_abs"] for r in rows))
    return row


def run_matrix(cases: list[EngineCase], device, dtype: torch.dtype) -> list[dict]:
    """Every case, a kernel exception counting as that case's failure."""
    rows = []
    for i, case in enumerate(cases):
        start = time.monotonic()
        try:
            row = check_case(case, device, dtype, seed=2000 + i)
        except Exception as e:  # one broken case must not hide the others
            row = {"case": case.label, "max_abs": math.inf, "rel_l2": math.inf, "within": 0,
                   "numel": 1, "failure": f"{case.label}: {type(e).__name__}: {e}"}
        row.update(kernel=case.kernel, family=case.family, seconds=time.monotonic() - start)
        rows.append(row)
    return rows


def family_metrics(rows: list[dict]) -> dict:
    """Per kernel family: worst max_abs and rel_l2, pct_within_tol, cases, failed_cases."""
    out = {}
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        numel = sum(r["numel"] for r in mine)
        out[family] = {"max_abs": max(r["max_abs"] for r in mine),
                       "rel_l2": max(r["rel_l2"] for r in mine),
                       "pct_within_tol": 100.0 * sum(r["within"] for r in mine) / max(numel, 1),
                       "cases": len(mine), "failed_cases": sum(1 for r in mine if r["failure"])}
    return out


def verdict(rows: list[dict], dtype: str) -> str:
    """"" when every case passes; else how many fail, in which kernels, and the first."""
    failures = [r for r in rows if r["failure"]]
    if not failures:
        return ""
    counts = {}
    for r in failures:
        counts[r["kernel"]] = counts.get(r["kernel"], 0) + 1
    kernels = ", ".join(f"{k} x{n}" for k, n in counts.items())
    return (f"engine kernels in {dtype}: {len(failures)} / {len(rows)} cases fail against "
            f"their torch references ({kernels}); first: {failures[0]['failure']}")
