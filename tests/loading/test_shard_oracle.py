"""The shard-map oracle: which global checkpoint elements each rank holds after loading.

A small HF checkpoint per model family is saved, then every float element is overwritten with
a code for its own (tensor, row, column): value = (tensor_id * R + row) * C + col + 1, exact in
fp32 here (all codes < 2**24), zero reserved for vocab padding. The engine is loaded at TP 1, 2,
4 and 8 on gloo ranks, every rank's parameters are decoded, and the elements each rank holds
are compared with a layout derived here from first principles (head, intermediate and vocab
slices of rank r), never from the engine's shard specs.

Dimensions: 8 heads, 2 KV heads (replicated at TP 4 and 8), head_dim 16, intermediate 128,
MoE intermediate 32, vocab 203 (padded at every TP > 1)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from freetoken.distributed import Placement, RankGroup

TP_SIZES = (1, 2, 4, 8)
FAMILIES = ("llama", "qwen3", "qwen3_moe")
COMMON = dict(vocab_size=203, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, max_position_embeddings=256)
DIMS = {
    "llama": dict(COMMON, num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False),
    "qwen3": dict(COMMON, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen3_moe": dict(COMMON, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[1], tie_word_embeddings=False),
}
EXACT_FP32 = 2**24


# --- rank function (module level: pickled to the forkserver ranks) ---------------------------


def _rank_load(ctx, folder: str) -> dict[str, torch.Tensor]:
    from freetoken.config import EngineConfig
    from freetoken.engine.core import EngineCore
    from freetoken.models.registry import load_config

    cfg = EngineConfig(dtype="float32", progress=False)
    core = EngineCore(folder, load_config(folder), cfg, "cpu")
    return {name: p.detach().clone() for name, p in core.model.named_parameters()}


# --- the code ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Code:
    """The element code of one synthetic checkpoint: tensor ids, shapes, and R, C."""

    names: tuple[str, ...]
    shapes: dict
    rows: int
    cols: int

    def ids(self, name: str) -> int:
        return self.names.index(name)

    def encode(self, name: str, rows: torch.Tensor | None = None,
               cols: torch.Tensor | None = None) -> torch.Tensor:
        """Codes of `name`'s elements at (rows x cols) (all when None); a 1-D tensor is one
        row, and the result is then 1-D too."""
        shape = self.shapes[name]
        flat = len(shape) == 1
        rows = torch.arange(1 if flat else shape[0]) if rows is None or flat else rows
        cols = torch.arange(shape[-1]) if cols is None else cols
        codes = (self.ids(name) * self.rows + rows[:, None]) * self.cols + cols[None, :] + 1
        codes = codes.to(torch.float32)
        return codes[0] if flat else codes

    def describe(self, value: float) -> str:
        """What one loaded element is: `name[row, col]`, padding, or not a code at all."""
        if value == 0:
            return "padding (0)"
        if value != int(value) or not 1 <= value <= len(self.names) * self.rows * self.cols:
            return f"{value!r} (not an element code)"
        k = int(value) - 1
        name = self.names[k // (self.rows * self.cols)]
        row, col = (k // self.cols) % self.rows, k % self.cols
        where = f"[{col}]" if len(self.shapes[name]) == 1 else f"[{row}, {col}]"
        return f"{value:g} = {name}{where}"


def _make_hf_model(family: str):
    import transformers as tf

    config, model = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                     "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                     "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)}[family]
    return model(config(**DIMS[family]))


def _make_coded_checkpoint(family: str, folder: Path) -> _Code:
    """Save `family` with HF, then overwrite every float tensor with its element codes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    _make_hf_model(family).save_pretrained(folder)
    files = sorted(folder.glob("model*.safetensors"))
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    code = _Code(tuple(sorted(shapes)), shapes, max(s[0] for s in shapes.values()),
                 1 + max(s[-1] for s in shapes.values()))
    assert len(code.names) * code.rows * code.cols < EXACT_FP32, "codes not exact in fp32"
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors = {n: code.encode(n) for n in f.keys()}
        tmp = file.with_suffix(".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, file)
    return code


# --- the expected layout, from first principles ----------------------------------------------


def _span(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)


def _kv_rows(cfg: dict, tp: int, rank: int) -> torch.Tensor:
    """Rows of k_proj / v_proj on `rank`: its KV heads, or KV head rank*KV//tp when there
    are fewer KV heads than ranks."""
    kv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    heads = range(rank * kv // tp, (rank + 1) * kv // tp) if kv >= tp else [rank * kv // tp]
    return torch.cat([_span(h * hd, (h + 1) * hd) for h in heads])


def _expected_attention(code: _Code, family: str, p: str, tp: int, rank: int) -> dict:
    """q rows of heads [r*H/tp, (r+1)*H/tp) then k and v rows in qkv_proj; o_proj columns of
    the same head slice; biases follow their rows; q/k norms (Qwen3) whole."""
    cfg = DIMS[family]
    width = cfg["num_attention_heads"] // tp * cfg["head_dim"]
    q, kv = _span(rank * width, (rank + 1) * width), _kv_rows(cfg, tp, rank)
    a = f"{p}.self_attn"
    out = {
        f"{a}.qkv_proj.weight": torch.cat([code.encode(f"{a}.q_proj.weight", q),
                                           code.encode(f"{a}.k_proj.weight", kv),
                                           code.encode(f"{a}.v_proj.weight", kv)]),
        f"{a}.o_proj.weight": code.encode(f"{a}.o_proj.weight", cols=q),
    }
    if cfg.get("attention_bias"):
        out[f"{a}.qkv_proj.bias"] = torch.cat([code.encode(f"{a}.q_proj.bias", cols=q),
                                               code.encode(f"{a}.k_proj.bias", cols=kv),
                                               code.encode(f"{a}.v_proj.bias", cols=kv)])
        out[f"{a}.o_proj.bias"] = code.encode(f"{a}.o_proj.bias")
    if family != "llama":
        for norm in ("q_norm", "k_norm"):
            out[f"{a}.{norm}.weight"] = code.encode(f"{a}.{norm}.weight")
    return out


def _expected_mlp(code: _Code, cfg: dict, p: str, layer: int, tp: int, rank: int) -> dict:
    """Dense: gate rows then up rows of intermediate slice r, down_proj columns of slice r.
    MoE: router whole; per expert the same with the MoE intermediate size."""
    moe = cfg.get("num_experts", 0) > 0 and layer not in cfg.get("mlp_only_layers", [])
    inter = cfg["moe_intermediate_size"] if moe else cfg["intermediate_size"]
    i = _span(rank * inter // tp, (rank + 1) * inter // tp)

    def gate_up(m):
        return torch.cat([code.encode(f"{m}.gate_proj.weight", i),
                          code.encode(f"{m}.up_proj.weight", i)])

    if not moe:
        return {f"{p}.mlp.gate_up_proj.weight": gate_up(f"{p}.mlp"),
                f"{p}.mlp.down_proj.weight": code.encode(f"{p}.mlp.down_proj.weight", cols=i)}
    experts = [f"{p}.mlp.experts.{e}" for e in range(cfg["num_experts"])]
    return {
        f"{p}.mlp.gate.weight": code.encode(f"{p}.mlp.gate.weight"),
        f"{p}.mlp.experts.w13": torch.stack([gate_up(e) for e in experts]),
        f"{p}.mlp.experts.w2": torch.stack([code.encode(f"{e}.down_proj.weight", cols=i)
                                            for e in experts]),
    }


def _expected_vocab_rows(code: _Code, name: str, vocab: int, tp: int, rank: int):
    """Rows of slice r of the vocab padded to a multiple of tp; rows past the vocab are 0."""
    local = -(-vocab // tp)
    rows = _span(rank * local, (rank + 1) * local)
    inside = (rows < vocab).to(torch.float32)[:, None]
    return code.encode(name, rows.clamp(max=vocab - 1)) * inside


def _expected_rank(code: _Code, family: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter of `rank` at `tp`, as the element codes it must hold."""
    cfg = DIMS[family]
    vocab = cfg["vocab_size"]
    out = {"model.embed_tokens.weight": _expected_vocab_rows(
        code, "model.embed_tokens.weight", vocab, tp, rank),
        "model.norm.weight": code.encode("model.norm.weight")}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = _expected_vocab_rows(code, "lm_head.weight", vocab, tp, rank)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = code.encode(f"{p}.{norm}.weight")
        out.update(_expected_attention(code, family, p, tp, rank))
        out.update(_expected_mlp(code, cfg, p, layer, tp, rank))
    return out


def _ranks_holding(cfg: dict, name: str, tp: int) -> int:
    """How many ranks hold each element of checkpoint tensor `name`: 0 for a tied lm_head,
    tp/KV for replicated KV heads, tp for norms, router and o_proj bias, else 1."""
    if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
        return 0
    if any(k in name for k in ("k_proj", "v_proj")):
        kv = cfg["num_key_value_heads"]
        return tp // kv if kv < tp else 1
    if name.endswith(("norm.weight", "mlp.gate.weight", "o_proj.bias")):
        return tp
    return 1


# --- assertions ----------------------------------------------------------------------------


def _assert_holds(code: _Code, got: dict, want: dict, label: str) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, f"{label}: parameters missing {missing}, extra {extra}"
    for param, expected in want.items():
        actual = got[param]
        assert actual.shape == expected.shape, (
            f"{label} {param}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
        wrong = (actual != expected).nonzero()
        if len(wrong):
            idx = tuple(wrong[0].tolist())
            raise AssertionError(
                f"{label} {param}{list(idx)} holds {code.describe(actual[idx].item())}, "
                f"expected {code.describe(expected[idx].item())} "
                f"({len(wrong)} / {expected.numel()} elements wrong)")


def _assert_coverage(code: _Code, cfg: dict, ranks: list[dict], label: str) -> None:
    values = torch.cat([t.flatten() for params in ranks for t in params.values()])
    pads = int((values == 0).sum())
    keys = values[values != 0].to(torch.int64) - 1
    counts = torch.bincount(keys, minlength=len(code.names) * code.rows * code.cols)
    counts = counts.view(len(code.names), code.rows, code.cols)
    for tid, name in enumerate(code.names):
        shape = code.shapes[name]
        want = _ranks_holding(cfg, name, len(ranks))
        held = counts[tid, : 1 if len(shape) == 1 else shape[0], : shape[-1]]
        bad = (held != want).nonzero()
        if len(bad):
            row, col = bad[0].tolist()
            where = f"[{col}]" if len(shape) == 1 else f"[{row}, {col}]"
            raise AssertionError(f"{label} {name}{where} is held by {int(held[row, col])} "
                                 f"ranks, expected {want} ({len(bad)} elements off)")
        counts[tid, : held.shape[0], : held.shape[1]] = 0
    assert not counts.any(), f"{label}: ranks hold codes outside every checkpoint tensor"
    padded = -(-cfg["vocab_size"] // len(ranks)) * len(ranks) - cfg["vocab_size"]
    heads = 1 if cfg["tie_word_embeddings"] else 2
    want_pads = padded * cfg["hidden_size"] * heads
    assert pads == want_pads, f"{label}: {pads} zero elements, expected {want_pads} (padding)"


# --- fixtures and tests --------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, _Code, dict]]:
    """Per family: the coded checkpoint folder, its code, and the dimensions it was built with
    (the test's own numbers, not the engine's reading of config.json)."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(f"oracle-{family}")
        out[family] = folder, _make_coded_checkpoint(family, folder), DIMS[family]
    return out


@pytest.fixture(scope="module", params=TP_SIZES, ids=lambda tp: f"tp{tp}")
def loaded(request, checkpoints) -> tuple[int, dict[str, list[dict]]]:
    """Every family loaded at one TP size, in one rank group: per family, per-rank params."""
    tp = request.param
    with RankGroup(tp, Placement("cpu-gloo"), timeout=300.0) as group:
        return tp, {family: group.run(_rank_load, str(folder))
                    for family, (folder, _, _) in checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_exactly_its_global_elements(family, loaded, checkpoints):
    """Rank r at TP=N holds exactly: q rows of heads [r*H/N, (r+1)*H/N) then its KV heads'
    rows (KV head r*KV//N when KV < N) in qkv_proj; gate then up rows of intermediate slice r
    in gate_up_proj and in every expert's w13; down_proj / w2 / o_proj columns of slice r;
    embedding and lm_head rows of slice r of the padded vocab, padding rows zero; norms,
    router and o_proj bias whole. Checked element by element, every parameter, every rank."""
    tp, results = loaded
    code = checkpoints[family][1]
    for rank, got in enumerate(results[family]):
        _assert_holds(code, got, _expected_rank(code, family, tp, rank),
                      f"{family} tp={tp} rank {rank}:")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_checkpoint_element_is_held_by_the_right_number_of_ranks(family, loaded,
                                                                       checkpoints):
    """Across all ranks, each element of a split tensor is held exactly once, a replicated
    one (norms, router, o_proj bias) N times, a KV-head element N/KV times when KV < N; a
    tied lm_head is held nowhere; no rank holds anything else except zero vocab padding."""
    tp, results = loaded
    _, code, cfg = checkpoints[family]
    _assert_coverage(code, cfg, results[family], f"{family} tp={tp}:")
