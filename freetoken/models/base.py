"""What every model family shares: the decoder stack (embedding, layers, final norm) and the
causal LM around it (the vocab-parallel LM head, the layer lists the engine asks for). A
family supplies its decoder layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.layers.attention import PagedAttention
from freetoken.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from freetoken.layers.norm import RMSNorm


class DecoderModel(nn.Module):
    """Vocab-parallel embedding, `layer_cls(cfg, i)` for every decoder layer, final RMSNorm
    (`norm_offset`: Gemma-style `1 + w`, Qwen3.5's): token ids and positions of a flat batch
    -> hidden states."""

    def __init__(self, cfg: ModelConfig, layer_cls: Callable[[ModelConfig, int], nn.Module],
                 norm_offset: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=norm_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class CausalLM(nn.Module):
    """A decoder stack plus the vocab-parallel LM head: token ids and positions of a flat batch
    -> hidden states; `compute_logits` -> full vocab logits on every rank."""

    def __init__(self, cfg: ModelConfig, model: DecoderModel):
        super().__init__()
        self.config = cfg
        self.model = model
        tied = model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tied=tied,
                                      fmt=cfg.format_of("lm_head"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]
