"""The layout statement of every checkpoint tensor of the supported families (Llama, Qwen3,
Qwen3-MoE, Qwen3.5-MoE with bf16/fp32 or NVFP4 experts), from config.json and the design's
model facts alone (see `freetoken_verify.checks.shards.layouts`).

Engine parameters the statements name: q, k, v into `self_attn.qkv_proj` (Qwen3.5: the rank's
q heads, then their gates, then k, then v); gate and up into `gate_up_proj` (dense and shared
expert) and into each expert's row of `experts.w13` (NVFP4: `w13_weight`, `w13_weight_scale`,
the global scales at `w13_weight_scale_2[e, 0 | 1]`); GatedDeltaNet `in_proj_qkv`, `_z`, `_b`,
`_a` one after the other into `linear_attn.in_proj`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from freetoken_verify.checks.shards.layouts import (
    LayoutError,
    Segment,
    Statement,
    heads,
    ignored,
    packed,
    replicated,
)

NVFP4_GROUP = 16
"""Inputs per NVFP4 block scale; a packed byte holds 2 inputs."""
_PREFIX = r"(?P<p>model\.language_model|model)"
_LAYER = _PREFIX + r"\.layers\.(?P<l>\d+)"
_GLOBAL_SCALES = ("weight_scale_2", "weight_global_scale")
_IGNORED_SCALES = ("input_scale", "input_global_scale")


def read_text_config(folder: str | Path) -> dict:
    """config.json, unwrapped to the text model's settings (a multimodal `text_config`),
    with `tie_word_embeddings` read where HF reads it (top level first)."""
    hf = json.loads((Path(folder) / "config.json").read_text())
    text = dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else dict(hf)
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings",
                                              text.get("tie_word_embeddings", False)))
    text["model_type"] = hf.get("model_type", text.get("model_type", ""))
    return text


class LayoutBook:
    """Statements for one checkpoint at one TP size. `state(name, dtype)` returns the
    statement of checkpoint tensor `name`, or None when no statement covers it."""

    def __init__(self, config: dict, tp: int):
        c = config
        self.tp = tp
        self.gated = c["model_type"].startswith("qwen3_5")
        self.vocab = c["vocab_size"]
        self.tied = c["tie_word_embeddings"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.intermediate = {"mlp": c.get("intermediate_size", 0),
                             "experts": c.get("moe_intermediate_size", 0),
                             "shared_expert": c.get("shared_expert_intermediate_size", 0)}
        self.nk, self.nv = c.get("linear_num_key_heads", 0), c.get("linear_num_value_heads", 0)
        self.dk, self.dv = c.get("linear_key_head_dim", 0), c.get("linear_value_head_dim", 0)
        self._rules = [(re.compile(p), f) for p, f in self._patterns()]

    @classmethod
    def from_folder(cls, folder: str | Path, tp: int) -> LayoutBook:
        return cls(read_text_config(folder), tp)

    def _patterns(self) -> list[tuple[str, object]]:
        return [
            (r"lm_head\.weight", self._lm_head),
            (_PREFIX + r"\.embed_tokens\.weight", self._embedding),
            (_PREFIX + r"\.norm\.weight", self._whole),
            (_LAYER + r"\.(input_layernorm|post_attention_layernorm)\.weight", self._whole),
            (_LAYER + r"\.self_attn\.(q_norm|k_norm)\.weight", self._whole),
            (_LAYER + r"\.self_attn\.o_proj\.bias", self._whole),
            (_LAYER + r"\.self_attn\.(?P<x>[qkv])_proj\.(?P<k>weight|bias)", self._qkv),
            (_LAYER + r"\.self_attn\.o_proj\.weight", self._o_proj),
            (_LAYER + r"\.linear_attn\.(?P<x>in_proj_\w+|conv1d)\.weight", self._gdn),
            (_LAYER + r"\.linear_attn\.(?P<x>A_log|dt_bias)", self._gdn_heads),
            (_LAYER + r"\.linear_attn\.norm\.weight", self._whole),
            (_LAYER + r"\.linear_attn\.out_proj\.weight", self._out_proj),
            (_LAYER + r"\.mlp\.(gate|shared_expert_gate)\.weight", self._whole),
            (_LAYER + r"\.mlp\.(?P<m>shared_expert|experts\.(?P<e>\d+))?\.?"
                      r"(?P<x>gate|up|down)_proj\.(?P<f>\w+)", self._mlp),
            (r"model\.visual\..+|mtp\..+", lambda name, m, dtype: ignored(name)),
        ]

    def state(self, name: str, dtype: torch.dtype) -> Statement | None:
        """The statement of `name`; LayoutError when the config cannot lay it out."""
        for rx, build in self._rules:
            m = rx.fullmatch(name)
            if m:
                return build(name, m, dtype)
        return None

    def _dest(self, name: str, m: re.Match) -> str:
        """The engine's parameter name: the text model always lives under `model.`."""
        return "model" + name[len(m["p"]):] if m.groupdict().get("p") else name

    def _local(self, count: int, what: str) -> int:
        if count % self.tp:
            raise LayoutError(f"{what}={count} cannot be split across tp_size={self.tp}")
        return count // self.tp

    def _whole(self, name, m, dtype):
        return replicated(name, self._dest(name, m))

    def _vocab(self, name, param):
        return Statement(name, param, dim=0, vocab=self.vocab)

    def _lm_head(self, name, m, dtype):
        # A tied checkpoint may still carry lm_head.weight; HF ignores it.
        return ignored(name) if self.tied else self._vocab(name, "lm_head.weight")

    def _embedding(self, name, m, dtype):
        return self._vocab(name, self._dest(name, m))

    def _qkv(self, name, m, dtype):
        """q by head (gated: rows `[q_h | gate_h]` per head, held as `[q | gate]` of the
        rank's heads), k and v by KV head, replicated when fewer KV heads than ranks."""
        hd, x = self.head_dim, m["x"]
        q_rows = self._local(self.heads, "num_attention_heads") * hd * (2 if self.gated else 1)
        kv_rows = max(self.kv_heads // self.tp, 1) * hd
        param = f"model.layers.{m['l']}.self_attn.qkv_proj.{m['k']}"
        if x == "q" and self.gated:
            segs = (Segment("q", 0, self.heads, hd, "head", stride=2 * hd),
                    Segment("gate", hd, self.heads, hd, "head", stride=2 * hd))
            return Statement(name, param, (slice(0, q_rows),), 0, segs)
        if x == "q":
            return Statement(name, param, (slice(0, q_rows),), 0,
                             (heads("q", self.heads, hd),))
        start = q_rows if x == "k" else q_rows + kv_rows
        seg = heads(x, self.kv_heads, hd, "KV head", replicate=True)
        return Statement(name, param, (slice(start, start + kv_rows),), 0, (seg,))

    def _o_proj(self, name, m, dtype):
        return Statement(name, self._dest(name, m), (), 1,
                         (heads("attention heads", self.heads, self.head_dim),))

    def _gdn(self, name, m, dtype):
        """in_proj_qkv and conv1d: `[q keys | k keys | v]`, each by head; z, b, a by value
        head; all four into in_proj one after the other."""
        nk, nv, dk, dv, x = self.nk, self.nv, self.dk, self.dv, m["x"]
        qkv = [("q keys", nk, dk, "key head"), ("k keys", nk, dk, "key head"),
               ("v", nv, dv, "value head")]
        if x == "conv1d":
            return packed(name, self._dest(name, m), qkv)
        parts = {"in_proj_qkv": qkv, "in_proj_z": [("z", nv, dv, "value head")],
                 "in_proj_b": [("b", nv, 1, "value head")],
                 "in_proj_a": [("a", nv, 1, "value head")]}
        if x not in parts:
            return None
        start = 0
        for key in parts:
            width = sum(u * size for _, u, size, _ in parts[key]) // self.tp
            if key == x:
                slot = (slice(start, start + width),)
                return packed(name, f"model.layers.{m['l']}.linear_attn.in_proj.weight",
                              parts[x], slot)
            start += width
        return None

    def _gdn_heads(self, name, m, dtype):
        return packed(name, self._dest(name, m), [(m["x"], self.nv, 1, "value head")])

    def _out_proj(self, name, m, dtype):
        return packed(name, self._dest(name, m), [("value heads", self.nv, self.dv,
                                                   "value head")], dim=1)

    def _mlp(self, name, m, dtype):
        """gate and up by intermediate row into `[gate | up]`; down by input column; NVFP4
        experts: packed inputs 2 per byte, block scales 1 column per 16 inputs, global
        scales whole."""
        kind = "experts" if m["e"] is not None else (m["m"] or "mlp")
        full = self.intermediate[kind]
        local, x, field = self._local(full, f"{kind} intermediate size"), m["x"], m["f"]
        module = f"model.layers.{m['l']}.mlp" + ("" if kind == "mlp" else f".{kind}")
        if field in _IGNORED_SCALES:
            return ignored(name)
        if kind == "experts":
            return self._expert(name, m, dtype, full, local)
        if field != "weight":
            return None
        if x == "down":
            return packed(name, f"{module}.down_proj.weight",
                          [("intermediate", full, 1, "column")], dim=1)
        rows = slice(0, local) if x == "gate" else slice(local, 2 * local)
        return packed(name, f"{module}.gate_up_proj.weight", [(x, full, 1, "row")], (rows,))

    def _expert(self, name, m, dtype, full, local):
        e, x, field = int(m["e"]), m["x"], m["f"]
        dest = f"model.layers.{m['l']}.mlp.experts."
        nvfp4 = dtype in (torch.uint8, torch.float8_e4m3fn) or field in _GLOBAL_SCALES
        if field in _GLOBAL_SCALES:
            slot = (e,) if x == "down" else (e, 0 if x == "gate" else 1)
            return replicated(name, dest + f"{'w2' if x == 'down' else 'w13'}_weight_scale_2",
                              slot)
        suffix = {"weight": "_weight", "weight_packed": "_weight",
                  "weight_scale": "_weight_scale"}.get(field) if nvfp4 else ""
        if suffix is None or (not nvfp4 and field != "weight"):
            return None
        if x == "down":
            columns = self._inputs(field, full) if nvfp4 else ("intermediate", full, 1, "column")
            return packed(name, f"{dest}w2{suffix}", [columns], (e,), dim=1)
        rows = slice(0, local) if x == "gate" else slice(local, 2 * local)
        return packed(name, f"{dest}w13{suffix}", [(x, full, 1, "row")], (e, rows))

    def _inputs(self, field: str, full: int) -> tuple[str, int, int, str]:
        """down's input columns of an NVFP4 expert as whole 16-input groups: 8 packed bytes
        or 1 block-scale column per group (a rank's share must be whole groups)."""
        if full % NVFP4_GROUP:
            raise LayoutError(f"NVFP4 moe_intermediate_size={full} is not whole "
                              f"{NVFP4_GROUP}-input groups")
        per_group = {"weight": NVFP4_GROUP // 2, "weight_packed": NVFP4_GROUP // 2,
                     "weight_scale": 1}[field]
        return ("intermediate", full // NVFP4_GROUP, per_group, "16-input group")
