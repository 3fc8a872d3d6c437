"""Time stage: step latency of each candidate tree on this machine, and the throughput hull.

Latency is measured by really decoding (draft + verify + accept), warmed up, with the trees
interleaved round by round so that drift of a shared machine hits all of them alike. End-to-end
throughput per tree combines that latency with the tree's tokens per step on the whole
calibration split (exact replay) and the measured prefill time.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from tqdm.auto import tqdm

from runtime.decoder import TreeDecoder, greedy_chain_top1
from runtime.device import clock
from runtime.generate import ar_generate
from runtime.sampling import Sampler


def time_trees(
    decoder: TreeDecoder, rows: list[dict], rounds: int = 2, new_tokens: int = 24, warmup_steps: int = 2,
    tokens_per_step: list[float] | None = None, cost_floor: float = 0.85, sampler: Sampler | None = None,
) -> dict[str, Any]:
    """Median step latency (s) per tree, median AR per-token latency and prefill time.

    Trees must come ordered by size. With `tokens_per_step` (each tree's replayed figure) the first
    round prunes: a tree is not timed when, even at `cost_floor` times the step latency of the
    largest tree timed before it, its tokens per step could not beat the best tokens per second
    measured so far. Verify and draft cost grow with the tree, so on a machine where wide trees
    are expensive this skips the slowest decodes of the stage; where they are cheap (a GPU) the
    bound never fires. Pruned trees get a NaN latency and are listed in "pruned"."""
    n = len(decoder.trees)
    if tokens_per_step is not None and len(tokens_per_step) != n:
        raise ValueError(f"tokens_per_step has {len(tokens_per_step)} entries for {n} trees")
    step_s: list[list[float]] = [[] for _ in range(n)]
    ar_s: list[float] = []
    prefill_s: list[float] = []
    prompt_tokens: list[int] = []
    pruned: dict[int, str] = {}
    # warm-up: one short decode per tree and one AR run (allocator, kernels, caches)
    decoder.generate(rows[0]["input_ids"], 8, choose=0, sampler=sampler)
    ar_generate(decoder.model, rows[0]["input_ids"], 4, sampler=sampler)
    bar = tqdm(total=rounds * len(rows) * (n + 1), desc="time", unit="run")
    for rnd in range(rounds):
        for i, row in enumerate(rows):
            t0 = clock(decoder.model.device)
            out = ar_generate(decoder.model, row["input_ids"], new_tokens // 2, sampler=sampler)
            ar_total = clock(decoder.model.device) - t0
            bar.update()
            best_rate, last_cost = 0.0, 0.0
            for k in range(n):
                if k in pruned:
                    bar.update()
                    continue
                if tokens_per_step is not None and rnd == 0 and i == 0 and last_cost > 0 \
                        and tokens_per_step[k] / (cost_floor * last_cost) < best_rate:
                    pruned[k] = (f"{tokens_per_step[k]:.3f} tokens/step at >= {1e3 * cost_floor * last_cost:.1f} ms/step "
                                 f"cannot beat {best_rate:.2f} tok/s")
                    bar.update()
                    continue
                res = decoder.generate(row["input_ids"], new_tokens, choose=k, sampler=sampler)
                times = [s.seconds for s in res.steps[warmup_steps:]] or [s.seconds for s in res.steps]
                step_s[k].extend(times)
                prefill_s.append(res.prefill_seconds)
                prompt_tokens.append(len(row["input_ids"]))
                if tokens_per_step is not None and times:
                    cost = statistics.median(times)
                    last_cost = max(last_cost, cost)
                    best_rate = max(best_rate, tokens_per_step[k] / cost)
                bar.update()
            # AR per-token latency: total minus this prompt's prefill, over the decoded tokens
            pre = statistics.median(prefill_s[-(n - len(pruned)):])
            if len(out) > 1:
                ar_s.append(max(ar_total - pre, 1e-9) / (len(out) - 1))
    bar.close()
    return {
        "step_s": [statistics.median(s) if s else float("nan") for s in step_s],
        "ar_token_s": statistics.median(ar_s) if ar_s else float("nan"),
        "prefill_s": statistics.median(prefill_s),
        "prompt_tokens": statistics.median(prompt_tokens),
        "pruned": pruned,
    }


@torch.inference_mode()
def time_head_chain(decoder: TreeDecoder, row: dict, repeats: int = 10) -> float:
    """Median seconds of one `greedy_chain_top1` call (the per-step extra of the signals that read
    the heads, `runtime.decoder.HEAD_SIGNALS`), from the context vector after the prompt of `row`."""
    model, heads = decoder.model, decoder.heads
    model.reset_cache()
    heads.reset()
    ids = torch.tensor([row["input_ids"]], dtype=torch.long, device=model.device)
    pos = torch.arange(ids.shape[1], device=model.device)
    logits, hidden = model(ids, pos, last_only=True)
    h = heads.observe(hidden, pos)
    root = int(logits[0, -1].argmax())
    greedy_chain_top1(heads, h, root)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock(model.device)
        greedy_chain_top1(heads, h, root)
        times.append(clock(model.device) - t0)
    model.reset_cache()
    heads.reset()
    return statistics.median(times)


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
