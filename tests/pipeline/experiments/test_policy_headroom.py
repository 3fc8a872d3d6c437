"""The policy-headroom bounds: the walk, and the in-sample table over a value a policy could see."""

from __future__ import annotations

import numpy as np

from pipeline.experiments.policy_headroom import best_table_rate, walk_rate
from pipeline.replay.oracle import oracle_schedule


def _accept(seed: int, T: int = 200) -> np.ndarray:
    """Two nested trees: the 1-node tree never accepts, the 2-node tree's draft is accepted at
    random steps (so knowing which steps is worth something)."""
    rng = np.random.default_rng(seed)
    return np.stack([np.zeros(T, dtype=np.int64), (rng.random(T) < 0.4).astype(np.int64)])


def test_walk_rate_counts_tokens_over_the_chosen_trees_costs() -> None:
    acc = np.array([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    costs = np.array([1.0, 1.5])
    # always tree 1: steps at 0, 2 (then 4 = T - 1 ends), 4 tokens in 2 steps of 1.5 s
    assert walk_rate([acc], costs, [np.ones(5, dtype=np.int64)]) == 4 / 3.0
    assert walk_rate([acc], costs, [np.zeros(5, dtype=np.int64)]) == 4 / 4.0


def test_a_value_that_reveals_acceptance_reaches_the_oracle_and_noise_does_not() -> None:
    accept = [_accept(s) for s in range(3)]
    costs = np.array([1.0, 1.6])  # the larger tree pays only where its draft is accepted
    oracle = sum(a.shape[1] - 1 for a in accept) / sum(oracle_schedule(a, costs)[0] for a in accept)
    static = max(walk_rate(accept, costs, [np.full(a.shape[1], k) for a in accept]) for k in range(2))
    knows = best_table_rate(accept, costs, [a[1].astype(float) for a in accept], static)
    noise = best_table_rate(accept, costs, [np.random.default_rng(9).random(a.shape[1]) for a in accept], static)
    # one-step knowledge is nearly all there is to know here (the oracle also plans across steps)
    assert 0.99 * oracle < knows <= oracle + 1e-9
    assert static <= noise < knows  # an in-sample table over noise fits a little, never the knowledge
