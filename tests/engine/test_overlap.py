"""Overlapped steps (`EngineConfig.overlap_steps`): a step launched before the previous one's
tokens reach the host, its ids fed back on the device, gives every request the tokens and
finish reason the step-by-step engine gives: at end tokens mid-batch (a spare row rides one
step), at the length limit, with requests arriving while a step is in flight, with sampled or
logit-returning sequences in the batch (those steps run one at a time), and when the cache
forces a preemption. CPU, eager (the graph's feedback is tested in test_graph_buffers and
test_step_io; on CUDA in test_cuda_engine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import GOLDEN

from freetoken import LLM
from freetoken.config import EngineConfig
from freetoken.engine import core as core_module
from freetoken.engine.core import PENDING, EngineCore
from freetoken.engine.options import check_overlap, engine_config
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.sequence import Request, SamplingParams
from freetoken.models.registry import load_config

_PROMPTS = [[1, 5, 9], [7], [3, 3, 8, 2, 4], [11, 2], [6, 6]]


def _core(case: str, overlap: bool, eos: tuple[int, ...] = (), **options) -> EngineCore:
    folder = GOLDEN / case
    model_config = dataclasses.replace(load_config(folder), eos_token_ids=eos)
    cfg = EngineConfig(dtype="float32", progress=False, max_model_len=128,
                       overlap_steps=overlap, **{"max_num_seqs": 4, **options})
    return EngineCore(folder, model_config, cfg, torch.device("cpu"))


def _outcome(results) -> list[tuple[list[int], str]]:
    return [(r.token_ids, r.finish_reason) for r in results]


def _eos_mid_generation(case: str) -> tuple[int, ...]:
    """An end token some sequence of the greedy run first emits as its third token or later
    while at least two others do not emit it in their first four: sequences stop on it
    mid-batch while others run on."""
    core = _core(case, overlap=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = [r.token_ids for r in core.generate(_PROMPTS, [params] * len(_PROMPTS))]
    for run in runs:
        for i, token in enumerate(run):
            if i >= 2 and token not in run[:i] and \
                    sum(token not in other[:4] for other in runs) >= 2:
                return (token,)
    raise AssertionError(f"{case}: no token stops a sequence mid-generation: {runs}")


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3.5-moe"])
def cores(request):
    """(step-by-step core, overlapped core) of one case, end tokens taken from its run."""
    eos = _eos_mid_generation(request.param)
    return _core(request.param, False, eos), _core(request.param, True, eos)


def test_overlapped_steps_equal_stepwise_at_end_tokens_and_length(cores, monkeypatch):
    """Mixed lengths and ignore_eos: sequences stopping on an end token mid-batch (their
    next step already launched: a spare row), at their length limit (the limit winning on
    the step it is reached), and running on."""
    spare = []
    original = EngineCore._resolve
    monkeypatch.setattr(EngineCore, "_resolve", lambda self, in_flight: (
        spare.extend(p >= len(s.output) for s, p in zip(in_flight.batch, in_flight.places)),
        original(self, in_flight))[1])
    stepwise, overlapped = cores
    params = [SamplingParams(max_tokens=m, ignore_eos=i % 4 == 3)
              for i, m in enumerate([8, 1, 8, 3, 6])]
    want = _outcome(stepwise.generate(_PROMPTS, params))
    assert any(reason == "stop" for _, reason in want), want
    assert any(reason == "length" for _, reason in want), want
    assert _outcome(overlapped.generate(_PROMPTS, params)) == want
    assert any(spare), "no sequence stopped with its next step in flight"


def test_steps_did_overlap(cores, monkeypatch):
    """The overlapped core really launches a step while one is in flight (and the
    step-by-step core never does)."""
    chained = []
    original = EngineCore._launch
    monkeypatch.setattr(EngineCore, "_launch", lambda self, batch, prefill, previous: (
        chained.append(previous is not None), original(self, batch, prefill, previous))[1])
    stepwise, overlapped = cores
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    stepwise.generate(_PROMPTS, [params] * len(_PROMPTS))
    assert chained == []
    overlapped.generate(_PROMPTS, [params] * len(_PROMPTS))
    assert sum(chained) >= 5, chained


def test_arrivals_while_a_step_is_in_flight(cores):
    """Requests added between steps (one `run_steps(1)` at a time, as the LLM's driver
    does) get the tokens they get alone."""
    stepwise, overlapped = cores
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    alone = {i: stepwise.generate([p], [params])[0].token_ids for i, p in enumerate(_PROMPTS)}
    overlapped.reset()
    arrivals = {0: [0, 1], 2: [2], 3: [3], 6: [4]}
    results, step = {}, 0
    while step <= max(arrivals) or overlapped.has_work():
        overlapped.add_requests([Request(i, _PROMPTS[i], params, i)
                                 for i in arrivals.get(step, [])])
        results.update(overlapped.run_steps(1))
        step += 1
    assert {i: r.token_ids for i, r in results.items()} == alone
    assert all(PENDING not in r.token_ids for r in results.values())


def test_sampled_and_logit_sequences_run_one_step_at_a_time(cores):
    """A seeded sampled sequence and one returning its logits share the batch with greedy
    ones: the same tokens and logits as step by step."""
    stepwise, overlapped = cores
    params = [SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True),
              SamplingParams(max_tokens=4, ignore_eos=True)]
    want = stepwise.generate(_PROMPTS[:4], params)
    got = overlapped.generate(_PROMPTS[:4], params)
    assert _outcome(got) == _outcome(want)
    torch.testing.assert_close(got[2].logits, want[2].logits, rtol=0, atol=0)


def test_no_overlap_while_the_cache_is_short(monkeypatch):
    """A cache too small for every sequence's next token: the step in flight is read before
    the scheduler may preempt (no sequence is recomputed with a placeholder in its tokens),
    and the results equal the step-by-step engine's."""
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt",
                        lambda self, seq: (preempted.append(seq.seq_id), original(self, seq)))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    small = dict(block_size=4, num_kv_blocks=9, max_num_seqs=3)
    want = _core("tiny-llama", False, **small).generate(_PROMPTS[:3], [params] * 3)
    assert preempted, "the cache was expected to force a preemption"
    preempted.clear()
    got = _core("tiny-llama", True, **small).generate(_PROMPTS[:3], [params] * 3)
    assert preempted
    assert _outcome(got) == _outcome(want)


