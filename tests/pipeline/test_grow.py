"""Greedy tree growth and the position-uniform optimum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.grow import GrowResult, grow, grow_all_depths, grow_frontier, top_count_tree, uniform_objective
from pipeline.replay.accept import accept_lengths, replay_tree, walk
from tests.helpers import synthetic_rollouts


def _valid(tree: list[tuple[int, ...]], max_depth: int, K: int) -> bool:
    s = set(tree)
    for p in tree:
        if not p or len(p) > max_depth or max(p) >= K or min(p) < 0:
            return False
        if len(p) > 1 and p[:-1] not in s:
            return False
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in s:
            return False
    return len(s) == len(tree)


def _naive_grow(rolls: list[dict], max_depth: int, budget: int, K: int) -> list[list[tuple[int, ...]]]:
    """The growth rule spelled out directly: score every candidate by full re-replay."""
    tree: list[tuple[int, ...]] = []
    out = []
    for _ in range(budget):
        visits = [walk(accept_lengths(r["rank_paths"], tree, K)) for r in rolls]
        nodes = [()] + tree
        cands = []
        for p in nodes:
            if len(p) >= max_depth:
                continue
            c = p + (sum(1 for q in tree if len(q) == len(p) + 1 and q[:-1] == p),)
            if c[-1] >= K:
                continue
            total = sum(int(accept_lengths(r["rank_paths"], tree + [c], K)[v].sum()) for r, v in zip(rolls, visits))
            cands.append((-total, sum(c), len(c), c))
        if not cands:
            break
        tree.append(min(cands)[3])
        out.append(sorted(tree, key=lambda q: (len(q), q)))
    return out


@pytest.mark.parametrize("seed,max_depth", [(0, 4), (1, 2), (2, 3), (3, 1)])
def test_grow_matches_the_naive_rule(seed: int, max_depth: int) -> None:
    K = 5
    rolls = synthetic_rollouts(3, 40, 4, rank_cap=K, seed=seed)
    res = grow(rolls, max_depth, 14, progress=False)
    assert res.trees == _naive_grow(rolls, max_depth, 14, K)


def test_grow_trees_are_nested_valid_and_scored() -> None:
    K = 6
    rolls = synthetic_rollouts(5, 60, 4, rank_cap=K, seed=7)
    res = grow(rolls, 4, 30, progress=False)
    assert len(res.trees) == 30 and res.trees[0] == [(0,)]
    prev: set = set()
    for b, tree in enumerate(res.trees, start=1):
        assert len(tree) == b and _valid(tree, 4, K)
        assert prev < set(tree)
        prev = set(tree)
        rep = replay_tree(rolls, tree)
        assert res.tokens_per_step[b - 1] == pytest.approx(rep.tokens_per_step)
        assert res.mean_accept[b - 1] == pytest.approx(rep.mean_accept_visited)
        assert res.mean_accept_uniform[b - 1] == pytest.approx(rep.mean_accept_uniform)
    # each addition does not lower the score it is chosen by (mean accepted length over the
    # previous tree's visited steps), and the position-uniform mean never decreases
    for b in range(1, 30):
        assert res.score[b] >= res.mean_accept[b - 1] - 1e-12
    assert all(np.diff(res.mean_accept_uniform) >= -1e-12)
    # round trip through JSON-able form
    assert GrowResult.from_dict(res.to_dict()) == res
    assert grow_frontier(rolls, 4, 30, progress=False) == res.trees


def test_grow_for_every_depth_respects_it_and_stops_when_out_of_candidates() -> None:
    K = 3
    rolls = synthetic_rollouts(3, 40, 3, rank_cap=K, seed=2)
    res = grow_all_depths(rolls, 3, 20, progress=False)
    assert sorted(res) == [1, 2, 3]
    assert len(res[1].trees) == K  # depth 1: only (0,), (1,), (2,) exist
    assert len(res[2].trees) == K + K * K
    for d, r in res.items():
        assert all(len(p) <= d for p in r.trees[-1]) and _valid(r.trees[-1], d, K)


def test_grow_ties_smaller_rank_sum_then_shallower() -> None:
    # nothing is ever accepted beyond (0,): every candidate gains 0 and the tie rule decides
    R = np.full((10, 3), 4, dtype=np.int16)
    rolls = [{"rank_paths": R, "rank_cap": 4}]
    trees = grow(rolls, 3, 4, progress=False).trees
    added = [next(iter(set(b) - set(a))) for a, b in zip([[]] + trees[:-1], trees)]
    # (0,) first; then (1,) [sum 1] vs (0,0) [sum 0] -> (0,0); then (1,), (0,1), (0,0,0) -> (0,0,0) [sum 0];
    # then (1,), (0,1), (0,0,1) all sum 1 -> the shallowest, (1,)
    assert added == [(0,), (0, 0), (0, 0, 0), (1,)]


def test_grow_ties_with_equal_gains() -> None:
    # i=0 (the only visited step with a gain after (0,)): R = (1, ...) and at i=... construct so that
    # (1,) and (0, 0) each gain once on the walk of {(0,)}
    K = 4
    R = np.array([[0, 0, K], [K, K, K], [1, K, K], [K, K, K]], dtype=np.int16)
    # {(0,)}: walk 0 -> 2 -> 3 (stop): visited 0, 2. (0,0) gains at 0, (1,) gains at 2: a tie at
    # 1 each; rank sums 0 vs 1 -> (0, 0)
    trees = grow([{"rank_paths": R, "rank_cap": K}], 2, 2, progress=False).trees
    assert trees[1] == [(0,), (0, 0)]


def test_grow_errors() -> None:
    rolls = synthetic_rollouts(2, 20, 3, rank_cap=4, seed=0)
    with pytest.raises(ValueError, match="max_depth"):
        grow(rolls, 4, 5, progress=False)
    with pytest.raises(ValueError, match="budget"):
        grow(rolls, 2, 0, progress=False)
    with pytest.raises(ValueError, match="no rollouts"):
        grow([], 2, 3, progress=False)


# --------------------------------------------------------------------------- uniform optimum


def _all_valid_trees(K: int, depth: int, size: int) -> list[list[tuple[int, ...]]]:
    universe = [p for d in range(1, depth + 1) for p in itertools.product(range(K), repeat=d)]
    return [list(c) for c in itertools.combinations(universe, size) if _valid(list(c), depth, K)]


@pytest.mark.parametrize("case", ["monotone", "rank1_beats_rank0", "sparse"])
def test_top_count_tree_is_optimal_by_brute_force(case: str) -> None:
    K, depth = 3, 2
    rng = np.random.default_rng(5)
    if case == "monotone":
        R = np.minimum(rng.geometric(0.5, size=(60, 2)) - 1, K)
    elif case == "rank1_beats_rank0":  # heads that are better at their 2nd guess: sibling gaps in top-N
        R = rng.choice([0, 1, 2, K], p=[0.2, 0.5, 0.2, 0.1], size=(60, 2))
    else:  # fewer observed prefixes than the budget
        R = np.array([[1, 1], [1, 1], [K, K]])
    for size in range(1, 6):
        best = max(uniform_objective(R, t, K) for t in _all_valid_trees(K, depth, size))
        got = top_count_tree(R, size, depth, rank_cap=K)
        assert len(got) == size and _valid(got, depth, K)
        assert uniform_objective(R, got, K) == pytest.approx(best)


def test_top_count_tree_bounds_greedy_growth_on_the_uniform_objective() -> None:
    rolls = synthetic_rollouts(4, 60, 4, rank_cap=6, seed=9)
    res = grow(rolls, 4, 25, progress=False)
    for b in (1, 5, 12, 25):
        top = top_count_tree(rolls, b, 4)
        assert _valid(top, 4, 6) and len(top) == b
        assert uniform_objective(rolls, top) >= res.mean_accept_uniform[b - 1] - 1e-12


def test_own_walk_tokens_per_step_need_not_grow_with_the_tree() -> None:
    # Why the monotone quantities above are the selection score and the uniform mean: adding a
    # node can move the decode onto worse positions. A = chain of 3, B = A + (1,).
    K = 4
    R = np.array([[1, K, K], [0, 0, 0], [2, K, K], [2, K, K], [K, K, K]], dtype=np.int16)
    A = [(0,), (0, 0), (0, 0, 0)]
    B = A + [(1,)]
    roll = [{"rank_paths": R, "rank_cap": K}]
    assert walk(accept_lengths(R, A, K)).tolist() == [0, 1]  # 0 -> 1 -> 5
    assert walk(accept_lengths(R, B, K)).tolist() == [0, 2, 3]  # 0 -> 2 -> 3 -> 4
    assert replay_tree(roll, A).tokens_per_step == 2.0
    assert replay_tree(roll, B).tokens_per_step == pytest.approx(4 / 3)
    assert uniform_objective(R, B, K) >= uniform_objective(R, A, K)
