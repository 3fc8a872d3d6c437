"""What the small-row CPU kernels (runtime.model.small_rows) buy: whole base-model forwards, kernels
against torch's products, side by side.

    python -m pipeline.benchmarks.small_rows_speed [--rows 1 2 3 5 9 17 33] [--context 300] [--repeats 9] [--bf16]
    python -m pipeline.benchmarks.small_rows_speed --attention [--contexts 150 400 700] [--rows 1 3 5 9]

Two copies of the default model in float32: one with the kernels (`add_fast_paths()`), one with
torch's products (`add_fast_paths(kernel=False)`, the MKL paths `runtime.model.Linear` describes,
and SDPA attention). Where the CPU has AVX-512 the kernels are also timed restricted to AVX2
(`kernels_avx2`, bit-identical results); `--bf16` adds torch's bfloat16 model (the other
candidate of `dtype: auto`). For each row count N, a forward of N new tokens (a chain: each attends to the
ones before it) after a `--context`-token cache, wall clock, median of `--repeats` rounds that
interleave both models. Prints ms and each forward's cost in one-token forwards of the same model.
Writes artifacts/reports/benchmarks/small_rows_speed.{csv,json}.

`--attention` times the attention kernel alone, the part of a forward that grows with the context:
every layer's `runtime.model.small_rows.attention` call on the model's head shapes, N rows of a chain after
each of `--contexts` cached positions (random queries and caches), median of `--repeats` x 20 calls.
Prints ms per forward (all layers) and each N's cost in one-row calls.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.artifacts import atomic_write_json, machine_info
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, median, write_csv
from runtime.model import small_rows
from runtime.model.llama import Transformer
from runtime.model.checkpoint import load_model


def forward_ms(model: Transformer, context: torch.Tensor, rows: int, gen: torch.Generator) -> float:
    """One forward of `rows` new tokens after the cached `context`, in ms (the cache is truncated back)."""
    ctx = context.shape[1]
    ids = torch.randint(0, model.args.vocab_size, (1, rows), generator=gen)
    mask = torch.ones(rows, rows, dtype=torch.bool).tril() if rows > 1 else None
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids, torch.arange(ctx, ctx + rows), mask)
        t = time.perf_counter() - t0
    model.truncate_cache(ctx)
    return 1e3 * t


def attention_ms(n_layers: int, heads: int, kv_heads: int, head_dim: int, rows: int, context: int,
                 gen: torch.Generator, calls: int = 20) -> float:
    """Median ms of `n_layers` attention calls for `rows` new chain rows after `context` cached slots."""
    k, v = (torch.randn(kv_heads, context + rows, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(rows, heads, head_dim, generator=gen)
    offsets = torch.tensor([0] + [r + 1 for r in range(rows)]).cumsum(0)
    slots = torch.tensor([context + j for r in range(rows) for j in range(r + 1)])
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        small_rows.attention(q, k, v, context, offsets, slots, rows, head_dim ** -0.5)
        samples.append(time.perf_counter() - t0)
    return 1e3 * n_layers * median(samples)


def main_attention(model_dir: str, rows: list[int], contexts: list[int], repeats: int) -> None:
    args = load_model(model_dir, max_seq_len=8).args
    gen = torch.Generator().manual_seed(0)
    shape = (args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim)
    times: dict[tuple[int, int], list[float]] = {(c, n): [] for c in contexts for n in rows}
    for _ in range(repeats):  # rounds interleave every cell, so the machine's phases hit them alike
        for c in contexts:
            for n in rows:
                times[(c, n)].append(attention_ms(*shape, n, c, gen))
    out = []
    for c in contexts:
        one = median(times[(c, rows[0])])
        for n in rows:
            ms = median(times[(c, n)])
            out.append({"context": c, "rows": n, "attention_ms": round(ms, 3), f"x_{rows[0]}_rows": round(ms / one, 3)})
        print(f"context {c:5d}: " + "   ".join(f"{r['rows']} rows {r['attention_ms']:.2f} ms ({r[f'x_{rows[0]}_rows']:.2f}x)"
                                          for r in out if r["context"] == c))
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    write_csv(REPORT_DIR / "small_rows_attention.csv", out)
    atomic_write_json(REPORT_DIR / "small_rows_attention.json", {
        "machine": machine_info(), "threads": torch.get_num_threads(), "layers": args.n_layers,
        "heads": args.n_heads, "kv_heads": args.n_kv_heads, "head_dim": args.head_dim, "results": out})
    print(f"wrote {REPORT_DIR / 'small_rows_attention.csv'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17, 33])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bf16", action="store_true", help="also time torch's bfloat16 model")
    ap.add_argument("--attention", action="store_true", help="time the attention kernel alone (see above)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[150, 400, 700], help="cached positions (--attention)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not small_rows.available():
        raise SystemExit(f"the small-row kernels are unavailable here: {small_rows.unavailable_reason()}")
    if a.attention:
        return main_attention(a.model, a.rows, a.contexts, a.repeats)
    seq = a.context + max(a.rows) + 1
    models = {"kernels": load_model(a.model, max_seq_len=seq)}
    # the same kernels restricted to AVX2 (bit-identical results) where the CPU has AVX-512
    isas = {"kernels": small_rows.isa()}
    if isas["kernels"] == "avx512":
        models["kernels_avx2"], isas["kernels_avx2"] = models["kernels"], "avx2"
    models["torch"] = load_model(a.model, max_seq_len=seq, fast_paths=False)
    models["torch"].add_fast_paths(kernel=False)
    assert models["kernels"].kernel_decode and not models["torch"].kernel_decode
    if a.bf16:  # what `dtype: auto` weighs the kernels against (torch's bf16 products, ordinary arithmetic)
        models["torch_bf16"] = load_model(a.model, dtype=torch.bfloat16, max_seq_len=seq)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, models["kernels"].args.vocab_size, (1, a.context), generator=gen)
    for m in set(models.values()):
        with torch.inference_mode():
            m(context, torch.arange(a.context))
        for n in a.rows:  # warm-up (and the row-count probes of the first calls)
            forward_ms(m, context, n, gen)
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in models for n in a.rows}
    for _ in range(a.repeats):
        for n in a.rows:
            for k, m in models.items():
                if k in isas:
                    small_rows.set_isa(isas[k])
                times[(k, n)].append(forward_ms(m, context, n, gen))
    small_rows.set_isa("auto")
    one = {k: median(times[(k, 1)]) for k in models}
    rows = []
    for n in a.rows:
        row = {"rows": n, "context": a.context}
        for k in models:
            ms = median(times[(k, n)])
            row[f"{k}_ms"], row[f"{k}_x_one_row"] = round(ms, 2), round(ms / one[k], 3)
        row["torch_over_kernels"] = round(row["torch_ms"] / row["kernels_ms"], 3)
        rows.append(row)
        print(f"{n:3d} rows: " + "   ".join(f"{k} {row[f'{k}_ms']:6.1f} ms ({row[f'{k}_x_one_row']:.2f}x)" for k in models)
              + f"   torch/kernels {row['torch_over_kernels']:.2f}")
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    write_csv(REPORT_DIR / "small_rows_speed.csv", rows)
    atomic_write_json(REPORT_DIR / "small_rows_speed.json", {"machine": machine_info(), "threads": torch.get_num_threads(),
                                                              "isa": isas["kernels"],
                                                              "repeats": a.repeats, "results": rows})
    print(f"wrote {REPORT_DIR / 'small_rows_speed.csv'}")


if __name__ == "__main__":
    main()
