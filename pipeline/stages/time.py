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

from pipeline.artifacts import machine_key, read_json, run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest, plain
from pipeline.loaders import sampler_from_cfg, tree_decoder
from pipeline.paths import Layout
from pipeline.stages import grow as grow_stage
from pipeline.stages import merge as merge_stage
from pipeline.stages import recalibrate as recalibrate_stage
from pipeline.stages.dtype import resolve_dtype
from pipeline.graph import runtime_key, runtime_spec
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
    if exact:  # the chains' tokens/step come from the rollout
        key["rollout"] = output_digest(merge_stage.output(cfg))
    if not exact:
        recal_dir = recalibrate_stage.output(cfg)
        key["recalibrate"] = output_digest(recal_dir)

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.replay.accept import replay_tokens_per_step
        from pipeline.rollout.record import load_rollout
        from pipeline.timing.measure import build_timing
        from runtime.tree import Tree

        cands = grow_stage.candidate_trees(cfg)
        if exact:
            per_tree_tps = [c["replay_tokens_per_step"] for c in cands]
        else:
            real = {Tree(r["paths"]): r["real_tokens_per_step"] for r in read_json(recal_dir / "recalibrate.json")["trees"]}
            per_tree_tps = [real[c["tree"]] for c in cands]
        # the best chain at each batch size, for engines that draft chains only (exact replay only)
        chains = [(Tree.chain(d), replay_tokens_per_step(load_rollout(merge_stage.output(cfg)), Tree.chain(d).paths))
                  for d in range(1, int(cfg.heads.num_heads) + 1)] if exact else []
        dec = tree_decoder(runtime_spec(cfg), [c["tree"] for c in cands], cfg.acceptance)
        return build_timing(tmp, dec, cands, per_tree_tps, rows, task_prompt_tokens, plain(cfg.time),
                            int(cfg.profile.max_new_tokens), sampler_from_cfg(cfg.sampling), resolve_dtype(cfg),
                            chains=chains, acceptance=plain(cfg.acceptance),
                            tokens_per_step_from="replay" if exact else "recalibrate",
                            max_depth=int(cfg.heads.num_heads))  # an EAGLE-3 drafter drafts deeper than its trees

    return run_stage("time", Layout.from_cfg(cfg).decode_work / "time", key, build, force=forced(cfg, "time"))
