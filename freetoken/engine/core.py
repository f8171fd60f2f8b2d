"""One rank's engine: builds and loads the rank-local model, owns the KV cache, and runs the
generation loop. Every rank runs the same loop on the same inputs; rank 0 samples and
broadcasts each step's tokens so all ranks stay in lockstep."""

from __future__ import annotations

from dataclasses import dataclass
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


PENDING = -1
"""The placeholder an overlapped step leaves in a sequence's output for its token until
that token reaches the host."""


@dataclass
class _InFlight:
    """A launched step whose greedy tokens are on their way to the host: its sequences, where
    each one's placeholder sits in its output, whether that token is its last (its length
    limit), and the host rows the tokens land in once `ready`."""

    batch: list[Sequence]
    places: list[int]
    last: list[bool]
    landing: torch.Tensor
    ready: torch.cuda.Event | None


class EngineCore:
    """The model, its cache and the generation loop on one rank.

    `model_config` is the checkpoint's config as the launcher parsed and validated it (TP
    size included): the rank builds from that object and never reads config.json again;
    `folder` is where its weights are read from.

    Overlapped steps (`EngineConfig.overlap_steps`): when every running sequence is greedy
    and wants no per-step logits, a step is launched before the previous one's tokens reach
    the host. Its ids are the previous step's greedy tokens, fed back on the device; its
    sequences carry a `PENDING` placeholder meanwhile. The host then schedules, fills and
    launches step n + 1 while the GPU computes step n, and reads step n's tokens (a copy
    into pinned memory) while step n + 1 runs. A sequence whose token turns out to end it
    (an end-of-sequence token) has ridden one step more than it needed; that step's row is
    dropped (and its batch partners ran that step in a batch one row larger)."""

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
        self._in_flight: _InFlight | None = None
        self.reset()
        self.graphs = self._decode_graphs() if self.use_graphs else None
        self.overlap = False
        self.set_overlap(overlap_allowed(cfg, self.use_graphs))

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

    def set_overlap(self, on: bool) -> None:
        """Turn overlapped steps on or off (between `generate` calls; TP 1 only)."""
        if on and get_tp_info().size > 1:
            raise ValueError(f"overlapped steps need TP 1, this engine runs at TP "
                             f"{get_tp_info().size}")
        if on and not hasattr(self, "_fed"):
            # The device rows every overlapped step's greedy tokens are written to (a decode
            # graph writes its own there), and two host rows they land in by turns.
            self._fed = (self.graphs.tokens if self.graphs is not None else torch.zeros(
                self.cfg.max_num_seqs, dtype=torch.long, device=self.device))
            pinned = self.device.type == "cuda"
            self._landings = [torch.zeros(self._fed.numel(), dtype=torch.long,
                                          pin_memory=pinned) for _ in range(2)]
            self._turn = 0
        self.overlap = on

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
        while self.has_work():
            results.update(self.run_steps(1))
        return [results[i] for i in range(len(prompts))]

    def reset(self) -> None:
        """Forget every request: all cache blocks and linear-state slots free again (a step
        still in flight is waited for and dropped)."""
        if self._in_flight is not None and self._in_flight.ready is not None:
            self._in_flight.ready.synchronize()
        self._in_flight = None
        self.blocks = BlockManager(self.blocks.num_blocks, self.blocks.block_size)
        self.states = StatePool(self.cfg.max_num_seqs)
        self.scheduler = Scheduler(self.blocks, self.cfg.max_num_seqs,
                                   self.cfg.max_num_batched_tokens, self.states)

    def has_work(self) -> bool:
        """Requests waiting or running, or a step whose tokens the host has not read."""
        return self.scheduler.has_work() or self._in_flight is not None

    def add_requests(self, requests: list[Request]) -> None:
        """Queue `requests` behind those in flight; later `run_steps` calls batch them all."""
        for request in requests:
            self.scheduler.add(self._sequence(request))

    def run_steps(self, max_steps: int) -> list[tuple[int, GenerationResult]]:
        """Up to `max_steps` engine steps, stopping after the first step in which a request
        finished (its caller is waiting); (request id, result) of each request finished."""
        finished = []
        for _ in range(max_steps):
            if finished or not self.has_work():
                break
            in_flight, self._in_flight = self._in_flight, None
            if in_flight is not None:
                # The next step goes to the GPU before this one's tokens are read.
                if self._can_chain():
                    batch, prefill = self.scheduler.schedule()
                    self._in_flight = self._launch(batch, prefill, in_flight)
                finished += self._resolve(in_flight)
                continue
            batch, prefill = self.scheduler.schedule()
            if self.overlap and all(map(_overlappable, batch)):
                self._in_flight = self._launch(batch, prefill, None)
                continue
            for seq, token in zip(batch, self.step(batch, prefill)):
                if self._append(seq, token):
                    finished.append((seq.seq_id, seq.result()))
        return finished

    def _can_chain(self) -> bool:
        """Whether the next step is a decode of the running sequences that may start before
        the one in flight is read: overlap is on, nothing waits to be admitted, every running
        sequence is greedy without per-step logits, and the cache holds one more token of
        each (no sequence with a placeholder may be preempted and recomputed)."""
        s = self.scheduler
        if not self.overlap or s.waiting or not s.running or \
                not all(map(_overlappable, s.running)):
            return False
        needed = sum(self.blocks.blocks_needed(seq, len(seq)) for seq in s.running)
        return needed <= len(self.blocks.free)

    @torch.inference_mode()
    def _launch(self, batch: list[Sequence], prefill: bool, previous: _InFlight | None
                ) -> _InFlight:
        """Run one step without waiting for it: its greedy tokens go to the fed-back device
        rows and, asynchronously, to a host landing; each sequence gets a placeholder (and
        leaves the scheduler at once when that token is its last by length)."""
        logits, greedy = self._forward_step(batch, prefill, previous)
        n = len(batch)
        fed = self._fed[:n]
        if greedy is None:
            fed.copy_(logits.argmax(dim=-1))
        elif greedy.data_ptr() != fed.data_ptr():
            fed.copy_(greedy)
        landing = self._landings[self._turn][:n]
        self._turn ^= 1
        landing.copy_(fed, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        places, last = [], []
        for seq in batch:
            places.append(len(seq.output))
            seq.output.append(PENDING)
            last.append(len(seq.output) >= seq.params.max_tokens)
            if last[-1]:
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
        return _InFlight(batch, places, last, landing, ready)

    def _resolve(self, in_flight: _InFlight) -> list[tuple[int, GenerationResult]]:
        """Put a launched step's tokens in place of its placeholders (waiting for them);
        (id, result) of each sequence that step finished. As `_append`, the length limit
        wins over an end token on the same step."""
        if in_flight.ready is not None:
            in_flight.ready.synchronize()
        finished = []
        eos = self.model_config.eos_token_ids
        for seq, place, last, token in zip(in_flight.batch, in_flight.places, in_flight.last,
                                           in_flight.landing.tolist()):
            if place >= len(seq.output):
                continue   # it stopped at an end token the step before: a spare row
            seq.output[place] = token
            if not last and not seq.params.ignore_eos and token in eos:
                del seq.output[place + 1:]
                if seq.finish_reason is None:   # else a later step already released it
                    self.scheduler.finish(seq)
                seq.finish_reason = "stop"
            elif not last:
                continue
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
        logits, greedy = self._forward_step(batch, prefill, None)
        return self._sample(batch, logits, greedy)

    def _forward_step(self, batch: list[Sequence], prefill: bool,
                      previous: _InFlight | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of one step (a decode graph's replay or the eager forward): float32
        logits at each sequence's last new token, and their greedy tokens when a graph took
        them. A `PENDING` token is the id `previous` step's row of that sequence fed back
        (-1 - row, read from the fed-back device rows)."""
        rows = {id(seq): j for j, seq in enumerate(previous.batch)} if previous else {}
        ids, positions, slots, qlens = [], [], [], []
        for seq in batch:
            start, prompt = seq.num_cached, len(seq.prompt)
            new = seq.output[start - prompt:] if start >= prompt else seq.tokens[start:]
            if new and new[-1] == PENDING:
                if len(new) != 1 or id(seq) not in rows:
                    raise RuntimeError(f"sequence {seq.seq_id}: a pending token outside an "
                                       "overlapped decode step")
                new = [-1 - rows[id(seq)]]
            ids += new
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
        return logits, greedy

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
            hidden = self.model(self._ids(ids), torch.tensor(positions, **as_long))
            # The LM head runs inside the step's context too, so that it takes the same path
            # (Triton or torch) as in a graph replay, which captures it with the forward.
            last = torch.tensor(qlens, device=self.device).cumsum(0) - 1
            logits = self.model.compute_logits(hidden[last]).float()
            self._keep_prompt_logits(batch, hidden, qlens, prefill)
        finally:
            set_forward_context(None)
        return logits

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """The step's ids on the device, each -1 - j replaced by fed-back token j."""
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        fed = [i for i, token in enumerate(ids) if token < 0]
        if fed:
            where = torch.tensor(fed, dtype=torch.long, device=self.device)
            tensor[where] = self._fed[-1 - tensor[where]]
        return tensor

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


def _overlappable(seq: Sequence) -> bool:
    """A sequence whose steps may overlap: its token is the greedy one the device computes,
    and no step's logits need reading."""
    return seq.params.temperature == 0 and not seq.params.return_logits


def overlap_allowed(cfg: EngineConfig, use_graphs: bool) -> bool:
    """`cfg.overlap_steps`, where None means "where decode runs as CUDA graphs at TP 1" (a
    rank group shares rank 0's tokens through the host)."""
    if cfg.overlap_steps is None:
        return use_graphs and get_tp_info().size == 1
    return cfg.overlap_steps


def graphs_allowed(cfg: EngineConfig, device: torch.device) -> bool:
    """Decode runs as CUDA graphs on CUDA unless `enforce_eager`, and never over gloo (its
    collectives run on the host and cannot be captured)."""
    if device.type != "cuda" or cfg.enforce_eager:
        return False
    dist = torch.distributed
    return not (dist.is_initialized() and dist.get_backend() != "nccl")
