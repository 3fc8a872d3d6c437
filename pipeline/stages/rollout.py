"""rollout: one shard of the calibration rollout — AR greedy continuations of the first
`profile.calib_prompts` calibration prompts, with every step's rank path (EntMTP-dyn's head
scores of the merged rollout: `pipeline.stages.scores`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import run_stage
from pipeline.graph import config_key, forced, once_per_config
from pipeline.loaders import load_runtime, sampler_from_cfg
from pipeline.paths import Layout
from pipeline.graph import runtime_key, runtime_spec
from pipeline.stages.prepare import rows_hash, split_rows

# what the rollout's content depends on (the shard fields only say which part of it this is)
READS = ("profile.calib_prompts", "profile.max_new_tokens", "profile.rank_cap", "sampling")
SHARD = ("rollout.shard", "rollout.num_shards")


def calib_rows(cfg: DictConfig) -> list[dict[str, Any]]:
    return split_rows(cfg, "calib", int(cfg.profile.calib_prompts))


def content_key(cfg: DictConfig) -> dict[str, Any]:
    """The key of the merged rollout: the same whatever the sharding."""
    return {**runtime_key(cfg), **config_key(cfg, READS), "calib": rows_hash(calib_rows(cfg))}


@once_per_config
def output(cfg: DictConfig) -> Path:
    from pipeline.rollout.record import run_rollout, shard_rows

    shard, n = int(cfg.rollout.shard), int(cfg.rollout.num_shards)
    out = Layout.from_cfg(cfg).work / "shards" / f"{shard}-of-{n}"
    rows = shard_rows(calib_rows(cfg), shard, n)
    key = {**content_key(cfg), **config_key(cfg, SHARD)}

    def build(tmp: Path) -> dict[str, Any]:
        model, heads = load_runtime(runtime_spec(cfg))
        return run_rollout(model, heads, rows, int(cfg.profile.max_new_tokens), int(cfg.profile.rank_cap), tmp,
                           desc=f"rollout {cfg.task.name} shard {shard}/{n}", sampler=sampler_from_cfg(cfg.sampling))

    return run_stage("rollout", out, key, build, force=forced(cfg, "rollout"))

