"""Every `freetoken-verify` command the README and docs/ show parses as written (each option
exists and takes the value given), and those that name only bundled cases plan without error
(`--dry-run`: no rank starts). A renamed or removed option that a page still shows fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from cli_run import run_cli

from freetoken_verify.cli import diff, verify

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"(?:`|^\s*(?:\.venv/bin/)?)(?:\.venv/bin/)?freetoken-verify((?: [^`\n#]*)?)",
                      re.M)
# Arguments a dry run on this machine cannot resolve: placeholders, files the page assumes.
_PLACEHOLDER = re.compile(r"/path/|Org/|ref/|\.json|\.txt|--device cuda|--download|35B")


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for match in _COMMAND.finditer(page.read_text()):
            args = shlex.split(match.group(1))
            if args:
                found.append((f"{page.name}: freetoken-verify {match.group(1).strip()}", args))
    return found


def test_the_pages_show_commands_this_file_checks():
    assert len(_commands()) >= 20, _commands()


@pytest.mark.parametrize("label, args", _commands(), ids=[c[0] for c in _commands()])
def test_documented_command_parses(label, args, capsys):
    command, rest = (diff, args[1:]) if args[0] == "diff" else (verify, args)
    if "--list" in rest or "--version" in rest:
        return  # eager options exit while parsing; test_cli runs them
    try:
        command.make_context("freetoken-verify", list(rest))
    except click.UsageError as e:
        pytest.fail(f"{label}: {e.format_message()}")
    if command is verify and not _PLACEHOLDER.search(" ".join(rest)):
        code, out, err = run_cli(capsys, *rest, "--dry-run")
        assert code == 0 and "row(s) planned" in out, f"{label}:\n{out}{err}"
