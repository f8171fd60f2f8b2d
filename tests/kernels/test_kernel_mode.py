"""How a process picks interpreted or compiled kernels: it asks for the interpreter once,
before its first kernel import, and then runs every kernel interpreted even when triton itself
was imported first (`jit_ops`' reductions give torch's results there); asking after kernels
were imported compiled fails with a one-line reason."""

from __future__ import annotations

_TRITON_FIRST = """
import torch
import triton                      # as transformers does, before the interpreter is asked for
import triton.language as tl
from freetoken.kernels import interpreting, jit_module, use_interpreter

use_interpreter()
ops = jit_module("jit_ops")


@triton.jit
def reduce_kernel(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(out_ptr + tl.arange(0, M), ops.sum_(x, 1))
    tl.store(out_ptr + M + tl.arange(0, N), ops.max_(x, 0))
    tl.store(out_ptr + M + N + tl.arange(0, N), ops.min_(x, 0))
    tl.store(out_ptr + M + 2 * N + tl.arange(0, N), ops.cumsum(ops.sum_(x, 0), 0))
    column = tl.reshape(x, (M, 1, N))
    tl.store(out_ptr + M + 3 * N + tl.arange(0, N), ops.sum_(ops.sum_(column, 1), 0))


x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
out = torch.zeros(4 + 4 * 8)
reduce_kernel[(1,)](x, out, M=4, N=8)
want = torch.cat([x.sum(1), x.amax(0), x.amin(0), x.sum(0).cumsum(0), x.sum(0)])
assert interpreting()
torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
print("ok")
"""

_COMPILED_FIRST = """
from freetoken.kernels import KernelModeError, jit_module, use_interpreter

jit_module("jit_ops")              # the process's kernels are now compiled ones
try:
    use_interpreter()
except KernelModeError as err:
    print(err)
"""


def _assert_ran(proc, want: str) -> None:
    assert proc.returncode == 0 and want in proc.stdout, proc.stdout + proc.stderr


def test_interpreter_asked_for_after_triton_import_runs_jit_ops_reductions():
    """triton imported before `use_interpreter`: a kernel calling jit_ops' sum, max, min and
    cumsum (over either axis, and over an axis of one) runs interpreted and matches torch."""
    from conftest import run_compiled

    _assert_ran(run_compiled(["-c", _TRITON_FIRST]), "ok")


def test_interpreter_after_compiled_kernels_is_refused():
    """Once kernels were imported compiled, `use_interpreter` raises `KernelModeError`
    naming TRITON_INTERPRET (no silent mix of interpreted and compiled kernels)."""
    from conftest import run_compiled

    _assert_ran(run_compiled(["-c", _COMPILED_FIRST]), "set TRITON_INTERPRET=1")


def test_no_kernel_calls_a_triton_language_jit_function():
    """No engine kernel calls one of triton.language's own @jit functions (`tl.zeros`,
    `tl.sum`, `tl.sigmoid`, ...): they are compiled when triton was imported before the
    interpreter was asked for (transformers imports it), and an interpreted kernel cannot
    call a compiled one ("Cannot call @triton.jit'd outside of the scope of a kernel": the
    fused decode kernels' `tl.zeros` failed the engine's interpreter tests that way).
    `jit_ops` and builtins such as `tl.full` serve instead."""
    import ast
    from pathlib import Path

    import triton.language.standard as standard

    jitted = {n for n, v in vars(standard).items() if type(v).__name__ == "JITFunction"}
    kernels = Path(__file__).resolve().parents[2] / "freetoken" / "kernels"
    found = []
    for path in sorted(kernels.glob("*_jit.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "tl" and node.attr in jitted):
                found.append(f"{path.name}:{node.lineno} tl.{node.attr}")
    assert not found, "triton.language @jit functions called from kernels: " + ", ".join(found)
