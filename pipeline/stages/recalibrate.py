"""recalibrate: real tree decoding of every candidate tree on `profile.recalib_prompts`
calibration prompts, and its agreement with the replayed acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest, plain
from pipeline.loaders import sampler_from_cfg, tree_decoder
from pipeline.paths import Layout
from pipeline.stages import grow as grow_stage
from pipeline.stages import merge as merge_stage
from pipeline.graph import runtime_key, runtime_spec
from pipeline.stages.prepare import rows_hash, split_rows

READS = ("profile.recalib_prompts", "profile.max_new_tokens", "profile.rank_cap", "sampling", "acceptance",
         *grow_stage.CANDIDATES)


@once_per_config
def output(cfg: DictConfig) -> Path:
    rollout_dir = merge_stage.output(cfg)
    rows = split_rows(cfg, "calib", int(cfg.profile.recalib_prompts))
    key = {**runtime_key(cfg), **config_key(cfg, READS), "prompts": rows_hash(rows),
           "rollout": output_digest(rollout_dir), "grow": output_digest(grow_stage.output(cfg))}

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.recalibrate import recalibrate
        from pipeline.rollout.record import load_rollout

        cands = grow_stage.candidate_trees(cfg)
        rollouts = {r["id"]: r for r in load_rollout(rollout_dir)}
        dec = tree_decoder(runtime_spec(cfg), [c["tree"] for c in cands], cfg.acceptance)
        res = recalibrate(dec, [c["tree"] for c in cands], rows, rollouts, int(cfg.profile.max_new_tokens),
                          int(cfg.profile.rank_cap), sampler=sampler_from_cfg(cfg.sampling))
        for c, r in zip(cands, res):
            r["paths"] = [list(p) for p in c["tree"].paths]
            r["nodes"] = c["tree"].num_nodes
            r["depth"] = c["tree"].depth
        atomic_write_json(tmp / "recalibrate.json", {"trees": res, "prompts": [r["id"] for r in rows]})
        if cfg.acceptance.kind != "exact":  # no exact replay to agree with (see pipeline.recalibrate)
            return {"trees": len(res), "acceptance": plain(cfg.acceptance),
                    "real_tokens_per_step": [round(r["real_tokens_per_step"], 4) for r in res]}
        return {
            "trees": len(res),
            "max_tps_rel_diff": max(r["tps_rel_diff"] for r in res),
            "min_step_agreement": min(r["step_agreement"] for r in res),
            "token_mismatch_prompts": sum(r["token_mismatch_prompts"] for r in res),
        }

    return run_stage("recalibrate", Layout.from_cfg(cfg).decode_work / "recalibrate", key, build, force=forced(cfg, "recalibrate"))
