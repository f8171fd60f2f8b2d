"""`freetoken-verify`: is the engine's TP path correct, at which size, and where not.

A thin layer over `freetoken_verify.running.plan`: it parses the command line's strings into typed
values, and turns `freetoken_verify.errors` into one `error: ...` line and exit status 2."""

from __future__ import annotations

import math
import sys

import click

from freetoken.distributed import MainModuleError, stop_on_signals
from freetoken.version import describe
from freetoken_verify.checks.base import CHECK_NAMES
from freetoken_verify.errors import VerifyError
from freetoken_verify.report.diff import print_diff
from freetoken_verify.running.listing import print_listing
from freetoken_verify.running.options import (
    DEFAULT_TIMEOUT,
    DEVICES,
    DTYPE_ALIASES,
    DTYPES,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    MAX_SEED,
    REFERENCES,
    is_count,
    parse_tp,
    split_values,
)
from freetoken_verify.running.plan import execute
from freetoken_verify.running.select import read_failed_rows

_EPILOG = f"""\b
Examples:
  freetoken-verify --tp 1,2                     every bundled case, every check
  freetoken-verify --model tiny-llama --tp 2 --checks golden,shards
  freetoken-verify --model ./my-checkpoint --tp 4 --dtype bfloat16 --reference hf
  freetoken-verify --model tiny-llama --tp 2 --fault drop-allreduce     (must fail)
  freetoken-verify --list                       cases, checks and faults

\b
Exit status:
  {EXIT_OK}    every check passed (some rows may be skipped)
  {EXIT_FAILED}    a check failed or errored, or every row was skipped (see --allow-skips)
  {EXIT_USAGE}    bad usage or bad input (one `error: ...` line, before any rank starts)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C); every rank process is stopped
The last line of output is `N passed, N failed, N skipped`."""


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


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(describe("freetoken-verify"))
        ctx.exit(EXIT_OK)


def _print_list(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        print_listing(click.echo)
        ctx.exit(EXIT_OK)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
               epilog=_EPILOG)
@click.option("--model", "models", multiple=True, metavar="MODEL",
              help="bundled case name, checkpoint folder or cached hub id; comma separated, "
                   "repeatable  [default: every bundled case]")
@click.option("--tp", "tp", multiple=True, default=("1,2",), show_default=True, metavar="SIZES",
              help="TP sizes, comma separated, repeatable")
@click.option("--checks", "checks", multiple=True, metavar="NAMES",
              help=f"checks to run, comma separated: {', '.join(CHECK_NAMES)}  [default: all]")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="where ranks run; auto: cuda when a GPU is present, else cpu")
@click.option("--oversubscribe", is_flag=True,
              help="with fewer GPUs than ranks, let gloo ranks share GPUs round-robin")
@click.option("--dtype", type=click.Choice(DTYPES + tuple(DTYPE_ALIASES)), default="auto",
              show_default=True, help="engine dtype (bf16, fp32, fp16 are aliases); auto: the "
                                      "checkpoint's")
@click.option("--reference", default="auto", show_default=True, metavar="REF",
              help=f"{', '.join(REFERENCES)}, or a folder written by --save-reference; auto: "
                   "stored golden for bundled cases with the default prompts, live HF otherwise")
@click.option("--num-layers", type=PositiveInt(), default=None,
              help="truncate the model to its first K layers (engine and HF reference)  "
                   "[default: all layers]")
@click.option("--report-json", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="write the JSON report (docs/report.md) to FILE, rewritten as each row "
                   "finishes")
@click.option("--junit-xml", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="write a JUnit XML report to FILE, for CI test reporters")
@click.option("--summary-md", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="write a compact markdown table of the results to FILE (also appended to "
                   "$GITHUB_STEP_SUMMARY when that is set)")
@click.option("--timeout", type=PositiveSeconds(), default=DEFAULT_TIMEOUT, show_default=True,
              help="seconds a rank group may take for one call")
@click.option("--fault", "--inject", "faults", multiple=True, metavar="FAULT",
              help="inject a known TP bug by name, to prove the checks catch it; repeatable "
                   "(names: --list; --inject: the old name)")
@click.option("--save-reference", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="compute HF's reference for the one --model once, store it in DIR with the "
                   "weights' fingerprints, and run against it (reuse with --reference DIR)")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="reference prompts: one text prompt a line (the model's tokenizer), or a "
                   ".json list of lists of token ids")
@click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED, max_open=True), default=None,
              help="seed of the random reference prompts and of seeded sampling  [default: 0 "
                   "for prompts, 1234 for sampling]")
