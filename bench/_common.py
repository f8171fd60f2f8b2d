"""Helpers the benchmark scripts share."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cpu_name() -> str:
    """platform.processor(), or the model name from /proc/cpuinfo where that is empty."""
    name = platform.processor()
    if not name or name == platform.machine():
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return name or "?"
