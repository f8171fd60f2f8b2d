"""Property tests of the shard specs (freetoken.formats.specs) and unit tests of
`ShardPlan.resolve`.

Every full tensor here is made of random bytes reinterpreted as its dtype, so NaNs, infinities
and -0.0 appear and "equal" always means bitwise equal."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.formats.shard import ShardError
from freetoken.formats.specs import Heads, PaddedSplit, Replicate, Segments, Split
from freetoken.loading.plan import Rule, ShardPlan

TP_SIZES = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NAME = "model.layers.7.self_attn.k_proj.weight"

tp_sizes = st.sampled_from(TP_SIZES)
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)
small = st.integers(1, 5)
PROPERTY = settings(max_examples=60, deadline=None)


# --- helpers -------------------------------------------------------------------------------


def _make_full(shape: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A contiguous tensor of random bytes viewed as `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def _assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (_bits(got) != _bits(want)).nonzero()
    assert len(diff) == 0, (f"{what}: {len(diff)} / {got.numel()} elements differ bitwise, "
                            f"first at {tuple(diff[0].tolist())}")


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _assert_fresh(shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
    """Contiguous, owns exactly its own bytes, and shares no memory with `full`."""
    assert shard.is_contiguous(), f"{what}: not contiguous (strides {shard.stride()})"
    nbytes = shard.untyped_storage().nbytes()
    assert nbytes == shard.numel() * shard.element_size(), (
        f"{what}: storage of {nbytes} bytes behind {shard.numel() * shard.element_size()} "
        "bytes of data (a view of a larger tensor)")
    s0, s1 = _storage_span(shard)
    f0, f1 = _storage_span(full)
    assert s1 <= f0 or f1 <= s0, f"{what}: storage overlaps the full tensor's storage"


def _assert_distinct_storages(shards: list[torch.Tensor], what: str) -> None:
    ptrs = [s.untyped_storage().data_ptr() for s in shards]
    assert len(set(ptrs)) == len(ptrs), f"{what}: ranks share a storage ({ptrs})"


def _shard_all(spec, full: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [spec.shard(full, rank, size, NAME) for rank in range(size)]


def _assert_round_trip(spec, full: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Shards of every rank are fresh, distinct, and unshard to `full` bitwise."""
    shards = _shard_all(spec, full, size)
    for rank, shard in enumerate(shards):
        _assert_fresh(shard, full, f"{spec} rank {rank}/{size}")
    _assert_distinct_storages(shards, f"{spec} tp={size}")
    _assert_bitwise_equal(spec.unshard(shards, NAME), full, f"{spec} tp={size} round trip")
    return shards


@st.composite
def _split_cases(draw):
    """(shape, dim, size): dim `dim` of `shape` is a multiple of `size`; dim may be negative."""
    size = draw(tp_sizes)
    ndim = draw(st.integers(1, 3))
    shape = [draw(small) for _ in range(ndim)]
    dim = draw(st.integers(-ndim, ndim - 1))
    shape[dim] = size * draw(st.integers(1, 4))
    return shape, dim, size


@st.composite
def _segment_cases(draw):
    """(shape, dim, size, sizes, unit) with every segment a multiple of size * unit."""
    size = draw(tp_sizes)
    unit = draw(st.sampled_from([1, 2, 3, 16]))
    sizes = tuple(size * unit * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 4))))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    dim = draw(st.integers(-ndim, ndim - 1))
    shape[dim] = sum(sizes)
    return shape, dim, size, sizes, unit


@st.composite
def _head_cases(draw):
    """(num_heads, head_dim, size) that the KV-head rule accepts: heads divisible by size, or
    size divisible by heads (replication)."""
    size = draw(tp_sizes)
    if draw(st.booleans()):
        num_heads = size * draw(st.integers(1, 3))
    else:
        num_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if h <= size]))
    return num_heads, draw(small), size


# --- Split ---------------------------------------------------------------------------------


