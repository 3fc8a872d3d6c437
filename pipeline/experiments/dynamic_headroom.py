"""How far is EntMTP-dyn from what its super-tree allows, and does the base model's confidence help?

    python -m pipeline.experiments.dynamic_headroom [--tasks humaneval gsm8k sharegpt] [--heads hydra-draft8192]

Per task, on the bank's calibration rollout and at the bank's modeled step costs (no model runs):

* EntMTP-dyn as the bank fitted it (`pipeline.replay.replay_dynamic`);
* the oracle over the bank's static trees (the must-show's yardstick);
* the super-tree's hindsight ceiling (`pipeline.replay.dynamic_ceiling`): each step verifies just
  its accepted chain, so no per-step signal can do better with this super-tree and these costs;
* EntMTP-dyn with its calibration fitted separately per quantile bin of the base model's top-1
  probability p0 at the step (a signal the decoder has for free from the last verification), at
  each early-stop threshold of the bank's grid; fitted and scored on the same steps, so it is an
  optimistic estimate of what that signal adds to the heads' path values.

Writes artifacts/reports/benchmarks/dynamic_headroom.{csv,json}.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import atomic_write_json
from pipeline.benchmarks import write_csv
from pipeline.experiments import bank_layouts, bank_study_args

P0_BINS = (2, 4)
STOP_GRID = (0.0, 0.1, 0.15, 0.2, 0.3, 0.4)


def p0_calibrated(rollouts: Sequence[dict], scores: Sequence[np.ndarray], dynamic: dict[str, Any], bins: int,
                  stop_below: float) -> float:
    """EntMTP-dyn with one calibration per quantile bin of p0 (fitted on these rollouts), replayed."""
    from pipeline.fit_policy import calibration_samples, fit_calibration
    from pipeline.replay import replay_dynamic
    from runtime.dynamic import Calibration, DynamicPolicy
    from runtime.tree import Tree

    tree = Tree(dynamic["super_tree"])
    p0 = [np.asarray(r["p0"], dtype=np.float64) for r in rollouts]
    edges = np.quantile(np.concatenate([p[:-1] for p in p0]), np.linspace(0, 1, bins + 1)[1:-1])
    bin_of = [np.searchsorted(edges, p) for p in p0]
    samples = [calibration_samples([r], [sc], tree) for r, sc in zip(rollouts, scores)]
    width = tree.num_nodes - 1
    policies = []
    for b in range(bins):
        parts = []
        for (v, d, a), bo in zip(samples, bin_of):
            keep = np.repeat(bo[: len(v) // width] == b, width)
            parts.append((v[keep], d[keep], a[keep]))
        cal = fit_calibration(*(np.concatenate([p[k] for p in parts]) for k in range(3)), tree.depth)
        policies.append(DynamicPolicy(tree, dynamic["step_ms"], Calibration.from_dict(cal),
                                      draft_ms=dynamic["draft_ms"], stop_below=stop_below))
    return replay_dynamic(rollouts, scores, policies[0],
                          policy_at=lambda n, i: policies[int(bin_of[n][i])]).tokens_per_second


def task_headroom(bank_dir: Path, work: Path) -> list[dict[str, Any]]:
    from pipeline.replay import dynamic_ceiling, replay_dynamic
    from pipeline.rollout import load_rollout, load_scores
    from runtime.bank import TopologyBank
    from runtime.tree import Tree

    bank = TopologyBank.load(bank_dir)
    if not bank.dynamic:
        raise SystemExit(f"{bank_dir}: the bank has no EntMTP-dyn entry; rebuild it with dynamic.enabled=true")
    rollouts = load_rollout(work / "rollout")
    stored = load_scores(work / "scores", rollouts)
    tree = Tree(bank.dynamic["super_tree"])
    match = [s for s, paths in enumerate(stored["super_trees"]) if Tree(paths) == tree]
    if not match:
        raise SystemExit(f"{work / 'scores'} holds no scores of the bank's super-tree; run `make bank` again")
    scores = stored["scores"][match[0]]
    policy = bank.dynamic_policy()
    dyn = replay_dynamic(rollouts, scores, policy).tokens_per_second
    oracle = float(bank.oracle["tokens_per_second"])
    ceiling = dynamic_ceiling(rollouts, policy)["tokens_per_second"]
    rows = [("EntMTP-dyn (the bank's fit)", dyn), ("oracle over the bank", oracle),
            ("super-tree hindsight ceiling", ceiling)]
    for bins in P0_BINS:
        best = max((p0_calibrated(rollouts, scores, bank.dynamic, bins, s), s) for s in STOP_GRID)
        rows.append((f"EntMTP-dyn, calibration per p0 bin ({bins} bins, stop below {best[1]:g}), in-sample", best[0]))
    return [{"method": name, "tok_per_s": round(tps, 2), "share_of_oracle_pct": round(100 * tps / oracle, 1),
             "share_of_ceiling_pct": round(100 * tps / ceiling, 1)} for name, tps in rows]


def main(argv: list[str] | None = None) -> None:
    a = bank_study_args(__doc__, argv)
    results: dict[str, list[dict[str, Any]]] = {}
    for task, lay in bank_layouts(a, needs=("rollout", "scores")):
        results[task] = task_headroom(lay.bank_dir, lay.work)
        for r in results[task]:
            print(f"{task:10s} {r['method']:75s} {r['tok_per_s']:7.1f} tok/s  {r['share_of_oracle_pct']:5.1f}% of the "
                  f"oracle  {r['share_of_ceiling_pct']:5.1f}% of the ceiling")
    out = Path(a.out)
    write_csv(out / "dynamic_headroom.csv", [{"task": t, **r} for t, rows in results.items() for r in rows])
    atomic_write_json(out / "dynamic_headroom.json", results)


if __name__ == "__main__":
    main()
