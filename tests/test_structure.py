"""FreeToken's dependency structure, read from the source with `ast` (nothing is imported).
In the engine dependencies point down, engine -> models -> layers -> kernels / loading /
distributed, with config, the forward context and the formats at the bottom; in the harness,
front door -> running -> checks -> report -> reference -> cases / activations / faults, with
errors and compare at the bottom. No module imports, directly or in a loop, a module that
imports it back. Function-local imports count like top-level ones; a package's `__init__`
importing its own submodules does not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "freetoken"
RANK = {
    "freetoken": 5, "cli": 5,
    "engine": 4,
    "models": 3,
    "layers": 2,
    "kernels": 1, "loading": 1, "distributed": 1,
    "config": 0, "context": 0, "formats": 0, "version": 0, "_build_info": 0,
}
"""Each top-level part of the engine and its height: a part imports only lower parts."""
VERIFY_RANK = {
    "freetoken_verify": 7, "cli": 7, "pytest_plugin": 7,
    "api": 6,
    "running": 5,
    "checks": 4,
    "report": 3,
    "reference": 2,
    "cases": 1, "activations": 1, "faults": 1,
    "errors": 0, "compare": 0,
}
"""Each top-level part of the harness (`freetoken_verify`) and its height."""
SIDEWAYS = {("loading", "distributed"), ("config", "formats"), ("cli", "freetoken"),
            ("cli", "freetoken_verify"), ("pytest_plugin", "freetoken_verify"),
            ("cases", "activations")}
"""Imports allowed between parts of one height (the loader asks the rank for its TP info;
the config reads the checkpoint's NVFP4 quantization config; the command lines and the
pytest plugin use their package's public API; the bundled cases' writer records HF's
per-module activations)."""
PACKAGES = {"freetoken": RANK, "freetoken_verify": VERIFY_RANK}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    """Every module name an import statement of the module (whose package is `package`)
    names, `from X import Y` giving both X and X.Y (Y may be a submodule)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _make_graph(root: Path, top: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of `top` it imports (resolved to existing modules)."""
    files = {_module_name(p, root): p for p in (root / top).rglob("*.py")}
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for name in _imported_names(ast.parse(path.read_text()), package):
            while name and name not in files:
                name = name.rpartition(".")[0]
            own_child = path.name == "__init__.py" and name.startswith(module + ".")
            if name and name != module and not own_child:
                targets.add(name)
        graph[module] = targets
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward_imports(graph: dict[str, set[str]], rank: dict[str, int] = RANK) -> list[str]:
    """`a imports b` for every import from a part to a part not below it, once per module
    and imported part."""
    found, seen = [], set()
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = _part(module), _part(target)
            if a == b or (a, b) in SIDEWAYS or (module, b) in seen:
                continue
            seen.add((module, b))
            if a not in rank or b not in rank:
                found.append(f"{module} imports {target}: a part missing from the layer table")
            elif rank[b] >= rank[a]:
                found.append(f"{module} imports {target} ({a} is not above {b})")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _make_package(root: Path, files: dict[str, str]) -> Path:
    """A synthetic `freetoken` under `root`: {relative path: source}."""
    for rel, source in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


_CLEAN = {
    "__init__.py": "",
    "engine/__init__.py": "from freetoken.engine import core\n",
    "engine/core.py": "from freetoken.models import llama\n",
    "models/__init__.py": "",
    "models/llama.py": "from freetoken.layers.linear import Linear\nfrom . import base\n",
    "models/base.py": "",
    "layers/__init__.py": "",
    "layers/linear.py": "import freetoken.kernels.matmul\nfrom freetoken.context import ctx\n",
    "kernels/__init__.py": "",
    "kernels/matmul.py": "from freetoken.formats.nvfp4 import GROUP\n",
    "formats/__init__.py": "",
    "formats/nvfp4.py": "GROUP = 16\n",
    "context.py": "ctx = None\n",
}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_point_down(package):
    """No module of the package imports a part at or above its own height."""
    found = _upward_imports(_make_graph(ROOT, package), PACKAGES[package])
    assert not found, "upward imports:\n" + "\n".join(found)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(package):
    """No set of the package's modules imports each other in a loop."""
    found = _cycles(_make_graph(ROOT, package))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_harness_part_has_a_height():
    """Every top-level module and package of freetoken_verify is in the layer table, so a new
    part cannot escape the check (the bundled cases are data, not a part)."""
    parts = {p.stem if p.suffix == ".py" else p.name
             for p in (ROOT / "freetoken_verify").iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name != "__init__.py"}
    assert parts == set(VERIFY_RANK) - {"freetoken_verify"}, parts ^ set(VERIFY_RANK)


def test_a_clean_synthetic_package_passes(tmp_path):
    """The checks find nothing in a package whose imports all point down (so the failures
    below come from the injected import, not from the synthetic package)."""
    graph = _make_graph(_make_package(tmp_path, _CLEAN))
    assert graph["freetoken.layers.linear"] == {"freetoken.kernels.matmul", "freetoken.context"}
    assert not _upward_imports(graph) and not _cycles(graph)


@pytest.mark.parametrize("rel,line,part", [
    ("kernels/matmul.py", "from freetoken.layers.linear import Linear\n", "kernels"),
    ("layers/linear.py", "def f():\n    from freetoken.engine.core import x\n", "layers"),
    ("formats/nvfp4.py", "import freetoken.models.llama\n", "formats"),
    ("models/base.py", "from ..engine import core\n", "models"),
])
def test_an_injected_upward_import_is_found(tmp_path, rel, line, part):
    """One upward import added to the clean package (top-level, function-local, relative) is
    reported, naming the importing module."""
    files = dict(_CLEAN)
    files[rel] = files[rel] + line
    found = _upward_imports(_make_graph(_make_package(tmp_path, files)))
    assert len(found) == 1 and found[0].startswith(f"freetoken.{part}."), found


def test_an_injected_cycle_is_found(tmp_path):
    """models.base importing models.llama, which imports it, is a cycle of those two."""
    files = dict(_CLEAN)
    files["models/base.py"] = "def f():\n    from freetoken.models.llama import g\n"
    found = _cycles(_make_graph(_make_package(tmp_path, files)))
    assert found == [["freetoken.models.base", "freetoken.models.llama"]], found
