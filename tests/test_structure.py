"""The shape of the code and of its tests.

The pipeline: no import cycle between its modules, library code never imports a stage or a driver,
one short module per stage in `STAGE_ORDER` (nothing else in pipeline/stages/) that names what it
reads and imports its library (`pipeline.graph.STAGE_LIBRARY`), the split packages are packages, and
paths come from `Layout` only.

The tests: tests/runtime/ and tests/pipeline/ mirror the code (`tests/<package>/test_<module>.py` or
`test_<module>_<topic>.py` for an existing `<package>/<module>.py` or `<package>/<module>/`), every
folder is a package, a test imports no other test module (shared code lives in tests.helpers), and
only the tests of the benchmarks and experiments import those scripts.

Each checker is a function of plain inputs, and a test feeds it a planted violation."""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

from pipeline.graph import STAGE_LIBRARY, STAGE_ORDER
from pipeline.paths import REPO_ROOT
from tests.helpers.imports import find_cycle, import_graph, module_name, package_files

ROOT = REPO_ROOT
PIPELINE = ROOT / "pipeline"
TESTS = ROOT / "tests"
MAX_STAGE_LINES = 100  # a stage module is read at once


def _module_name(path: Path) -> str:
    return module_name(path, ROOT)


@functools.cache
def _graph() -> dict[str, set[str]]:
    """pipeline module -> the pipeline modules it imports (one scan per test process; read only)."""
    return import_graph(package_files(ROOT, "pipeline"), "pipeline")


def test_no_import_cycle_inside_pipeline() -> None:
    graph = _graph()
    assert "pipeline.stages.bank" in graph and "pipeline.graph" in graph["pipeline.stages.bank"]  # the scan sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


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
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


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


# --- pipeline/stages/: one module per stage, each on its library -----------------------------------


def _stage_problems(stage_modules: set[str], imports: dict[str, set[str]], order: tuple[str, ...] | list[str],
                    library: dict[str, str]) -> list[str]:
    """What breaks 'pipeline/stages/ holds exactly one module per stage of `order`, and stage `s`
    imports its library `library[s]` (or a module inside it)'. `stage_modules`: the module names in
    pipeline/stages/ (file stems); `imports`: pipeline module -> the pipeline modules it imports."""
    stray = sorted(stage_modules - set(order) - {"__init__"})
    problems = [f"pipeline/stages/{m}.py is no stage of STAGE_ORDER" for m in stray]
    problems += [f"stage {s!r} has no module pipeline/stages/{s}.py" for s in order if s not in stage_modules]
    for s in order:
        lib = library.get(s)
        deps = imports.get(f"pipeline.stages.{s}", set())
        if lib is None:
            problems.append(f"stage {s!r} has no library in STAGE_LIBRARY")
        elif s in stage_modules and not any(d == lib or d.startswith(lib + ".") for d in deps):
            problems.append(f"pipeline.stages.{s} does not import its library {lib}")
    return problems


def test_stages_folder_holds_one_module_per_stage_each_importing_its_library() -> None:
    stems = {p.stem for p in (PIPELINE / "stages").glob("*.py")}
    problems = _stage_problems(stems, _graph(), STAGE_ORDER, STAGE_LIBRARY)
    assert not problems, problems
    assert set(STAGE_LIBRARY) == set(STAGE_ORDER)


def test_the_stage_check_sees_a_stray_module_a_missing_one_and_a_missing_library_import() -> None:
    order, library = ("model", "grow"), {"model": "pipeline.model", "grow": "pipeline.grow"}
    imports = {"pipeline.stages.model": {"pipeline.model.provision"}, "pipeline.stages.grow": {"pipeline.replay.accept"}}
    assert _stage_problems({"__init__", "model", "grow"}, {**imports, "pipeline.stages.grow": {"pipeline.grow"}},
                           order, library) == []
    assert _stage_problems({"__init__", "model", "grow", "helpers"}, imports, order, library) == [
        "pipeline/stages/helpers.py is no stage of STAGE_ORDER",
        "pipeline.stages.grow does not import its library pipeline.grow"]
    assert _stage_problems({"__init__", "grow"}, {"pipeline.stages.grow": {"pipeline.grow"}}, order, library) == [
        "stage 'model' has no module pipeline/stages/model.py"]


