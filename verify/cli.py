"""`freetoken-verify`: is the engine's TP path correct, at which size, and where not.

Exit status: 0 all passed, 1 a check failed (or errored), 2 bad usage or bad input. The last
line of output is `N passed, N failed, N skipped`."""

from __future__ import annotations

import math
import sys

import click

from verify.faults import FAULTS
from verify.options import EXIT_FAILED, EXIT_OK, EXIT_USAGE, is_count


class PositiveInt(click.ParamType):
    """A positive integer in ASCII digits."""

    name = "count"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        if isinstance(value, str) and is_count(value.strip()):
            return int(value)
        self.fail(f"{value!r} is not a positive integer", param, ctx)


class PositiveSeconds(click.ParamType):
    """A finite number of seconds above zero."""

    name = "seconds"

    def convert(self, value, param, ctx):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        text = str(value).strip()
        if not (math.isfinite(seconds) and seconds > 0 and text.isascii()):
            self.fail(f"{value!r} is not a finite number of seconds above 0", param, ctx)
        return seconds


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "models", multiple=True,
              help="bundled case name, checkpoint folder or cached hub id (repeatable; "
                   "default: every bundled case)")
@click.option("--tp", "tp", multiple=True, default=("1,2",), show_default=True,
              help="TP sizes, comma separated")
@click.option("--checks", "checks", multiple=True, help="checks to run (default: all)")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True)
@click.option("--oversubscribe", is_flag=True, help="let gloo ranks share GPUs")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              default="auto", show_default=True)
@click.option("--reference", default="auto", show_default=True,
              help="auto, golden, hf, or a folder written by --save-reference; auto: stored "
                   "golden for bundled cases with default prompts, live HF otherwise")
@click.option("--num-layers", type=PositiveInt(), default=None,
              help="truncate the model to its first K layers (engine and HF reference)")
@click.option("--report-json", type=click.Path(dir_okay=False), default=None)
@click.option("--junit-xml", type=click.Path(dir_okay=False), default=None)
@click.option("--timeout", type=PositiveSeconds(), default=600.0, show_default=True,
              help="seconds a rank group may take for one call")
@click.option("--inject", "faults", multiple=True, type=click.Choice(sorted(FAULTS)),
              help="inject a known TP bug into the engine (to prove the checks catch it)")
@click.option("--save-reference", type=click.Path(file_okay=False), default=None,
              help="compute HF's reference for the one --model once, store it in DIR with the "
                   "weights' fingerprints, and run against it (reuse with --reference DIR)")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="reference prompts: one text prompt a line (the model's tokenizer), or a "
                   ".json list of lists of token ids")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="seed of the random reference prompts and of seeded sampling [default: 0 "
                   "for prompts, 1234 for sampling]")
@click.option("--max-new-tokens", type=PositiveInt(), default=None,
              help="greedy continuation length of the reference [default: 16]")
@click.option("--download", is_flag=True,
              help="let a hub id Org/Name[@revision] missing from the local HF cache be "
                   "downloaded (never otherwise)")
@click.option("-v", "--verbose", is_flag=True, help="print rank tracebacks of errors")
def verify(**kwargs) -> int:
    """Verify the engine's tensor-parallel path against references at several TP sizes."""
    from freetoken.distributed import stop_on_signals
    from verify.main import execute

    with stop_on_signals():
        return execute(**kwargs)


def main(argv: list[str] | None = None) -> None:
    try:
        code = verify.main(args=argv, prog_name="freetoken-verify", standalone_mode=False)
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        code = EXIT_USAGE
    except click.Abort:
        code = EXIT_FAILED
    sys.exit(code if isinstance(code, int) else EXIT_OK)


if __name__ == "__main__":
    main()
