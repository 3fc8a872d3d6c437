"""Cost of one base-model forward vs the number of new tokens it verifies, per context and dtype.

    python -m pipeline.benchmarks.cost_curve [--sizes 1 2 4 8 16 32 64] [--contexts 128 512 1024] ...

A tree of n nodes is verified in one forward with n new tokens, so this curve is what makes wide
trees cheap or dear on a machine: where n = 32 costs about what n = 1 costs, a big tree is nearly
free. For every (dtype, context, n): warm-up calls, then `repeats` timed calls, each followed by
truncating the cache back to the context; the median is reported. Calls of all sizes and dtypes are
interleaved so that the load of a shared machine spreads over all of them alike.

Writes artifacts/reports/benchmarks/cost_curve.csv, cost_curve.png and cost_curve.json (machine,
settings, headline ratios).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import atomic_write_json, machine_info, save_figure
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, write_csv
from pipeline.timing.curves import measure_cost_curves
from runtime.model.checkpoint import load_model

def _lookup(rows: list[dict[str, Any]], stat: str = "median_ms") -> dict[tuple[str, int, int], float]:
    return {(r["dtype"], r["context"], r["new_tokens"]): r[stat] for r in rows}


def summarise(rows: list[dict[str, Any]], stat: str = "median_ms") -> dict[str, Any]:
    """Headline ratios: cost(n)/cost(1) per dtype and context; which dtype decodes (n = 1) faster.
    `stat` is "median_ms" or "min_ms" (the latter is less sensitive to other processes' load)."""
    t = _lookup(rows, stat)
    dtypes = sorted({r["dtype"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    sizes = sorted({r["new_tokens"] for r in rows})
    out: dict[str, Any] = {"cost_vs_one_token": {}, "faster_at_one_token": {}}
    for d in dtypes:
        for c in contexts:
            if (d, c, 1) in t:
                out["cost_vs_one_token"][f"{d}@{c}"] = {n: round(t[d, c, n] / t[d, c, 1], 3) for n in sizes}
    if len(dtypes) > 1 and 1 in sizes:
        for c in contexts:
            best = min(dtypes, key=lambda d: t.get((d, c, 1), float("inf")))
            out["faster_at_one_token"][c] = best
    if ("bfloat16", 512, 1) in t and ("bfloat16", 512, 32) in t:
        ratio = t["bfloat16", 512, 32] / t["bfloat16", 512, 1]
        out["bf16_32_over_1_at_512"] = round(ratio, 3)
        out["bf16_target_met"] = ratio <= 1.5  # the target: <= 1.5
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    t = _lookup(rows)
    dtypes = sorted({r["dtype"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    sizes = sorted({r["new_tokens"] for r in rows})
    head = f"{'context':>8}{'n':>5}" + "".join(f"{d + ' ms':>15}{'x n=1':>8}" for d in dtypes)
    if len(dtypes) == 2:
        head += f"{dtypes[0] + '/' + dtypes[1]:>20}"
    print(head)
    for c in contexts:
        for n in sizes:
            line = f"{c:>8}{n:>5}"
            for d in dtypes:
                v, one = t.get((d, c, n)), t.get((d, c, 1))
                line += f"{v:>15.1f}{(v / one if one else float('nan')):>8.2f}" if v is not None else " " * 23
            if len(dtypes) == 2 and (dtypes[0], c, n) in t and (dtypes[1], c, n) in t:
                line += f"{t[dtypes[0], c, n] / t[dtypes[1], c, n]:>20.2f}"
            print(line)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for d in sorted({r["dtype"] for r in rows}):
        for c in sorted({r["context"] for r in rows}):
            pts = sorted((r["new_tokens"], r["median_ms"]) for r in rows if r["dtype"] == d and r["context"] == c)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if d == "float32" else "--",
                    label=f"{d}, context {c}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new tokens per forward (tree nodes verified)")
    ax.set_ylabel("median latency of one forward (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="forward latency vs new tokens, per context and dtype")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=REPORT_DIR)
    a = p.parse_args(argv)

    max_seq = max(a.contexts) + max(a.sizes)
    models = {d: load_model(a.model, dtype=getattr(torch, d), max_seq_len=max_seq, device=a.device) for d in a.dtypes}
    torch.set_num_threads(a.threads)  # after loading: load_model sets the thread count too
    info = machine_info()
    print(f"{info['cpu']} ({info['cores']} cores, AMX: {info['amx']}), {torch.get_num_threads()} threads; "
          f"sizes {a.sizes}, contexts {a.contexts}, {a.repeats} repeats")
    t0 = time.perf_counter()
    rows = measure_cost_curves(models, a.sizes, a.contexts, a.repeats)
    for r in rows:
        del r["model"]
    print(f"measured in {time.perf_counter() - t0:.0f} s\n")
    print_table(rows)
    summary = summarise(rows)
    summary_min = summarise(rows, "min_ms")
    print()
    for c, d in summary["faster_at_one_token"].items():
        print(f"faster for decoding (one token) at context {c}: {d} (by medians; by minima: "
              f"{summary_min['faster_at_one_token'][c]})")
    if "bf16_32_over_1_at_512" in summary:
        print(f"bf16 forward with 32 new tokens / with 1 at context 512: x{summary['bf16_32_over_1_at_512']:.2f} "
              f"by medians, x{summary_min['bf16_32_over_1_at_512']:.2f} by minima "
              f"(target <= 1.5: {'met' if summary['bf16_target_met'] else 'NOT met'})")

    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / "cost_curve.csv", rows)
    plot(rows, a.out / "cost_curve.png", f"{a.model.name} on {info['cpu']}, {torch.get_num_threads()} threads")
    report = {"machine": info, "settings": {k: str(v) for k, v in vars(a).items()}, "summary": summary,
              "summary_by_minima": summary_min}
    atomic_write_json(a.out / "cost_curve.json", report)
    print(f"\nwrote {a.out / 'cost_curve.csv'}, cost_curve.png, cost_curve.json "
          "(timings on a shared machine are noisy; compare the interleaved ratios)")
    return report


if __name__ == "__main__":
    main()
