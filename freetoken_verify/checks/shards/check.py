"""shards: every checkpoint tensor through the engine's own shard plan, for every rank, one
tensor at a time and without building the model, and against the model's layout as stated
independently of the plan (`freetoken_verify.checks.shards.layout_book`).

Per tensor: its dtype and shape are what its module's declared format stores (the format is
the quantization config's answer, never guessed from the dtype); exactly one rule matches; a
layout statement covers it, names the same engine parameter and slot as the plan, and agrees
on whether the engine loads it; a tensor the plan drops passes its rule's checks (a stored
input scale finite and above 0, `Rule.checked`); each rank's shard
is a fresh tensor (a view would pin the whole checkpoint tensor); it fits the rank's parameter
slot (shapes from a model built on the meta device); every rank's shard holds exactly the
global rows (columns) the statement gives that rank, in the stated local order, bit for bit
(the first wrong local row is named with the global row it holds and the one it should hold,
and a shard identical to another rank's whose stated rows differ is called out); reassembling
all ranks' shards with the plan's inverse gives the original bit for bit; replicated tensors
are identical on every rank. Per parameter: every element is covered exactly once. When the
engine for this model is already loaded on the rank (after golden or memory), each loaded
parameter slot is compared with the statement the same way."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from freetoken.formats.shard import ShardError
from freetoken.formats.specs import Replicate
from freetoken.loading import CheckpointReader
from freetoken.loading.plan import slot_key
from freetoken.models.registry import build_model, load_config, shard_plan
from freetoken_verify.checks.base import CheckContext, make_result
from freetoken_verify.checks.engine_cache import resident_engine
from freetoken_verify.checks.shards.layout_book import LayoutBook
from freetoken_verify.checks.shards.layout_compare import bits, identical_to, mismatch
from freetoken_verify.checks.shards.layouts import LayoutError
from freetoken_verify.report.formats import CheckResult

MAX_REPORTED = 20
_UNSTATED = object()
"""Stands for a tensor whose statement failed (already reported)."""


def run(ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    records = ctx.runner.run(_audit, ctx.case.engine_args(ctx.options))
    failures = [f for r in records for f in r.value["failures"]]
    first = records[0].value
    metrics = {"tensors": first["tensors"], "ignored": first["ignored"],
               "stated": first["stated"],
               "bytes_read": first["bytes_read"],
               "loaded_compared": sum(r.value["loaded_compared"] for r in records),
               "problems": len(failures)}
    status = "fail" if failures else "pass"
    message = f"{ctx.case.name} tp={ctx.tp}: {failures[0]}" if failures else ""
    return make_result("shards", ctx, start, status, metrics, message)


def owns_storage(t: torch.Tensor) -> bool:
    """True when `t` is the only tensor over its storage, with nothing else kept alive."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _audit(rank_ctx, engine_args: dict) -> dict:
    """Runs on every rank; rank 0 also checks round trips and replication across ranks."""

    audit = _Audit(rank_ctx, engine_args)
    # Golden's bitwise engine (tp_invariant) loads the same parameters as the default one.
    engine = resident_engine(rank_ctx, engine_args) or \
        resident_engine(rank_ctx, {**engine_args, "tp_invariant": True})
    audit.loaded = dict(engine.model.named_parameters()) if engine is not None else None
    reader = audit.reader = CheckpointReader(engine_args["folder"], engine_args["num_layers"])
    for name in reader.names():
        try:
            audit.tensor(name, reader.get(name))
        except ShardError as e:
            audit.fail(str(e))
    reader.close()
    audit.coverage()
    return audit.summary()


