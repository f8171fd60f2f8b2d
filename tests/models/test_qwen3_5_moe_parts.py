"""Qwen3.5-MoE pieces on their own: the gated delta rule (chunked vs recurrent vs HF), the
causal conv state, the interleaved-heads shard spec, config parsing from both HF layouts, TP
divisibility, and `freetoken-verify` failing when a packed tensor is split as a plain chunk."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import GOLDEN

from freetoken.config import ConfigError
from freetoken.formats.specs import InterleavedHeads
from freetoken.layers.causal_conv import CausalConv1d
from freetoken.layers.delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from freetoken.models.registry import check_tp, config_from_hf, load_config

CASE = "tiny-qwen3.5-moe"


def _make_rule_inputs(batch=2, length=150, heads=4, dk=16, dv=8, seed=0):
    """Normalised q (scaled) and k, values, decays in (-1, 0], rates in (0, 1), and a
    non-zero initial state: the inputs GatedDeltaNet feeds the rule."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, length, heads, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(batch, length, heads, dk, generator=gen))
    v = torch.randn(batch, length, heads, dv, generator=gen)
    g = -torch.rand(batch, length, heads, generator=gen)
    beta = torch.rand(batch, length, heads, generator=gen)
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _assert_rule_close(got, want, label: str, tol: float = 1e-5) -> None:
    for name, a, b in zip(("output", "final state"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"{label} {name}: {m}")


def test_chunked_rule_equals_recurrent_rule():
    """Over 150 tokens (two full 64-token chunks and a padded third) from a non-zero state,
    the chunked rule gives the recurrent rule's outputs and final state."""
    q, k, v, g, beta, state = _make_rule_inputs()
    _assert_rule_close(chunk_gated_delta_rule(q, k, v, g, beta, state),
                       recurrent_gated_delta_rule(q, k, v, g, beta, state), "chunk vs recurrent")


def test_state_carries_across_calls():
    """Prefilling 70 tokens with the chunked rule, then decoding 20 one at a time with the
    recurrent rule from the carried state, equals one chunked pass over all 90 tokens."""
    q, k, v, g, beta, _ = _make_rule_inputs(length=90)
    out, state = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70],
                                        beta[:, :70])
    outs = [out]
    for t in range(70, 90):
        step, state = recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                                 g[:, t:t + 1], beta[:, t:t + 1], state)
        outs.append(step)
    _assert_rule_close((torch.cat(outs, dim=1), state),
                       chunk_gated_delta_rule(q, k, v, g, beta), "split vs one pass")


def test_rules_match_hf_torch_fallbacks():
    """The engine's rules equal HF's `torch_chunk_gated_delta_rule` and
    `torch_recurrent_gated_delta_rule` (HF normalises q and k itself and repeats key heads
    for grouped value heads; the engine does both before the rule)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 100, 2, 16, generator=gen)
    v = torch.randn(2, 100, 4, 8, generator=gen)
    g, beta = -torch.rand(2, 100, 4, generator=gen), torch.rand(2, 100, 4, generator=gen)
    state = torch.randn(2, 4, 16, 8, generator=gen)
    ours_q = (l2norm(q) * 16**-0.5).repeat_interleave(2, dim=2)
    ours_k = l2norm(k).repeat_interleave(2, dim=2)
    kw = dict(g=g, beta=beta, initial_state=state, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    _assert_rule_close(chunk_gated_delta_rule(ours_q, ours_k, v, g, beta, state),
                       hf.torch_chunk_gated_delta_rule(q, k, v, **kw), "chunk vs HF", 1e-6)
    _assert_rule_close(recurrent_gated_delta_rule(ours_q, ours_k, v, g, beta, state),
                       hf.torch_recurrent_gated_delta_rule(q, k, v, **kw), "recurrent vs HF",
                       1e-6)


def test_causal_conv_state_continues_a_sequence():
    """Convolving 9 tokens, then 1, then 5 with the carried state equals convolving all 15 at
    once from zero state (HF's left padding); the state is the last kernel - 1 inputs."""
    torch.manual_seed(0)
    conv = CausalConv1d(channels=6, kernel=4)
    conv.weight.data.normal_()
    x = torch.randn(2, 15, 6)
    whole, whole_state = conv(x, None)
    parts, state = [], None
    for a, b in ((0, 9), (9, 10), (10, 15)):
        out, state = conv(x[:, a:b], state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, msg=lambda m: f"outputs: {m}")
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2), msg=lambda m: f"state: {m}")
    torch.testing.assert_close(whole_state, state, msg=lambda m: f"final state: {m}")