# --- packages that must stay packages --------------------------------------------------------------

PACKAGES = ("pipeline/bank", "pipeline/benchmarks", "pipeline/benchmarks/gpu", "pipeline/config", "pipeline/evaluate",
            "pipeline/experiments", "pipeline/heads", "pipeline/heads/published", "pipeline/model", "pipeline/prepare",
            "pipeline/replay", "pipeline/rollout", "pipeline/stages", "pipeline/timing", "runtime/export",
            "runtime/model")


def _package_problems(root: Path, packages: tuple[str, ...] | list[str]) -> list[str]:
    """Each of `packages` is a folder with an __init__.py, and no module of the same name sits beside it."""
    problems = []
    for pkg in packages:
        if not (root / pkg / "__init__.py").is_file():
            problems.append(f"{pkg}/ is not a package")
        if (root / f"{pkg}.py").exists():
            problems.append(f"{pkg}.py sits beside the package {pkg}/")
    return problems


def test_split_modules_are_packages() -> None:
    assert "pipeline/replay" in PACKAGES
    assert not _package_problems(ROOT, PACKAGES), _package_problems(ROOT, PACKAGES)


def test_the_package_check_sees_a_module_in_place_of_a_package(tmp_path: Path) -> None:
    (tmp_path / "pipeline" / "rollout").mkdir(parents=True)
    (tmp_path / "pipeline" / "rollout" / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "replay.py").write_text("")
    assert _package_problems(tmp_path, ["pipeline/rollout", "pipeline/replay"]) == [
        "pipeline/replay/ is not a package", "pipeline/replay.py sits beside the package pipeline/replay/"]


# --- tests/ mirrors runtime/ and pipeline/ ---------------------------------------------------------


def _code_units(root: Path) -> set[str]:
    """'runtime/api', 'runtime/model', 'runtime/model/llama', ...: every module (no .py) and every
    package (a folder with an __init__.py) of runtime/ and pipeline/, relative to the repo root."""
    units = set()
    for top in ("runtime", "pipeline"):
        for p in (root / top).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            rel = p.relative_to(root).with_suffix("").as_posix()
            units.add(rel.removesuffix("/__init__") if p.name == "__init__.py" else rel)
    return units


def _mirror_problems(test_files: list[str], units: set[str]) -> list[str]:
    """Test files (relative to tests/) under runtime/ or pipeline/ that mirror nothing: a file
    `<folder>/test_<name>.py` needs `<folder>` to be a package of the code and `<name>` to be, or to
    start with `<unit>_`, the name of a module or package in it."""
    problems = []
    for rel in test_files:
        folder, _, file = rel.rpartition("/")
        if folder.split("/")[0] not in ("runtime", "pipeline") or not file.startswith("test_"):
            continue
        parts = file.removeprefix("test_").removesuffix(".py").split("_")
        if folder not in units:
            problems.append(f"tests/{rel}: {folder}/ is no package of the code")
        elif not any(f"{folder}/{'_'.join(parts[:k])}" in units for k in range(1, len(parts) + 1)):
            problems.append(f"tests/{rel}: no module or package {folder}/{'_'.join(parts)}(.py) or a prefix of it")
    return problems


def _test_files() -> list[str]:
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_tests_mirror_the_code() -> None:
    files = _test_files()
    assert "runtime/test_decoder.py" in files and "pipeline/replay/test_dynamic.py" in files  # the scan sees them
    assert not _mirror_problems(files, _code_units(ROOT)), _mirror_problems(files, _code_units(ROOT))


def test_every_tests_folder_is_a_package() -> None:
    """Test basenames repeat across folders (tests/runtime/test_dynamic.py, tests/pipeline/replay/...)."""
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert not missing, f"folders without __init__.py: {missing}"