def test_feedback_ignored_is_caught(cores, monkeypatch):
    """The bug the comparison exists for: a chained step that takes a stale id instead of
    the fed-back token (here the sequence's last known token) decodes other tokens."""
    stepwise, overlapped = cores
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = _outcome(stepwise.generate(_PROMPTS, [params] * len(_PROMPTS)))
    original = EngineCore._forward_step

    def stale(self, batch, prefill, previous):
        for seq in batch:
            if seq.output and seq.output[-1] == PENDING:
                seq.output[-1] = seq.tokens[-2]
        return original(self, batch, prefill, None)

    monkeypatch.setattr(EngineCore, "_forward_step", stale)
    assert _outcome(overlapped.generate(_PROMPTS, [params] * len(_PROMPTS))) != want


def test_reset_drops_a_step_in_flight(cores):
    """`reset` (the driver's, after a failed call) forgets the step in flight; the next
    generation is unaffected."""
    stepwise, overlapped = cores
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    overlapped.reset()
    overlapped.add_requests([Request(0, _PROMPTS[0], params, 0)])
    overlapped.run_steps(1)
    assert overlapped.has_work() and overlapped._in_flight is not None
    overlapped.reset()
    assert not overlapped.has_work()
    assert _outcome(overlapped.generate(_PROMPTS, [params] * 5)) == \
        _outcome(stepwise.generate(_PROMPTS, [params] * 5))


def test_overlap_turned_off_midway_reads_the_step_in_flight(cores):
    """`set_overlap(False)` with a step in flight: that step is read, no new one is chained,
    and the rest runs step by step with the same tokens."""
    stepwise, overlapped = cores
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = _outcome(stepwise.generate(_PROMPTS[:2], [params] * 2))
    overlapped.reset()
    overlapped.add_requests([Request(i, p, params, i) for i, p in enumerate(_PROMPTS[:2])])
    results = dict(overlapped.run_steps(1))
    assert overlapped._in_flight is not None
    overlapped.set_overlap(False)
    try:
        results.update(overlapped.run_steps(1))
        assert overlapped._in_flight is None
        while overlapped.has_work():
            results.update(overlapped.run_steps(1))
            assert overlapped._in_flight is None
    finally:
        overlapped.set_overlap(True)
    assert _outcome(results[i] for i in range(2)) == want


def test_overlap_option_is_checked():
    """A non-boolean value and `True` above TP 1 are refused by name, before any rank
    starts; an engine rank at TP > 1 refuses it too."""
    model_config = load_config(GOLDEN / "tiny-llama")
    with pytest.raises(ValueError, match="overlap_steps must be True or False"):
        engine_config(model_config, "float32", dict(overlap_steps="yes"))
    with pytest.raises(ValueError, match="overlap_steps=True needs tp=1, got tp=2"):
        check_overlap(engine_config(model_config, "float32", dict(overlap_steps=True)), 2)
    check_overlap(engine_config(model_config, "float32", dict(overlap_steps=None)), 2)
    with pytest.raises(ValueError, match="overlap_steps=True needs tp=1"):
        LLM(GOLDEN / "tiny-llama", tp=2, device="cpu", overlap_steps=True)
    cfg = EngineConfig(overlap_steps=True)
    assert not core_module.overlap_allowed(EngineConfig(), use_graphs=False)
    assert core_module.overlap_allowed(EngineConfig(), use_graphs=True)
    assert core_module.overlap_allowed(cfg, use_graphs=False)
