"""Where the developer loop's time goes: runs `freetoken-verify` (default: what `make verify
TP=2` runs, every bundled case at TP 1 and 2) `--repeat` times in fresh processes and prints,
from its JSON report, the seconds per check and TP size, per model, and what lies outside the
rows (interpreter and torch import, planning, rank-group start-up, the reference), with the
wall time. Arguments after `--` go to freetoken-verify.

    python bench/verify_loop.py                       # make verify TP=2
    python bench/verify_loop.py -- --tp 1,2 --model tiny-llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _common import cpu_name
from tabulate import tabulate


def _run(args: list[str]) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "freetoken_verify.cli", *args,
                               "--report-json", str(report)], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"freetoken-verify exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                     f"{proc.stderr[-3000:]}")
        return wall, json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs; the table is the median")
    parser.add_argument("args", nargs="*", help="freetoken-verify arguments (after --)")
    opts = parser.parse_args()
    args = opts.args or ["--tp", "1,2"]
    walls, by_check, by_model, inside = [], defaultdict(list), defaultdict(list), []
    for _ in range(opts.repeat):
        wall, report = _run(args)
        walls.append(wall)
        check_tp, model = defaultdict(float), defaultdict(float)
        for row in report["results"]:
            check_tp[row["check"], row["tp"]] += row["seconds"]
            model[row["model"]] += row["seconds"]
        for key, seconds in check_tp.items():
            by_check[key].append(seconds)
        for key, seconds in model.items():
            by_model[key].append(seconds)
        inside.append(sum(row["seconds"] for row in report["results"]))
    med = statistics.median
    sizes = sorted({tp for _, tp in by_check})
    checks = list(dict.fromkeys(check for check, _ in by_check))
    rows = [[check, *(f"{med(by_check[check, tp]):.1f}" if (check, tp) in by_check else "-"
                      for tp in sizes),
             f"{sum(med(by_check[check, tp]) for tp in sizes if (check, tp) in by_check):.1f}"]
            for check in checks]
    rows.append(["outside the rows", *([""] * len(sizes)), f"{med(walls) - med(inside):.1f}"])
    rows.append(["wall", *([""] * len(sizes)), f"{med(walls):.1f}"])
    print(f"freetoken-verify {' '.join(args)}  ({opts.repeat} run(s), median; {cpu_name()})")
    print(tabulate(rows, headers=["check", *(f"tp={tp} s" for tp in sizes), "total s"],
                   tablefmt="github", disable_numparse=True))
    print()
    print(tabulate([[m, f"{med(v):.1f}"] for m, v in by_model.items()],
                   headers=["model", "seconds in rows"], tablefmt="github",
                   disable_numparse=True))


if __name__ == "__main__":
    main()
