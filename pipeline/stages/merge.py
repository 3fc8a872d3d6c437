"""merge: the rollout shards as one rollout, in calibration order (runs missing shards itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.artifacts import is_up_to_date, run_stage
from pipeline.graph import forced, once_per_config
from pipeline.paths import Layout
from pipeline.stages import rollout as rollout_stage

READS = rollout_stage.READS  # not the sharding: the merged rollout does not depend on it


@once_per_config
def output(cfg: DictConfig) -> Path:
    key = rollout_stage.content_key(cfg)
    out = Layout.from_cfg(cfg).work / "rollout"
    if not forced(cfg, "merge") and is_up_to_date(out, key):
        return out  # merged earlier, from however many shards
    shard_dirs = []
    for k in range(int(cfg.rollout.num_shards)):
        sub = cfg.copy()
        OmegaConf.update(sub, "rollout.shard", k)
        shard_dirs.append(rollout_stage.output(sub))
    order = [r["id"] for r in rollout_stage.calib_rows(cfg)]

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.rollout.merge import merge_rollouts

        return merge_rollouts(shard_dirs, order, tmp)

    return run_stage("merge", out, key, build, force=forced(cfg, "merge"))
