"""The training prompt mix: every task's train pool plus HumanEval-style prompts cut from the Python
functions in a chat task's recorded replies, drawn round-robin over the sources, with a held-out
share for the accuracy report."""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path
from typing import Any

from pipeline.config.schema import TrainSettings

FUNCTIONS = "functions"  # the source name of the cut-out function prompts


def select_prompts(rows_by_task: dict[str, list[dict]], s: TrainSettings) -> tuple[list[dict], list[dict]]:
    """(train, holdout) rows: round-robin over the sources after a seeded shuffle, prompts that fit
    only; the holdout takes every source's share of `holdout_prompts`, spread over its picks."""
    rng = random.Random(s.seed)
    queues = []
    for task in sorted(rows_by_task):
        rows = [r for r in rows_by_task[task] if 0 < len(r["input_ids"]) <= s.max_prompt_tokens]
        rng.shuffle(rows)
        queues.append(rows)
    picked: list[list[dict]] = [[] for _ in queues]
    n = 0
    while n < s.max_prompts and any(queues):
        for q, out in zip(queues, picked):
            if q and n < s.max_prompts:
                out.append(q.pop())
                n += 1
    if n <= s.holdout_prompts:
        raise ValueError(f"only {n} training prompts of <= {s.max_prompt_tokens} tokens were found; "
                         f"need more than holdout_prompts={s.holdout_prompts} (prepare the tasks' train splits)")
    # largest-remainder shares, so the report sees every source in proportion
    quota = [s.holdout_prompts * len(out) / n for out in picked]
    share = [int(x) for x in quota]
    for i in sorted(range(len(quota)), key=lambda i: share[i] - quota[i])[:s.holdout_prompts - sum(share)]:
        share[i] += 1
    train, hold = [], []
    for out, k in zip(picked, share):
        held = {int(j * len(out) / k) for j in range(k)} if k else set()
        hold += [r for j, r in enumerate(out) if j in held]
        train += [r for j, r in enumerate(out) if j not in held]
    return train, hold


_CODE_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
_DEF_NAME = re.compile(r"\bdef\s+(\w+)\s*\(")


def function_texts(reply: str, max_chars: int = 2000) -> list[tuple[str, str]]:
    """(name, prompt text) of every top-level Python function in the fenced code blocks of `reply`:
    the block's imports, then the function's decorators, signature and docstring, as a HumanEval
    prompt reads. Blocks that do not parse as Python are skipped."""
    out = []
    for block in _CODE_FENCE.findall(reply):
        try:
            tree = ast.parse(block)
        except (SyntaxError, ValueError):
            continue
        lines = block.splitlines()
        imports = [ast.get_source_segment(block, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        head = "\n".join(i for i in imports if i) + "\n\n\n" if imports else ""
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            first = node.body[0]
            # keep the docstring (the task's specification); cut before the first real statement
            end = first.end_lineno if ast.get_docstring(node) is not None else first.lineno - 1
            if end < node.lineno or (ast.get_docstring(node) is not None and len(node.body) < 2):
                continue  # a one-line def, or nothing left to complete after the docstring
            text = head + "\n".join(lines[start - 1:end]) + "\n"
            if len(text) <= max_chars:
                out.append((node.name, text))
    return out


def function_prompts(rows: list[dict[str, Any]], tokenizer: Any, template: str, system: str | None,
                     max_prompt_tokens: int, held_prompts: list[str]) -> list[dict[str, Any]]:
    """Rendered HumanEval-style prompts cut from the functions in `rows`' recorded replies.

    `held_prompts` are the calib/eval prompts of every task: a function whose name any of them
    defines, or whose rendered prompt equals one, is left out, so the mix cannot train on an
    evaluated problem. Duplicate functions (equal up to whitespace and case) are kept once."""
    from pipeline.prepare import render_prompt

    names = {n for p in held_prompts for n in _DEF_NAME.findall(p)}
    held = set(held_prompts)
    out, seen = [], set()
    for row in sorted(rows, key=lambda r: r["id"]):
        for name, text in function_texts(row.get("reference") or ""):
            key = " ".join(text.split()).casefold()
            if name in names or key in seen:
                continue
            seen.add(key)
            rendered = render_prompt(tokenizer, text, template, system, max_prompt_tokens, "skip")
            if rendered is not None and rendered[0] not in held:
                out.append({"id": f"{FUNCTIONS}/{row['id']}/{name}", "prompt": rendered[0], "input_ids": rendered[1]})
    return out



def read_train_rows(data_dir: Path, model_dir: Path, s: TrainSettings) -> dict[str, list[dict[str, Any]]]:
    """The training sources: each task's train pool, plus the cut-out function prompts if asked for."""
    from pipeline.prepare import load_chat_tokenizer, load_task_config, read_split

    rows = {t: read_split(data_dir, t, "train") for t in s.tasks}
    if s.functions_from:
        style = load_task_config(s.functions_template)
        tasks = sorted(set(s.tasks) | {s.functions_from, s.functions_template})
        held = [r["prompt"] for t in tasks for split in ("calib", "eval") for r in read_split(data_dir, t, split)]
        rows[FUNCTIONS] = function_prompts(read_split(data_dir, s.functions_from, "train"), load_chat_tokenizer(model_dir),
                                           style["template"], style.get("system"), s.max_prompt_tokens, held)
    return rows
