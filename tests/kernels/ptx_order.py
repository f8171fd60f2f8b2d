"""What a kernel's PTX reads before `griddepcontrol.wait`, traced from its parameters: the
check that a kernel launched with programmatic dependent launch reads nothing a kernel in
flight may still write (`freetoken.kernels.pdl`).

Each register's parameters are found by following the PTX's instructions back to the
`ld.param` that loaded them (a loaded value counts as coming from its address's
parameters, so a pointer read from a table is traced to the table); registers assigned in
several places (loops) take the union, iterated to a fixed point."""

from __future__ import annotations

import re

_REGISTER = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"\[(\w+)_param_(\d+)\]")


def _instructions(ptx: str) -> list[tuple[str, list[str], list[str], str]]:
    """(opcode, destination registers, source registers, line) of each instruction, the
    predicate guard left out; an address in brackets is a source."""
    out = []
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith(("//", ".", "{", "}", "$")) or not line.endswith(";"):
            continue
        body = re.sub(r"^@!?%p\d+\s+", "", line)[:-1]
        op, _, rest = body.partition(" ")
        operands = rest.strip()
        if op.startswith(("st.", "atom.", "red.", "bra", "ret", "bar.", "griddepcontrol",
                          "setmaxnreg", "fence", "membar", "cp.async", "mma", "@")):
            out.append((op, [], _REGISTER.findall(operands), line))
            continue
        # the first operand (or brace group) is the destination
        if operands.startswith("{"):
            dest, _, sources = operands[1:].partition("}")
        else:
            dest, _, sources = operands.partition(",")
        out.append((op, _REGISTER.findall(dest), _REGISTER.findall(sources), line))
    return out


def traced_params(ptx: str) -> list[tuple[str, str, set[int]]]:
    """("load" or "store", line, the parameter indices its address comes from) of every
    global load (`cp.async` included) and of every store or atomic, in order, and ("wait",
    line, set()) for each `griddepcontrol.wait`, ("barrier", line, set()) for each
    `bar.sync`."""
    instructions = _instructions(ptx)
    deps: dict[str, set[int]] = {}
    changed = True
    while changed:
        changed = False
        for op, dests, sources, line in instructions:
            if not dests:
                continue
            found: set[int] = set()
            if op.startswith("ld.param"):
                found = {int(m.group(2)) for m in _PARAM.finditer(line)}
            for reg in sources:
                found |= deps.get(reg, set())
            for reg in dests:
                have = deps.setdefault(reg, set())
                if not found <= have:
                    have |= found
                    changed = True
    out = []
    for op, _, _, line in instructions:
        if op.startswith("griddepcontrol.wait"):
            out.append(("wait", line, set()))
            continue
        if op.startswith(("bar.sync", "barrier.sync")):
            out.append(("barrier", line, set()))
            continue
        if op.startswith(("ld.global", "cp.async.ca", "cp.async.cg")):
            kind = "load"
        elif op.startswith(("st.global", "atom.", "red.")):
            kind = "store"
        else:
            continue
        # the global address: the last bracket (cp.async names its shared target first)
        address = re.findall(r"\[([^\]]+)\]", line)[-1]
        regs = _REGISTER.findall(address)
        out.append((kind, line, set().union(*(deps.get(r, set()) for r in regs))))
    return out


def param_names(fn) -> list[str]:
    """The PTX parameter order of @triton.jit `fn` compiled with its constexpr parameters
    fixed (as `bench/nvfp4_sass.compile_kernel` compiles it): its other parameters in
    order."""
    import inspect

    return [p for p, v in inspect.signature(fn.fn).parameters.items()
            if "constexpr" not in str(v.annotation)]


def early_read_problems(ptx: str, names: list[str], early: set[str]) -> list[str]:
    """What breaks programmatic dependent launch in a kernel launched with it: exactly one
    `griddepcontrol.wait` and one `griddepcontrol.launch_dependents`; before the wait, no
    store or atomic, and every global load's address comes from parameters in `early` (what
    no kernel in flight writes: weights, sizes, strides) or from none; and at least one load
    before the wait (the overlap PDL is for). `names`: the PTX parameters' names in order
    (`param_names`)."""
    waits = ptx.count("griddepcontrol.wait")
    launches = ptx.count("griddepcontrol.launch_dependents")
    if waits != 1 or launches != 1:
        return [f"{waits} griddepcontrol.wait and {launches} launch_dependents, want 1 and 1"]
    problems, loads = [], 0
    for kind, line, params in traced_params(ptx):
        if kind == "wait":
            break
        if kind == "barrier":
            continue
        named = {names[i] if i < len(names) else f"param_{i}" for i in params}
        if kind == "store":
            problems.append(f"store or atomic before the wait: {line}")
        elif named - early:
            problems.append(f"load of {', '.join(sorted(named - early))} before the wait: "
                            f"{line}")
        else:
            loads += 1
    if not loads:
        problems.append("no load before the wait")
    return problems


def wait_moved_to_end(ptx: str) -> str:
    """The PTX with its `griddepcontrol.wait` moved just before the last `ret;` (the bug of a
    kernel that reads its activations before waiting for the kernel that writes them)."""
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    end = max(i for i, line in enumerate(lines) if line.strip() == "ret;")
    return "\n".join(lines[:wait] + lines[wait + 1:end] + [lines[wait]] + lines[end:])