def test_the_mirror_check_sees_a_test_of_nothing() -> None:
    units = {"runtime", "runtime/decoder", "runtime/model", "runtime/model/llama", "pipeline", "pipeline/replay",
             "pipeline/replay/accept", "pipeline/small_rows"}
    ok = ["runtime/test_decoder.py", "runtime/test_decoder_batch.py", "runtime/model/test_llama_row_invariance.py",
          "runtime/test_model.py", "pipeline/test_replay.py", "pipeline/replay/test_accept.py",
          "pipeline/test_small_rows_speed.py", "slow/test_long_run.py", "test_structure.py"]
    assert _mirror_problems(ok, units) == []
    assert _mirror_problems(["runtime/test_batch.py", "pipeline/oracle/test_replay.py", "runtime/test_decoderbatch.py"],
                            units) == [
        "tests/runtime/test_batch.py: no module or package runtime/batch(.py) or a prefix of it",
        "tests/pipeline/oracle/test_replay.py: pipeline/oracle/ is no package of the code",
        "tests/runtime/test_decoderbatch.py: no module or package runtime/decoderbatch(.py) or a prefix of it"]


# --- what a test may import ------------------------------------------------------------------------

SCRIPTS = ("pipeline.benchmarks", "pipeline.experiments")  # imported only by tests/pipeline/<their folder>/


def _test_import_problems(rel: str, source: str) -> list[str]:
    """What file `rel` (relative to tests/) imports that it may not: another test module (anything
    of `tests` but tests.helpers), a relative import outside tests/helpers, or a benchmark or
    experiment script unless it is a test of those scripts (under tests/pipeline/benchmarks/ or
    tests/pipeline/experiments/)."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if not rel.startswith("helpers/"):
                problems.append(f"tests/{rel}: relative import (use tests.helpers)")
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if (name == "tests" or name.startswith("tests.")) and not (
                    name == "tests.helpers" or name.startswith("tests.helpers.")) and not rel.startswith("helpers/"):
                problems.append(f"tests/{rel} imports {name}: a test imports only tests.helpers")
            for script in SCRIPTS:
                home = script.replace(".", "/") + "/"
                if (name == script or name.startswith(script + ".")) and not rel.startswith(home):
                    problems.append(f"tests/{rel} imports {name}: only tests under tests/{home} import {script}")
    return problems


def test_tests_import_no_test_module_and_no_script_but_their_own() -> None:
    problems = [q for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts
                for q in _test_import_problems(p.relative_to(TESTS).as_posix(), p.read_text())]
    assert not problems, problems


def test_the_import_check_sees_a_test_import_and_a_script_import() -> None:
    allowed = ("from tests.helpers import tiny_model\nfrom tests.helpers.env import REPO\nfrom tests import helpers\n"
               "import pipeline.timing.invariance\n")
    assert _test_import_problems("runtime/test_decoder.py", allowed) == []
    assert _test_import_problems("pipeline/benchmarks/gpu/test_check.py",
                                 "from pipeline.benchmarks.gpu import check\n") == []
    assert _test_import_problems("pipeline/experiments/test_policy_headroom.py",
                                 "def f():\n    from pipeline.experiments.policy_headroom import walk_rate\n") == []
    planted = ("from tests.test_dynamic import SUPER\nimport tests.runtime.test_batch\nfrom .helpers import x\n"
               "def f():\n    from pipeline.benchmarks.row_invariance import compare\n"
               "from pipeline import experiments\n")
    assert _test_import_problems("runtime/test_dynamic.py", planted) == [
        "tests/runtime/test_dynamic.py imports tests.test_dynamic.SUPER: a test imports only tests.helpers",
        "tests/runtime/test_dynamic.py imports tests.runtime.test_batch: a test imports only tests.helpers",
        "tests/runtime/test_dynamic.py: relative import (use tests.helpers)",
        "tests/runtime/test_dynamic.py imports pipeline.experiments: only tests under tests/pipeline/experiments/ "
        "import pipeline.experiments",
        "tests/runtime/test_dynamic.py imports pipeline.benchmarks.row_invariance.compare: only tests under "
        "tests/pipeline/benchmarks/ import pipeline.benchmarks"]
    # a benchmark's test may not import an experiment, nor the other way round
    assert len(_test_import_problems("pipeline/benchmarks/test_x.py", "import pipeline.experiments.x\n")) == 1

