"""`freetoken generate`: run the engine from the command line."""

from __future__ import annotations

import sys

import click

from freetoken.distributed import RankError, RankTimeout

USAGE_ERRORS = (ValueError, FileNotFoundError)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers",
                                 param_hint="--prompt-ids") from None


@click.group()
def main() -> None:
    """FreeToken: a tensor-parallel LLM inference engine."""


@main.command()
@click.option("--model", required=True, help="checkpoint folder or hub id in the local HF cache")
@click.option("--tp", default=1, show_default=True, help="tensor-parallel size")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True)
@click.option("--oversubscribe", is_flag=True, help="let gloo ranks share GPUs")
@click.option("--prompt", "prompts", multiple=True, help="a text prompt (repeatable)")
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="a prompt as token ids, e.g. '1,2,3' (repeatable)")
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--ignore-eos", is_flag=True)
@click.option("--enforce-eager", is_flag=True, help="no CUDA graphs for decode steps")
def generate(model, tp, device, dtype, oversubscribe, prompts, prompt_ids, max_tokens,
             temperature, top_k, top_p, seed, ignore_eos, enforce_eager) -> None:
    """Generate a continuation for each prompt."""
    from freetoken import LLM, SamplingParams

    all_prompts = list(prompts) + [_parse_ids(p) for p in prompt_ids]
    if not all_prompts:
        raise click.UsageError("give at least one --prompt or --prompt-ids")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, ignore_eos=ignore_eos)
        with LLM(model, tp=tp, device=device, dtype=dtype, oversubscribe=oversubscribe,
                 enforce_eager=enforce_eager) as llm:
            results = llm.generate(all_prompts, params)
    except (RankError, RankTimeout) as e:
        detail = e.detail if isinstance(e, RankError) else e.describe()
        click.echo(detail, err=True)
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except USAGE_ERRORS as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    for prompt, result in zip(all_prompts, results):
        click.echo(f"prompt: {prompt!r}")
        if result.text is not None:
            click.echo(f"text:   {result.text!r}")
        click.echo(f"ids:    {result.token_ids}")


if __name__ == "__main__":
    main()
