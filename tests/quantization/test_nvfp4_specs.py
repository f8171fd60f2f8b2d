"""NVFP4 shard specs (freetoken.formats.nvfp4.specs): input splits of packed weights
and block scales round-trip bitwise into fresh tensors, refuse a split that cuts a 16-element
group naming the tensor and sizes, global scales stay float32 scalars; and the expert rules
load a per-expert NVFP4 checkpoint (both producers) into `NVFP4FusedExperts` whose per-rank
partial sums add up to the unsharded reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
from freetoken.formats.nvfp4.checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    to_checkpoint,
)
from freetoken.formats.nvfp4.quantizer import quantize
from freetoken.formats.nvfp4.specs import (
    PACKED,
    SCALE,
    GlobalScale,
    InputSplit,
)
from freetoken.formats.shard import ShardError
from freetoken.layers.quantization.nvfp4 import NVFP4FusedExperts
from freetoken.layers.quantization.nvfp4.reference import reference_moe
from freetoken.loading.loader import load_weights
from freetoken.loading.plan import ShardPlan
from freetoken.models.shard_rules import expert_rules

PROPERTY = settings(max_examples=60, deadline=None)
NAME = "model.layers.1.mlp.experts.3.down_proj.weight"


def _random_bytes(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def _owns_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


@PROPERTY
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 3), st.integers(1, 5),
       st.sampled_from([PACKED, SCALE]), st.integers(0, 2**31 - 1))
def test_input_split_round_trips_bitwise(tp, groups_per_rank, rows, kind, seed):
    """Every rank's shard is fresh and contiguous, holds whole groups, and concatenating them
    gives back the checkpoint tensor bit for bit (fp8 scales compared as bytes)."""
    columns = tp * groups_per_rank * (8 if kind == PACKED else 1)
    full = _random_bytes((rows, columns), seed)
    if kind == SCALE:
        full = full.view(torch.float8_e4m3fn)
    spec = InputSplit(kind, 1)
    parts = [spec.shard(full, r, tp, NAME) for r in range(tp)]
    assert all(_owns_storage(p) for p in parts), "a shard must not be a view"
    assert all(p.shape[1] == columns // tp for p in parts)
    assert torch.equal(spec.unshard(parts, NAME).view(torch.uint8), full.view(torch.uint8))


@pytest.mark.parametrize("kind, columns, tp, per_rank", [(PACKED, 40, 2, "40"),
                                                          (PACKED, 24, 4, "12"),
                                                          (SCALE, 3, 2, "24")])
def test_split_cutting_a_group_names_tensor_and_sizes(kind, columns, tp, per_rank):
    """A split whose per-rank share is not whole 16-element groups is a ShardError naming the
    tensor, the logical input size, tp_size, the share and the stored columns."""
    full = torch.zeros(4, columns, dtype=torch.uint8)
    inputs = columns * (2 if kind == PACKED else 16)
    with pytest.raises(ShardError) as err:
        InputSplit(kind, 1).shard(full, 0, tp, NAME)
    text = str(err.value)
    for needle in (NAME, f"{inputs} NVFP4 inputs", f"tp_size={tp}", f"{per_rank} per rank",
                   f"{columns} ", "16-element group"):
        assert needle in text, f"{needle!r} missing from: {text}"


def test_global_scale_replicated_float32_and_restored():
    """Global scales: every rank gets the float32 scalar; the inverse restores the stored
    shape ([] for ModelOpt, [1] for compressed-tensors); other dtypes are refused."""
    for shape in ((), (1,)):
        full = torch.full(shape, 0.0123, dtype=torch.float32)
        spec = GlobalScale(shape)
        parts = [spec.shard(full, r, 4, "w.weight_scale_2") for r in range(4)]
        assert all(p.shape == () and p.dtype == torch.float32 for p in parts)
        assert torch.equal(spec.unshard(parts), full) and spec.unshard(parts).shape == shape
    with pytest.raises(ShardError, match="w.weight_scale_2.*float32.*bfloat16"):
        GlobalScale().shard(torch.ones((), dtype=torch.bfloat16), 0, 2, "w.weight_scale_2")


class _Reader:
    """The CheckpointReader interface over a dict."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def get(self, name):
        return self.tensors[name]

    def close(self):
        pass


