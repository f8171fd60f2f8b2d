"""What the interpreter tests of the engine's CUDA kernels share: the process switched to
Triton's interpreter, a closeness rule relative to the expected tensor's scale, and a
recorder of a launcher's kernel launches that refuses an argument the kernel does not take
(the interpreter ignores one; a compiled launch raises KeyError)."""

from __future__ import annotations

import pytest
import torch

from bench.nvfp4_sass import LAUNCH_OPTIONS

TP_SIZES = (1, 2, 4, 8)


def require_interpreter() -> None:
    """This process's kernels run interpreted (sets TRITON_INTERPRET=1 for the process). A
    process on a GPU machine whose kernels were already imported compiled (a GPU test ran
    first in it) skips, saying so; on a machine without a GPU that is a failure."""
    from freetoken.kernels import KernelModeError, use_interpreter

    try:
        use_interpreter()
    except KernelModeError as err:
        if not torch.cuda.is_available():
            raise
        pytest.skip(f"{err} (run the interpreter tests in a pytest process of their own)")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Kernels in this process run interpreted (`require_interpreter`)."""
    require_interpreter()


def assert_close(got, want, what):
    atol = 1e-5 * max(float(want.abs().max()), 1e-30)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


class LaunchRecorder:
    """A launcher's kernel module behind a recorder of each launch's kernel name and keyword
    arguments (`seen`); a launch naming an argument that is neither a parameter of its
    kernel nor a launch option fails, naming it."""

    def __init__(self, module):
        self.module = module
        self.seen = []

    def __getattr__(self, name):
        kernel = getattr(self.module, name)
        seen = self.seen

        class Grid:
            def __getitem__(self, grid):
                def launch(**kw):
                    unknown = set(kw) - set(kernel.arg_names) - LAUNCH_OPTIONS
                    assert not unknown, f"{name} launched with arguments it does not take: " \
                                        f"{sorted(unknown)}"
                    seen.append((name, kw))
                    return kernel[grid](**kw)
                return launch
        return Grid()
