"""The decode graph's input unpacking and its float-logits-and-argmax kernels
(`freetoken.kernels.step_io`) in Triton's interpreter, against the torch steps they replace:
every staging field in its input with its dtype, and greedy tokens as `torch.argmax` picks
them (first index of the largest value, ties, NaN, infinities, a vocab of several blocks
and a partial one, a strided view)."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpreter  # noqa: F401  (module-wide fixture)

from freetoken.kernels import step_io


def _assert_argmax(logits: torch.Tensor, what: str) -> None:
    got, got_greedy = step_io.float_argmax(logits)
    want, want_greedy = step_io.reference_float_argmax(logits)
    assert got.dtype == torch.float32 and torch.equal(got.nan_to_num(), want.nan_to_num()), \
        f"{what}: float32 logits differ"
    assert got_greedy.tolist() == want_greedy.tolist(), \
        f"{what}: greedy {got_greedy.tolist()} != torch's {want_greedy.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_argmax_equals_torch(dtype):
    """Random rows over a vocab of two whole blocks and a partial one, and rows built to
    bite: a tie across blocks (the first wins), the largest value in the last partial
    block, a NaN after the largest, infinities, every value -inf."""
    vocab = 2 * step_io.ARGMAX_BLOCK + 37
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, [5, step_io.ARGMAX_BLOCK + 5]] = 50.0
    logits[2, vocab - 1] = 60.0
    logits[3, 7], logits[3, vocab - 2] = 70.0, float("nan")
    logits[4, [9, 3000]] = float("inf")
    logits[5] = float("-inf")
    logits[6, [100, 4000]] = float("nan")
    _assert_argmax(logits.to(dtype), f"{dtype}")


def test_float_argmax_takes_a_strided_view_and_small_vocab():
    """The vocab-parallel head's logits sliced off their padding (a view whose rows are
    longer than the vocab), and a vocab smaller than one block."""
    padded = torch.randn(3, 120, generator=torch.Generator().manual_seed(1))
    _assert_argmax(padded[:, :100], "sliced view")
    _assert_argmax(padded[:, :5], "5 logits")


def test_unpack_equals_torch_copies():
    """Each staging field lands in its input, the context lengths and block tables as
    int32; an id -1 - j is the fed-back token j (the previous step's greedy token)."""
    staging = torch.randint(0, 10_000, (4, 5 + 7), generator=torch.Generator().manual_seed(2))
    staging[1, 0], staging[3, 0] = -1 - 2, -1
    feedback = torch.tensor([501, 502, 503], dtype=torch.long)
    outs = (torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
            torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.int32),
            torch.zeros(4, dtype=torch.long), torch.zeros(4, 7, dtype=torch.int32))
    step_io.unpack(staging, feedback, *outs)
    names = ("ids", "positions", "slots", "context lengths", "state slots", "block tables")
    want_all = step_io.reference_unpack(staging, feedback)
    assert want_all[0][[1, 3]].tolist() == [503, 501]
    for name, got, want in zip(names, outs, want_all):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {got} != {want}"
    with pytest.raises(ValueError, match=r"does not fit block tables \(4, 6\)"):
        step_io.unpack(staging, feedback, *outs[:5], torch.zeros(4, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="feedback must be a non-empty int64 vector"):
        step_io.unpack(staging, feedback.int(), *outs)


def test_float_argmax_writes_the_given_tokens():
    """The tokens land in the caller's buffer (a decode graph's shared feedback rows);
    a buffer of the wrong shape is refused by name."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    tokens = torch.full((3,), -7, dtype=torch.long)
    _, greedy = step_io.float_argmax(logits, tokens)
    assert greedy.data_ptr() == tokens.data_ptr()
    assert torch.equal(tokens, logits.argmax(-1))
    with pytest.raises(ValueError, match="greedy must be int64"):
        step_io.float_argmax(logits, torch.zeros(2, dtype=torch.long))
