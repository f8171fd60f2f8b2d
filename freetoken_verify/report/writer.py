"""Reports written as the run goes: after every finished row the JSON report, the JUnit XML
and the markdown summary are rewritten whole and atomically (a temporary file in the same
folder, then `os.replace`), so a run killed after hours leaves a valid report of what finished,
marked `"complete": false`. At the end the markdown summary is also appended to
`$GITHUB_STEP_SUMMARY` when that is set (GitHub Actions' job summary)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from freetoken_verify.report.formats import CheckResult, junit_tree, markdown_summary, report_dict
from freetoken_verify.report.run_info import RunInfo, utc_now

STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


@dataclass(frozen=True)
class ReportPaths:
    """Where the reports go; None: not written."""

    json: str | None = None
    junit: str | None = None
    summary_md: str | None = None


def write_atomically(path, text: str) -> None:
    """Replace `path` with `text` in one step: readers see the old file or the new one, never
    a half-written one (creating the folder first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A sibling (os.replace needs the same file system) named by this process; open() rather
    # than mkstemp so the file gets the usual permissions, not 0600.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ReportWriter:
    """Collects results as they finish (`add`) and keeps the requested reports current;
    `finish` marks them complete. A report that cannot be written is dropped for the rest of
    the run with one line in `errors`; the others still come out."""

    def __init__(self, info: RunInfo, paths: ReportPaths):
        self.info = info
        self.results: list[CheckResult] = []
        self.errors: list[str] = []
        self.complete = False
        self._outputs: dict[str, tuple[str, Callable[[], str]]] = {
            option: (path, render) for option, path, render in (
                ("--report-json", paths.json, self._json),
                ("--junit-xml", paths.junit, self._junit),
                ("--summary-md", paths.summary_md, self._markdown)) if path}

    def start(self) -> ReportWriter:
        """Write the reports with no rows yet: the run's identity is on disk from the start."""
        self._write_all()
        return self

    def add(self, result: CheckResult) -> None:
        """Record one finished result and rewrite every report."""
        self.results.append(result)
        self._write_all()

    def finish(self) -> None:
        """Stamp the end time, mark the reports complete, append the job summary."""
        self.info.run["finished"] = utc_now()
        self.complete = True
        self._write_all()
        summary = os.environ.get(STEP_SUMMARY)
        if summary:
            try:
                with open(summary, "a", encoding="utf-8") as f:
                    f.write(self._markdown() + "\n")
            except OSError as e:
                self.errors.append(f"${STEP_SUMMARY}: could not append to {summary} "
                                   f"({e.strerror or e})")

    def _write_all(self) -> None:
        for option, (path, render) in list(self._outputs.items()):
            try:
                write_atomically(path, render())
            except OSError as e:
                self.errors.append(f"{option}: could not write {path} ({e.strerror or e})")
                del self._outputs[option]

    def _json(self) -> str:
        document = report_dict(self.results, self.info, self.complete)
        return json.dumps(document, indent=2, allow_nan=False) + "\n"

    def _junit(self) -> str:
        root = junit_tree(self.results, self.info)
        return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"

    def _markdown(self) -> str:
        return markdown_summary(self.results, self.info, self.complete)
