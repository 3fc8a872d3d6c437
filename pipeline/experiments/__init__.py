"""Studies behind design choices (`python -m pipeline.experiments.<name>`); each prints its figures
and writes them under artifacts/reports/benchmarks/. Shared here: the command line of the studies
that read built banks."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline.benchmarks import REPORT_DIR, TASKS
from pipeline.paths import Layout, default_model_name


def bank_study_args(doc: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    """The options of a study over built banks: artifacts folder, model, heads, profile, tasks, output."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--model-name", default=None, help="model folder name (default: the config's default model)")
    p.add_argument("--heads", default="hydra-draft8192", help="heads run name (the banks' folder under the model)")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--out", default=str(REPORT_DIR))
    return p.parse_args(argv)


def bank_layouts(a: argparse.Namespace, needs: Sequence[str] = ("rollout",)) -> Iterator[tuple[str, Layout]]:
    """(task, its Layout) for each task of `a`, after checking that the bank and the rollout-work
    folders `needs` exist (SystemExit saying which `make bank` to run if not)."""
    for task in a.tasks:
        lay = Layout(Path(a.artifacts), Path("data"), a.model_name or default_model_name(), a.heads, task, a.profile)
        for need in (lay.bank_dir / "bank.json", *(lay.work / n for n in needs)):
            if not need.exists():
                raise SystemExit(f"{need} does not exist: build the bank first (`make bank TASK={task}`)")
        yield task, lay
