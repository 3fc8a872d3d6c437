"""What does `lossless: exact` cost on the torch path (GPU, CPU bfloat16, the small-row kernel off)?

    python -m pipeline.benchmarks.exact_attention [--dtypes float32 bfloat16] [--contexts 256 1024 2048]
                                                  [--rows 1 8 64] [--rounds 5] [--no-7b] [--device cpu]

One decode step (a forward of `rows` new tokens, a chain, after `context` committed positions) with
the ordinary arithmetic (`lossless: numerical`: SDPA over the cache) and under
`set_row_invariance(8)` (the exact attention of `runtime.model.invariant`, EXACT_ATTENTION), timed
interleaved: each round times numerical then exact on the same model and cache, and the ratio is
taken per round; the median ratio and the median times are printed. Two models: the default model
(artifacts/models/smollm2-135m-instruct, if converted) and one Vicuna-7B-shaped layer (hidden 4096,
32 heads, intermediate 11008, random weights, a 256-token vocabulary so the lm_head does not
dominate). The target is exact <= 1.2x numerical. Wall-clock times (perf_counter; on CUDA after a
synchronize). Prints the figures and the machine; writes nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeline.artifacts import machine_info
from pipeline.benchmarks import DEFAULT_MODEL_DIR, median
from pipeline.timing.invariance import probe_model
from runtime.model import invariant
from runtime.model.llama import Transformer

INVARIANT_ROWS = 8


def vicuna_layer(dtype: torch.dtype, device: str, max_seq_len: int) -> Transformer:
    """One Vicuna-7B-shaped layer with random weights ~ N(0, 1/fan_in), its cache allocated."""
    return probe_model(32, 32, 128, max_seq_len, device, dtype, dim=4096, intermediate=11008)


def default_model(dtype: torch.dtype, device: str, max_seq_len: int) -> Transformer | None:
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        return None
    from runtime.model.checkpoint import load_model

    # fast_paths off: torch's products everywhere (the small-row kernel is not the path measured)
    return load_model(DEFAULT_MODEL_DIR, dtype=dtype, max_seq_len=max_seq_len, device=device, fast_paths=False)


def _timer(device: str) -> Callable[[], float]:
    def now() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


@torch.inference_mode()
def step_costs(model: Transformer, contexts: Sequence[int], rows: Sequence[int], rounds: int,
               device: str) -> list[dict[str, Any]]:
    """Per (context, rows): median ms of one step numerical and exact, and the median of the paired
    per-round ratios exact / numerical."""
    now, out = _timer(device), []
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    for context in contexts:
        ids = torch.randint(0, vocab, (1, context), generator=g).to(device)
        model.set_row_invariance(None)
        model.reset_cache()
        model(ids, torch.arange(context, device=device), last_only=True)
        for n in rows:
            tokens = torch.randint(0, vocab, (1, n), generator=g).to(device)
            pos = torch.arange(context, context + n, device=device)
            mask = None if n == 1 else torch.ones(n, n, dtype=torch.bool, device=device).tril()
            times: dict[str, list[float]] = {"numerical": [], "exact": []}
            for r in range(rounds + 1):  # round 0 warms up (probes, plans)
                for mode in ("numerical", "exact"):
                    model.set_row_invariance(INVARIANT_ROWS if mode == "exact" else None)
                    t0 = now()
                    model(tokens, pos, mask)
                    t1 = now()
                    model.truncate_cache(context)
                    if r:
                        times[mode].append(1e3 * (t1 - t0))
            ratios = [e / nu for e, nu in zip(times["exact"], times["numerical"])]
            out.append({"context": context, "rows": n, "numerical_ms": round(median(times["numerical"]), 2),
                        "exact_ms": round(median(times["exact"]), 2), "ratio": round(median(ratios), 3)})
    model.set_row_invariance(None)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2048])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-default", action="store_true", help="skip the default model")
    ap.add_argument("--no-7b", action="store_true", help="skip the Vicuna-7B-shaped layer")
    args = ap.parse_args(argv)
    print(f"machine: {machine_info()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, exact attention "
          f"{invariant.EXACT_ATTENTION!r} (KEY_BLOCK {invariant.KEY_BLOCK}, rows per product "
          f"{invariant.ATTENTION_ROWS.get(torch.device(args.device).type, INVARIANT_ROWS)}), invariant_rows {INVARIANT_ROWS}")
    longest = max(args.contexts) + max(args.rows) + 8
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        builders = []
        if not args.no_default:
            builders.append(("default", default_model))
        if not args.no_7b:
            builders.append(("vicuna7b-layer", vicuna_layer))
        for label, build in builders:
            model = build(dtype, args.device, longest)
            if model is None:
                print(f"{label}: not converted ({DEFAULT_MODEL_DIR}), skipped")
                continue
            assert not model.kernel_decode, "the torch path is measured: the small-row kernel must be off"
            for r in step_costs(model, args.contexts, args.rows, args.rounds, args.device):
                print(f"{label:15s} {dt:8s} context {r['context']:5d} rows {r['rows']:3d}: numerical "
                      f"{r['numerical_ms']:8.2f} ms  exact {r['exact_ms']:8.2f} ms  exact/numerical {r['ratio']:.3f}")
            del model


if __name__ == "__main__":
    main()
