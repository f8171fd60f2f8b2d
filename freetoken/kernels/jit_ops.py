"""Reductions, a scan, the sigmoid and the programmatic-dependent-launch steps (`grid_wait`,
`launch_next`: `freetoken.kernels.pdl`) for the engine's Triton kernels, from Triton builtins
and public APIs only.

Why not `tl.sum`, `tl.max`, `tl.cumsum`, `tl.sigmoid`: they are @jit functions of
triton.language, interpreted or compiled as triton was when first imported, which may be
before this process asked for the interpreter (transformers imports triton); an interpreted
kernel cannot call a compiled @jit function. So this module is imported once the process's
kernel mode is fixed (`freetoken.kernels.interpreting`) and defines, for that mode:
- compiled: `tl.reduce` / `tl.associative_scan` with the combiners below, the same IR as
  triton.language's own reductions;
- interpreted: reductions as a tree of builtin `tl.split`s (one numpy operation per level),
  because the interpreter runs a combiner of ours element by element in Python; they and the
  sigmoid are plain Python functions (a call to a @jit function costs the interpreter a
  re-patch of triton.language); the scan (1-d only: expert counts and ranks) is the sum of
  a lower-triangular selection, for the same reason.
Block shapes are powers of two, which the tree relies on.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels import interpreting


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


if not interpreting():

    @triton.jit
    def cumsum(x, axis: tl.constexpr):
        return tl.associative_scan(x, axis, _add)

    @triton.jit
    def sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def sum_(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _add)

    @triton.jit
    def max_(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _maximum)

    @triton.jit
    def min_(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _minimum)

    @triton.jit
    def grid_wait(PDL: tl.constexpr):
        """With programmatic dependent launch (PDL 1, sm_90+): wait until the stream's
        previous kernel has finished and its writes are visible. Loads before it may only
        read what no kernel in flight writes (weights, routing ids)."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def launch_next(PDL: tl.constexpr):
        """With PDL: the stream's next kernel may start once every program of this one got
        here (its programs take SMs that this kernel's last ones leave idle, and wait in
        `grid_wait`)."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=tl.int32, is_pure=False, pack=1)

else:
    # Plain Python here: the interpreter runs a kernel's calls to other @jit functions by
    # patching triton.language again (an `inspect.getmembers` over its modules) on every call,
    # and a tree makes log2(n) of them; a plain function runs under the calling kernel's patch.
    # It was about half of an interpreted engine step's time.

    def _tree(x, axis, combine):
        """`x` reduced over `axis` by `combine` in a pairwise tree (interpreter only: the
        shapes are plain Python here)."""
        rank = len(x.shape)
        x = tl.permute(x, [d for d in range(rank) if d != axis] + [axis])
        lead = list(x.shape[:-1])
        single = x.shape[-1] == 1
        if single:
            x = tl.reshape(tl.join(x, x), lead + [2])
        while x.shape[-1] > 2:
            a, b = tl.split(tl.reshape(x, lead + [x.shape[-1] // 2, 2]))
            x = combine(a, b)
        a, b = tl.split(x)
        if single:
            return a
        return combine(a, b)

    def sum_(x, axis):
        return _tree(x, axis, lambda a, b: a + b)

    def max_(x, axis):
        return _tree(x, axis, lambda a, b: tl.maximum(a, b))

    def min_(x, axis):
        return _tree(x, axis, lambda a, b: tl.minimum(a, b))

    def sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    def _no_pdl(PDL):
        """The interpreter has no programmatic dependent launch (launchers never ask it)."""
        if PDL:
            raise ValueError("jit_ops: programmatic dependent launch (PDL 1) needs a GPU, "
                             "not Triton's interpreter")

    grid_wait = launch_next = _no_pdl

    def cumsum(x, axis):
        """Inclusive prefix sum of a 1-d x: the sum of a lower-triangular selection (one
        numpy operation per tree level; a scan would run our combiner element by
        element)."""
        if len(x.shape) != 1 or axis != 0:
            raise ValueError(f"jit_ops.cumsum: interpreted for 1-d tensors along axis 0, got "
                             f"shape {x.shape} axis {axis}")
        i = tl.arange(0, x.shape[0])
        return sum_(tl.where(i[:, None] >= i[None, :], x[None, :], 0), axis=1)
