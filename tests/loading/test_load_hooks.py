"""`POST_LOAD_HOOKS` (`freetoken/loading/loader.py`): each hook runs once per `load_weights`, in
the order appended, with the loaded model, its reader and its plan, after every shard is in
place; what it writes stays in the model. The harness's loader faults rely on exactly that."""

from __future__ import annotations

from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.loading import CheckpointReader, load_weights, loader
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.cases.catalogue import GOLDEN

FOLDER = GOLDEN / "tiny-llama"


def _load_rank_1_of_2():
    """Rank 1 of 2's tiny-llama, loaded in this process."""
    cfg = load_config(FOLDER)
    set_tp_info(TPInfo(1, 2))
    try:
        model = build_model(cfg)
        plan = shard_plan(cfg, 2)
        reader = CheckpointReader(FOLDER)
        load_weights(model, reader, plan, progress=False)
    finally:
        reset_tp_info()
    return model, reader, plan


def test_hooks_run_in_order_on_the_loaded_model_and_their_writes_stay(monkeypatch):
    clean = {n: p.detach().clone() for n, p in _load_rank_1_of_2()[0].named_parameters()}
    calls = []

    def record(model, reader, plan):
        loaded = dict(model.named_parameters())
        calls.append(("record", all(loaded[n].equal(want) for n, want in clean.items())))
        calls[-1] += (model, reader, plan)

    def zero_norm(model, reader, plan):
        calls.append(("zero_norm",))
        model.get_parameter("model.norm.weight").data.zero_()

    monkeypatch.setattr(loader, "POST_LOAD_HOOKS", [record, zero_norm])
    model, reader, plan = _load_rank_1_of_2()
    assert [c[0] for c in calls] == ["record", "zero_norm"], calls
    assert calls[0][1], "a hook ran before every shard was in place"
    assert calls[0][2:] == (model, reader, plan), "the hook got another model, reader or plan"
    assert not model.get_parameter("model.norm.weight").any(), "the hook's write was undone"

