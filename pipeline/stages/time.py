"""time: a measured step-cost model of this machine (`pipeline.timing.step_cost`), every candidate tree's
modeled step cost and the end-to-end tok/s it implies, checked against timed decodes of the trees
that can pay for their cost (`time.prune` skips the others).

Tokens/step come from the exact replay under exact acceptance; under typical acceptance, which
the replay does not model, from recalibrate's real decoding with it (so time then runs after
recalibrate), and the timed decodes use typical acceptance too."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, machine_info, machine_key, read_json, run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest, plain
from pipeline.loaders import sampler_from_cfg, tree_decoder
from pipeline.paths import Layout
from pipeline.stages import grow as grow_stage
from pipeline.stages import recalibrate as recalibrate_stage
from pipeline.stages.dtype import resolve_dtype
from pipeline.stages.inputs import runtime_key, runtime_spec
from pipeline.stages.prepare import rows_hash, split_rows

READS = ("time", "profile.timing_prompts", "profile.calib_prompts", "profile.max_new_tokens", "sampling", "acceptance", *grow_stage.CANDIDATES)


@once_per_config
def output(cfg: DictConfig) -> Path:
    rows = split_rows(cfg, "calib", int(cfg.profile.timing_prompts))
    # the task's prompt lengths set the context the bank's costs are taken at (`cost_contexts`)
    task_prompt_tokens = statistics.mean(len(r["input_ids"]) for r in split_rows(cfg, "calib", int(cfg.profile.calib_prompts)))
    key = {**runtime_key(cfg), **config_key(cfg, READS), "prompts": rows_hash(rows),
           "task_prompt_tokens": task_prompt_tokens,
           "grow": output_digest(grow_stage.output(cfg)),
           "machine": machine_key(str(cfg.device))}
    exact = cfg.acceptance.kind == "exact"
    if not exact:
        recal_dir = recalibrate_stage.output(cfg)
        key["recalibrate"] = output_digest(recal_dir)

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.timing.step_cost import cost_contexts, tree_entries
        from pipeline.timing.checks import e2e_tokens_per_second, measure_and_check, prune_again, time_head_chain
        from runtime.decoder import HEAD_SIGNALS
        from runtime.tree import Tree
        from tqdm.auto import tqdm

        cands = grow_stage.candidate_trees(cfg)
        tc = cfg.time
        if exact:
            per_tree_tps = [c["replay_tokens_per_step"] for c in cands]
        else:
            real = {Tree(r["paths"]): r["real_tokens_per_step"] for r in read_json(recal_dir / "recalibrate.json")["trees"]}
            per_tree_tps = [real[c["tree"]] for c in cands]
        n_new = int(cfg.profile.max_new_tokens)
        dec = tree_decoder(runtime_spec(cfg), [c["tree"] for c in cands], cfg.acceptance)
        sampler = sampler_from_cfg(cfg.sampling)
        prompt_len = statistics.median(len(r["input_ids"]) for r in rows)
        contexts, ref_ctx, check_ctx = cost_contexts(prompt_len, task_prompt_tokens, n_new, int(tc.new_tokens))
        bar = tqdm(total=1, desc="step-cost model + timed decodes", unit="run")
        model, t = measure_and_check(dec, rows, [c["tree"] for c in cands], per_tree_tps, contexts, ref_ctx,
                                     repeats=int(tc.cost_repeats), rounds=int(tc.rounds),
                                     fixed_tokens=int(tc.cost_tokens), new_tokens=int(tc.new_tokens),
                                     prune_margin=float(tc.prune_margin) if tc.prune else None, sampler=sampler,
                                     clock_kind=str(tc.clock), dtype=resolve_dtype(cfg), machine=machine_info(),
                                     bar=bar)
        bar.close()
        model.save(tmp / "step_cost.json")
        modeled = [model.predict(c["tree"], ref_ctx) for c in cands]
        trees = tree_entries(cands, per_tree_tps, modeled, t, model, check_ctx,
                             lambda tps, step_s: e2e_tokens_per_second(tps, step_s, t["prefill_s"], n_new))
        if tc.prune:
            prune_again(trees, float(tc.prune_margin))
        # AR at the model's speed too (its ratio to the phase probes), so that "x AR" compares like with like
        ar_token_s = t["ar_token_over_phase"] * model.phase_ms / 1000
        if not ar_token_s > 0:
            ar_token_s = t["ar_token_s"]
        ar_tok_s = e2e_tokens_per_second(1.0, ar_token_s, t["prefill_s"], n_new)
        chain_ms = 1000 * time_head_chain(dec, rows[0])
        errors = [abs(e["model_error_pct"]) for e in trees if "model_error_pct" in e]
        atomic_write_json(tmp / "timing.json", {
            "trees": trees, "ar_token_ms": 1000 * ar_token_s, "ar_token_ms_raw": 1000 * t["ar_token_s"],
            "ar_tok_per_s": ar_tok_s, "phase_ms": model.phase_ms,
            "signal_ms": {name: chain_ms for name in HEAD_SIGNALS},
            "prefill_ms": 1000 * t["prefill_s"], "prompt_tokens": t["prompt_tokens"],
            "cost_model": {"file": "step_cost.json", "clock": str(tc.clock), "reference_context": ref_ctx,
                           "task_prompt_tokens": task_prompt_tokens,
                           "check_context": check_ctx, "check_rounds_after_probe_rounds": t["after_probe_rounds"],
                           "pruned_with_probe_rounds": t["pruned_with_probe_rounds"],
                           "max_abs_error_pct": max(errors) if errors else None},
            "machine": machine_info(), "dtype": resolve_dtype(cfg),
            "tokens_per_step_from": "replay" if exact else "recalibrate", "acceptance": plain(cfg.acceptance)})
        best = max((x for x in trees if "pruned" not in x), key=lambda x: x["tok_per_s"])
        return {"best_nodes": best["nodes"], "best_tok_per_s": best["tok_per_s"], "ar_tok_per_s": ar_tok_s,
                "pruned": len(t["pruned"]), "max_abs_model_error_pct": max(errors) if errors else None}

    return run_stage("time", Layout.from_cfg(cfg).decode_work / "time", key, build, force=forced(cfg, "time"))
