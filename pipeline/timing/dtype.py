"""`dtype: auto`: the decode dtype of this machine, measured.

Some CPUs have native bf16 matrix units (AMX), others emulate bf16 and are slower in it, and the
exact lossless mode's row-invariant arithmetic costs differently again: so the choice is measured,
never assumed, in the arithmetic the decode will use."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CANDIDATES = ("float32", "bfloat16")


def pick_decode_dtype(model_dir: str | Path, sizes: tuple[int, ...] = (1, 8, 16), context: int = 256,
                      invariant_rows: int | None = None) -> dict[str, Any]:
    """Time float32 and bfloat16 forwards side by side (interleaved) at the row counts a decode
    step uses and return the dtype with the lower summed latency, with the figures. With
    `invariant_rows`, both models run row-invariant (`lossless: exact`)."""
    import torch

    from pipeline.timing.curves import measure_cost_curves
    from runtime.model.checkpoint import load_model

    models = {d: load_model(model_dir, dtype=getattr(torch, d), max_seq_len=context + max(sizes) + 1) for d in CANDIDATES}
    for m in models.values():
        m.set_row_invariance(invariant_rows)
    rows = measure_cost_curves(models, list(sizes), [context], repeats=3)
    cost = {d: sum(r["median_ms"] for r in rows if r["model"] == d) for d in models}
    best = min(cost, key=cost.get)
    log.info("[dtype] step cost over new tokens %s at context %d%s: %s -> %s", list(sizes), context,
             f" (row-invariant, {invariant_rows} rows)" if invariant_rows else "",
             ", ".join(f"{d} {c:.1f} ms" for d, c in cost.items()), best)
    return {"dtype": best, "cost_ms": cost, "rows": rows, "invariant_rows": invariant_rows}
