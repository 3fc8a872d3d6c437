"""The oracle: the best tree per step in hindsight over a bank, given per-tree step costs (a dynamic
program over positions), an upper bound for any policy over that bank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.replay.policy import BankReplay, _check_costs


def oracle_schedule(accept_lens: np.ndarray, step_costs: Sequence[float] | np.ndarray) -> tuple[float, np.ndarray]:
    """Best per-step tree choice in hindsight for one prompt.

    accept_lens: int [n_trees, T]; step_costs: [n_trees] seconds. Dynamic program from the end:
    best[i] = min_k cost_k + best[min(i + a_k(i) + 1, T - 1)], best[T - 1] = 0 (nothing left).
    Returns (best[0] = the least total step time to emit y_2..y_T, the tree chosen at each step of
    the optimal decode; its length is the number of steps). Ties go to the smaller tree. No policy
    over the same bank takes less time, so its tokens per second is an upper bound for any policy
    (its tokens per step is not: the largest tree alone may accept more per step).
    """
    a = np.asarray(accept_lens)
    if a.ndim != 2:
        raise ValueError(f"accept_lens must be [n_trees, T], got shape {a.shape}")
    n_trees, T = a.shape
    costs = _check_costs(step_costs, n_trees)
    if T <= 1:
        return 0.0, np.zeros(0, dtype=np.int64)
    best = [0.0] * T
    arg = [0] * T
    nxt = np.minimum(np.arange(T)[None, :] + a + 1, T - 1).T.tolist()  # [T][n_trees]
    cl = costs.tolist()
    ks = range(1, n_trees)
    for i in range(T - 2, -1, -1):
        row = nxt[i]
        k_best = 0
        t_best = cl[0] + best[row[0]]
        for k in ks:
            t = cl[k] + best[row[k]]
            if t < t_best:
                k_best, t_best = k, t
        best[i] = t_best
        arg[i] = k_best
    steps = []
    i = 0
    while i < T - 1:
        k = arg[i]
        steps.append(k)
        i = nxt[i][k]
    return best[0], np.asarray(steps, dtype=np.int64)


@dataclass
class OracleReplay:
    steps: int
    tokens: int
    tokens_per_step: float
    time_s: float
    tokens_per_second: float
    tree_steps: np.ndarray
    choices: list[np.ndarray]  # per prompt: tree chosen at each step of the optimal walk

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_step": self.tokens_per_step,
            "time_s": self.time_s,
            "tokens_per_second": self.tokens_per_second,
            "tree_share": (self.tree_steps / max(self.steps, 1)).round(4).tolist(),
        }


def oracle_replay(
    rollouts: dict | Sequence[dict] | BankReplay,
    trees: Sequence[Any] | None,
    step_costs: Sequence[float] | np.ndarray,
    rank_cap: int | None = None,
) -> OracleReplay:
    """The oracle schedule on every prompt, pooled: the tokens-per-second ceiling of the bank."""
    data = rollouts if isinstance(rollouts, BankReplay) else BankReplay.build(rollouts, trees or [], rank_cap)
    costs = _check_costs(step_costs, data.n_trees)
    total = 0.0
    steps = 0
    all_choices = []
    for acc in data.accept:
        t, choice = oracle_schedule(acc, costs)
        total += t
        steps += len(choice)
        all_choices.append(choice)
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    tokens = data.tokens
    tree_steps = np.bincount(np.concatenate(all_choices), minlength=data.n_trees)
    return OracleReplay(steps, tokens, tokens / steps, total, tokens / total, tree_steps, all_choices)

