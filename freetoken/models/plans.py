"""Shard plans of the Llama, Qwen3 and Qwen3-MoE checkpoints, as data."""

from __future__ import annotations

from freetoken.config import ModelConfig
from freetoken.layers.linear import local_kv_heads
from freetoken.loading.plan import Rule, ShardPlan
from freetoken.loading.specs import Heads, PaddedSplit, Replicate, Split

LAYER = r"(?P<p>model\.layers\.\d+)"


def attention_rules(cfg: ModelConfig, tp: int, prefix: str = LAYER) -> list[Rule]:
    """q, k, v into the fused qkv_proj (k and v by KV head, replicated when fewer than ranks),
    o_proj split on its input."""
    hd = cfg.head_dim
    q = cfg.num_attention_heads // tp * hd
    kv_rows = local_kv_heads(cfg.num_key_value_heads, tp) * hd
    attn = prefix + r"\.self_attn"
    slots = {"q": slice(0, q), "k": slice(q, q + kv_rows),
             "v": slice(q + kv_rows, q + 2 * kv_rows)}
    kv = Heads(cfg.num_key_value_heads)
    specs = {"q": Split(0), "k": kv, "v": kv}
    kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    rules = [
        Rule(rf"{attn}\.{x}_proj\.{kind}", specs[x], rf"\g<p>.self_attn.qkv_proj.{kind}",
             (slots[x],))
        for x in "qkv" for kind in kinds
    ]
    rules.append(Rule(rf"{attn}\.o_proj\.weight", Split(1)))
    if cfg.attention_bias:
        rules.append(Rule(rf"{attn}\.o_proj\.bias", Replicate()))
    if cfg.qk_norm:
        rules.append(Rule(rf"{attn}\.[qk]_norm\.weight", Replicate()))
    return rules


def dense_mlp_rules(intermediate: int, tp: int, prefix: str = LAYER) -> list[Rule]:
    """gate and up split separately into the merged gate_up_proj; down split on its input."""
    i = intermediate // tp
    mlp = prefix + r"\.mlp"
    return [
        Rule(rf"{mlp}\.gate_proj\.weight", Split(0), r"\g<p>.mlp.gate_up_proj.weight",
             (slice(0, i),)),
        Rule(rf"{mlp}\.up_proj\.weight", Split(0), r"\g<p>.mlp.gate_up_proj.weight",
             (slice(i, 2 * i),)),
        Rule(rf"{mlp}\.down_proj\.weight", Split(1)),
    ]


def expert_rules(intermediate: int, tp: int, prefix: str = LAYER) -> list[Rule]:
    """Per-expert checkpoint keys into the stacked w13 / w2, split on the intermediate dim."""
    i = intermediate // tp
    ex = prefix + r"\.mlp\.experts\.(?P<e>\d+)"
    return [
        Rule(rf"{ex}\.gate_proj\.weight", Split(0), r"\g<p>.mlp.experts.w13", ("e", slice(0, i))),
        Rule(rf"{ex}\.up_proj\.weight", Split(0), r"\g<p>.mlp.experts.w13",
             ("e", slice(i, 2 * i))),
        Rule(rf"{ex}\.down_proj\.weight", Split(1), r"\g<p>.mlp.experts.w2", ("e",)),
    ]


def embedding_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [
        Rule(r"model\.embed_tokens\.weight", PaddedSplit(cfg.vocab_size)),
        Rule(r"model\.norm\.weight", Replicate()),
        Rule(rf"{LAYER}\.(input_layernorm|post_attention_layernorm)\.weight", Replicate()),
    ]
    # A tied checkpoint may still carry lm_head.weight; HF ignores it, so do we.
    head = None if cfg.tie_word_embeddings else r"\g<0>"
    rules.append(Rule(r"lm_head\.weight", PaddedSplit(cfg.vocab_size), head))
    return rules


def decoder_plan(cfg: ModelConfig, tp: int) -> ShardPlan:
    """The plan for Llama, Qwen3 and Qwen3-MoE checkpoints at `tp` ranks."""
    rules = embedding_rules(cfg) + attention_rules(cfg, tp)
    if cfg.intermediate_size and any(not cfg.is_moe_layer(i)
                                     for i in range(cfg.num_hidden_layers)):
        rules += dense_mlp_rules(cfg.intermediate_size, tp)
    if cfg.num_experts:
        rules.append(Rule(rf"{LAYER}\.mlp\.gate\.weight", Replicate()))
        rules += expert_rules(cfg.moe_intermediate_size, tp)
    return ShardPlan(rules, tp)
