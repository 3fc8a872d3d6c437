"""The runtime's shape: no import cycle between its modules, nothing in `runtime/` that `EntMTP`
(runtime.api) or the `entmtp` command line (runtime.cli) never executes, and no import of the
pipeline or its heavy dependencies anywhere in it.

Imports are read with `ast` from the source, wherever they are: at the top of a module, inside a
function (the runtime's lazy imports) and under ``if TYPE_CHECKING:`` (a module that needs another
one's names only for its annotations still knows that module: two such modules are one design).
`tests/test_runtime_imports.py` checks the same dependency rule in a fresh interpreter, for what
importing the runtime really loads.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.paths import REPO_ROOT
from tests.helpers.imports import (
    find_cycle,
    import_graph,
    imports,
    package_files,
    unreachable,
)

ENTRY_POINTS = ("runtime.api", "runtime.cli")
FORBIDDEN = ("pipeline", "hydra", "omegaconf", "pandas", "matplotlib", "transformers", "datasets")


def _files() -> dict[str, Path]:
    return package_files(REPO_ROOT, "runtime")


def _import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    return import_graph(files, "runtime")


def _forbidden_imports(files: dict[str, Path]) -> list[str]:
    return sorted({f"{module} imports {base}" for module, path in files.items() for base, _ in imports(path, module)
                   if base.partition(".")[0] in FORBIDDEN})


# ---------------------------------------------------------------------------------- the runtime


def test_no_import_cycle_inside_the_runtime() -> None:
    graph = _import_graph(_files())
    # the scan sees top-level, function-level and TYPE_CHECKING imports
    assert "runtime.bank" in graph["runtime.api"] and "runtime.export.engines" in graph["runtime.cli"]
    assert "runtime.policy" in graph["runtime.bank"]  # lazy, inside a function
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_serving_schedule_knows_no_bank() -> None:
    graph = _import_graph(_files())
    for module in ("runtime.export.schedule", "runtime.export.engines"):
        assert "runtime.bank" not in graph[module], f"{module} imports runtime.bank"


def test_every_runtime_module_runs_under_entmtp_or_its_cli() -> None:
    graph = _import_graph(_files())
    assert set(ENTRY_POINTS) <= set(graph)
    missing = unreachable(graph, ENTRY_POINTS)
    assert not missing, (f"{missing}: in runtime/ but never imported by {' or '.join(ENTRY_POINTS)}; move them to "
                         "where they are used (pipeline/, tests/helpers/)")


def test_runtime_never_imports_the_pipeline_or_its_dependencies() -> None:
    """Anywhere in the source, lazy imports included (`tests/test_runtime_imports.py` checks what an
    import loads, which cannot see a function-level import that has not run)."""
    assert not _forbidden_imports(_files()), _forbidden_imports(_files())


# ---------------------------------------------------------------- the checkers can fail


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"runtime.bank": {"runtime.export.schedule"},
                        "runtime.export.schedule": {"runtime.bank"}}) == ["runtime.bank", "runtime.export.schedule",
                                                                         "runtime.bank"]


def test_the_reachability_check_finds_a_planted_orphan() -> None:
    graph = {"runtime": set(), "runtime.api": {"runtime.bank"}, "runtime.cli": {"runtime.api"},
             "runtime.bank": {"runtime.export.schedule"}, "runtime.export": set(), "runtime.export.schedule": set(),
             "runtime.orphan": {"runtime.bank"}, "runtime.helpers": set(), "runtime.helpers.timer": set()}
    # parent packages run first (runtime, runtime.export); nothing imports the orphan or runtime.helpers.*
    assert unreachable(graph, ENTRY_POINTS) == ["runtime.helpers", "runtime.helpers.timer", "runtime.orphan"]


def test_the_scan_reads_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "runtime"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    import pandas\n    from ..top import g\n")
    (pkg / "top.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                "    from runtime.sub import leaf\n")
    files = {".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
             for p in pkg.rglob("*.py")}
    graph = _import_graph(files)
    assert graph["runtime.sub"] == {"runtime.sub.leaf"}
    assert graph["runtime.sub.leaf"] == {"runtime.top"} and graph["runtime.top"] == {"runtime.sub.leaf"}
    assert find_cycle(graph) == ["runtime.sub.leaf", "runtime.top", "runtime.sub.leaf"]
    assert _forbidden_imports(files) == ["runtime.sub.leaf imports pandas"]
