"""Decode graphs' static inputs (CPU-checkable part of `freetoken.engine.graphs`): buckets
are powers of two covering the batch limit, every step's rows land in the static buffers,
and padding rows point only at the scratch cache block and scratch state slot; the
graph's own unpacking of the staging rows is what fills them."""

from __future__ import annotations

import torch

from freetoken.engine.graphs import DecodeGraphs, buckets


def _make_graphs() -> DecodeGraphs:
    return DecodeGraphs(torch.nn.Identity(), max_batch=5, max_blocks=6, block_size=4,
                        scratch_block=9, scratch_state=7, device="cpu")


def test_buckets_cover_the_batch_limit():
    """1, 2, 4, ... up to the first power of two >= the limit."""
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(16) == [1, 2, 4, 8, 16]


def test_fill_writes_real_rows_then_scratch_padding():
    """Three sequences in bucket 4: their ids, positions, slots, context lengths, state
    slots and block tables; the fourth row writes to the scratch block's first slot, reads
    one position of it and uses the scratch state slot. A later, smaller step overwrites the
    rows it uses (no stale input)."""
    g = _make_graphs()
    g._fill(4, [11, 12, 13], [5, 0, 8], [21, 2, 33], [6, 1, 9], [[5, 1], [0], [3, 8, 2]],
            [2, 0, 1])
    g._unpack(4)
    assert g.ids[:4].tolist() == [11, 12, 13, 0]
    assert g.positions[:4].tolist() == [5, 0, 8, 0]
    assert g.slot_mapping[:4].tolist() == [21, 2, 33, 36]
    assert g.context_lens[:4].tolist() == [6, 1, 9, 1]
    assert g.seq_slots[:4].tolist() == [2, 0, 1, 7]
    assert g.block_tables[:4, :3].tolist() == [[5, 1, 0], [0, 0, 0], [3, 8, 2], [9, 0, 0]]
    g._fill(2, [40], [6], [22], [7], [[5, 1]], [3])
    g._unpack(2)
    assert g.ids[:2].tolist() == [40, 0]
    assert g.slot_mapping[:2].tolist() == [22, 36]
    assert g.context_lens[:2].tolist() == [7, 1]
    assert g.seq_slots[:2].tolist() == [3, 7]
    assert g.block_tables[:2, :2].tolist() == [[5, 1], [9, 0]]


def test_negative_ids_take_the_previous_steps_tokens():
    """An id -1 - j is the j-th greedy token of the previous replay (the shared `tokens`
    rows every graph writes its argmax into): an overlapped step's fed-back input."""
    g = _make_graphs()
    g.tokens[:3] = torch.tensor([71, 72, 73])
    g._fill(4, [-1 - 2, 15, -1], [5, 0, 8], [21, 2, 33], [6, 1, 9], [[5, 1], [0], [3]],
            [2, 0, 1])
    g._unpack(4)
    assert g.ids[:4].tolist() == [73, 15, 71, 0]


def test_rows_reach_the_inputs_only_through_the_unpacking():
    """`_fill` writes the host rows and the device staging rows; the layers' inputs change
    only when `_unpack` (captured into each graph) runs, so a graph that did not unpack
    would replay stale inputs."""
    g = _make_graphs()
    g._fill(2, [40], [6], [22], [7], [[5, 1]], [3])
    assert g.staging[:2, :7].tolist() == g.host[:2, :7].tolist()
    assert g.staging[0, :7].tolist() == [40, 6, 22, 7, 3, 5, 1]
    assert g.ids[:2].tolist() == [0, 0]
    g._unpack(2)
    assert g.ids[:2].tolist() == [40, 0]


def test_drop_forgets_graphs_and_their_pool():
    """`drop` leaves no graph, output or pool behind, so the next step of every bucket
    captures again into a fresh pool (a pool whose graphs are all freed cannot take a new
    capture)."""
    g = _make_graphs()
    g.graphs[1], g.logits[1], g.greedy[1], g.pool = object(), object(), object(), (0, 1)
    g.drop()
    assert (g.graphs, g.logits, g.greedy, g.pool) == ({}, {}, {}, None)
