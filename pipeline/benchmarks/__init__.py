"""Speed benchmarks of the runtime base model (AR decoding, forward cost vs number of new tokens).

Shared helpers: the default model folder, the report folder, medians and atomic CSV writing (real
prompts from the task data sets: `pipeline.prepare.render.task_prompts`). Importing this package
imports neither hydra-core nor omegaconf, so the GPU check runs on a bare machine. Throughput is
always reported as ratios measured side by side in one run, with the machine recorded.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_bytes
# hydra-free sources only (pipeline.config.names, pipeline.paths): this package and
# pipeline.benchmarks.gpu import on a bare GPU machine without hydra-core or omegaconf
from pipeline.config.names import TRAIN_TASKS as TASKS  # noqa: F401 - the benchmarks' default tasks
from pipeline.paths import Layout, default_model_name

REPORT_DIR = Path("artifacts") / "reports" / "benchmarks"
# the converted folder of the config's default model
DEFAULT_MODEL_DIR = Layout.for_model("artifacts", default_model_name()).model_dir


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write dict rows as CSV atomically (columns: union of keys, first-seen order)."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode())
    return Path(path)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of an empty list")
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])
