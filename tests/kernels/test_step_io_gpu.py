"""The decode graph's float-logits-and-argmax and unpacking kernels (`freetoken.kernels.
step_io`) compiled on a GPU (skipped without one): bf16 logits over the medium Llama's and
Qwen3.5's vocabularies (32000, 248320) at 1 and 16 rows, ties and a NaN, give torch's
float32 logits and argmax exactly, and a graph's replay equals the eager call."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import step_io

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("vocab", [32000, 248320])
def test_float_argmax_bf16(rows, vocab):
    """Random rows, a tie two blocks apart in row 0 and a NaN in the last row."""
    gen = torch.Generator(device="cuda").manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits[0, [11, 2 * step_io.ARGMAX_BLOCK + 11]] = 40.0
    logits[-1, vocab // 2] = float("nan")
    got, greedy = step_io.float_argmax(logits)
    want, want_greedy = step_io.reference_float_argmax(logits)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"V={vocab}: float32 logits"
    assert torch.equal(greedy, want_greedy), f"V={vocab}: {greedy.tolist()} != " \
        f"{want_greedy.tolist()}"
    graph = torch.cuda.CUDAGraph()
    step_io.float_argmax(logits)
    with torch.cuda.graph(graph):
        replay, replay_greedy = step_io.float_argmax(logits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay_greedy, greedy), f"V={vocab}: graph replay differs"


def test_unpack_on_the_gpu():
    """Staging rows into the six inputs, context lengths and tables as int32; ids -1 - j
    taken from the fed-back tokens."""
    staging = torch.randint(0, 1 << 20, (16, 5 + 40), device="cuda")
    staging[::3, 0] = -1 - torch.arange(0, 16, 3, device="cuda")
    feedback = torch.randint(0, 1 << 20, (16,), device="cuda")
    outs = [torch.zeros_like(r) for r in step_io.reference_unpack(staging, feedback)]
    step_io.unpack(staging, feedback, *outs)
    for got, want in zip(outs, step_io.reference_unpack(staging, feedback)):
        assert got.dtype == want.dtype and torch.equal(got, want)
