"""A rank's exception names where it came from: the innermost engine module running (by its
name in the resident model) and the innermost frame inside the `freetoken` package, appended
to the first message line with the exception's type kept, so the row a person reads says
where the engine broke (`rank 1: RuntimeError: split_with_sizes ... [in
model.layers.0.linear_attn; freetoken/models/qwen3_5_moe/gdn.py:171 in _heads]`)."""

from __future__ import annotations

import pytest
from torch import nn

from freetoken.distributed import divide
from freetoken.distributed.failures import fault_from_exception
from freetoken_verify.checks.locate import annotate, engine_frame, location


class _Inner(nn.Module):
    def forward(self, x):
        return self._split(x)

    def _split(self, x):
        return divide(x, 3, "num_heads")


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(x)


def _make_model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([_Outer()])
    return model


def _raised(fn, *args) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def test_location_names_the_innermost_module_and_engine_frame():
    """An error raised by engine code (`divide`) under two nested modules names the inner
    module by its path in the model and the engine's own frame, not this test's."""
    model = _make_model()
    exc = _raised(model.layers[0], 4)
    where = location(exc, model)
    assert where.startswith("in layers.0.inner; freetoken/distributed/"), where
    assert where.endswith(" in divide"), where


def test_a_module_outside_the_model_is_named_by_its_class():
    exc = _raised(_Outer(), 4)
    assert location(exc, None).startswith("in _Inner; freetoken/"), location(exc, None)


def test_no_engine_frame_and_no_module_give_no_location():
    exc = _raised(lambda: [][1])
    assert engine_frame(exc.__traceback__) is None
    assert location(exc, None) is None


def test_annotate_appends_to_the_first_line_and_keeps_the_type():
    """The location goes at the end of the first line (the line a rank's summary shows), the
    rest of the message stays, and the summary of the rank's failure carries it."""
    exc = RuntimeError("split_with_sizes expects 224\nmore detail")
    annotate(exc, "in model.layers.0.linear_attn; freetoken/x.py:1 in f")
    assert type(exc) is RuntimeError
    assert str(exc) == ("split_with_sizes expects 224 [in model.layers.0.linear_attn; "
                        "freetoken/x.py:1 in f]\nmore detail"), str(exc)
    summary = fault_from_exception(1, exc, "", 0.0).summary
    assert summary == ("RuntimeError: split_with_sizes expects 224 [in "
                       "model.layers.0.linear_attn; freetoken/x.py:1 in f]"), summary


def test_annotate_other_argument_shapes():
    """No arguments: the location is the message; several arguments (an OSError's errno and
    text): left as they are, the location added as a note for the traceback."""
    bare = IndexError()
    annotate(bare, "in lm_head")
    assert str(bare) == "[in lm_head]"
    several = OSError(2, "No such file")
    annotate(several, "in lm_head")
    assert several.args == (2, "No such file") and several.__notes__ == ["[in lm_head]"]