def _hf_expert_rules(full_intermediate: int, tp: int, producer: str):
    """NVFP4 expert rules for the HF per-expert layout `model.layers.L.mlp.experts.E.*` into
    `model.layers.L.mlp.experts`."""
    expert = r"(?P<p>model\.layers\.\d+)\.mlp\.experts\.(?P<e>\d+)"
    return expert_rules(expert, r"\g<p>.mlp.experts", full_intermediate, tp, producer)


def _make_checkpoint(experts: int, hidden: int, inter: int, producer: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tensors, full = {}, {"w13": [], "w13_scale": [], "w13_global": [], "w2": [],
                         "w2_scale": [], "w2_global": []}
    for e in range(experts):
        prefix = f"model.layers.0.mlp.experts.{e}"
        q = {p: quantize(torch.randn(shape, generator=gen) * (1 + e) * (3 if p == "up" else 1))
             for p, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                              ("down", (hidden, inter)))}
        for part, t in q.items():
            tensors.update(to_checkpoint(t, f"{prefix}.{part}_proj", producer))
            tensors[f"{prefix}.{part}_proj.input_scale" if producer == MODELOPT else
                    f"{prefix}.{part}_proj.input_global_scale"] = torch.ones(())
        full["w13"].append(torch.cat([q["gate"].packed, q["up"].packed]))
        full["w13_scale"].append(torch.cat([q["gate"].block_scale, q["up"].block_scale]))
        full["w13_global"].append(torch.stack([q["gate"].global_scale, q["up"].global_scale]))
        full["w2"].append(q["down"].packed)
        full["w2_scale"].append(q["down"].block_scale)
        full["w2_global"].append(q["down"].global_scale)
    return tensors, {k: torch.stack(v) for k, v in full.items()}


@pytest.mark.parametrize("producer", [MODELOPT, COMPRESSED_TENSORS])
def test_expert_rules_load_shards_that_sum_to_the_reference(producer):
    """At TP 1, 2 and 4 every rank loads its shards through the plan (every parameter
    element written once); the ranks' partial sums add up to the unsharded experts' output,
    gate and up keeping their own global scales (CT's reciprocal ones included)."""
    experts, hidden, inter = 4, 32, 64
    tensors, full = _make_checkpoint(experts, hidden, inter, producer, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, hidden, generator=gen)
    weights, ids = torch.rand(5, 2, generator=gen), torch.randint(0, experts, (5, 2),
                                                                  generator=gen)
    expected = reference_moe(x, weights, ids, **full)
    for tp in (1, 2, 4):
        total = torch.zeros_like(expected)
        for rank in range(tp):
            reset_tp_info()
            set_tp_info(TPInfo(rank, tp))
            try:
                module = _LayerHolder(experts, hidden, inter, producer)
                plan = ShardPlan(_hf_expert_rules(inter, tp, producer), tp)
                load_weights(module, _Reader(tensors), plan, progress=False)
                total += module.model.layers[0].mlp.experts(x, weights, ids)
            finally:
                reset_tp_info()
        # CT's global scales differ from ModelOpt's by up to one float32 ulp (reciprocal),
        # which cancellation in silu(gate) * up and the sums can magnify ~100x.
        atol = 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=atol,
                                   msg=lambda m, tp=tp: f"tp={tp}: {m}")


class _LayerHolder(torch.nn.Module):
    """`model.layers.0.mlp.experts` as the plan's destination names expect."""

    def __init__(self, experts, hidden, inter, producer):
        super().__init__()
        mlp = torch.nn.Module()
        mlp.experts = NVFP4FusedExperts(experts, hidden, inter, backend="torch",
                                        global_scale_is_reciprocal=producer == COMPRESSED_TENSORS)
        layer = torch.nn.Module()
        layer.mlp = mlp
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])
