"""Exact greedy replay of tree decoding from rank paths (the rank-path convention below).

Under greedy verification the decoded text is the AR continuation y_1..y_T whatever the tree, so
a rollout's rank paths R [T, D] determine everything:

* accepted length of a tree at step index i = longest prefix of R[i] that is a node of the tree;
* a decode visits i_0 = 0, i_{s+1} = i_s + a(i_s) + 1;
* a per-step policy over a bank of trees, and the best schedule in hindsight (the oracle), are
  replays of the same arrays.

Counting convention (the same as a real decoder with max_new_tokens = T): the prefill emits y_1;
before the step at i the tokens y_1..y_{i+1} are known, and the step emits y_{i+2}..y_{i+a+2},
i.e. min(a + 1, T - 1 - i) tokens (only the very last step can be clipped: its bonus token would
be y_{T+1}). Steps run while a token is left, i.e. while i < T - 1. So the steps of one prompt
emit T - 1 tokens in all, and

    tokens per step = (T - 1) / steps        (the prefill token y_1 is not counted)

pooled over prompts as sum(T - 1) / sum(steps). Tokens per second = the same tokens / the sum of
the chosen trees' step costs (prefill excluded): a ratio between policies over one bank.

A rollout is a dict of arrays over step indices i = 0..T-1: `rank_paths` int [T, D] (ranks
capped at K = `rank_cap`: K means "not in the top K" or "beyond the end"), and for policies that
read a signal `p0` [T], `head_top1` [T, D], `entropy` [T]; optionally `rank_cap` (int; else it is
read off the data: the last row is all K) and `greedy_top1` [T, D]. Head-aware signals read
`greedy_top1` when present (the heads' top-1 probabilities along their *own* greedy chain: what a
decoder sees before verifying) and `head_top1` otherwise.
"""

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

