"""How close can any per-step policy come to the oracle over a bank? Bounds by what the policy knows.

    python -m pipeline.experiments.policy_headroom [--tasks humaneval gsm8k sharegpt] [--heads hydra-draft8192]

The oracle over a bank picks each step's tree knowing every tree's accepted length at that step.
A policy sees, before the step, a few numbers (the base model's top-1 probability p0 and entropy,
the heads' greedy-chain probabilities q1..qD, its own past acceptance). For each such number this
fits the best lookup table "value bucket -> tree" *on the same calibration steps it is scored on*
(quantile buckets, 2 to 32 of them; per bucket the tree that maximises tokens - rate x seconds,
with the rate iterated to the policy's own tokens per second). Fitted and scored in-sample, it is
at least as good as any policy that maps that number to a tree, so its share of the oracle bounds
what a better fit of that signal could gain. Two rows are knowledge no signal has, to size the gap:
"knows if draft 1 is accepted" (a perfect predictor of the first draft token) and "knows the best
static tree's accepted length".

Reads the bank (`artifacts/banks/<model>/<heads>/<task>/bank.json`: trees, modeled step costs,
fitted policies) and its calibration rollout; runs no model. Writes
artifacts/reports/benchmarks/policy_headroom.{csv,json,png}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import atomic_write_json, read_json
from pipeline.benchmarks import write_csv
from pipeline.experiments import bank_layouts, bank_study_args
from pipeline.replay.policy import BankReplay, replay_policy
from pipeline.replay.oracle import oracle_replay
from pipeline.rollout.record import load_rollout
from runtime.tree import Tree

BUCKET_COUNTS = (2, 4, 8, 16, 32)


def walk_rate(accept: list[np.ndarray], costs: np.ndarray, choices: list[np.ndarray]) -> float:
    """Tokens per second of a decode that takes tree choices[n][i] at step index i of prompt n."""
    tokens = seconds = 0.0
    for acc, ch in zip(accept, choices):
        T, i = acc.shape[1], 0
        while i < T - 1:
            k = ch[i]
            seconds += costs[k]
            i = min(i + int(acc[k, i]) + 1, T - 1)
        tokens += T - 1
    return tokens / seconds


def best_table_rate(accept: list[np.ndarray], costs: np.ndarray, values: list[np.ndarray], rate: float) -> float:
    """In-sample tokens/s of the best bucket -> tree table over `values` (one per step index)."""
    emitted = np.concatenate([np.minimum(a + 1, a.shape[1] - 1 - np.arange(a.shape[1])) for a in accept], 1)
    pooled = np.concatenate(values)
    best = 0.0
    for nb in BUCKET_COUNTS:
        edges = np.unique(np.quantile(pooled, np.linspace(0, 1, nb + 1)[1:-1]))
        bucket = np.searchsorted(edges, pooled, side="right")
        lam = rate
        for _ in range(6):  # Dinkelbach: maximise tokens - lam * seconds, lam = the table's own rate
            gain = np.stack([np.bincount(bucket, weights=emitted[k] - lam * costs[k], minlength=len(edges) + 1)
                             for k in range(len(costs))])
            table = gain.argmax(0)
            lam = walk_rate(accept, costs, [table[np.searchsorted(edges, v, side="right")] for v in values])
        best = max(best, lam)
    return best


def task_headroom(bank_dir: Path, rollout_dir: Path) -> list[dict[str, Any]]:
    """Rows (what the policy knows, tokens/s, share of the oracle) for one bank."""
    bank = read_json(bank_dir / "bank.json")
    trees = [Tree(t["paths"]).paths for t in bank["trees"]]
    costs = np.array([t["step_ms"] for t in bank["trees"]]) / 1000
    rolls = load_rollout(rollout_dir)
    data = BankReplay.build(rolls, trees)
    oracle = oracle_replay(data, None, costs).tokens_per_second
    static_k = int(bank["best_static"])
    static = walk_rate(data.accept, costs, [np.full(a.shape[1], static_k) for a in data.accept])
    rows = [("oracle (knows every tree's accepted length)", oracle), ("best static tree", static)]
    for kind, pol in bank["policies"].items():
        if kind != "static":
            rows.append((f"fitted {kind} policy ({pol.get('signal')})", replay_policy(data, None, pol, costs).tokens_per_second))
    chain = [np.asarray(r["greedy_top1"], dtype=np.float64) for r in rolls]
    signals = {
        "p0 (the paper's signal)": [np.asarray(r["p0"], dtype=np.float64) for r in rolls],
        "base entropy": [-np.asarray(r["entropy"], dtype=np.float64) for r in rolls],
        "head 1 top-1 probability q1": [c[:, 0] for c in chain],
        "q1 * q2": [c[:, 0] * c[:, 1] for c in chain],
        "expected greedy-chain length sum_d q1..qd": [np.cumprod(c, 1).sum(1) for c in chain],
        "knows if draft 1 is accepted": [(a[-1] > 0).astype(np.float64) for a in data.accept],
        "knows the best static tree's accepted length": [a[static_k].astype(np.float64) for a in data.accept],
    }
    for name, values in signals.items():
        rows.append((f"best in-sample table over {name}" if not name.startswith("knows") else name,
                     best_table_rate(data.accept, costs, values, static)))
    return [{"policy": name, "tok_per_s": round(tps, 2), "share_of_oracle_pct": round(100 * tps / oracle, 1)}
            for name, tps in rows]


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.artifacts import save_figure

    names = [r["policy"] for r in next(iter(results.values()))]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    h = 0.8 / len(results)
    for j, (task, rows) in enumerate(results.items()):
        ax.barh(np.arange(len(names)) + j * h, [r["share_of_oracle_pct"] for r in rows], h, label=task)
    ax.set_yticks(np.arange(len(names)) + 0.4 - h / 2, names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(90, color="k", ls="--", lw=0.8)
    ax.set_xlim(70, 101)
    ax.set_xlabel("replayed tokens/s, % of the oracle over the bank (calibration steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    a = bank_study_args(__doc__, argv)
    results = {task: task_headroom(lay.bank_dir, lay.work / "rollout") for task, lay in bank_layouts(a)}
    names = [r["policy"] for r in next(iter(results.values()))]
    print("share of the oracle's replayed tokens/s (calibration steps of each bank; tok/s in brackets)")
    print(" | ".join(["what the policy knows", *results]))
    for i, name in enumerate(names):
        print(" | ".join([name, *(f"{rows[i]['share_of_oracle_pct']}% ({rows[i]['tok_per_s']})" for rows in results.values())]))
    out = Path(a.out)
    write_csv(out / "policy_headroom.csv", [{"task": t, **r} for t, rows in results.items() for r in rows])
    atomic_write_json(out / "policy_headroom.json", {"settings": vars(a), "tasks": results})
    plot(results, out / "policy_headroom.png")
    print(f"wrote {out / 'policy_headroom.png'}")


if __name__ == "__main__":
    main()
