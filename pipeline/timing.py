"""Time stage: step latency of each candidate tree on this machine, and the throughput hull.

Latency is measured by really decoding (draft + verify + accept), warmed up, with the trees
interleaved round by round so that drift of a shared machine hits all of them alike. End-to-end
throughput per tree combines that latency with the tree's tokens per step on the whole
calibration split (exact replay) and the measured prefill time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tqdm.auto import tqdm

from runtime.decoder import TreeDecoder
from runtime.generate import ar_generate


def time_trees(
    decoder: TreeDecoder, rows: list[dict], rounds: int = 2, new_tokens: int = 48, warmup_steps: int = 2,
) -> dict[str, Any]:
    """Median step latency (s) per tree, median AR per-token latency and prefill time."""
    n = len(decoder.trees)
    step_s: list[list[float]] = [[] for _ in range(n)]
    ar_s: list[float] = []
    prefill_s: list[float] = []
    prompt_tokens: list[int] = []
    # warm-up: one short decode per tree and one AR run (allocator, kernels, caches)
    decoder.generate(rows[0]["input_ids"], 8, choose=0)
    ar_generate(decoder.model, rows[0]["input_ids"], 4)
    bar = tqdm(total=rounds * len(rows) * (n + 1), desc="time", unit="run")
    for _ in range(rounds):
        for row in rows:
            t0 = time.perf_counter()
            out = ar_generate(decoder.model, row["input_ids"], new_tokens // 2)
            ar_total = time.perf_counter() - t0
            bar.update()
            for k in range(n):
                res = decoder.generate(row["input_ids"], new_tokens, choose=k)
                step_s[k].extend(s.seconds for s in res.steps[warmup_steps:])
                prefill_s.append(res.prefill_seconds)
                prompt_tokens.append(len(row["input_ids"]))
                bar.update()
            # AR per-token latency: total minus this prompt's prefill, over the decoded tokens
            pre = statistics.median(prefill_s[-n:])
            if len(out) > 1:
                ar_s.append(max(ar_total - pre, 1e-9) / (len(out) - 1))
    bar.close()
    return {
        "step_s": [statistics.median(s) if s else float("nan") for s in step_s],
        "ar_token_s": statistics.median(ar_s) if ar_s else float("nan"),
        "prefill_s": statistics.median(prefill_s),
        "prompt_tokens": statistics.median(prompt_tokens),
    }


def e2e_tokens_per_second(tokens_per_step: float, step_s: float, prefill_s: float, new_tokens: int) -> float:
    """Output tok/s of a `new_tokens` generation: the prefill yields the first token, then steps."""
    return new_tokens / (prefill_s + (new_tokens - 1) / tokens_per_step * step_s)


def throughput_hull(nodes: list[int], tok_per_s: list[float]) -> list[int]:
    """Indices kept by the paper's rule: a tree stays only if faster than every smaller tree."""
    order = sorted(range(len(nodes)), key=lambda k: (nodes[k], -tok_per_s[k]))
    keep, best = [], float("-inf")
    for k in order:
        if tok_per_s[k] > best:
            keep.append(k)
            best = tok_per_s[k]
    return keep
