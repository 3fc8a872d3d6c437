"""scores: the calibration rollout's head scores on EntMTP-dyn's candidate super-trees (the bank
stage asks for them when `dynamic.enabled`). See `pipeline.rollout.scores` for what a score is and
`pipeline.bank.dynamic` for the candidates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import run_stage
from pipeline.graph import config_key, once_per_config, output_digest
from pipeline.loaders import load_runtime
from pipeline.paths import Layout
from pipeline.stages import grow as grow_stage
from pipeline.stages import merge as merge_stage
from pipeline.graph import runtime_key, runtime_spec
from pipeline.stages.rollout import calib_rows


READS = ("dynamic.super_sizes", "heads.num_heads")


def wanted(cfg: DictConfig) -> bool:
    """EntMTP-dyn is fitted when `dynamic.enabled` and acceptance is exact (its replay is exact
    acceptance: greedy or seeded sampling)."""
    return bool(cfg.dynamic.enabled) and str(cfg.acceptance.kind) == "exact"


def bank_inputs(cfg: DictConfig, scores_dir: Path, time_dir: Path) -> dict[str, Any]:
    """What `pipeline.bank.write.build_bank` fits EntMTP-dyn on: the scores, the time stage's
    step-cost model, whether to fit a calibration and the early-stop thresholds to try."""
    from pipeline.artifacts import read_json
    from pipeline.timing.step_cost import StepCostModel

    timing = read_json(time_dir / "timing.json")
    return {"scores_dir": scores_dir, "calibrate": bool(cfg.dynamic.calibrate),
            "stop_below": [float(x) for x in cfg.dynamic.stop_below],
            "cost_model": StepCostModel.load(time_dir / timing["cost_model"]["file"])}


def super_tree_candidates(cfg: DictConfig) -> list:
    """The candidate super-trees of EntMTP-dyn (`pipeline.bank.dynamic.super_tree_candidates`) from
    the grow frontier."""
    from pipeline.artifacts import read_json
    from pipeline.bank.dynamic import super_tree_candidates as candidates

    frontier = read_json(grow_stage.output(cfg) / "frontier.json")
    return candidates(frontier, [int(s) for s in cfg.dynamic.super_sizes], int(cfg.heads.num_heads))


@once_per_config
def output(cfg: DictConfig) -> Path:
    """The merged calibration rollout's head scores on every candidate super-tree (`pipeline.rollout.
    score_prompt`), in `<work>/scores/`. Part of the bank stage's inputs: built when the bank is, and
    again whenever the rollout, the frontier's candidates or the runtime change (its key), so scores
    of an older rollout are never read with a newer one (`load_scores` also checks it)."""
    from pipeline.bank.dynamic import SCORES_FORMAT

    rollout_dir, grow_dir = merge_stage.output(cfg), grow_stage.output(cfg)
    rollout_digest = output_digest(rollout_dir)
    # the candidates are a function of the frontier, the sizes and the heads (torch-free key)
    key = {**runtime_key(cfg), **config_key(cfg, READS), "rollout": rollout_digest, "format": SCORES_FORMAT,
           "grow": output_digest(grow_dir)}

    def build(tmp: Path) -> dict[str, Any]:
        from tqdm.auto import tqdm

        from pipeline.rollout.scores import save_scores, score_prompt
        from pipeline.rollout.record import load_rollout
        from runtime.tree import TreeBuffers

        trees = super_tree_candidates(cfg)
        model, heads = load_runtime(runtime_spec(cfg))
        rollouts = load_rollout(rollout_dir)
        rows = {r["id"]: r for r in calib_rows(cfg)}
        bufs = [TreeBuffers.compile(t) for t in trees]
        per_prompt = []
        for r in tqdm(rollouts, desc=f"score {cfg.task.name} super-trees", unit="prompt"):
            ids = rows[r["id"]]["input_ids"]
            per_prompt.append(score_prompt(model, heads, ids, r["tokens"], bufs))  # heads or an EAGLE-3 drafter
        save_scores(tmp, [r["id"] for r in rollouts], [list(t.paths) for t in trees], per_prompt, rollout_digest)
        return {"prompts": len(rollouts), "super_tree_nodes": [t.num_nodes for t in trees]}

    return run_stage("scores", Layout.from_cfg(cfg).work / "scores", key, build)
