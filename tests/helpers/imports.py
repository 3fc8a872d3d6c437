"""Reading a package's imports from its source (`ast`), for the structure tests: wherever an import
stands (top level, inside a function, under ``if TYPE_CHECKING:``), relative ones resolved."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """The dotted module name of `path`, a file below the repository `root`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_files(root: Path, package: str) -> dict[str, Path]:
    """module name -> file, for every module of `package` (a folder below `root`)."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py")) if "__pycache__" not in p.parts}


def imports(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """Every import statement of `path`, anywhere in it, as (module named, names imported from it):
    ``import a.b`` gives ("a.b", []), ``from a import b, c`` ("a", ["b", "c"]); relative imports
    are resolved against `module`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            out.append((base, [a.name for a in node.names]))
    return out


def resolve(name: str, modules: set[str]) -> str | None:
    """The module of `modules` that importing `name` runs last: itself, or its longest known prefix."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(files: dict[str, Path], package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports: ``import a.b`` and ``from a.b import c`` name a.b, or
    a.b.c where that is a module (``from pkg import sub``); the parent packages Python runs first
    and the module itself are left out."""
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps: set[str] = set()
        for base, names in imports(path, module):
            if base.partition(".")[0] != package:
                continue
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            deps.update(subs)
            if not names or len(subs) < len(names):  # something of `base` itself
                deps.add(resolve(base, modules) or base)
        graph[module] = deps - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def unreachable(graph: dict[str, set[str]], roots: tuple[str, ...]) -> list[str]:
    """Modules of `graph` that importing `roots` never runs: reached through imports, and importing a
    module runs its parent packages' ``__init__`` first."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        parents = [m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)]
        todo += sorted(graph[m]) + parents
    return sorted(set(graph) - seen)
