"""Bundled verification cases: tiny checkpoints in the on-disk format of real models, built and
saved by HF transformers itself, with every parameter re-randomised at a scale where layers matter,
plus HF's reference outputs, shipped as package data in `freetoken_verify/golden/`. `python -m
freetoken_verify.cases --write freetoken_verify/golden` regenerates them (`make golden`); the same
environment writes the same bytes.

Dimensions are valid at TP 1, 2, 4 and 8; 2 KV heads make TP 4 and 8 replicate KV heads; the
odd vocab (301) makes every TP>1 pad the vocab-parallel rows."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.config import ConfigError
from freetoken.engine.resolve import ModelNotFound, resolve_checkpoint
from freetoken.formats.quant import read_quant_config
from freetoken.formats.quant.twin import write_dequantized_twin
from freetoken.models.registry import load_config
from freetoken_verify.cases import bisect_file
from freetoken_verify.cases.numerics import check_pinned, pinned_env
from freetoken_verify.cases.nvfp4 import quantize_experts
from freetoken_verify.cases.quantized import (
    NVIDIA_MIXED,
    QWEN3_FP8,
    QWEN_FP8,
    REDHAT_NVFP4,
    Recipe,
    stored_formats,
)
from freetoken_verify.cases.qwen3_5_moe import (
    qwen3_5_moe_tiny,
    qwen3_5_moe_tiny_nvfp4,
    qwen3_5_moe_tiny_quantized,
    write_realdims,
)
from freetoken_verify.cases.randomise import rerandomise
from freetoken_verify.cases.realdims import FORMATS as REALDIMS_FORMATS
from freetoken_verify.cases.tiny import VOCAB
from freetoken_verify.cases.tokenizer import write_tokenizer
from freetoken_verify.compare import logit_metrics

# Package data: found through importlib.resources so an installed wheel finds its own copy.
GOLDEN = Path(str(resources.files("freetoken_verify") / "golden"))
PROMPT_LENS = (5, 23, 70)
NUM_GREEDY = 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, intermediate_size=128,
              max_position_embeddings=512, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class CaseSpec:
    """How to build one bundled case with HF."""

    name: str
    build: Callable[[int], torch.nn.Module]
    seed: int
    prompt_lens: tuple[int, ...] = PROMPT_LENS
    num_greedy: int = NUM_GREEDY
    extra: dict = field(default_factory=dict)
    nvfp4: bool = False
    """Routed experts written in ModelOpt NVFP4; the reference runs on their dequantized values."""
    recipe: Recipe | None = None
    """The checkpoint HF saves rewritten in a quantized layout; the reference is HF on its
    dequantized twin."""
    @property
    def quantized(self) -> bool:
        """A quantized checkpoint: HF cannot be its live reference, its stored golden is."""
        return self.nvfp4 or self.recipe is not None

    @property
    def quantization_label(self) -> str:
        """A few words on the quantization ("" when unquantized)."""
        return self.recipe.label if self.recipe else "NVFP4 experts" if self.nvfp4 else ""


def _llama(eos: int):
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    # Biases on q, k, v and o_proj: a row-parallel bias added on every rank before the
    # all-reduce (or a q/k/v bias split off its heads) changes the output only with them.
    return LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=rope, eos_token_id=eos,
                                        tie_word_embeddings=False, attention_bias=True))


def _qwen3(eos: int):
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON, eos_token_id=eos, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1000000.0}))


def _qwen3_moe(eos: int):
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(COMMON, num_hidden_layers=3)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **cfg, eos_token_id=eos, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False))


CASES: dict[str, CaseSpec] = {
    "tiny-llama": CaseSpec("tiny-llama", _llama, seed=11),
    "tiny-qwen3": CaseSpec("tiny-qwen3", _qwen3, seed=12),
    "tiny-qwen3-moe": CaseSpec("tiny-qwen3-moe", _qwen3_moe, seed=13),
    # 24 greedy tokens: decode runs long enough through the GatedDeltaNet conv and recurrent
    # states; the 70-token prompt spans two 64-token prefill chunks.
    "tiny-qwen3.5-moe": CaseSpec("tiny-qwen3.5-moe", qwen3_5_moe_tiny, seed=14, num_greedy=24),
    # Same seed as tiny-qwen3.5-moe; experts 128 wide so TP 8 splits whole NVFP4 groups.
    "tiny-qwen3.5-moe-nvfp4": CaseSpec("tiny-qwen3.5-moe-nvfp4", qwen3_5_moe_tiny_nvfp4,
                                       seed=14, num_greedy=24, nvfp4=True),
    # Shared expert and experts 128 wide: at TP 8 each rank's down_proj holds one whole
    # 16-element NVFP4 group of inputs.
    "tiny-qwen3.5-moe-nvfp4-ct": CaseSpec(
        "tiny-qwen3.5-moe-nvfp4-ct", qwen3_5_moe_tiny_quantized, seed=15, num_greedy=24,
        recipe=REDHAT_NVFP4),
    "tiny-qwen3.5-moe-mixed": CaseSpec(
        "tiny-qwen3.5-moe-mixed", qwen3_5_moe_tiny_quantized, seed=16, num_greedy=24,
        recipe=NVIDIA_MIXED),
    # tiny-qwen3.5-moe's dimensions: with 24 x 40 blocks the shared expert's 48 rows give 6
    # per rank at TP 8, the experts' 32 give 4, down_proj's 32 inputs lie in one partial block.
    "tiny-qwen3.5-moe-fp8": CaseSpec(
        "tiny-qwen3.5-moe-fp8", qwen3_5_moe_tiny, seed=17, num_greedy=24, recipe=QWEN_FP8),
    "tiny-qwen3-fp8": CaseSpec("tiny-qwen3-fp8", _qwen3, seed=18, recipe=QWEN3_FP8),
}


def make_prompts(seed: int, lens: tuple[int, ...], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def vocab_boundary_ids(vocab: int, tp_sizes: tuple[int, ...] = (2, 4, 8)) -> list[int]:
    """The first and last id of every rank's vocab-parallel range at each TP size (ranges of
    `ceil(vocab / tp)` rows, the last one padded), and the last real id before the padding:
    the ids an off-by-one in the range or the padding gets wrong."""
    ids = set()
    for tp in tp_sizes:
        per_rank = -(-vocab // tp)
        for rank in range(tp):
            first = rank * per_rank
            if first < vocab:
                ids.update((first, min(first + per_rank, vocab) - 1))
    return sorted(ids)


def reference_prompts(seed: int, lens: tuple[int, ...], vocab: int) -> list[list[int]]:
    """`make_prompts`, with every vocab-shard boundary id (`vocab_boundary_ids`) written over
    the start of the first prompt long enough to hold them all, in a seeded order."""
    prompts = make_prompts(seed, lens, vocab)
    ids = torch.tensor(vocab_boundary_ids(vocab))
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed + 2000))
    for prompt in prompts:
        if len(prompt) >= len(ids):
            prompt[: len(ids)] = ids[order].tolist()
            break
    return prompts


@torch.inference_mode()
def hf_reference(model, prompts: list[list[int]], num_greedy: int) -> dict[str, torch.Tensor]:
    """Prefill logits at every position and a greedy continuation (ids and their logits) for
    each prompt, one prompt at a time (no padding), end-of-text ignored."""
    out = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        out[f"prompt_{i}"] = ids[0]
        ids = ids.to(model.device)
        out[f"prefill_logits_{i}"] = model(ids).logits[0].float()
        # An explicit mask: otherwise HF masks every prompt token equal to pad_token_id.
        gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=num_greedy, min_new_tokens=num_greedy,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        out[f"greedy_ids_{i}"] = gen.sequences[0, len(prompt):].cpu()
        out[f"greedy_logits_{i}"] = torch.cat(gen.logits).float()
    return {k: v.cpu().contiguous() for k, v in out.items()}


LOW_PRECISION = ("bfloat16", "float16")
BASELINE_SAMPLES = 4


@torch.inference_mode()
def low_precision_spread(model, prompt: list[int], expected: torch.Tensor):
    """The worst of `BASELINE_SAMPLES` runs of `model` (HF at a low-precision dtype) against
    the float32 logits `expected`: one as is, the others with the output of the embedding and
    of every decoder layer perturbed by half a rounding step (uniform, relative, seeded), as
    another correct implementation's different rounding would. Where the model has near-ties
    (MoE routers whose k-th and (k+1)-th expert differ by less than the dtype resolves), one
    sample of HF's own error can sit well below another correct implementation's, so the
    yardstick is the spread. The `LogitMetrics` of the worst sample; None if a run is not
    finite."""

    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(len(prompt))
    worst = None
    for sample in range(BASELINE_SAMPLES):
        scale = torch.finfo(dtype).eps / 2 if sample else 0.0
        hooks = [m.register_forward_hook(_perturb(scale, gen)) for m in _rounding_points(model)]
        try:
            logits = model(torch.tensor([prompt], device=model.device)).logits[0].float().cpu()
        finally:
            for h in hooks:
                h.remove()
        if not bool(torch.isfinite(logits).all()):
            return None
        metrics = logit_metrics(logits, expected)
        worst = metrics if worst is None or metrics.rel_l2 > worst.rel_l2 else worst
    return worst


def _rounding_points(model) -> list[torch.nn.Module]:
    """The input embedding and every decoder layer (modules named `...layers.N`)."""
    layers = [m for name, m in model.named_modules() if re.search(r"layers\.\d+$", name)]
    return [model.get_input_embeddings(), *layers]


def _perturb(scale: float, gen: torch.Generator):
    def hook(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if scale == 0 or not isinstance(out, torch.Tensor):
            return None
        noise = (2 * torch.rand(out.shape, generator=gen) - 1).to(out.device, out.dtype)
        out = out * (1 + scale * noise)
        return (out, *output[1:]) if isinstance(output, tuple) else out
    return hook


@torch.inference_mode()
def low_precision_baselines(model, prompts: list[list[int]], reference: dict) -> dict:
    """For bf16 and fp16: how far HF at that dtype lands from HF in fp32 (`reference`) on each
    prompt's prefill logits (the worst of `low_precision_spread`'s samples), as `logit_metrics`
    dicts rounded to 3 significant digits (None where HF itself gives non-finite logits).
    Stored with the golden, it is the yardstick the
    golden check widens low-precision bounds by when it does not run HF live."""

    out = {}
    for name in LOW_PRECISION:
        low = copy.deepcopy(model).to(getattr(torch, name))
        rows = []
        for i, prompt in enumerate(prompts):
            spread = low_precision_spread(low, prompt, reference[f"prefill_logits_{i}"])
            if spread is None:
                rows = None
                break
            metrics = spread.as_dict()
            rows.append({k: v if isinstance(v, int) else float(f"{v:.3g}")
                         for k, v in metrics.items()})
        out[name] = rows
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.glob("model*.safetensors"))}


def build_hf_model(spec: CaseSpec, eos: int):
    torch.manual_seed(spec.seed)
    model = spec.build(eos).eval()
    rerandomise(model, spec.seed)
    return model


TWIN_REFERENCE = ("HF transformers (float32) on the dequantized twin: every quantized weight "
                  "dequantized in float64 from the format definition "
                  "(freetoken.formats.quant.twin), rounded once to float32, scales dropped")


def write_case(spec: CaseSpec, folder: Path) -> Path:
    """Build, save and reference one case into `folder` (created or overwritten)."""
    folder.mkdir(parents=True, exist_ok=True)
    if spec.recipe is not None:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_quantized(spec, folder, Path(tmp))
            quantization = {"producer": spec.recipe.producer, "layout": spec.recipe.layout,
                            "formats": stored_formats(folder), "reference": TWIN_REFERENCE}
            _write_reference(spec, folder, model, quantization)
        return folder
    eos = write_tokenizer(folder)
    model = build_hf_model(spec, eos)
    model.save_pretrained(folder)
    quantization = None
    if spec.nvfp4:
        quantize_experts(model, folder)
        quantization = "NVFP4 experts (ModelOpt layout); reference on dequantized experts"
    _write_reference(spec, folder, model, quantization)
    return folder


def write_quantized(spec: CaseSpec, folder: Path, tmp: Path):
    """Write `spec`'s checkpoint into `folder` in its recipe's layout (HF saves it under
    `tmp`, the recipe rewrites it; the folder's previous files are removed) and return HF's
    model of the folder's dequantized twin, in float32: the model the reference runs."""
    # transformers costs seconds to import; only writing cases and HF references need it.
    from transformers import AutoModelForCausalLM

    saved = tmp / "hf"
    saved.mkdir()
    build_hf_model(spec, write_tokenizer(saved)).save_pretrained(saved)
    written = spec.recipe.write(saved, tmp / "quantized")
    for old in folder.iterdir():
        if old.is_file():
            old.unlink()
    for new in sorted(written.iterdir()):
        shutil.copyfile(new, folder / new.name)
    twin = write_dequantized_twin(folder, tmp / "twin", read_quant_config(folder))
    return AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()


def _write_reference(spec: CaseSpec, folder: Path, model, quantization) -> None:
    """HF's reference outputs of `model` (reference.safetensors), its per-module activations
    on the bisect prompt (bisect.safetensors, `bisect_file`) and meta.json."""
    # transformers costs seconds to import; only writing cases and HF references need it.
    import transformers

    prompts = reference_prompts(spec.seed, spec.prompt_lens, VOCAB)
    reference = hf_reference(model, prompts, spec.num_greedy)
    save_file(reference, folder / "reference.safetensors")
    meta = {
        "case": spec.name, "seed": spec.seed, "dtype": "float32",
        "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
        "prompts": prompts, "num_greedy": spec.num_greedy,
        "weights_sha256": weights_sha256(folder),
        "baselines": low_precision_baselines(model, prompts, reference),
        # HF's modules on the bisect prompt, in float32: bisect runs no HF for the case.
        "bisect": _write_bisect(folder, prompts, reference),
    }
    if quantization is not None:
        meta["quantization"] = quantization
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def _write_bisect(folder: Path, prompts: list[list[int]], reference: dict) -> dict:
    """HF's float32 activations on the bisect prompt into `folder`'s bisect.safetensors, from
    HF loaded as the bisect check loads it (the folder itself, or for a quantized case its
    dequantized twin in float32, so the modules have the names and weights it would see);
    the meta.json entry."""
    from transformers import AutoModelForCausalLM

    scheme = read_quant_config(folder)
    logits = [reference[f"prefill_logits_{i}"] for i in range(len(prompts))]
    with tempfile.TemporaryDirectory() as tmp:
        source = folder if scheme is None else \
            write_dequantized_twin(folder, Path(tmp) / "twin", scheme)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        prompt, token, acts = bisect_file.record(model, prompts, logits)
    return bisect_file.save(folder, prompt, token, {"float32": acts})


def load_reference(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta.json, reference tensors) of a bundled case folder."""

    meta = json.loads((folder / "meta.json").read_text())
    return meta, load_file(folder / "reference.safetensors")


class CaseError(ValueError):
    """A --model argument names no bundled case, folder or cached hub snapshot."""


@dataclass(frozen=True)
class Case:
    """A model to verify: a bundled case (with stored golden outputs) or any checkpoint."""

    name: str
    folder: Path
    bundled: bool
    source: dict = field(default_factory=dict, compare=False)
    """Where the checkpoint came from: `path`, and for a hub id `hub_id`, `revision` and
    `snapshot` (the commit hash of the cached snapshot), for the report."""

    @cached_property
    def model_config(self):
        return load_config(self.folder)

    def engine_args(self, options) -> dict:
        """What a rank needs to build this model's engine under `options`."""
        return {"folder": str(self.folder), "dtype": options.dtype,
                "num_layers": options.num_layers}


def bundled_folder(name: str) -> Path | None:
    """The folder of bundled case `name` when it is present, else None: how `freetoken
    generate`, `freetoken plan` and `LLM(...)` take case names (the `freetoken.checkpoints`
    entry point)."""
    folder = GOLDEN / name
    return folder if name in CASES and (folder / "config.json").is_file() else None


def resolve_case(arg: str, download: bool = False) -> Case:
    """A bundled case name, a local checkpoint folder, or a hub id `Org/Name[@revision]` from
    the local HF cache (fetched only when `download` is set: `freetoken.engine.resolve`)."""

    if arg in CASES:
        if not (GOLDEN / arg / "config.json").is_file():
            raise CaseError(f"bundled case {arg!r} is missing from {GOLDEN}; run `make golden`")
        case = Case(arg, GOLDEN / arg, True, {"path": str(GOLDEN / arg)})
    else:
        try:
            folder, source = resolve_checkpoint(arg, download,
                                                hint="; pass --download to fetch it")
            case = Case(arg, folder, False, source)
        except ModelNotFound as e:
            raise CaseError(f"{e} (bundled cases: {', '.join(sorted(CASES))})") from None
    try:
        case.model_config  # noqa: B018 - read now so a bad config is a usage error
    except (ConfigError, KeyError) as e:
        raise CaseError(f"{arg}: unusable config.json ({e})") from None
    return case


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the bundled verification cases.")
    parser.add_argument("--write", type=Path, default=GOLDEN,
                        help="output root (freetoken_verify/golden/)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only these")
    parser.add_argument("--realdims", type=Path, metavar="FOLDER",
                        help="instead, write qwen3.5-moe-realdims (not bundled) into FOLDER")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="weight dtype of --realdims")
    parser.add_argument("--format", choices=REALDIMS_FORMATS, default="bf16",
                        help="layout of --realdims: bf16 or a shipping quantized one")
    parser.add_argument("--num-layers", type=int, default=2, help="layers of --realdims")
    parser.add_argument("--quantize-on", default="cpu", help="device the --format quantizer "
                        "runs on (cpu, cuda)")
    args = parser.parse_args(argv)
    if args.realdims is not None:
        written = write_realdims(args.realdims, args.dtype, args.format, args.num_layers,
                                 args.quantize_on)
        print(f"wrote {written}")
        return
    torch.set_num_threads(1)
    unpinned = check_pinned(torch)
    if unpinned:
        print(f"warning: {unpinned}", file=sys.stderr)
    for name in args.case or sorted(CASES):
        print(f"writing {write_case(CASES[name], args.write / name)}")


def write_pinned(names: list[str], root: Path, timeout: float = 1200) -> list[Path]:
    """Write the bundled cases `names` under `root` as `make golden` does: in a fresh process
    with the pinned numeric environment (`freetoken_verify.cases.numerics`), whatever this
    process's torch was started with. Raises RuntimeError with the writer's output if it
    fails."""
    args = [sys.executable, "-m", "freetoken_verify.cases", "--write", str(root)]
    for name in names:
        args += ["--case", name]
    proc = subprocess.run(args, env=pinned_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or "warning:" in proc.stderr:
        raise RuntimeError(f"case writer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [root / name for name in names]


if __name__ == "__main__":
    main()
