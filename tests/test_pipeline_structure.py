"""The pipeline's shape: no import cycle between its modules, one short module per stage that names
what it reads, and paths from `Layout` only."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipeline.graph import STAGE_ORDER

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipeline"
MAX_STAGE_LINES = 100  # a stage module is read at once


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of `pipeline` that `path` imports anywhere (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in modules:  # `from pipeline.x import f` -> pipeline.x
                n = n.rpartition(".")[0]
            if n and n != "pipeline":
                out.add(n)
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for p in PIPELINE.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in files}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
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


def test_no_import_cycle_inside_pipeline() -> None:
    graph = _graph()
    assert "pipeline.stages.bank" in graph and "pipeline.graph" in graph["pipeline.stages.bank"]  # the scan sees imports
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


# the stage graph and the drivers that run it; every other module of `pipeline` is library code
DRIVERS = ("pipeline.graph", "pipeline.stages", "pipeline.benchmarks", "pipeline.experiments", "pipeline.__main__",
           "pipeline.heads.__main__")


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'library -> stage or driver' imports: layers must point one way (stages call library code)."""
    def is_driver(m: str) -> bool:
        return any(m == d or m.startswith(d + ".") for d in DRIVERS)

    return sorted(f"{m} imports {n}" for m, deps in graph.items() if not is_driver(m)
                  for n in deps if is_driver(n) and n != "pipeline.graph" or n.startswith("pipeline.stages"))


def test_library_code_never_imports_a_stage_or_a_benchmark() -> None:
    graph = _graph()
    assert "pipeline.loaders" in graph and "pipeline.timing.step_cost" in graph
    assert not _upward_imports(graph), _upward_imports(graph)


def test_the_layer_check_sees_an_upward_import() -> None:
    graph = {"pipeline.loaders": {"pipeline.stages.model"}, "pipeline.rollout": {"pipeline.benchmarks.cost_curve"},
             "pipeline.stages.model": {"pipeline.model.provision"}, "pipeline.benchmarks.cost_curve": {"pipeline.timing.curves"}}
    assert _upward_imports(graph) == ["pipeline.loaders imports pipeline.stages.model",
                                      "pipeline.rollout imports pipeline.benchmarks.cost_curve"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("stage", STAGE_ORDER)
def test_each_stage_is_one_short_module_naming_what_it_reads(stage: str) -> None:
    path = PIPELINE / "stages" / f"{stage}.py"
    assert len(path.read_text().splitlines()) <= MAX_STAGE_LINES, f"{path} is too long to read at once"
    module = importlib.import_module(f"pipeline.stages.{stage}")
    assert callable(module.output) and isinstance(module.READS, tuple)


def test_stage_keys_read_no_evaluation_setting() -> None:
    """The calibration stages never name the eval split's size: changing it re-runs only evaluate."""
    for stage in ("rollout", "merge", "grow", "recalibrate", "time", "bank"):
        reads = importlib.import_module(f"pipeline.stages.{stage}").READS
        assert not {"profile", "profile.eval_prompts", "evaluate"} & set(reads), (stage, reads)


def test_paths_come_from_layout_only() -> None:
    """No module but pipeline/paths.py spells out where artifacts live or names a model folder."""
    offenders = []
    for p in PIPELINE.rglob("*.py"):
        if p.name == "paths.py" or "__pycache__" in p.parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    "artifacts/" in node.value and not node.value.startswith(("`", "artifacts/reports/benchmarks"))
                    or "smollm2-135m" in node.value) and "\n" not in node.value and " " not in node.value:
                offenders.append(f"{p.relative_to(ROOT)}: {node.value!r}")
    assert not offenders, offenders
