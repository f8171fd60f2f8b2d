"""Start-up failures that come from the user's main module, not from a rank.

Every rank imports the main module of the parent (as `__mp_main__`) before it runs anything
of ours. A script that starts ranks at its top level (no `if __name__ == "__main__":`
guard) starts them again inside each rank while that rank is still bootstrapping;
multiprocessing refuses with "...before the current process has finished its bootstrapping
phase" and a long traceback, and the parent only sees a rank that died starting. Here the
rank ends quietly with `EXIT_UNGUARDED_MAIN` before that happens, and the parent turns that
(or any rank that died before it began, while importing the main module) into one
MainModuleError line that says what to change.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import spawn

from freetoken.distributed.failures import RankFault, exit_reason

# The exit status of a rank whose import of the main module tried to start ranks.
EXIT_UNGUARDED_MAIN = 87
_GUARD = 'if __name__ == "__main__":'


class MainModuleError(RuntimeError):
    """Ranks could not start because of the main module: it starts rank processes when it is
    imported (the guard is missing), or it failed while a rank imported it. `rank` is the
    rank that died first, `main` the module's file (or name)."""

    def __init__(self, rank: int, main: str, message: str):
        self.rank = rank
        self.main = main
        super().__init__(message)


def refuse_start_while_importing_main() -> None:
    """Called first by RankGroup.start: inside a rank that is still importing the parent's
    main module (the same test multiprocessing makes), end that rank at once and quietly
    with EXIT_UNGUARDED_MAIN, which its parent reads as a missing guard."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(EXIT_UNGUARDED_MAIN)


def main_module() -> str | None:
    """The file (or module name) each rank imports as the parent's main module before it
    begins; None when ranks import none (an interactive session, `python -c`)."""
    data = spawn.get_preparation_data("freetoken-rank")
    return data.get("init_main_from_path") or data.get("init_main_from_name")


def bootstrap_fault(rank: int, exitcode: int | None, began: bool, when: float
                    ) -> RankFault | None:
    """The fault of a rank that died starting, when the main module is to blame: it exited
    with EXIT_UNGUARDED_MAIN, or it died (not killed) before it `began` running our code
    while a main module was being imported. None otherwise."""
    main = main_module()
    if main is None or began or exitcode is None or exitcode < 0:
        return None
    if exitcode == EXIT_UNGUARDED_MAIN:
        summary = (f"{main} starts rank processes when it is imported, and every rank "
                   f"imports it again: put that code under `{_GUARD}`")
    else:
        summary = (f"rank {rank} died ({exit_reason(exitcode)}) while importing the main "
                   f"module {main}, before it began: code at the top level of {main} runs "
                   f"again in every rank; keep it under `{_GUARD}` (the rank's own error is "
                   f"printed above)")
    return RankFault(rank, "bootstrap", summary, summary, when)


def raise_if_bootstrap(faults: list[RankFault]) -> None:
    """Raise MainModuleError for the first bootstrap fault among `faults`, if any."""
    for fault in sorted(faults, key=lambda f: (f.time, f.rank)):
        if fault.kind == "bootstrap":
            raise MainModuleError(fault.rank, main_module() or "", fault.summary)
