"""How the package is put together, read from the source (no import, no GPU).

- The runtime core, every module outside `altup_cupy.lab` but the command line (`__main__`, which
  drives the research tools), imports nothing from `altup_cupy.lab`.
- The package's import graph has no cycle.
- The tests import nothing from scripts/ (every check lives in tests/).

An edge of the graph is an import written in a module: at module level or inside a function alike
(a function-level import ties two modules together as much as a top-level one). `from . import x`
is an edge to the submodule x where there is one, else to the package. Importing a submodule also
runs its parents' `__init__`; those implicit imports are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import altup_cupy

PACKAGE_DIR = Path(altup_cupy.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
PACKAGE = "altup_cupy"
TOOLS = "altup_cupy.lab"
COMMAND_LINE = "altup_cupy.__main__"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imported(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules) -> list[str]:
    """The package's modules one import statement names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = name.split(".") if is_package else name.split(".")[:-1]
        if node.level:
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                   for alias in node.names]
    found = []
    for target in targets:
        while target not in modules and "." in target:  # `import a.b.c` imports a.b.c's module
            target = target.rsplit(".", 1)[0]
        if target in modules and target != name:
            found.append(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module- and function-level imports)."""
    modules = _modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_imported(name, is_package, node, modules))
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as the modules along it, or [] if there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "altup_cupy.ops.collapse" in graph["altup_cupy"]  # from .ops.collapse import collapse
    assert "altup_cupy._sources" in graph["altup_cupy._arrays"]  # inside a function
    assert "altup_cupy._device" in graph["altup_cupy.ops._registry"]  # from .. import _device
    assert "altup_cupy.lab.bench" in graph["altup_cupy.lab.benchmarks.collapse"]  # from ..bench import


def test_the_runtime_imports_nothing_from_the_research_tools():
    graph = import_graph()
    core = [m for m in graph if not (m == TOOLS or m.startswith(TOOLS + ".")) and m != COMMAND_LINE]
    assert "altup_cupy.ops.collapse" in core and "altup_cupy.lab.bench" not in core
    leaks = sorted(f"{m} -> {t}" for m in core for t in graph[m] if t == TOOLS or t.startswith(TOOLS + "."))
    assert not leaks, "runtime modules that import the research tools:\n" + "\n".join(leaks)


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_tests_import_nothing_from_scripts():
    """Neither an import of a script nor a script's file named in a test (a module loaded from
    its path)."""
    scripts = sorted((REPO_ROOT / "scripts").glob("*.py"))
    modules, files = {path.stem for path in scripts} | {"scripts"}, {path.name for path in scripts}
    found = []
    for path in sorted((REPO_ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in modules]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in modules:
                found.append(f"{path.name}: from {node.module} import ...")
            elif isinstance(node, ast.Constant) and node.value in files:
                found.append(f"{path.name}: names {node.value}")
    assert scripts and not found, "\n".join(found)


def test_one_module_calls_the_drivers_kernel_launch():
    """Every launch goes through `_launch.PackedLaunch`: no other module names the driver's launch
    call (an attribute or name of the code, comments and docstrings aside)."""
    callers = set()
    for name, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
            if named in ("launchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel"):
                callers.add(name)
    assert callers == {"altup_cupy._launch"}, callers
