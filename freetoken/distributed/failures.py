"""Why a rank group failed, and which rank's failure was the cause.

When one rank fails, its peers fail too: a peer blocked in a collective gets a transport error
from gloo or NCCL, a peer killed at teardown dies. Only the root failure (a rank's own
exception, else a rank that died, else the earliest transport error) says what went wrong;
the others are consequences and belong in the detail, not in the message a person reads first.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Error messages of peers that lost a connection because another rank failed.
_TRANSPORT_WORDS = ("connection closed by peer", "connection reset", "broken pipe",
                    "socket closed", "gloo", "nccl communicator", "connection refused")
_TRANSPORT_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError",
                    "ConnectionError", "BrokenPipeError", "ConnectionResetError", "EOFError")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass(frozen=True)
class RankFault:
    """One rank's failure: `summary` is `Type: message`, `detail` its traceback; `kind` is
    `raised` (its own exception), `transport` (lost a peer), `died` (the process exited) or
    `bootstrap` (it died starting, because of the main module: see `bootstrap.py`)."""

    rank: int
    kind: str
    summary: str
    detail: str
    time: float = 0.0


def fault_from_exception(rank: int, exc: BaseException, detail: str, when: float) -> RankFault:
    """Classify an exception raised on `rank` (called on the rank itself)."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    summary = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc).lower()
    transport = bool(names & set(_TRANSPORT_TYPES)) or any(w in text for w in _TRANSPORT_WORDS)
    return RankFault(rank, "transport" if transport else "raised", summary, detail, when)


def exit_reason(code: int | None) -> str:
    """A process exit code in words: `killed by SIGKILL`, `exit code 3`."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def root_fault(faults: list[RankFault]) -> RankFault:
    """The cause among simultaneous faults: the main module failing a rank's start, else a
    rank's own exception (earliest first), else a death, else the earliest transport error."""
    order = {"bootstrap": -1, "raised": 0, "died": 1, "transport": 2}
    return min(faults, key=lambda f: (order[f.kind], f.time, f.rank))


class RankError(RuntimeError):
    """A rank raised or died; carries the root rank, its `Type: message` summary and traceback,
    and (in `others`) what happened to the ranks torn down with it."""

    def __init__(self, rank: int, detail: str, summary: str | None = None,
                 others: dict[int, str] | None = None):
        self.rank = rank
        self.detail = detail
        lines = detail.strip().splitlines()
        self.summary = summary or (lines[-1].strip() if lines else "no output")
        self.others = dict(others or {})
        super().__init__(f"rank {rank} failed: {self.summary}")

    @classmethod
    def from_fault(cls, root: RankFault, faults: list[RankFault], size: int) -> RankError:
        seen = {f.rank: f for f in faults}
        others = {}
        for r in range(size):
            if r == root.rank:
                continue
            why = f" ({seen[r].summary})" if r in seen else ""
            others[r] = f"torn down after rank {root.rank} failed{why}"
        return cls(root.rank, root.detail, root.summary, others)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def where(self) -> str:
        path = Path(self.file)
        shown = path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path
        return f"{self.func} at {shown}:{self.line}"


def _threads(stack: str) -> list[list[Frame]]:
    """faulthandler's dump split per thread, each innermost frame first."""
    threads: list[list[Frame]] = []
    for line in stack.splitlines():
        if line.startswith(("Thread ", "Current thread ")) or not threads:
            threads.append([])
        m = _FRAME.search(line)
        if m:
            threads[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    return [t for t in threads if t]


def _is_project(frame: Frame) -> bool:
    path = Path(frame.file)
    return (path.is_relative_to(PROJECT_ROOT) and "site-packages" not in path.parts
            and path.name not in ("launch.py", "worker.py"))


def _in_collective(frames: list[Frame]) -> bool:
    return any("torch/distributed" in f.file or f.file.endswith("distributed/comm.py")
               for f in frames)


def working_frames(stack: str) -> list[Frame]:
    """The frames of the thread that runs the rank's call (the one inside the rank's serve
    loop), innermost first; [] when the dump holds none."""
    threads = _threads(stack)
    serving = [t for t in threads if any(f.func == "_serve" for f in t)]
    return (serving or threads or [[]])[0]


def hang_site(stack: str) -> str:
    """`func at file.py:line` for the innermost project frame of a rank's stack dump."""
    frames = working_frames(stack)
    project = [f for f in frames if _is_project(f)]
    frame = (project or frames or [None])[0]
    return frame.where() if frame else "an unknown place (no stack captured)"


class RankTimeout(RuntimeError):
    """Ranks did not answer in time; carries each hung rank's Python stack. `rank` is the
    likely culprit: a hung rank that is not waiting in a collective for the others."""

    def __init__(self, timeout: float, stacks: dict[int, str]):
        self.timeout = timeout
        self.stacks = stacks
        hung = sorted(stacks)
        working = [r for r in hung if not _in_collective(working_frames(stacks[r]))]
        self.rank = (working or hung or [0])[0]
        site = hang_site(stacks.get(self.rank, ""))
        self.summary = f"timed out after {timeout:g}s in {site}"
        super().__init__(f"rank {self.rank} {self.summary}")

    def describe(self) -> str:
        parts = [str(self)]
        for rank, stack in sorted(self.stacks.items()):
            parts.append(f"--- rank {rank} stack ---\n{stack.strip() or '(no stack captured)'}")
        return "\n".join(parts)
