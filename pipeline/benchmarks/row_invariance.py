"""Does a position's logits row depend on how many tokens the forward holds, and where they sit?

    python -m pipeline.benchmarks.row_invariance [--dtypes bfloat16 float32] [--sizes 2 5 9 17] [--rows 8]

For a real prompt, AR decoding feeds the greedy continuation t_0, t_1, ... one token per forward;
a tree verify feeds the same tokens as one chain of N nodes (root t_0, node d at depth d), and a
*branchy* verify interleaves a distractor sibling after every chain node, so that node d sits in
slot 2d with masked slots between its ancestors. Each chain node's logits row is compared with
AR's row for the same position: max |difference| and whether the rows are bit-identical, per
depth, with the ordinary arithmetic and under `Transformer.set_row_invariance(rows)`.

Then the cost: CPU time (process_time, medians of interleaved repeats) of a one-token forward and of
n-token forwards at the prompt's context, with and without invariance, per dtype.

Writes artifacts/reports/benchmarks/row_invariance.json (machine, settings, results).

The correctness verdict (every chain node's row bit-identical to AR's under invariance, per dtype)
is asserted on the default model by the slow test
`tests/runtime/model/test_llama_row_invariance.py::test_smollm2_rows_are_bit_identical_under_invariance`
(which runs `pipeline.timing.invariance.compare`); this script reports the differences of both
arithmetics and the cost of invariance.

    python -m pipeline.benchmarks.row_invariance --probe [--device cuda] [--dtypes float16 bfloat16]

runs `invariance_probe` instead: random-weight models with the attention shapes of Vicuna-7B and
Llama-3-8B at ~200 / 700 / 1500 positions, every row of two verified trees against AR's row for the
same token (attention and the whole forward), and writes row_invariance_probe.json. The checks
themselves live in pipeline/timing/invariance.py, which the GPU check calls too.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import atomic_write_json, machine_info
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, median
from pipeline.timing.invariance import PROMPT, compare, invariance_probe
from runtime.model.checkpoint import load_model, load_tokenizer
from runtime.model.llama import Transformer

log = logging.getLogger(__name__)


def cost(models: dict[str, Transformer], ids: list[int], sizes: Sequence[int], repeats: int) -> dict[str, float]:
    """Median CPU ms of an n-token forward after the prompt, per (model label, n); interleaved."""
    for m in models.values():
        m.reset_cache()
        m(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)
    start = len(ids)
    times: dict[str, list[float]] = {f"{k} n={n}": [] for k in models for n in sizes}
    for r in range(repeats + 1):
        for label, m in models.items():
            for n in sizes:
                mask = torch.ones(n, n, dtype=torch.bool).tril()
                t0 = time.process_time()
                m(torch.zeros(1, n, dtype=torch.long), start + torch.arange(n), mask, check_mask=False)
                dt = time.process_time() - t0
                m.truncate_cache(start)
                if r:  # the first round warms up
                    times[f"{label} n={n}"].append(dt * 1e3)
    return {k: round(median(v), 2) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--sizes", nargs="+", type=int, default=[2, 5, 9, 17])
    p.add_argument("--rows", type=int, default=8, help="padded row count under invariance")
    p.add_argument("--cost-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--probe", action="store_true", help="run invariance_probe (random models) instead")
    p.add_argument("--device", default="cpu", help="the probe's device")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    if a.probe:
        probes = [invariance_probe(a.device, getattr(torch, name), rows=a.rows) for name in a.dtypes]
        for pr in probes:
            for r in pr["results"]:
                log.info("%s %s %-10s context %4d %-9s identical rows %2d/%d, max|diff| %s", pr["device"], pr["dtype"],
                         r["shape"], r["context"], r["tree"], r["identical_rows"], r["nodes"], r["max_abs_diff"])
            log.info("%s %s: %s", pr["device"], pr["dtype"], "row-invariant" if pr["ok"] else "NOT row-invariant")
        out = REPORT_DIR / "row_invariance_probe.json"
        atomic_write_json(out, {"machine": machine_info(), "probes": probes})
        log.info("wrote %s", out)
        return

    tok = load_tokenizer(a.model)
    ids = tok.encode(PROMPT * 3, add_special_tokens=False).ids
    report: dict[str, Any] = {"machine": machine_info(), "prompt_tokens": len(ids), "rows": a.rows,
                              "threads": a.threads, "compare": {}, "cost_ms": {}}
    models: dict[str, Transformer] = {}
    for name in a.dtypes:
        model = load_model(a.model, dtype=getattr(torch, name), max_seq_len=len(ids) + 64)
        torch.set_num_threads(a.threads)
        with torch.inference_mode():
            for inv in (None, a.rows):
                model.set_row_invariance(inv)
                key = f"{name} {'invariant P=' + str(inv) if inv else 'plain'}"
                report["compare"][key] = res = compare(model, ids, a.sizes)
                for r in res:
                    log.info("%-26s %-8s N=%-3d identical depths %d/%d, max|diff| by depth %s", key, r["layout"],
                             r["nodes"], r["identical_depths"], r["depths"], r["max_abs_diff_by_depth"])
        models[name] = model
    if not a.skip_cost:
        import copy

        timed: dict[str, Transformer] = {}
        for name, model in models.items():
            model.set_row_invariance(None)
            timed[f"{name} plain"] = model
            inv = copy.deepcopy(model)
            inv.set_row_invariance(a.rows)
            timed[f"{name} P={a.rows}"] = inv
        with torch.inference_mode():
            report["cost_ms"] = cost(timed, ids, a.cost_sizes, a.repeats)
        for k, v in report["cost_ms"].items():
            log.info("cost %-28s %8.2f ms", k, v)
    out = REPORT_DIR / "row_invariance.json"
    atomic_write_json(out, report)
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
