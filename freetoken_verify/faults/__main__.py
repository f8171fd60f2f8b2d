"""`python -m freetoken_verify.faults --markdown` prints the fault list of docs/extending.md as
the registry gives it; `--write` puts it into the page (after adding or changing a fault)."""

from __future__ import annotations

import click

from freetoken_verify.faults import doc


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--markdown", "mode", flag_value="markdown", default=True,
              help="print the fault list (the default)")
@click.option("--write", "mode", flag_value="write",
              help="rewrite the fault list in docs/extending.md")
def main(mode: str) -> None:
    """The fault list of docs/extending.md, generated from the fault registry."""
    if mode == "write":
        changed = doc.write()
        click.echo(f"{doc.PAGE}: {'fault list rewritten' if changed else 'already current'}")
    else:
        click.echo(doc.markdown(), nl=False)


if __name__ == "__main__":
    main()