@PROPERTY
@given(_split_cases(), dtypes, seeds)
def test_split_round_trips_with_fresh_equal_chunks(case, dtype, seed):
    """Split(dim): rank r holds the r-th of `size` equal chunks of `dim` as a fresh contiguous
    tensor, and unshard of all ranks is the original bit for bit."""
    shape, dim, size = case
    full = _make_full(shape, dtype, seed)
    spec = Split(dim)
    shards = _assert_round_trip(spec, full, size)
    step = shape[dim] // size
    for rank, shard in enumerate(shards):
        _assert_bitwise_equal(shard, full.narrow(dim, rank * step, step),
                              f"{spec} rank {rank}/{size}")


@PROPERTY
@given(st.integers(1, 3), st.sampled_from([2, 4, 8]), st.integers(1, 40), seeds)
def test_split_not_dividing_raises_naming_tensor(ndim, size, length, seed):
    """A dim whose length is not a multiple of tp_size raises ShardError naming the tensor."""
    if length % size == 0:
        length += 1
    shape = [2] * ndim
    shape[-1] = length
    with pytest.raises(ShardError, match=re.escape(NAME)):
        Split(ndim - 1).shard(_make_full(shape, torch.float32, seed), 0, size, NAME)


# --- Segments ------------------------------------------------------------------------------