@click.option("--max-new-tokens", type=PositiveInt(), default=None,
              help="greedy continuation length of the reference  [default: 16]")
@click.option("--download", is_flag=True,
              help="let a hub id Org/Name[@revision] missing from the local HF cache be "
                   "downloaded (never otherwise)")
@click.option("--bitwise/--no-bitwise", default=None,
              help="golden runs the engine's tp_invariant mode and requires TP=N to equal "
                   "TP=1 bit for bit  [default: on where that mode runs: TP sizes dividing "
                   "the model's canonical chunk count]")
@click.option("--allow-skips", is_flag=True,
              help="exit 0 when every row was skipped (by default a run that verified nothing "
                   "exits 1)")
@click.option("-k", "keyword", default=None, metavar="EXPR",
              help="only rows whose model, check, tpN or dtype match EXPR (pytest style: "
                   "words match substrings; and, or, not, parentheses)")
@click.option("-x", "--exitfirst", is_flag=True, help="stop after the first failed row")
@click.option("--maxfail", type=PositiveInt(), default=None, metavar="N",
              help="stop after N failed rows")
@click.option("--rerun-failed", type=click.Path(dir_okay=False), default=None,
              metavar="REPORT",
              help="run only the rows REPORT (a --report-json file) failed or errored, with its "
                   "dtype, device, depth, faults and prompts unless given here")
@click.option("--dry-run", "--collect-only", "dry_run", is_flag=True,
              help="print the rows the run would make and exit; no rank starts")
@click.option("-v", "--verbose", is_flag=True, help="print rank tracebacks of errors")
@click.option("--list", "list_", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_list, help="list bundled cases, checks and faults, then exit")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="print the version and exit")
@click.pass_context
def verify(ctx, models, tp, checks, faults, report_json, junit_xml, summary_md, verbose,
           allow_skips, keyword, exitfirst, maxfail, rerun_failed, dry_run, **options) -> int:
    """Verify the engine's tensor-parallel path against references at several TP sizes."""

    plan_args = dict(models=split_values(models, "--model"), tp=parse_tp(tp),
                     checks=split_values(checks, "--checks"),
                     faults=split_values(faults, "--fault"), keyword=keyword,
                     maxfail=1 if exitfirst else maxfail, **options)
    if rerun_failed:
        given = {name for name in ctx.params
                 if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT}
        plan_args = rerun_arguments(read_failed_rows(rerun_failed), plan_args, given)
    with stop_on_signals():
        return execute(plan_args, report_json, junit_xml, verbose, summary_md, allow_skips,
                       dry_run)


RERUN_OPTIONS = ("dtype", "device", "num_layers", "faults", "seed", "max_new_tokens",
                 "prompts_file", "reference", "bitwise", "oversubscribe")
"""What `--rerun-failed` takes from the earlier report's arguments unless given again."""


def rerun_arguments(failed, plan_args: dict, given: set[str]) -> dict:
    """`plan_args` for rerunning `failed` (`read_failed_rows`): only its rows; its models,
    TP sizes and checks, and the `RERUN_OPTIONS` of its run, where the command line left
    them at their defaults."""
    args = dict(plan_args, only=failed.rows)
    for name, value in (("models", failed.models), ("tp", failed.tp_sizes),
                        ("checks", failed.checks)):
        if name not in given:
            args[name] = value
    for name in RERUN_OPTIONS:
        if name not in given and name in failed.arguments and name in args:
            args[name] = failed.arguments[name]
    return args


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
def diff(old, new) -> int:
    """Show which rows changed between two --report-json files: status, presence, or a
    metric moved by more than 10x. Exit 1 when a row that passed in OLD fails in NEW."""
    return print_diff(old, new, click.echo)


def main(argv: list[str] | None = None) -> None:
    """The `freetoken-verify` entry point: exits with the run's status. `freetoken-verify diff
    OLD.json NEW.json` compares two reports instead (`freetoken_verify.report.diff`)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args[:1] == ["diff"]:
            code = diff.main(args=args[1:], prog_name="freetoken-verify diff",
                             standalone_mode=False)
        else:
            code = verify.main(args=args, prog_name="freetoken-verify", standalone_mode=False)
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        code = EXIT_USAGE
    except (VerifyError, MainModuleError) as e:
        click.echo(f"error: {e}", err=True)
        code = EXIT_USAGE
    except click.Abort:
        # click turns a Ctrl-C outside the run (while parsing, importing) into Abort.
        click.echo("interrupted by SIGINT", err=True)
        code = EXIT_INTERRUPTED
    sys.exit(code if isinstance(code, int) else EXIT_OK)


if __name__ == "__main__":
    main()
