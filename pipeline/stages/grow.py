"""grow: greedy tree growth on the merged rollout, a frontier per max depth (exact replay of
greedy acceptance), plus two reference trees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest
from pipeline.paths import Layout
from pipeline.stages import merge as merge_stage

READS = ("grow.max_depth", "profile.grow_budget", "profile.rank_cap", "heads.num_heads")


@once_per_config
def output(cfg: DictConfig) -> Path:
    rollout_dir = merge_stage.output(cfg)
    key = {"rollout": output_digest(rollout_dir), **config_key(cfg, READS)}
    budget, rank_cap, max_depth = int(cfg.profile.grow_budget), int(cfg.profile.rank_cap), int(cfg.grow.max_depth)

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.grow import grow, top_count_tree
        from pipeline.replay.accept import replay_tokens_per_step
        from pipeline.rollout.record import load_rollout
        from runtime.tree import Tree

        rollouts = load_rollout(rollout_dir)
        frontier: dict[str, Any] = {}
        for depth in range(1, max_depth + 1):
            res = grow(rollouts, max_depth=depth, budget=budget, rank_cap=rank_cap)
            frontier[str(depth)] = [{"paths": [list(p) for p in t], "tokens_per_step": float(tps)}
                                    for t, tps in zip(res.trees, res.tokens_per_step)]
        top = top_count_tree(rollouts, budget=budget, max_depth=max_depth, rank_cap=rank_cap)
        extra = {"top_count": {"paths": [list(p) for p in top], "tokens_per_step": replay_tokens_per_step(rollouts, top)}}
        mc = Tree.named("mc_sim_7b_63")
        if mc.depth <= int(cfg.heads.num_heads):
            extra["mc_sim_7b_63"] = {"paths": [list(p) for p in mc.paths], "tokens_per_step": replay_tokens_per_step(rollouts, mc.paths)}
        atomic_write_json(tmp / "frontier.json", {"frontier": frontier, "reference": extra})
        best = max((e for es in frontier.values() for e in es), key=lambda e: e["tokens_per_step"])
        return {"best_tokens_per_step": best["tokens_per_step"], "best_nodes": len(best["paths"]) + 1}

    return run_stage("grow", Layout.from_cfg(cfg).work / "grow", key, build, force=forced(cfg, "grow"))


# which frontier trees the recalibrate and time stages decode for real
CANDIDATES = ("grow.candidate_sizes", "grow.candidate_tolerance")


@once_per_config
def candidate_trees(cfg: DictConfig) -> list[dict[str, Any]]:
    """The frontier trees that get real decoding and timing: a size grid over every max depth.

    At one size, a tree whose replayed tokens/step is more than `grow.candidate_tolerance` below
    the best tree of that size is dropped: it verifies as many nodes for fewer tokens, and only a
    much cheaper draft (shallower Hydra chain) could save it — the tolerance keeps those close
    enough for that to matter."""
    from pipeline.artifacts import read_json
    from runtime.tree import Tree

    doc = read_json(output(cfg) / "frontier.json")
    sizes = set(int(s) for s in cfg.grow.candidate_sizes)
    seen, out = set(), []
    if 0 in sizes:  # the root alone is plain AR decoding: the bank's floor on unpredictable text
        root_only = Tree([])
        seen.add(root_only)
        out.append({"tree": root_only, "max_depth": 0, "replay_tokens_per_step": 1.0})
    best_at: dict[int, float] = {}
    for entries in doc["frontier"].values():
        for e in entries:
            n = len(e["paths"])
            best_at[n] = max(best_at.get(n, 0.0), e["tokens_per_step"])
    tol = float(cfg.grow.candidate_tolerance)
    for depth, entries in doc["frontier"].items():
        for e in entries:
            t = Tree(e["paths"])
            if len(t) in sizes and t not in seen and e["tokens_per_step"] >= (1 - tol) * best_at[len(t)]:
                seen.add(t)
                out.append({"tree": t, "max_depth": int(depth), "replay_tokens_per_step": e["tokens_per_step"]})
    out.sort(key=lambda c: (c["tree"].num_nodes, c["tree"].depth))
    return out