@PROPERTY
@given(_segment_cases(), dtypes, seeds)
def test_segments_round_trip_and_hold_each_segments_slice(case, dtype, seed):
    """Segments: rank r holds [seg_0_r | seg_1_r | ...], each seg_i_r the r-th equal chunk of
    segment i; unshard of all ranks is the original bit for bit."""
    shape, dim, size, sizes, unit = case
    full = _make_full(shape, dtype, seed)
    spec = Segments(sizes, dim, unit)
    shards = _assert_round_trip(spec, full, size)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for rank, shard in enumerate(shards):
        want = torch.cat([full.narrow(dim, start + rank * (s // size), s // size)
                          for start, s in zip(starts, sizes)], dim=dim)
        _assert_bitwise_equal(shard, want, f"{spec} rank {rank}/{size}")


@PROPERTY
@given(st.sampled_from([2, 4, 8]), st.sampled_from([1, 2, 16]), st.integers(1, 3),
       st.integers(1, 15), st.booleans())
def test_segment_not_divisible_by_size_times_unit_raises(size, unit, k, off, first):
    """A segment that is not a multiple of tp_size * unit raises ShardError naming the tensor,
    whichever segment it is."""
    good = size * unit * k
    bad = good + off % (size * unit) if off % (size * unit) else good + 1
    sizes = (bad, good) if first else (good, bad)
    full = torch.zeros(sum(sizes), 3)
    with pytest.raises(ShardError, match=re.escape(NAME)):
        Segments(sizes, 0, unit).shard(full, 0, size, NAME)


def test_segments_not_summing_to_dim_raises_naming_tensor():
    """Segments whose sizes do not sum to the dim raise ShardError naming the tensor."""
    with pytest.raises(ShardError, match=re.escape(NAME)):
        Segments((4, 4), 0).shard(torch.zeros(12, 2), 0, 2, NAME)


# --- Heads ---------------------------------------------------------------------------------


@PROPERTY
@given(_head_cases(), st.integers(1, 3), st.booleans(), dtypes, seeds)
def test_heads_round_trip_and_owner_of_each_rank(case, cols, head_dim_last, dtype, seed):
    """Heads(n): with n >= size rank r holds heads [r*n/size, (r+1)*n/size); with n < size it
    holds head r*n//size. Shards are fresh, unshard restores the original bitwise."""
    num_heads, head_dim, size = case
    dim = -1 if head_dim_last else 0
    shape = [cols, num_heads * head_dim] if head_dim_last else [num_heads * head_dim, cols]
    full = _make_full(shape, dtype, seed)
    spec = Heads(num_heads, dim)
    shards = _assert_round_trip(spec, full, size)
    for rank, shard in enumerate(shards):
        if num_heads >= size:
            first, count = rank * num_heads // size, num_heads // size
        else:
            first, count = rank * num_heads // size, 1
        want = full.narrow(dim, first * head_dim, count * head_dim)
        _assert_bitwise_equal(shard, want, f"{spec} rank {rank}/{size} (heads from {first})")


@PROPERTY
@given(st.sampled_from([(1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8)]), small, dtypes, seeds)
def test_heads_replica_groups_hold_identical_shards(heads_size, head_dim, dtype, seed):
    """With fewer heads than ranks, replicas(size) partitions the ranks into one contiguous
    group per head, of size/n ranks each, and every rank of a group holds the same bytes."""
    num_heads, size = heads_size
    full = _make_full([num_heads * head_dim, 3], dtype, seed)
    spec = Heads(num_heads)
    groups = spec.replicas(size)
    per = size // num_heads
    assert groups == [list(range(h * per, (h + 1) * per)) for h in range(num_heads)], (
        f"{spec}.replicas({size}) = {groups}")
    shards = _shard_all(spec, full, size)
    for head, group in enumerate(groups):
        want = full.narrow(0, head * head_dim, head_dim)
        for rank in group:
            _assert_bitwise_equal(shards[rank], want, f"{spec} rank {rank}/{size} (head {head})")


@given(tp_sizes)
def test_heads_replicas_are_singletons_when_heads_suffice(size):
    """With at least as many heads as ranks, no two ranks hold the same shard."""
    assert Heads(8).replicas(size) == [[r] for r in range(size)]


@pytest.mark.parametrize("num_heads,size", [(3, 4), (3, 8), (5, 8), (6, 8)])
def test_heads_that_cannot_be_replicated_raise_naming_tensor(num_heads, size):
    """Fewer heads than ranks, tp_size not a multiple of heads: ShardError naming the tensor."""
    with pytest.raises(ShardError, match=re.escape(NAME)):
        Heads(num_heads).shard(torch.zeros(num_heads * 4, 2), 0, size, NAME)


@pytest.mark.parametrize("num_heads,rows,size", [(3, 12, 2), (6, 24, 4), (4, 6, 2)])
def test_heads_not_divisible_raise_naming_tensor(num_heads, rows, size):
    """Heads that cannot be split whole (heads not a multiple of tp_size, or a dim that is not
    a whole number of heads) raise ShardError naming the tensor, not a mid-head chunk."""
    try:
        shard = Heads(num_heads).shard(torch.zeros(rows, 2), 0, size, NAME)
    except ShardError as e:
        assert NAME in str(e), f"ShardError does not name the tensor: {e}"
        return
    raise AssertionError(f"Heads({num_heads}) on {rows} rows at tp_size={size} returned a "
                         f"shard of {shard.shape[0]} rows")


# --- PaddedSplit ---------------------------------------------------------------------------


@PROPERTY
@given(tp_sizes, st.integers(1, 40), st.integers(1, 3), st.booleans(), dtypes, seeds)
def test_padded_split_pads_zero_only_beyond_full_size(size, full_size, cols, last, dtype, seed):
    """PaddedSplit(n): the ranks' shards, in order, are the original rows followed by zero
    rows up to the next multiple of size; each rank holds padded/size rows; unshard
    restores the original bitwise."""
    dim = -1 if last else 0
    shape = [cols, full_size] if last else [full_size, cols]
    full = _make_full(shape, dtype, seed)
    spec = PaddedSplit(full_size, dim)
    shards = _assert_round_trip(spec, full, size)
    padded = -(-full_size // size) * size
    for rank, shard in enumerate(shards):
        assert shard.shape[dim] == padded // size, f"{spec} rank {rank}/{size}: {shard.shape}"
    joined = torch.cat(shards, dim=dim)
    _assert_bitwise_equal(joined.narrow(dim, 0, full_size), full, f"{spec} tp={size} rows")
    pad = joined.narrow(dim, full_size, padded - full_size)
    assert not _bits(pad).any(), f"{spec} tp={size}: padding rows are not all zero bits"


def test_padded_split_of_wrong_length_raises_naming_tensor():
    """A tensor whose dim is not `full_size` raises ShardError naming the tensor."""
    with pytest.raises(ShardError, match=re.escape(NAME)):
        PaddedSplit(301).shard(torch.zeros(300, 4), 0, 2, NAME)


# --- Replicate -----------------------------------------------------------------------------


@PROPERTY
@given(st.lists(small, min_size=1, max_size=3), tp_sizes, dtypes, seeds)
def test_replicate_gives_every_rank_a_fresh_full_copy(shape, size, dtype, seed):
    """Replicate: every rank holds its own fresh copy of the whole tensor, bitwise equal."""
    full = _make_full(shape, dtype, seed)
    shards = _assert_round_trip(Replicate(), full, size)
    for rank, shard in enumerate(shards):
        _assert_bitwise_equal(shard, full, f"Replicate rank {rank}/{size}")


# --- non-contiguous inputs -----------------------------------------------------------------


@pytest.mark.parametrize("spec,size", [(Replicate(), 2), (Split(0), 1), (Heads(4, 0), 1)])
def test_shard_of_transposed_input_is_contiguous(spec, size):
    """The contract holds for any input layout: a shard of a transposed tensor is contiguous."""
    full = _make_full([6, 4], torch.float32, 0).t()
    for rank in range(size):
        _assert_fresh(spec.shard(full, rank, size, NAME), full, f"{spec} rank {rank}/{size}")


# --- ShardPlan.resolve ---------------------------------------------------------------------

LAYER = r"(?P<p>model\.layers\.\d+)"


def _make_plan(tp: int = 2) -> ShardPlan:
    experts = LAYER + r"\.mlp\.experts\.(?P<e>\d+)"
    return ShardPlan([
        Rule(r"model\.norm\.weight", Replicate()),
        Rule(rf"{LAYER}\.self_attn\.k_proj\.weight", Heads(2), r"\g<p>.self_attn.qkv_proj.weight",
             (slice(32, 48),)),
        Rule(rf"{experts}\.gate_proj\.weight", Split(0), r"\g<p>.mlp.experts.w13",
             ("e", slice(0, 4))),
        Rule(rf"{experts}\.down_proj\.weight", Split(1), r"\g<p>.mlp.experts.w2", ("e",)),
        Rule(r"lm_head\.weight", PaddedSplit(301), None),
    ], tp)


def test_resolve_unmatched_name_raises_naming_tensor():
    """A checkpoint name no rule full-matches (also a prefix match) raises ShardError naming it."""
    plan = _make_plan()
    for name in ("model.layers.0.mlp.shared_expert.up_proj.weight", "model.norm.weight.extra"):
        with pytest.raises(ShardError, match=re.escape(repr(name))):
            plan.resolve(name)


def test_resolve_name_matching_two_rules_raises_naming_tensor_and_rules():
    """A name that two rules match raises ShardError naming the tensor and both patterns."""
    plan = ShardPlan([Rule(r"model\.norm\.weight"), Rule(r"model\.(norm|embed)\.\w+", Split(0))],
                     2)
    with pytest.raises(ShardError, match=re.escape("'model.norm.weight' matches 2 rules")) as e:
        plan.resolve("model.norm.weight")
    assert r"model\\.(norm|embed)" in str(e.value), f"second pattern not named: {e.value}"


@given(st.integers(0, 95), st.integers(0, 511))
def test_resolve_substitutes_expert_index_into_slot(layer, expert):
    """An expert rule's slot names the regex group `e`: the target slot starts with that expert
    index as an int, and `param` expands the layer prefix."""
    plan = _make_plan()
    prefix = f"model.layers.{layer}.mlp.experts"
    gate = plan.resolve(f"{prefix}.{expert}.gate_proj.weight")
    assert (gate.param, gate.slot) == (f"model.layers.{layer}.mlp.experts.w13",
                                       (expert, slice(0, 4))), f"gate target: {gate}"
    down = plan.resolve(f"{prefix}.{expert}.down_proj.weight")
    assert (down.param, down.slot) == (f"model.layers.{layer}.mlp.experts.w2", (expert,)), (
        f"down target: {down}")
    assert isinstance(gate.slot[0], int) and isinstance(down.slot[0], int)


def test_resolve_default_param_is_the_name_and_none_ignores():
    """Without `param` a tensor targets the parameter of its own name with no slot; a rule with
    param=None resolves to an ignored target."""
    plan = _make_plan()
    norm = plan.resolve("model.norm.weight")
    assert (norm.param, norm.slot, norm.name) == ("model.norm.weight", (), "model.norm.weight")
    assert plan.resolve("lm_head.weight").param is None
    k = plan.resolve("model.layers.3.self_attn.k_proj.weight")
    assert (k.param, k.slot) == ("model.layers.3.self_attn.qkv_proj.weight", (slice(32, 48),))


_OVERLAPPING = [r"a\.\d+", r"a\.(?P<n>\d+)", r"a\.1\d*", r"b\.\w+", r"(a|b)\.x",
                r"a\.(?P<n>\d)\.y", r"\w+\.y", r"(?P<m>\w)\.(?P<n>\d)\.y"]
_NAMES = ["a.1", "a.12", "a.7", "a.x", "b.x", "b.12", "a.3.y", "b.4.y", "c.y", "c", "a.1.y.z"]


def _outcome(resolve, name: str):
    try:
        t = resolve(name)
    except ShardError as e:
        return str(e)
    return t.rule.pattern, t.param, t.slot


@given(st.lists(st.sampled_from(_OVERLAPPING), min_size=1, max_size=6, unique=True),
       st.lists(st.sampled_from(_NAMES), min_size=1, max_size=8))
def test_resolve_through_combined_regexes_equals_rule_by_rule(patterns, names):
    """The combined-regex resolve gives the rule-by-rule answer for any rule order and name:
    the same rule, destination and slot, or the same error (no rule, or every rule of an
    ambiguous name) - named groups shared by several rules included."""
    plan = ShardPlan([Rule(p, param=r"\g<0>.p", slot=("n",) if "<n>" in p else ())
                      for p in patterns], 1)
    for name in names:
        assert _outcome(plan.resolve, name) == _outcome(plan._resolve_slow, name), name


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3.5-moe-nvfp4"])
def test_resolve_of_every_bundled_tensor_equals_rule_by_rule(case):
    """Over the real shard plans, every checkpoint name resolves as rule by rule would."""
    from freetoken.loading import CheckpointReader
    from freetoken.models.registry import load_config, shard_plan
    from freetoken_verify.cases.catalogue import resolve_case

    folder = resolve_case(case).folder
    plan = shard_plan(load_config(folder), 2)
    for name in CheckpointReader(folder).names():
        assert _outcome(plan.resolve, name) == _outcome(plan._resolve_slow, name), name


def test_plan_shard_uses_the_plans_tp_size():
    """ShardPlan.shard applies the resolved rule at the plan's tp_size."""
    full = torch.arange(8.0).reshape(4, 2)
    down = "model.layers.0.mlp.experts.1.down_proj.weight"
    got = _make_plan(tp=2).shard(down, full, 1)
    _assert_bitwise_equal(got, full[:, 1:], f"{down} rank 1/2")


@pytest.mark.parametrize("case", ["tiny-llama", "tiny-qwen3-moe", "tiny-qwen3.5-moe",
                                  "tiny-qwen3.5-moe-nvfp4"])
def test_every_plan_spec_follows_the_shard_spec_protocol(case):
    """Each rule of a bundled case's plan carries a ShardSpec (shard, pieces, unshard): the
    loader and the shards check call all three on whatever a plan holds."""
    from freetoken.formats.shard import ShardSpec
    from freetoken.models.registry import load_config, shard_plan
    from freetoken_verify.cases.catalogue import resolve_case

    plan = shard_plan(load_config(resolve_case(case).folder), 2)
    bad = [r.pattern for r in plan.rules if not isinstance(r.spec, ShardSpec)]
    assert not bad, f"rules whose spec is no ShardSpec: {bad}"
