"""The lossless modes side by side: identity with AR and speed, per dtype, with one bank's trees.

    python -m pipeline.benchmarks.lossless_modes --bank artifacts/banks/<model>/hydra-draft8192/humaneval \
        [--variants bfloat16:exact bfloat16:numerical float32:numerical float32:exact] [--prompts 5]

Each variant is the base model in a dtype and a lossless mode (exact: row-invariant forwards,
`Transformer.set_row_invariance`; numerical: the ordinary arithmetic), with the bank's Hydra heads.
For every eval prompt, every variant decodes with AR (in its own arithmetic: the reference of its
identity check), the bank's best static tree (EntMTP*), its hysteresis policy (EntMTPτ) and its
largest tree, interleaved per prompt so that the load of a shared machine hits all alike. Reports
per variant and method: outputs identical to that variant's AR, tokens per step, CPU-time tok/s
(process_time: run it with --threads 1) and the ratio to the variant's AR and to float32 numerical
AR; and every divergence with AR's top-2 logit gap and the dtype's rounding bound
(`pipeline.evaluate.list_divergences`).

Writes artifacts/reports/benchmarks/lossless_modes.json and .md.

The correctness verdict (`verdict`: under exact, every method's output identical to AR's in every
dtype; under numerical, every divergence within the rounding bound) is asserted on the default
model with its shipped heads by the slow test
`tests/pipeline/benchmarks/test_lossless_modes.py::test_exact_mode_outputs_are_ars` (per dtype; which runs
`load_variants`, `decode_interleaved` and `summarize` below); this script adds the speed part.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, atomic_write_json, machine_info
from pipeline.benchmarks import REPORT_DIR
from pipeline.evaluate.run import list_divergences
from pipeline.paths import REPO_ROOT
from pipeline.prepare import read_split
from runtime.bank import TopologyBank
from runtime.decoder import TreeDecoder
from runtime.ar import ar_generate
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model
from runtime.policy import Scheduler, policy_from_dict

log = logging.getLogger(__name__)


def load_variants(bank_dir: Path, variants: list[str], rows: int, threads: int) -> dict[str, dict[str, Any]]:
    """{"<dtype>:<mode>": {"model", "methods": {name: run(ids, n) -> (tokens, steps)}, "recs"}} for
    the bank's model and heads: AR, the best static tree (EntMTP*), the largest tree and, when the
    bank has one, its hysteresis policy (EntMTPτ)."""
    bank = TopologyBank.load(bank_dir, force=True)
    prov = bank.provenance
    model_dir, heads_dir = bank_dir / prov["model_dir"], bank_dir / prov["heads_dir"]
    largest = max(range(len(bank.trees)), key=lambda k: bank.trees[k].num_nodes)
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        dtype, mode = v.split(":")
        if mode not in ("exact", "numerical"):
            raise ValueError(f"variant {v!r}: the mode must be exact or numerical")
        model = load_model(model_dir, dtype=getattr(torch, dtype), max_seq_len=2048)
        torch.set_num_threads(threads)
        model.set_row_invariance(rows if mode == "exact" else None)
        heads = load_heads(heads_dir, model=model)
        dec = TreeDecoder(model, heads, bank.buffers)
        methods: dict[str, Any] = {
            "AR": lambda ids, n, model=model: (ar_generate(model, ids, n), n),
            "EntMTP*": lambda ids, n, dec=dec: _spec(dec, ids, n, bank.best_static),
            f"largest tree ({bank.trees[largest].num_nodes} nodes)": lambda ids, n, dec=dec: _spec(dec, ids, n, largest),
        }
        if "hysteresis" in bank.policies:
            pol = bank.policies["hysteresis"]
            methods["EntMTPτ"] = lambda ids, n, dec=dec, pol=pol: _spec(
                dec, ids, n, Scheduler(policy_from_dict(pol), len(bank.trees)))
        out[v] = {"model": model, "methods": methods, "recs": {m: [] for m in methods}}
    return out


def decode_interleaved(variants: dict[str, dict[str, Any]], prompts: list[dict[str, Any]], new_tokens: int,
                       progress: bool = True) -> None:
    """Every variant's every method on every prompt, interleaved per prompt (so that the load of a
    shared machine hits all alike); appends {"id", "tokens", "cpu_s", "steps"} to its `recs`."""
    for v in variants.values():  # warm-up
        for run in v["methods"].values():
            run(prompts[0]["input_ids"], 4)
    for row in tqdm(prompts, desc="lossless modes", unit="prompt", disable=not progress):
        for v in variants.values():
            for name, run in v["methods"].items():
                t0 = time.process_time()
                tokens, steps = run(row["input_ids"], new_tokens)
                v["recs"][name].append({"id": row["id"], "tokens": tokens, "cpu_s": time.process_time() - t0,
                                        "steps": steps})


def summarize(variants: dict[str, dict[str, Any]], prompts: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """({variant: {"table": {method: figures}, "divergences": [...]}}, markdown table lines)."""
    out: dict[str, Any] = {}
    base = variants.get("float32:numerical")
    base_speed = _speed(base["recs"]["AR"]) if base else None
    lines = ["| variant | method | identical to its AR | tokens/step | CPU tok/s | vs its AR | vs fp32 numerical AR |",
             "|---|---|---|---|---|---|---|"]
    for key, v in variants.items():
        recs, model = v["recs"], v["model"]
        ar_speed = _speed(recs["AR"])
        table = {}
        for name, rs in recs.items():
            same = sum(r["tokens"] == x["tokens"] for r, x in zip(rs, recs["AR"]))
            emitted = sum(len(r["tokens"]) - 1 for r in rs)
            table[name] = {"identical": f"{same}/{len(rs)}", "tokens_per_step": emitted / max(sum(r["steps"] for r in rs), 1),
                           "cpu_tok_per_s": _speed(rs), "vs_ar": _speed(rs) / ar_speed,
                           "vs_fp32_numerical_ar": _speed(rs) / base_speed if base_speed else None}
            t = table[name]
            lines.append(f"| {key} | {name} | {t['identical']} | {t['tokens_per_step']:.2f} | {t['cpu_tok_per_s']:.2f} | "
                         f"{t['vs_ar']:.2f}x | {t['vs_fp32_numerical_ar']:.2f}x |" if base_speed else "")
        out[key] = {"table": table, "divergences": list_divergences(model, prompts, recs, key.split(":")[0])}
    return out, lines


def verdict(summary: dict[str, Any]) -> list[str]:
    """What breaks losslessness (empty: none): under exact, a method whose output is not AR's; under
    numerical, a divergence from AR beyond the dtype's rounding bound."""
    problems = []
    for key, v in summary.items():
        if key.endswith(":exact"):
            for name, t in v["table"].items():
                n = t["identical"].split("/")[1]
                if t["identical"] != f"{n}/{n}":
                    problems.append(f"{key} {name}: {t['identical']} outputs identical to AR")
        problems += [f"{key} divergence beyond the rounding bound: {d}" for d in v["divergences"] if not d["within_bound"]]
    return problems


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bank", type=Path, required=True)
    p.add_argument("--task", default="humaneval")
    p.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    p.add_argument("--variants", nargs="+",
                   default=["bfloat16:exact", "bfloat16:numerical", "float32:numerical", "float32:exact"])
    p.add_argument("--rows", type=int, default=8, help="padded row count of the exact variants")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)

    prompts = read_split(a.data, a.task, "eval", limit=a.prompts)
    variants = load_variants(a.bank, a.variants, a.rows, a.threads)
    decode_interleaved(variants, prompts, a.new_tokens)
    summary, lines = summarize(variants, prompts)
    report: dict[str, Any] = {"machine": machine_info(), "bank": str(a.bank), "threads": a.threads, "rows": a.rows,
                              "prompts": len(prompts), "new_tokens": a.new_tokens, "variants": summary,
                              "verdict": verdict(summary)}
    for key, v in summary.items():
        for d in v["divergences"]:
            log.info("%s divergence: %s", key, d)
    md = "\n".join(lines) + "\n"
    log.info("\n%s", md)
    log.info("verdict: %s", "lossless" if not report["verdict"] else "; ".join(report["verdict"]))
    atomic_write_json(REPORT_DIR / "lossless_modes.json", report)
    atomic_write_bytes(REPORT_DIR / "lossless_modes.md", md.encode())


def _spec(dec: TreeDecoder, ids: list[int], n: int, choose: Any) -> tuple[list[int], int]:
    r = dec.generate(ids, n, choose=choose)
    return r.tokens, len(r.steps)


def _speed(rs: list[dict[str, Any]]) -> float:
    return sum(len(r["tokens"]) for r in rs) / sum(r["cpu_s"] for r in rs)


if __name__ == "__main__":
    main()