class _Audit:
    def __init__(self, rank_ctx, engine_args: dict):
        cfg = load_config(engine_args["folder"])
        if engine_args["num_layers"] is not None:
            cfg = cfg.truncated(engine_args["num_layers"])
        self.rank, self.size = rank_ctx.rank, rank_ctx.size
        self.plan = shard_plan(cfg, self.size)
        with torch.device("meta"):
            self.params = dict(build_model(cfg).named_parameters())
        self.filled: dict[str, dict[str, int]] = defaultdict(dict)
        self.failures: list[str] = []
        self.tensors = self.ignored = self.bytes_read = self.loaded_compared = self.stated = 0
        self.book = LayoutBook.from_folder(engine_args["folder"], self.size)
        self.loaded = self.reader = None

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def fail_once(self, message: str) -> None:
        """A finding that is the same on every rank: reported by rank 0 only."""
        if self.rank == 0:
            self.fail(message)

    def tensor(self, name: str, full: torch.Tensor) -> None:
        self.tensors += 1
        self.bytes_read += full.numel() * full.element_size()
        try:
            stated = self.book.state(name, full.dtype)
            if stated is not None:
                stated.check_shape(tuple(full.shape))
        except LayoutError as e:
            self.fail_once(str(e))
            stated = _UNSTATED
        target = self.plan.resolve(name)
        statement = self._statement(name, stated, target)
        if target.param is None:
            self.ignored += 1
            target.rule.check_dropped(full, self.rank, self.size, name)
            return
        spec = target.rule.spec
        ranks = range(self.size) if self.rank == 0 else [self.rank]
        shards = {r: spec.shard(full, r, self.size, name) for r in ranks}
        mine = shards[self.rank]
        if self.rank == 0:
            self._planned_layout(name, full, statement, shards)
        if not owns_storage(mine) or mine.untyped_storage().data_ptr() == \
                full.untyped_storage().data_ptr():
            self.fail(f"{name}: rank {self.rank}'s shard is a view pinning "
                      f"{full.untyped_storage().nbytes()} bytes of the checkpoint tensor")
        if target.param not in self.params:
            self.fail(f"{name}: maps to parameter {target.param!r}, which the model lacks")
            return
        slot = self.params[target.param][target.slot]
        if tuple(slot.shape) != tuple(mine.shape):
            self.fail(f"{name}: rank {self.rank}'s shard has shape {tuple(mine.shape)}, "
                      f"parameter {destination(target.param, target.slot)} has "
                      f"{tuple(slot.shape)}")
            return
        key = slot_key(target.slot)
        if key in self.filled[target.param]:
            self.fail(f"{name}: parameter {destination(target.param, target.slot)} is written "
                      "twice")
        self.filled[target.param][key] = mine.numel()
        if self.rank == 0:
            self._across_ranks(name, full, spec, shards)
        self._loaded(name, target, mine, statement, full)

    def _statement(self, name, st, target):
        """The tensor's layout statement `st`, after checking that it covers what the plan
        does with the tensor and names the same destination; None when nothing can be
        compared."""
        if st is _UNSTATED:
            return None
        if st is None:
            if target.param is not None:
                self.fail_once(f"{name}: no layout statement covers it (the plan loads it "
                               f"into {target.param} with {target.rule.spec})")
            return None
        if st.ignored or target.param is None:
            if st.ignored != (target.param is None):
                plan = "ignores it" if target.param is None else f"loads it into {target.param}"
                self.fail_once(f"{name}: the layout says the engine "
                               f"{'ignores' if st.ignored else 'loads'} it, the plan {plan}")
            return None
        self.stated += 1
        if (st.param, self._slot(st.param, st.slot)) != \
                (target.param, self._slot(target.param, target.slot)):
            self.fail_once(f"{name}: the plan writes it to "
                           f"{destination(target.param, target.slot)}, the layout says "
                           f"{destination(st.param, st.slot)}")
        return st

    def _slot(self, param: str, slot: tuple) -> str:
        """`slot` with trailing slices spanning their whole dim of `param` dropped (`[0:3]`
        of a 3-row parameter is the whole of it), for comparison."""
        shape = self.params[param].shape if param in self.params else None
        slot = list(slot)
        while shape is not None and slot and isinstance(slot[-1], slice) and \
                (slot[-1].start or 0, slot[-1].stop) == (0, shape[len(slot) - 1]):
            slot.pop()
        return slot_key(tuple(slot))

    def _planned_layout(self, name, full, st, shards) -> None:
        """Every rank's planned shard against the statement; the first wrong rank is named,
        and whether its shard is another rank's although their rows should differ."""
        if st is None:
            return
        for r in range(self.size):
            try:
                wrong = mismatch(st, full, shards[r], r, self.size)
                same = identical_to(st, full, shards, r, self.size) if wrong else None
            except LayoutError as e:
                self.fail(str(e))
                return
            if wrong:
                also = "" if same is None else (f"; its shard is identical to rank {same}'s, "
                                                "whose layout rows differ")
                self.fail(f"{name} rank {r} (planned for {destination(st.param, st.slot)}): "
                          f"{wrong}{also}")
                return

    def _across_ranks(self, name, full, spec, shards) -> None:
        parts = [shards[r] for r in range(self.size)]
        back = spec.unshard(parts, name)
        if back.numel() == 1 == full.numel():
            # A scalar (a global scale) is read as () or (1,) alike; the value must come back.
            back = back.reshape(full.shape)
        if back.dtype != full.dtype or back.shape != full.shape or not _same_bits(back, full):
            self.fail(f"{name}: reassembling the {self.size} shards does not give the "
                      f"checkpoint tensor back ({_diff(back, full)})")
        if isinstance(spec, Replicate):
            bad = [r for r in range(1, self.size) if not _same_bits(parts[r], parts[0])]
            if bad:
                self.fail(f"{name}: replicated tensor differs on rank(s) {bad}")

    def _loaded(self, name, target, mine, st, full) -> None:
        """The loaded engine's parameter against the statement (or, for a tensor without
        one, against the planned shard)."""
        if self.loaded is None:
            return
        self.loaded_compared += 1
        if st is not None and st.param in self.loaded:
            held = self.loaded[st.param].data[st.slot].cpu()
            ref = full if held.dtype == full.dtype else full.to(held.dtype)
            try:
                wrong = mismatch(st, ref, held, self.rank, self.size,
                                 lambda: self._sharing(st, held.dtype))
            except LayoutError as e:
                wrong = str(e)
            if wrong:
                self.fail(f"{name} rank {self.rank} (loaded "
                          f"{destination(st.param, st.slot)}): {wrong}")
            return
        param = self.loaded[target.param].data
        held = param[target.slot] if target.slot else param
        if not _same_bits(held.cpu(), mine.to(held.dtype)):
            self.fail(f"{name}: rank {self.rank}'s loaded {target.param} differs from its "
                      f"planned shard ({_diff(held.cpu(), mine.to(held.dtype))})")

    def _sharing(self, st, dtype):
        """The other checkpoint tensors loaded into `st`'s parameter at the same expert index
        (per-tensor scales: of the same destination), with statements (read only to name
        what a wrong row or value holds, so only when one is wrong)."""
        for name in self.reader.names():
            try:
                other = self.book.state(name) if name != st.name else None
            except LayoutError:
                continue
            if other is None or other.param != st.param or other.replicated != st.replicated:
                continue
            same = (other.slot[:-1] == st.slot[:-1] if st.replicated else
                    _indices(other.slot) == _indices(st.slot))
            if same:
                tensor = self.reader.get(name)
                yield other, tensor if tensor.dtype == dtype else tensor.to(dtype)

    def coverage(self) -> None:
        for pname, p in self.params.items():
            got = sum(self.filled.get(pname, {}).values())
            if got != p.numel():
                self.fail(f"parameter {pname}: {got} of {p.numel()} elements covered by the "
                          f"plan on rank {self.rank}")

    def summary(self) -> dict:
        return {"failures": self.failures[:MAX_REPORTED], "tensors": self.tensors,
                "ignored": self.ignored, "bytes_read": self.bytes_read,
                "loaded_compared": self.loaded_compared, "stated": self.stated}


def destination(param: str, slot: tuple) -> str:
    """`param[slot]` as a person reads it: `...qkv_proj.weight[0:64]`, `...w13[3, 8:16]`."""
    if not slot:
        return param
    parts = [f"{s.start}:{s.stop}" if isinstance(s, slice) else str(s) for s in slot]
    return f"{param}[{', '.join(parts)}]"


def _indices(slot: tuple) -> tuple:
    """The integer (expert) part of a parameter slot."""
    return tuple(s for s in slot if isinstance(s, int))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal (float8 too, which CPU torch cannot compare; NaN and -0.0 exactly)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    return f"{int((bits(a) != bits(b)).sum())} / {a.numel()} elements differ"
