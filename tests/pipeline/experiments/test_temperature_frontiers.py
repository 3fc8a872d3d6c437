"""The temperature-frontier report: the best tree per size across max depths, one line per
temperature, written beside the task's greedy reports."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipeline.experiments.temperature_frontiers import compose_cfg, frontier_rows, plot, summary_markdown
from pipeline.paths import Layout

DOC = {"frontier": {
    "1": [{"paths": [[0]], "tokens_per_step": 1.3}, {"paths": [[0], [1]], "tokens_per_step": 1.35}],
    "2": [{"paths": [[0]], "tokens_per_step": 1.3}, {"paths": [[0], [0, 0]], "tokens_per_step": 1.5},
          {"paths": [[0], [0, 0], [1], [0, 1]], "tokens_per_step": 1.6}],
}}


def test_frontier_rows_keep_the_best_depth_per_size() -> None:
    rows = frontier_rows(DOC, 0.7)
    assert [(r["draft_nodes"], r["tokens_per_step"], r["max_depth"]) for r in rows] == \
        [(1, 1.3, 1), (2, 1.5, 2), (4, 1.6, 2)]
    assert all(r["tree_nodes"] == r["draft_nodes"] + 1 and r["temperature"] == 0.7 for r in rows)


def test_summary_and_plot(tmp_path: Path) -> None:
    cfg = compose_cfg(["task=humaneval", "sampling.temperature=0.7", f"artifacts_dir={tmp_path}"])
    df = pd.DataFrame(frontier_rows(DOC, 0.0) + frontier_rows(DOC, 0.7))
    table = summary_markdown(df, {0.0: 2.2}, cfg)
    assert "| 0 | 1.30 | 1.60 |  |  | 2.20 |" in table and "| 0.7 | 1.30 | 1.60 |  |  |  |" in table
    out = Layout.from_cfg(cfg).temperature_reports
    # beside the greedy reports of the task, not inside the T = 0.7 folder
    assert out == tmp_path / "reports" / cfg.model.name / Layout.from_cfg(cfg).heads_name / "humaneval" / "temperatures"
    plot(df, {0.0: 2.2}, out / "frontiers.png", cfg)
    assert (out / "frontiers.png").read_bytes()[:4] == b"\x89PNG"
