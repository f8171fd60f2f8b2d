"""Tests for freetoken.engine.scheduler.Scheduler and kv_cache.BlockManager."""

import math

import pytest

from freetoken.engine.kv_cache import BlockManager
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.sequence import SamplingParams, Sequence


def _make_seq(seq_id: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def _make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                    max_num_batched_tokens: int = 1024) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens)


def _ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def _step(batch: list[Sequence]) -> None:
    """What the engine does after a step: every sequence gains one token, all now cached."""
    for seq in batch:
        seq.num_cached = len(seq)
        seq.output.append(0)


def _assert_block_accounting(sched: Scheduler) -> None:
    blocks = sched.blocks
    held = [b for seq in sched.running for b in seq.block_table]
    for seq in sched.running:
        assert len(seq.block_table) >= math.ceil(len(seq) / blocks.block_size), \
            f"seq {seq.seq_id}: {len(seq)} tokens in {len(seq.block_table)} blocks"
    for seq in sched.waiting:
        assert seq.block_table == [], f"waiting seq {seq.seq_id} holds {seq.block_table}"
    assert len(set(held)) == len(held), f"a block is held twice: {sorted(held)}"
    both = set(held) & set(blocks.free)
    assert not both, f"held blocks also free: {sorted(both)}"
    assert sorted(held + blocks.free) == list(range(blocks.num_blocks)), "blocks lost or invented"


def test_block_manager_holds_ceil_n_over_block_size():
    """A sequence grown to n tokens holds exactly ceil(n / block_size) distinct blocks, and
    releasing it returns every block to the free list."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = _make_seq(0, 1)
    for n in range(1, 4 * 8 + 1):
        blocks.grow(seq, n)
        assert len(seq.block_table) == math.ceil(n / 4), f"{n} tokens: {seq.block_table}"
        assert len(set(seq.block_table)) == len(seq.block_table), f"{n}: {seq.block_table}"
        assert len(blocks.free) == 8 - len(seq.block_table), f"{n} tokens: free {blocks.free}"
    assert not blocks.can_grow(_make_seq(1, 1), 1), "an exhausted cache still grows"
    blocks.release(seq)
    assert seq.block_table == [] and sorted(blocks.free) == list(range(8)), f"{blocks.free}"


def test_slot_maps_positions_through_the_block_table():
    """Position p of a sequence lives in slot block_table[p // bs] * bs + p % bs."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    other, seq = _make_seq(0, 1), _make_seq(1, 1)
    blocks.grow(other, 4)
    blocks.grow(seq, 10)
    slots = [blocks.slot(seq, p) for p in range(10)]
    table = seq.block_table
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(10)], f"slots {slots} for {table}"
    assert not set(slots) & {blocks.slot(other, p) for p in range(4)}, "slots shared"


def test_prefill_admits_up_to_max_num_seqs():
    """A prefill batch holds at most max_num_seqs sequences, FIFO; with the running set full
    the next step decodes."""
    sched = _make_scheduler(max_num_seqs=3)
    for i in range(5):
        sched.add(_make_seq(i, 4))
    batch, prefill = sched.schedule()
    assert prefill and _ids(batch) == [0, 1, 2], f"prefill={prefill} batch {_ids(batch)}"
    assert _ids(sched.waiting) == [3, 4], f"waiting {_ids(sched.waiting)}"
    _step(batch)
    batch, prefill = sched.schedule()
    assert not prefill and _ids(batch) == [0, 1, 2], f"prefill={prefill} batch {_ids(batch)}"
    _assert_block_accounting(sched)


def test_prefill_respects_max_num_batched_tokens():
    """A prefill batch stops before the sequence that would exceed max_num_batched_tokens."""
    sched = _make_scheduler(max_num_batched_tokens=20)
    for i in range(4):
        sched.add(_make_seq(i, 8))
    batch, prefill = sched.schedule()
    assert prefill and _ids(batch) == [0, 1], f"prefill={prefill} batch {_ids(batch)}"
    assert sum(len(s) for s in batch) <= 20, f"{sum(len(s) for s in batch)} batched tokens"
    batch, prefill = sched.schedule()
    assert prefill and _ids(batch) == [2, 3], f"second prefill {_ids(batch)}"