@pytest.mark.parametrize("size", [1, 2, 4])
def test_interleaved_heads_keep_each_gate_with_its_head(size):
    """Rank r's q_proj shard holds exactly its heads' q rows, then the same heads' gate rows,
    in fresh storage; unshard rebuilds the checkpoint tensor bit for bit."""
    heads, hd = 4, 3
    full = torch.arange(heads * 2 * hd * 5, dtype=torch.float32).reshape(heads * 2 * hd, 5)
    view = full.reshape(heads, 2, hd, 5)
    spec, local = InterleavedHeads(heads), heads // size
    parts = [spec.shard(full, r, size, "q_proj") for r in range(size)]
    for r, part in enumerate(parts):
        mine = view[r * local : (r + 1) * local]
        want = torch.cat([mine[:, 0].reshape(-1, 5), mine[:, 1].reshape(-1, 5)])
        assert torch.equal(part, want), f"size {size} rank {r}: wrong rows"
        assert part.untyped_storage().nbytes() == part.numel() * 4, f"rank {r}: a view"
    assert torch.equal(spec.unshard(parts), full), f"size {size}: unshard differs"


def test_config_from_the_multimodal_layout():
    """The bundled case's Qwen3_5MoeForConditionalGeneration config.json: text sizes from
    `text_config`, weights under `model.language_model.`, partial rotary from
    `rope_parameters`, layer kinds from `layer_types`."""
    cfg = load_config(GOLDEN / CASE)
    assert (cfg.arch, cfg.checkpoint_prefix) == ("qwen3_5_moe", "model.language_model"), cfg
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2, cfg.layer_types
    assert (cfg.rotary_dim, cfg.linear_num_value_heads, cfg.num_experts) == (8, 16, 8), cfg
    assert cfg.truncated(1).layer_types == ("linear_attention",), "truncation keeps kinds"


def test_config_from_the_text_layout_with_an_interval():
    """A text-only config with `full_attention_interval` and no `layer_types` or
    `partial_rotary_factor`: every 4th layer is full attention, rotary covers a quarter of
    each head (HF's defaults), weights under `model.`."""
    hf = json.loads((GOLDEN / CASE / "config.json").read_text())["text_config"]
    hf = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    hf.update(architectures=["Qwen3_5MoeForCausalLM"], num_hidden_layers=8,
              full_attention_interval=4, rope_theta=1e6)
    cfg = config_from_hf(hf)
    assert cfg.checkpoint_prefix == "model", cfg.checkpoint_prefix
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7], cfg
    assert (cfg.rotary_dim, cfg.rope_theta) == (8, 1e6), cfg
    with pytest.raises(ConfigError, match="linear_num_value_heads=12 is not a multiple"):
        config_from_hf(dict(hf, linear_num_value_heads=12, linear_num_key_heads=8))


@pytest.mark.parametrize("dim, tp", [("linear_num_key_heads", 4), ("linear_num_value_heads", 8),
                                     ("shared_expert_intermediate_size", 8)])
def test_check_tp_names_the_gated_delta_net_dimension(dim, tp):
    """check_tp rejects a TP size that cannot split a Qwen3.5 dimension, naming it."""
    cfg = load_config(GOLDEN / CASE)
    value = {"linear_num_key_heads": 2, "linear_num_value_heads": 12,
             "shared_expert_intermediate_size": 36}[dim]
    with pytest.raises(ValueError, match=f"{dim}={value} cannot be split across tp_size={tp}"):
        check_tp(replace(cfg, **{dim: value}), tp)


def test_cli_rejects_an_unsplittable_tp_before_starting_ranks(capsys):
    """`freetoken-verify --tp 3` on the bundled case is a usage error (exit 2) naming the
    dimension."""
    from freetoken_verify.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", CASE, "--tp", "3", "--checks", "golden"])
    assert exit_info.value.code == 2, f"exit {exit_info.value.code}"
    err = capsys.readouterr().err
    assert "cannot be split across tp_size=3" in err, err


@pytest.mark.parametrize("fault", ["plain-chunk-gdn-qkv", "plain-chunk-gdn-conv1d",
                                   "plain-chunk-q-gate", "plain-chunk-expert-gate-up"])
def test_verify_catches_a_plain_chunk_of_a_packed_tensor(fault, capsys):
    """Splitting a packed tensor (GatedDeltaNet q|k|v, its conv1d, the attention q|gate
    interleave, the experts' gate|up) as a plain row chunk makes the golden check fail at
    TP 2: exit 1, and the table names the case with FAIL."""
    from freetoken_verify.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", CASE, "--tp", "2", "--checks", "golden", "--inject", fault])
    out = capsys.readouterr().out
    assert exit_info.value.code == 1, f"{fault}: exit {exit_info.value.code}\n{out}"
    row = next((line for line in out.splitlines() if line.startswith(CASE)), "")
    assert "FAIL" in row, f"{fault}: no FAIL row for {CASE}:\n{out}"
