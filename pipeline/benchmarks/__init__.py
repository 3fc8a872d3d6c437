"""Speed benchmarks of the runtime base model (AR decoding, forward cost vs number of new tokens).

Shared helpers: real prompts from the packaged task datasets (rendered by the prepare stage's
code), atomic CSV writing. Throughput is always reported as ratios measured side by side
in one run, with the machine recorded.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_bytes
from pipeline.paths import Layout, default_model_name
from pipeline.config.schema import TRAIN_TASKS as TASKS  # noqa: F401 - the benchmarks' default tasks

REPORT_DIR = Path("artifacts") / "reports" / "benchmarks"
# the converted folder of the config's default model
DEFAULT_MODEL_DIR = Layout.for_model("artifacts", default_model_name()).model_dir


def task_prompts(model_dir: str | Path, tasks: tuple[str, ...] | list[str], n_per_task: int,
                 max_prompt_tokens: int = 1024) -> list[tuple[str, list[int]]]:
    """[(task, prompt token ids)] for the first `n_per_task` usable records of each task, in file
    order (so runs are comparable), rendered exactly as the prepare stage renders them: the task's
    conf/task/<task>.yaml template through the model's chat template (generation prompt added),
    encoded without adding special tokens again. Reading (incl. the cut-off ShareGPT file) is the
    prepare stage's own."""
    from pipeline.prepare import load_chat_tokenizer, load_records, load_task_config, render_prompt

    if n_per_task <= 0:
        raise ValueError(f"n_per_task must be positive, got {n_per_task}")
    tokenizer = load_chat_tokenizer(model_dir)
    out: list[tuple[str, list[int]]] = []
    for task in tasks:
        cfg = load_task_config(task)
        records, _ = load_records(cfg)
        if len(records) < n_per_task:
            raise ValueError(f"task {task!r} has only {len(records)} usable records; ask for fewer prompts")
        for rec in records[:n_per_task]:
            rendered = render_prompt(tokenizer, rec["text"], cfg["template"], cfg.get("system"), max_prompt_tokens,
                                     "truncate")
            out.append((task, rendered[1]))
    return out


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