def test_prefill_allocates_blocks_and_finish_frees_them():
    """Each admitted sequence holds ceil(len / block_size) blocks; finishing returns them."""
    sched = _make_scheduler(num_blocks=16, block_size=4)
    lengths = [1, 4, 5, 9]
    for i, n in enumerate(lengths):
        sched.add(_make_seq(i, n))
    batch, _ = sched.schedule()
    got = [len(s.block_table) for s in batch]
    assert got == [math.ceil(n / 4) for n in lengths], f"blocks per sequence {got}"
    assert len(sched.blocks.free) == 16 - sum(got), f"free {len(sched.blocks.free)}"
    _assert_block_accounting(sched)
    for seq in list(batch):
        sched.finish(seq)
    assert sorted(sched.blocks.free) == list(range(16)), f"free after finish {sched.blocks.free}"
    assert not sched.has_work(), "work left after every sequence finished"


def test_prefill_waits_when_the_cache_is_full():
    """A waiting prompt whose blocks are not free stays waiting; running sequences decode."""
    sched = _make_scheduler(num_blocks=4, block_size=4)
    sched.add(_make_seq(0, 12))
    sched.add(_make_seq(1, 8))
    batch, prefill = sched.schedule()
    assert prefill and _ids(batch) == [0], f"prefill={prefill} batch {_ids(batch)}"
    assert _ids(sched.waiting) == [1], f"waiting {_ids(sched.waiting)}"
    _assert_block_accounting(sched)


def test_decode_grows_blocks_at_the_boundary():
    """Decode gives a sequence a new block exactly when its length crosses a block boundary."""
    sched = _make_scheduler(num_blocks=8, block_size=4)
    sched.add(_make_seq(0, 3, max_tokens=8))
    batch, _ = sched.schedule()
    for length in range(4, 10):
        _step(batch)
        batch, prefill = sched.schedule()
        assert not prefill and _ids(batch) == [0], f"length {length}: {_ids(batch)}"
        assert len(batch[0].block_table) == math.ceil(length / 4), \
            f"length {length}: {batch[0].block_table}"
        _assert_block_accounting(sched)


def test_exhausted_cache_preempts_the_newest_sequence():
    """When decode runs out of blocks, the newest running sequence goes back to the front of
    the waiting queue with its blocks freed, and the older one decodes."""
    sched = _make_scheduler(num_blocks=4, block_size=4)
    for i, n in enumerate([8, 8, 4]):
        sched.add(_make_seq(i, n, max_tokens=8))
    batch, _ = sched.schedule()
    assert _ids(batch) == [0, 1] and _ids(sched.waiting) == [2], f"prefill {_ids(batch)}"
    _step(batch)
    newest = batch[1]
    batch, prefill = sched.schedule()
    assert not prefill and _ids(batch) == [0], f"prefill={prefill} decode batch {_ids(batch)}"
    assert _ids(sched.waiting) == [1, 2], f"waiting after preemption {_ids(sched.waiting)}"
    assert newest.block_table == [] and newest.num_cached == 0, \
        f"preempted: blocks {newest.block_table}, cached {newest.num_cached}"
    assert len(batch[0].block_table) == 3 and len(sched.blocks.free) == 1, \
        f"survivor blocks {batch[0].block_table}, free {sched.blocks.free}"
    _assert_block_accounting(sched)


def test_several_preemptions_keep_arrival_order():
    """Preempting more than one sequence puts them back at the front in arrival order."""
    sched = _make_scheduler(num_blocks=3, block_size=4)
    for i in range(3):
        sched.add(_make_seq(i, 4, max_tokens=4))
    batch, _ = sched.schedule()
    _step(batch)
    batch, prefill = sched.schedule()
    assert not prefill and _ids(batch) == [0], f"decode batch {_ids(batch)}"
    assert _ids(sched.waiting) == [1, 2], f"waiting after preemption {_ids(sched.waiting)}"
    _assert_block_accounting(sched)


def test_add_rejects_a_request_that_can_never_fit():
    """add() refuses a request whose prompt + max_tokens exceeds the whole cache, naming it;
    one that exactly fills the cache is accepted."""
    sched = _make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"request 7: 6 prompt \+ 3 new tokens") as info:
        sched.add(_make_seq(7, 6, max_tokens=3))
    assert "3 cache blocks" in str(info.value) and "has 2" in str(info.value), f"{info.value}"
    assert not sched.has_work(), "a rejected request was queued"
    sched.add(_make_seq(8, 5, max_tokens=3))
    assert _ids(sched.waiting) == [8], f"waiting {_ids(sched.waiting)}"
