"""The layout statement of every checkpoint tensor of the supported families (Llama, Qwen3,
Qwen3-MoE, Qwen3.5-MoE), in every storage format, from config.json, the quantization config
and the design's model facts alone (see `freetoken_verify.checks.shards.layouts`).

Each linear module's format is the quantization config's answer for that module
(`QuantScheme.format_of`, read by each producer's own matching rules), never guessed from a
tensor's dtype; its tensors' statements follow from the format's definition
(`freetoken_verify.checks.shards.linears`). Engine destinations the statements name: q, k, v
into `self_attn.qkv_proj` (Qwen3.5: the rank's q heads, then their gates, then k, then v);
gate and up into `gate_up_proj` (dense and shared expert) and into each expert's `w13`;
GatedDeltaNet `in_proj_qkv`, `_z`, `_b`, `_a` one after the other into `linear_attn.in_proj`,
or, with `[qkv | z]` quantized and `[b | a]` not, `[qkv | z]` into `in_proj` and `[b | a]`
into `in_proj_ba` (a fused destination whose parts differ in format is two GEMMs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from freetoken.formats.quant import BF16, NVFP4, UNQUANTIZED, QuantScheme, read_quant_config
from freetoken.formats.quant.format import QUANTIZED_DTYPES
from freetoken_verify.checks.shards.layouts import (
    LayoutError,
    Segment,
    Statement,
    contiguous,
    heads,
    ignored,
    packed,
    replicated,
)
from freetoken_verify.checks.shards.linears import (
    NVFP4_GROUP,
    SCALAR,
    Gemm,
    Part,
    check_dtype,
    gemm_format,
    statement,
)

_PREFIX = r"(?P<p>model\.language_model|model)"
_LAYER = _PREFIX + r"\.layers\.(?P<l>\d+)"


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
    statement of checkpoint tensor `name`, or None when no statement covers it; `scheme` is
    the checkpoint's quantization config (None: unquantized)."""

    def __init__(self, config: dict, tp: int, scheme: QuantScheme | None = None):
        c = config
        self.tp, self.scheme = tp, scheme
        self.gated = c["model_type"].startswith("qwen3_5")
        self.vocab = c["vocab_size"]
        self.tied = c["tie_word_embeddings"]
        self.hidden = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.intermediate = {"mlp": c.get("intermediate_size", 0),
                             "experts": c.get("moe_intermediate_size", 0),
                             "shared_expert": c.get("shared_expert_intermediate_size", 0)}
        self.nk, self.nv = c.get("linear_num_key_heads", 0), c.get("linear_num_value_heads", 0)
        self.dk, self.dv = c.get("linear_key_head_dim", 0), c.get("linear_value_head_dim", 0)
        self._rules = [(re.compile(p), f) for p, f in self._patterns()]
        self._linear_rules = [(re.compile(p), f) for p, f in self._linear_patterns()]
        self._declared = (f"{scheme.source} makes its module" if scheme is not None else
                          "with no quantization config its module is")

    @classmethod
    def from_folder(cls, folder: str | Path, tp: int) -> LayoutBook:
        return cls(read_text_config(folder), tp, read_quant_config(folder))

    def _patterns(self) -> list[tuple[str, object]]:
        """Tensors outside the linear modules (and the LM head)."""
        return [
            (_PREFIX + r"\.embed_tokens\.weight", self._embedding),
            (_PREFIX + r"\.norm\.weight", self._whole),
            (_LAYER + r"\.(input_layernorm|post_attention_layernorm)\.weight", self._whole),
            (_LAYER + r"\.self_attn\.(q_norm|k_norm)\.weight", self._whole),
            (_LAYER + r"\.linear_attn\.conv1d\.weight", self._conv1d),
            (_LAYER + r"\.linear_attn\.(?P<x>A_log|dt_bias)", self._gdn_heads),
            (_LAYER + r"\.linear_attn\.norm\.weight", self._whole),
            (_LAYER + r"\.mlp\.(gate|shared_expert_gate)\.weight", self._whole),
            (r"model\.visual\..+|mtp\..+", lambda name, m, dtype: ignored(name)),
        ]

    def _linear_patterns(self) -> list[tuple[str, object]]:
        """Linear modules (names without the tensor suffix) -> (their GEMM, part index)."""
        return [
            (_LAYER + r"\.self_attn\.(?P<x>[qkvo])_proj", self._attention),
            (_LAYER + r"\.linear_attn\.(?P<x>in_proj_(qkv|z|b|a)|out_proj)", self._gdn),
            (_LAYER + r"\.mlp\.(?P<m>shared_expert\.|experts\.(?P<e>\d+)\.)?"
                      r"(?P<x>gate|up|down)_proj", self._mlp),
        ]

    def state(self, name: str, dtype: torch.dtype | None = None) -> Statement | None:
        """The statement of `name`; LayoutError when the config cannot lay it out, or when
        `dtype` (None: not checked) is not what its module's declared format stores."""
        module, _, suffix = name.rpartition(".")
        if module == "lm_head":
            return self._lm_head(name, suffix, dtype)
        for rx, build in self._linear_rules:
            m = rx.fullmatch(module)
            if m:
                gemm, k = build(m)
                return statement(name, suffix, gemm, k, self.tp, dtype, self._declared)
        for rx, build in self._rules:
            m = rx.fullmatch(name)
            if m:
                st = build(name, m, dtype)
                if not st.ignored and dtype in QUANTIZED_DTYPES:
                    raise LayoutError(f"{name} is {str(dtype).removeprefix('torch.')}, "
                                      "quantized data, in a module no quantized format covers "
                                      "(not a linear layer)")
                return st
        return None

    def _format(self, module: str):
        return self.scheme.format_of(module) if self.scheme is not None else UNQUANTIZED

    def _gemm(self, dest: str, parts: tuple[Part, ...], expert: int | None = None) -> Gemm:
        formats = [self._format(p.module) for p in parts]
        return Gemm(dest, parts, gemm_format(parts, formats, dest), expert)

    def _dest(self, name: str, m: re.Match) -> str:
        """The engine's parameter name: the text model always lives under `model.`."""
        return "model" + name[len(m["p"]):] if m.groupdict().get("p") else name

    def _layer(self, m: re.Match) -> tuple[str, str]:
        """(checkpoint layer prefix, engine layer prefix)."""
        return f"{m['p']}.layers.{m['l']}", f"model.layers.{m['l']}"

    def _whole(self, name, m, dtype):
        return replicated(name, self._dest(name, m))

    def _embedding(self, name, m, dtype):
        return Statement(name, self._dest(name, m), dim=0, vocab=self.vocab)

    def _lm_head(self, name: str, suffix: str, dtype: torch.dtype | None) -> Statement:
        """Vocab rows padded to a multiple of tp with zero rows; NVFP4 (the one quantized
        format the engine runs it in): packed bytes and block scales by vocab row, the
        global scale whole."""
        if self.tied:
            return ignored(name)  # a tied checkpoint may still carry lm_head; HF ignores it
        fmt = self._format("lm_head")
        field = fmt.suffixes().get(suffix)
        if fmt.kind not in (BF16, NVFP4):
            raise LayoutError(f"{name}: {self._declared} {fmt.describe()}; the engine runs "
                              "lm_head only in bf16 or NVFP4")
        if field is None:
            raise LayoutError(f"{name}: {self._declared} {fmt.describe()}, whose tensors are "
                              f"{', '.join(fmt.suffixes())}; {suffix!r} is none of them")
        check_dtype(name, fmt, field, dtype, self._declared)
        if field == "input_scale":
            return ignored(name, SCALAR)
        if field == "weight_scale_2":
            return Statement(name, "lm_head.weight_scale_2", (0,), shapes=SCALAR)
        per_column = {"weight": 2, "weight_scale": NVFP4_GROUP}[field] if fmt.quantized else 1
        return Statement(name, f"lm_head.{field}", dim=0, vocab=self.vocab,
                         shapes=((self.vocab, self.hidden // per_column),))

    def _attention(self, m):
        """q by head (gated: rows `[q_h | gate_h]` per head, held as `[q | gate]` of the
        rank's heads), k and v by KV head, replicated when fewer KV heads than ranks; o_proj
        by head on its input."""
        (src, dest), hd, h, x = self._layer(m), self.head_dim, self.hidden, m["x"]
        a = f"{src}.self_attn"
        if x == "o":
            o = Part(f"{a}.o_proj", (heads("attention heads", self.heads, hd),), 1, h,
                     self.heads * hd)
            return self._gemm(f"{dest}.self_attn.o_proj", (o,)), 0
        if self.gated:
            q = Part(f"{a}.q_proj", (Segment("q", 0, self.heads, hd, "head", stride=2 * hd),
                                     Segment("gate", hd, self.heads, hd, "head",
                                             stride=2 * hd)),
                     0, 2 * self.heads * hd, h, interleaved=True)
        else:
            q = Part(f"{a}.q_proj", (heads("q", self.heads, hd),), 0, self.heads * hd, h)
        k, v = (Part(f"{a}.{y}_proj", (heads(y, self.kv_heads, hd, "KV head", replicate=True),),
                     0, self.kv_heads * hd, h) for y in "kv")
        return self._gemm(f"{dest}.self_attn.qkv_proj", (q, k, v)), "qkv".index(x)

    def _gdn(self, m):
        """in_proj_qkv `[q keys | k keys | v]`, each by head; z, b, a by value head; out_proj
        by value head on its input. [b | a] is a GEMM of its own when [qkv | z] is
        quantized."""
        (src, dest), h, x = self._layer(m), self.hidden, m["x"]
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        g, d = f"{src}.linear_attn", f"{dest}.linear_attn"
        if x == "out_proj":
            out = Part(f"{g}.out_proj", (heads("value heads", nv, dv, "value head"),), 1, h,
                       nv * dv)
            return self._gemm(f"{d}.out_proj", (out,)), 0
        qkv = Part(f"{g}.in_proj_qkv", contiguous(self._qkv_segments()), 0,
                   2 * nk * dk + nv * dv, h)
        z = Part(f"{g}.in_proj_z", (heads("z", nv, dv, "value head"),), 0, nv * dv, h)
        b, a = (Part(f"{g}.in_proj_{y}", (heads(y, nv, 1, "value head"),), 0, nv, h)
                for y in "ba")
        parts = (qkv, z, b, a)
        if self._format(qkv.module).quantized and not any(
                self._format(p.module).quantized for p in (b, a)):
            gemms = (self._gemm(f"{d}.in_proj", (qkv, z)), self._gemm(f"{d}.in_proj_ba", (b, a)))
        else:
            gemms = (self._gemm(f"{d}.in_proj", parts),)
        module = f"{g}.{x}"
        return next((gm, gm.parts.index(p)) for gm in gemms for p in gm.parts
                    if p.module == module)

    def _mlp(self, m):
        """gate and up by intermediate row into `[gate | up]`, down by input column, for the
        dense MLP, the shared expert and each routed expert (`experts.w13[e]`, `w2[e]`)."""
        (src, dest), h, x = self._layer(m), self.hidden, m["x"]
        kind = "experts" if m["e"] is not None else "shared_expert" if m["m"] else "mlp"
        full, expert = self.intermediate[kind], None if m["e"] is None else int(m["e"])
        module = f"{src}.mlp" + ("" if kind == "mlp" else f".{m['m'][:-1]}")
        d = f"{dest}.mlp" + ("" if kind == "mlp" else f".{kind}")
        if x == "down":
            down = Part(f"{module}.down_proj", (heads("intermediate", full, 1, "column"),), 1,
                        h, full)
            dest_name = f"{d}.w2" if expert is not None else f"{d}.down_proj"
            return self._gemm(dest_name, (down,), expert), 0
        gate, up = (Part(f"{module}.{y}_proj", (heads(y, full, 1, "row"),), 0, full, h)
                    for y in ("gate", "up"))
        dest_name = f"{d}.w13" if expert is not None else f"{d}.gate_up_proj"
        return self._gemm(dest_name, (gate, up), expert), 0 if x == "gate" else 1

    def _qkv_segments(self) -> list[tuple[str, int, int, str]]:
        """GatedDeltaNet's `[q keys | k keys | v]` channels (in_proj_qkv rows, conv1d)."""
        return [("q keys", self.nk, self.dk, "key head"),
                ("k keys", self.nk, self.dk, "key head"), ("v", self.nv, self.dv, "value head")]

    def _conv1d(self, name, m, dtype):
        return packed(name, self._dest(name, m), self._qkv_segments())

    def _gdn_heads(self, name, m, dtype):
        return packed(name, self._dest(name, m), [(m["x"], self.nv, 1, "value head")])
