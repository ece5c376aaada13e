"""strata's module import graph, read with `ast`: no cycle between two modules, and packages depend one way.

Every import counts, including those inside functions and under TYPE_CHECKING: the rule is about what a module
depends on, and a deferred import is still a dependency (deferring one only hides a cycle). Importing
`strata.a.b` also runs `strata/__init__.py` and `strata/a/__init__.py`; those implicit edges are left out, or
every module would sit in a cycle with the public surface in `strata/__init__.py`.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

STRATA = Path(__file__).resolve().parents[1] / "strata"

# Highest first: a module may import its own level or lower ones, never a higher one. Longest prefix wins.
LEVELS: list[tuple[str, list[str]]] = [
    ("entry points", ["strata", "strata.__main__", "strata.cli", "strata.server", "strata.bench", "strata.plan"]),
    ("llm/engine", ["strata.llm", "strata.engine"]),
    ("executor", ["strata.executor", "strata.structured"]),
    ("models", ["strata.models", "strata.multimodal"]),
    ("layers", ["strata.layers"]),
    ("kernels", ["strata.kernels"]),
    ("leaf modules", ["strata.distributed", "strata.config", "strata.sampling_params", "strata.errors",
                      "strata.outputs", "strata.tokenizer", "strata.plamo2_tokenizer", "strata.host_memory",
                      "strata.demo", "strata.model_source", "strata.hub", "strata.reasoning", "strata.gguf",
                      "strata.harmony", "strata.lora"]),
]


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package's name is its __init__.py's)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            # `from pkg import mod` depends on the module pkg.mod; `from mod import name` on mod.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """For each group of modules that reach each other (strongly connected, Tarjan): one cycle through its
    first module as a closed path, and the group's other modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in sorted(groups, key=min):
        if len(group) > 1:
            path = _closed_path(graph, group)
            found.append((path, sorted(group - set(path))))
    return found


def _closed_path(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {start: start}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & group):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def level_of(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LEVELS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    return level


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imports in sorted(graph.items()):
        for imported in sorted(imports):
            if level_of(imported) < level_of(module):
                found.append(f"{module} ({LEVELS[level_of(module)][0]}) imports {imported} "
                             f"({LEVELS[level_of(imported)][0]})")
    return found


def test_the_graph_sees_deferred_and_relative_imports_and_names_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nx = 1\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [(["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"], [])]
    (pkg / "e.py").write_text("import pkg.sub.c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nimport pkg.e\n")
    assert cycles(import_graph(pkg)) == [(["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"], ["pkg.e"])]


def test_every_module_of_strata_has_a_level():
    unplaced = sorted(m for m in import_graph(STRATA) if level_of(m) is None)
    assert not unplaced, f"add these modules to LEVELS in {Path(__file__).name}: {unplaced}"


def test_no_import_cycle_between_modules_of_strata():
    found = cycles(import_graph(STRATA))
    lines = [" -> ".join(path) + (f" (and through {', '.join(others)})" if others else "") for path, others in found]
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_packages_of_strata_depend_one_way():
    found = upward_imports(import_graph(STRATA))
    assert not found, "imports against the layering (" + " -> ".join(n for n, _ in LEVELS) + "):\n" + "\n".join(found)
