"""Helpers the benchmark scripts share."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
