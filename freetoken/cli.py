"""`freetoken generate`: run the engine from the command line; `freetoken plan`: print how a
checkpoint splits across ranks."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import click

from freetoken.distributed import RankError, RankTimeout

USAGE_ERRORS = (ValueError, FileNotFoundError)
# Exceptions a rank raises on bad input (a damaged or inconsistent checkpoint): exit 2 with
# one line, like a usage error, instead of a rank traceback and exit 1.
INPUT_FAULTS = ("NonFiniteError", "LoadError", "CheckpointError", "ShardError", "ConfigError",
                "NVFP4ConfigError", "NVFP4FormatError", "QuantConfigError")


class PositiveInt(click.ParamType):
    """A positive integer in ASCII digits (int() also takes other scripts' digits)."""

    name = "count"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        text = str(value).strip()
        if text.isascii() and text.isdigit() and int(text) >= 1:
            return int(text)
        self.fail(f"{value!r} is not a positive integer", param, ctx)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers",
                                 param_hint="--prompt-ids") from None


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from freetoken.version import describe

        click.echo(describe("freetoken"))
        ctx.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="print the version (and commit) and exit")
def main() -> None:
    """FreeToken: a tensor-parallel LLM inference engine."""


@main.command()
@click.option("--model", required=True,
              help="checkpoint folder, bundled case name (tiny-llama, ...), or hub id "
                   "Org/Name[@revision] in the local HF cache")
@click.option("--tp", type=PositiveInt(), default=1, show_default=True,
              help="tensor-parallel size")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16", "fp32",
                                            "bf16", "fp16"]),
              default="auto", show_default=True, help="bf16, fp32, fp16 are aliases")
@click.option("--oversubscribe", is_flag=True, help="let gloo ranks share GPUs")
@click.option("--prompt", "prompts", multiple=True, help="a text prompt (repeatable)")
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="a prompt as token ids, e.g. '1,2,3' (repeatable)")
@click.option("--max-new-tokens", "--max-tokens", "max_tokens", type=PositiveInt(), default=32,
              show_default=True,
              help="tokens to generate per prompt (--max-tokens: the old name)")
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int, help="sampling seed, in [0, 2**63)")
@click.option("--ignore-eos", is_flag=True)
@click.option("--enforce-eager", is_flag=True, help="no CUDA graphs for decode steps")
@click.option("--tp-invariant", is_flag=True,
              help="canonical TP-split sums: logits bit-identical at every TP size (slower)")
def generate(model, tp, device, dtype, oversubscribe, prompts, prompt_ids, max_tokens,
             temperature, top_k, top_p, seed, ignore_eos, enforce_eager, tp_invariant) -> None:
    """Generate a continuation for each prompt."""
    from freetoken.distributed import stop_on_signals
    from freetoken.engine.core import canonical_dtype

    dtype = canonical_dtype(dtype)
    all_prompts = list(prompts) + [_parse_ids(p) for p in prompt_ids]
    if not all_prompts:
        raise click.UsageError("give at least one --prompt or --prompt-ids")
    with stop_on_signals():
        results = _generate(all_prompts, model, tp, device, dtype, oversubscribe,
                            dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, ignore_eos=ignore_eos),
                            dict(enforce_eager=enforce_eager, tp_invariant=tp_invariant))
    for prompt, result in zip(all_prompts, results):
        click.echo(f"prompt: {prompt!r}")
        if result.text is not None:
            click.echo(f"text:   {result.text!r}")
        click.echo(f"ids:    {result.token_ids}")


def _generate(prompts, model, tp, device, dtype, oversubscribe, sampling: dict, modes: dict):
    """The LLM run (`modes`: EngineConfig switches); exits 2 on bad input (ours or a
    rank's), 1 on a rank failure."""
    from freetoken import LLM, SamplingParams
    from freetoken.engine.llm import check_generate

    try:
        params = SamplingParams(**sampling)
        check_generate(model, prompts, params, tp=tp, dtype=dtype)
        # Progress bars redraw with carriage returns: only for a person at a terminal.
        with LLM(model, tp=tp, device=device, dtype=dtype, oversubscribe=oversubscribe,
                 progress=sys.stderr.isatty(), **modes) as llm:
            return llm.generate(prompts, params)
    except RankError as e:
        if e.summary.split(":")[0] in INPUT_FAULTS:
            click.echo(f"error: rank {e.rank}: {e.summary}", err=True)
            sys.exit(2)
        click.echo(e.detail, err=True)
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except RankTimeout as e:
        click.echo(e.describe(), err=True)
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except USAGE_ERRORS as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


@main.command()
@click.option("--model", required=True,
              help="checkpoint folder, bundled case name, or hub id Org/Name[@revision] in "
                   "the local HF cache")
@click.option("--tp", type=PositiveInt(), required=True, help="tensor-parallel size")
@click.option("--tensor", "pattern", default=None,
              help="only checkpoint tensors whose name matches this regex (re.search)")
def plan(model, tp, pattern) -> None:
    """Print, per checkpoint tensor, its shard rule, spec, destination and the global rows
    and columns each rank holds."""
    try:
        sys.exit(print_plan(model, tp, pattern, click.echo))
    except USAGE_ERRORS as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def print_plan(model: str, tp: int, pattern: str | None, echo: Callable[[str], None]) -> int:
    """Print the layout of every checkpoint tensor of `model` (whose name matches `pattern`)
    at `tp` ranks through `echo`; returns the exit status: 0, or 1 when a tensor matches no
    rule (or two) or its rule cannot split it (each such tensor printed with the reason).
    ValueError (bad model, TP size or regex) for the caller to report."""
    from freetoken.engine.resolve import resolve_model
    from freetoken.formats.shard import ShardError
    from freetoken.loading.checkpoint import CheckpointReader
    from freetoken.loading.describe import describe_tensor
    from freetoken.models.registry import check_tp, load_config, shard_plan

    try:
        wanted = re.compile(pattern or "")
    except re.error as e:
        raise ValueError(f"--tensor {pattern!r} is not a regex ({e})") from None
    folder = resolve_model(model)
    cfg = load_config(folder)
    check_tp(cfg, tp)
    plan = shard_plan(cfg, tp)
    reader = CheckpointReader(folder)
    names = sorted(n for n in reader.names() if wanted.search(n))
    if not names:
        raise ValueError(f"{folder}: no checkpoint tensor matches {pattern!r}")
    failed = 0
    for name in names:
        shape, _ = reader.meta(name)
        try:
            lines = describe_tensor(plan, name, shape).lines()
        except ShardError as e:
            failed += 1
            lines = [f"{name} {list(shape)}", f"  error: {e}"]
        for line in lines:
            echo(line)
    reader.close()
    return 1 if failed else 0


if __name__ == "__main__":
    main()
