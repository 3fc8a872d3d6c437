"""Measuring a machine for the time stage: the step-cost model of this machine (with its batch axis), every
candidate tree's modeled step and end-to-end tok/s, the checks against timed decodes, written to
`timing.json` and `step_cost.json`."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json, machine_info
from pipeline.timing.batch import BATCH_CHECK_PASSES, measure_batch_axis
from pipeline.timing.checks import e2e_tokens_per_second, measure_and_check, prune_again, time_head_chain
from pipeline.timing.step_cost import cost_contexts, tree_entries
from runtime.decoder import HEAD_SIGNALS, TreeDecoder
from runtime.device import clock
from runtime.sampling import Sampler
from runtime.tree import Tree

log = logging.getLogger(__name__)


def build_timing(out: Path, dec: TreeDecoder, cands: list[dict], per_tree_tps: list[float], rows: list[dict],
                 task_prompt_tokens: float, tc: dict[str, Any], n_new: int, sampler: Sampler, dtype: str, *,
                 chains: list[tuple[Tree, float]], acceptance: dict, tokens_per_step_from: str,
                 max_depth: int | None = None) -> dict[str, Any]:
    """Measure, check and write the time stage's output into `out` (`tc`: the `time` settings);
    returns the manifest summary. `max_depth`: the deepest tree the step-cost model prices (default:
    the drafter's own max depth)."""
    from tqdm.auto import tqdm

    prompt_len = statistics.median(len(r["input_ids"]) for r in rows)
    contexts, ref_ctx, check_ctx = cost_contexts(prompt_len, task_prompt_tokens, n_new, int(tc["new_tokens"]))
    bar = tqdm(total=1, desc="step-cost model + timed decodes", unit="run")
    model, t = measure_and_check(dec, rows, [c["tree"] for c in cands], per_tree_tps, contexts, ref_ctx,
                                 repeats=int(tc["cost_repeats"]), rounds=int(tc["rounds"]),
                                 fixed_tokens=int(tc["cost_tokens"]), new_tokens=int(tc["new_tokens"]),
                                 prune_margin=float(tc["prune_margin"]) if tc["prune"] else None, sampler=sampler,
                                 clock_kind=str(tc["clock"]), dtype=dtype, machine=machine_info(), bar=bar,
                                 max_depth=max_depth)
    bar.close()
    timed = [k for k in range(len(cands)) if k not in t["pruned"]]
    larger = [b for b in set(tc["batch_sizes"]) if int(b) > 1]
    bar = tqdm(total=2 * BATCH_CHECK_PASSES * len(timed) * len(larger), desc="batch axis: timed batched decodes",
               unit="run")
    batch = measure_batch_axis(dec, model, [c["tree"] for c in cands], per_tree_tps, timed, list(tc["batch_sizes"]),
                               ref_ctx, rows[0]["input_ids"], repeats=int(tc["cost_repeats"]), new_tokens=n_new,
                               check_tokens=int(tc["new_tokens"]), prefill_s=t["prefill_s"], sampler=sampler,
                               now=lambda: clock(dec.model.device), chains=chains, progress=bar.update)
    bar.close()
    retimed = [r["passes"] for e in batch["per_batch"].values() for r in e["trees"] if r.get("passes", 0) > 2 * BATCH_CHECK_PASSES]
    if retimed:
        log.info("[time] batch axis: %d (tree, batch size) cells disagreed between their calibration and check passes "
                 "and were timed again (%s passes)", len(retimed), ", ".join(map(str, retimed)))
    model.save(out / "step_cost.json")
    modeled = [model.predict(c["tree"], ref_ctx) for c in cands]
    trees = tree_entries(cands, per_tree_tps, modeled, t, model, check_ctx,
                         lambda tps, step_s: e2e_tokens_per_second(tps, step_s, t["prefill_s"], n_new))
    if tc["prune"]:
        prune_again(trees, float(tc["prune_margin"]))
    # AR at the model's speed too (its ratio to the phase probes), so that "x AR" compares like with like
    ar_token_s = t["ar_token_over_phase"] * model.phase_ms / 1000
    if not ar_token_s > 0:
        ar_token_s = t["ar_token_s"]
    ar_tok_s = e2e_tokens_per_second(1.0, ar_token_s, t["prefill_s"], n_new)
    chain_ms = 1000 * time_head_chain(dec, rows[0])
    errors = [abs(e["model_error_pct"]) for e in trees if "model_error_pct" in e]
    atomic_write_json(out / "timing.json", {
        "trees": trees, "ar_token_ms": 1000 * ar_token_s, "ar_token_ms_raw": 1000 * t["ar_token_s"],
        "ar_tok_per_s": ar_tok_s, "phase_ms": model.phase_ms,
        "signal_ms": {name: chain_ms for name in HEAD_SIGNALS},
        "prefill_ms": 1000 * t["prefill_s"], "prompt_tokens": t["prompt_tokens"],
        "cost_model": {"file": "step_cost.json", "clock": str(tc["clock"]), "reference_context": ref_ctx,
                       "task_prompt_tokens": task_prompt_tokens,
                       "check_context": check_ctx, "check_rounds_after_probe_rounds": t["after_probe_rounds"],
                       "pruned_with_probe_rounds": t["pruned_with_probe_rounds"],
                       "max_abs_error_pct": max(errors) if errors else None},
        "machine": machine_info(), "dtype": dtype,
        "tokens_per_step_from": tokens_per_step_from, "acceptance": acceptance,
        "batch": batch})
    best = max((x for x in trees if "pruned" not in x), key=lambda x: x["tok_per_s"])
    return {"best_nodes": best["nodes"], "best_tok_per_s": best["tok_per_s"], "ar_tok_per_s": ar_tok_s,
            "pruned": len(t["pruned"]), "max_abs_model_error_pct": max(errors) if errors else None}

