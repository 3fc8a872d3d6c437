"""Latency of one base-model forward against the number of new rows it verifies and the context
it follows: the curve that makes wide trees cheap or dear on a machine. Calls of every size, model
and context are interleaved so that the load of a shared machine hits them alike."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from pipeline.timing.step_cost import fill_cache, time_forward
from runtime.device import clock
from runtime.model.llama import Transformer

WARMUP = 2


def _check(models: dict[str, Transformer], sizes: Sequence[int], contexts: Sequence[int], repeats: int) -> None:
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive token counts, got {list(sizes)}")
    if not contexts or min(contexts) < 0:
        raise ValueError(f"contexts must be non-negative lengths, got {list(contexts)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    need = max(contexts) + max(sizes)
    for name, m in models.items():
        if m.max_seq_len < need:
            raise ValueError(f"model {name!r} has a KV cache of {m.max_seq_len} positions; the largest context + "
                             f"size needs {need}: load it with max_seq_len >= {need}")


@torch.inference_mode()
def measure_cost_curves(models: dict[str, Transformer], sizes: Sequence[int], contexts: Sequence[int],
                        repeats: int) -> list[dict[str, Any]]:
    """Latency of one forward with n new tokens on top of a committed context of c positions, for
    every model (e.g. one per dtype), n in `sizes` and c in `contexts`, calls interleaved: rows
    {model, dtype, context, new_tokens, median_ms, min_ms, repeats}. Each model's cache must hold
    max(contexts) + max(sizes); it is left empty."""
    _check(models, sizes, contexts, repeats)
    times: dict[tuple[str, int, int], list[float]] = {}
    gen = torch.Generator().manual_seed(1)
    for ctx in sorted(contexts):
        for m in models.values():
            fill_cache(m, ctx, torch.Generator().manual_seed(ctx))
        for rep in range(WARMUP + repeats):
            for name, m in models.items():
                for n in sizes:
                    # causal over the new tokens (a tree mask costs the same), passed as a verify
                    # passes its mask, so that a row-invariant model times its verify path
                    dt = time_forward(m, ctx, n, gen, lambda: clock(m.device))
                    if rep >= WARMUP:
                        times.setdefault((name, ctx, n), []).append(dt)
    rows = []
    for (name, ctx, n), ts in times.items():
        m = models[name]
        rows.append({"model": name, "dtype": str(m.dtype).removeprefix("torch."), "context": ctx, "new_tokens": n,
                     "median_ms": round(1e3 * statistics.median(ts), 3), "min_ms": round(1e3 * min(ts), 3), "repeats": len(ts)})
    for m in models.values():
        m.reset_cache()
    return sorted(rows, key=lambda r: (r["model"], r["context"], r["new_tokens"]))
