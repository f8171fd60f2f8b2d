"""One rank's engine: builds and loads the rank-local model, owns the KV cache, and runs the
generation loop. Every rank runs the same loop on the same inputs; rank 0 samples and
broadcasts each step's tokens so all ranks stay in lockstep."""

from __future__ import annotations

from pathlib import Path

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.context import ForwardContext, device_batch, set_forward_context
from freetoken.distributed import get_communicator, get_tp_info
from freetoken.engine.graphs import DecodeGraphs
from freetoken.engine.kv_cache import BlockManager, StatePool, allocate_kv_cache
from freetoken.engine.sampler import sample
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.sequence import (
    GenerationResult,
    Request,
    SamplingParams,
    Sequence,
    default_seed,
)
from freetoken.loading import CheckpointReader, load_weights
from freetoken.models.registry import build_model, shard_plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The short names reports and other tools use; each means its dtype everywhere a dtype is
taken (`LLM(dtype=)`, `freetoken generate --dtype`, `freetoken-verify --dtype`)."""


def canonical_dtype(name: str) -> str:
    """`name` with an alias (`bf16`) replaced by its dtype's name (`bfloat16`); `auto` and
    unknown names unchanged (the caller's check names them)."""
    return DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    """`auto` takes the checkpoint's dtype."""
    name = cfg.dtype if dtype == "auto" else canonical_dtype(dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


class EngineCore:
    """The model, its cache and the generation loop on one rank.

    `model_config` is the checkpoint's config as the launcher parsed and validated it (TP
    size included): the rank builds from that object and never reads config.json again;
    `folder` is where its weights are read from."""

    def __init__(self, folder: str | Path, model_config: ModelConfig, cfg: EngineConfig,
                 device: torch.device):
        self.cfg = cfg
        self.device = torch.device(device)
        self.model_config = model_config
        if cfg.num_layers is not None:
            self.model_config = model_config.truncated(cfg.num_layers)
        self.dtype = resolve_dtype(cfg.dtype, self.model_config)
        self.model = self._build()
        load_weights(self.model, CheckpointReader(folder, cfg.num_layers),
                     shard_plan(self.model_config, get_tp_info().size), progress=cfg.progress)
        self.use_graphs = graphs_allowed(cfg, self.device)
        # The Triton paths (sync-free, graphable) on CUDA; CPU keeps the torch reference.
        self.use_kernels = self.device.type == "cuda"
        self.blocks = self._allocate_cache()
        self.reset()
        self.graphs = self._decode_graphs() if self.use_graphs else None

    def _build(self) -> torch.nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = build_model(self.model_config, self.cfg.tp_invariant)
        finally:
            torch.set_default_dtype(previous)
        return model.eval()

    def _allocate_cache(self) -> BlockManager:
        layers = self.model.attention_layers()
        num_blocks = self.cfg.num_kv_blocks or self.cfg.max_num_seqs * -(
            -self.cfg.max_model_len // self.cfg.block_size)
        # Graphed decode pads its batch with rows that write to one scratch block and one
        # scratch state slot, past those the allocators hand out.
        scratch = int(self.use_graphs)
        if layers:
            a = layers[0]
            self.kv_cache = allocate_kv_cache(len(layers), num_blocks + scratch,
                                              self.cfg.block_size, a.num_kv_heads, a.head_dim,
                                              self.dtype, self.device)
            for i, layer in enumerate(layers):
                layer.bind_cache(self.kv_cache[0, i], self.kv_cache[1, i])
        # One linear-state slot per sequence the scheduler may run at once.
        for layer in getattr(self.model, "linear_state_layers", list)():
            layer.allocate_state(self.cfg.max_num_seqs + scratch, self.dtype, self.device)
        return BlockManager(num_blocks, self.cfg.block_size)

    def _decode_graphs(self) -> DecodeGraphs:
        max_blocks = -(-self.cfg.max_model_len // self.cfg.block_size)
        return DecodeGraphs(self.model, self.cfg.max_num_seqs, max_blocks, self.cfg.block_size,
                            scratch_block=self.blocks.num_blocks,
                            scratch_state=self.cfg.max_num_seqs, device=self.device)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]
                 ) -> list[GenerationResult]:
        """Generate for every prompt with continuous batching; results in prompt order. Drops
        any requests still in flight from `add_requests` (their callers are the LLM's to
        settle): this call owns the engine until it returns."""
        self.reset()
        self.add_requests([Request(i, list(p), sp, default_seed(sp, i))
                           for i, (p, sp) in enumerate(zip(prompts, params))])
        results: dict[int, GenerationResult] = {}
        while self.scheduler.has_work():
            results.update(self.run_steps(1))
        return [results[i] for i in range(len(prompts))]

    def reset(self) -> None:
        """Forget every request: all cache blocks and linear-state slots free again."""
        self.blocks = BlockManager(self.blocks.num_blocks, self.blocks.block_size)
        self.states = StatePool(self.cfg.max_num_seqs)
        self.scheduler = Scheduler(self.blocks, self.cfg.max_num_seqs,
                                   self.cfg.max_num_batched_tokens, self.states)

    def add_requests(self, requests: list[Request]) -> None:
        """Queue `requests` behind those in flight; later `run_steps` calls batch them all."""
        for request in requests:
            self.scheduler.add(self._sequence(request))

    def run_steps(self, max_steps: int) -> list[tuple[int, GenerationResult]]:
        """Up to `max_steps` engine steps, stopping after the first step in which a request
        finished (its caller is waiting); (request id, result) of each request finished."""
        finished = []
        for _ in range(max_steps):
            if finished or not self.scheduler.has_work():
                break
            batch, prefill = self.scheduler.schedule()
            for seq, token in zip(batch, self.step(batch, prefill)):
                if self._append(seq, token):
                    finished.append((seq.seq_id, seq.result()))
        return finished

    def _sequence(self, request: Request) -> Sequence:
        vocab = self.model_config.vocab_size
        i, prompt, params = request.request_id, request.prompt, request.params
        bad = [t for t in prompt if not 0 <= t < vocab]
        if not prompt or bad:
            raise ValueError(f"request {i}: token ids must be non-empty and in [0, {vocab}), "
                             f"got {bad[:5] or 'an empty prompt'}")
        limit = min(self.cfg.max_model_len, self.model_config.max_position_embeddings)
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(f"request {i}: {len(prompt)} tokens + max_tokens="
                             f"{params.max_tokens} exceed the model length {limit}")
        gen = None
        if params.temperature > 0:
            gen = torch.Generator().manual_seed(request.seed)
        return Sequence(i, list(prompt), params, generator=gen)

    def _append(self, seq: Sequence, token: int) -> bool:
        """Add `token` to `seq`; True when that finished it."""
        seq.output.append(token)
        if len(seq.output) >= seq.params.max_tokens:
            seq.finish_reason = "length"
        elif not seq.params.ignore_eos and token in self.model_config.eos_token_ids:
            seq.finish_reason = "stop"
        if seq.finish_reason:
            self.scheduler.finish(seq)
        return seq.finish_reason is not None

    @torch.inference_mode()
    def step(self, batch: list[Sequence], prefill: bool) -> list[int]:
        """One forward over `batch`; returns each sequence's next token (same on all ranks)."""
        ids, positions, slots, qlens = [], [], [], []
        for seq in batch:
            start = seq.num_cached
            ids += seq.tokens[start:]
            positions += range(start, len(seq))
            slots += [self.blocks.slot(seq, p) for p in range(start, len(seq))]
            qlens.append(len(seq) - start)
        seq_slots = [self.states.acquire(s) for s in batch]
        greedy = None
        if not prefill and self.graphs is not None and self.graphs.fits(len(batch)):
            logits, greedy = self.graphs.run(ids, positions, slots, [len(s) for s in batch],
                                             [s.block_table for s in batch], seq_slots)
        else:
            logits = self._forward(batch, prefill, ids, positions, slots, qlens, seq_slots)
        for seq in batch:
            seq.num_cached = len(seq)
        return self._sample(batch, logits, greedy)

    def _forward(self, batch, prefill, ids, positions, slots, qlens, seq_slots) -> torch.Tensor:
        """The eager forward: float32 logits at each sequence's last new token."""
        as_long = dict(dtype=torch.long, device=self.device)
        context_lens, tables = [len(s) for s in batch], [s.block_table for s in batch]
        device = None
        if self.use_kernels:
            device = device_batch(qlens, context_lens, tables, seq_slots, self.device)
        set_forward_context(ForwardContext(
            prefill, qlens, context_lens, torch.tensor(slots, **as_long), tables, seq_slots,
            device=device))
        try:
            hidden = self.model(torch.tensor(ids, **as_long), torch.tensor(positions, **as_long))
            # The LM head runs inside the step's context too, so that it takes the same path
            # (Triton or torch) as in a graph replay, which captures it with the forward.
            last = torch.tensor(qlens, device=self.device).cumsum(0) - 1
            logits = self.model.compute_logits(hidden[last]).float()
            self._keep_prompt_logits(batch, hidden, qlens, prefill)
        finally:
            set_forward_context(None)
        return logits

    def _keep_prompt_logits(self, batch, hidden, qlens, prefill) -> None:
        start = 0
        for seq, qlen in zip(batch, qlens):
            if prefill and seq.params.return_prompt_logits and not seq.output:
                seq.prompt_logits = self.model.compute_logits(
                    hidden[start : start + qlen]).float().cpu()
            start += qlen

    def _sample(self, batch: list[Sequence], logits: torch.Tensor,
                greedy: torch.Tensor | None = None) -> list[int]:
        """Each sequence's next token; `greedy` is the logits' argmax when the step already
        took it (a decode graph does)."""
        tokens = [0] * len(batch)
        if get_tp_info().is_first:
            # Greedy rows in one argmax and one copy to the host, not one per sequence.
            greedy = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()
            tokens = [greedy[i] if seq.params.temperature == 0
                      else sample(logits[i], seq.params, seq.generator)
                      for i, seq in enumerate(batch)]
        for i, seq in enumerate(batch):
            if seq.params.return_logits:
                seq.step_logits.append(logits[i].cpu())
        if get_tp_info().size == 1:
            return tokens
        shared = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return get_communicator().broadcast(shared).tolist()


def graphs_allowed(cfg: EngineConfig, device: torch.device) -> bool:
    """Decode runs as CUDA graphs on CUDA unless `enforce_eager`, and never over gloo (its
    collectives run on the host and cannot be captured)."""
    if device.type != "cuda" or cfg.enforce_eager:
        return False
    dist = torch.distributed
    return not (dist.is_initialized() and dist.get_backend() != "nccl")
