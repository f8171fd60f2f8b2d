"""The run's typed state (`freetoken_verify.checks.state`): one Baselines per model for the
whole run, and every lazy member built once per key, whoever asks first."""

from __future__ import annotations

from types import SimpleNamespace

from freetoken_verify.checks.state import RunState


def _counting(value):
    calls = []

    def build():
        calls.append(1)
        return value

    return build, calls


def test_every_row_of_a_model_gets_that_models_baselines():
    """Rows of one model (any TP size, any check) share a Baselines; another model has its
    own."""
    state = RunState()
    llama, qwen = SimpleNamespace(name="tiny-llama"), SimpleNamespace(name="tiny-qwen3")
    state.baselines(llama).tp1_sampled = [[1, 2]]
    assert state.baselines(SimpleNamespace(name="tiny-llama")).tp1_sampled == [[1, 2]]
    assert state.baselines(qwen).tp1_sampled is None


def test_a_lazy_member_is_built_once_per_key():
    """The builder runs on the first request of a key only; another key builds again, and a
    None result is kept like any other (a saved reference without activations)."""
    baselines = RunState().baselines(SimpleNamespace(name="tiny-llama"))
    build, calls = _counting("tp2")
    assert baselines.bisection(2, build) == baselines.bisection(2, build) == "tp2"
    baselines.bisection(4, build)
    assert len(calls) == 2
    build, calls = _counting(("fp32", None))
    baselines.hf_activations([1, 2, 3], build)
    baselines.hf_activations([1, 2, 3], build)
    assert len(calls) == 1
    state = RunState()
    build, calls = _counting(None)
    assert state.saved_bisect("/ref", build) is None and state.saved_bisect("/ref", build) is None
    assert len(calls) == 1
