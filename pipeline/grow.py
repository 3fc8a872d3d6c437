"""Greedy tree growth by mean accepted length (the paper's method), and the position-uniform optimum.

`grow` follows EntMTP: start from {(0,)}; each round the candidates are, for the root and every
node shallower than max_depth, its next-rank child (parent + (number of its children,)); each is
scored by the mean accepted length over the steps that the *current* tree's decode visits, pooled
over every calibration prompt (the paper scores in one joint-tree rollout that advances with the
current tree); the best is added (ties: smaller rank sum, then shallower, then lexicographically
smaller). The tree after each addition is recorded, which gives a nested frontier for budgets
1..B. Under greedy verification this joint rollout is exactly a replay of the rank paths (see
`pipeline.replay`), so a round is a few array operations:

* adding child c of node p raises the accepted length by one exactly at the steps whose accepted
  path ends at p and whose next rank is c's, so the gain of every candidate is a count of "next
  prefix" keys over the visited steps, and the update after adding touches only those steps.

`top_count_tree` maximises the position-uniform objective (mean accepted length over *all* step
indices) exactly: that mean is the sum over nodes of how often the node is a prefix of R[i].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.replay.accept import Path, as_rollouts, key_base, path_key, prefix_keys, rank_cap_of


def _sorted_paths(paths: Sequence[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: (len(p), p))


@dataclass
class GrowResult:
    """One greedy growth run at one max depth. Entry b - 1 of each list describes the b-node tree.

    `score` never falls below the previous tree's `mean_accept` and `mean_accept_uniform` never
    decreases, but `tokens_per_step` (each tree's own decode) can dip: a larger tree can move the
    decode onto worse positions (tests/pipeline/test_grow.py has a four-token example).
    """

    max_depth: int
    rank_cap: int
    trees: list[list[Path]] = field(default_factory=list)  # paths sorted by (depth, lexicographic)
    added: list[Path] = field(default_factory=list)  # the node added in each round
    score: list[float] = field(default_factory=list)  # selection score: mean accepted length of the new tree over the previous tree's visited steps
    tokens_per_step: list[float] = field(default_factory=list)  # replayed on the tree's own decode
    mean_accept: list[float] = field(default_factory=list)  # mean accepted length over the tree's own visited steps
    mean_accept_uniform: list[float] = field(default_factory=list)  # over every step index

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_depth": self.max_depth,
            "rank_cap": self.rank_cap,
            "trees": [[list(p) for p in t] for t in self.trees],
            "added": [list(p) for p in self.added],
            "score": self.score,
            "tokens_per_step": self.tokens_per_step,
            "mean_accept": self.mean_accept,
            "mean_accept_uniform": self.mean_accept_uniform,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GrowResult":
        return cls(
            max_depth=int(d["max_depth"]),
            rank_cap=int(d["rank_cap"]),
            trees=[[tuple(p) for p in t] for t in d["trees"]],
            added=[tuple(p) for p in d["added"]],
            score=list(d["score"]),
            tokens_per_step=list(d["tokens_per_step"]),
            mean_accept=list(d["mean_accept"]),
            mean_accept_uniform=list(d["mean_accept_uniform"]),
        )


def _walk_mask(a: list[int], bounds: list[tuple[int, int]], n: int) -> np.ndarray:
    """Visited-step mask over the concatenated prompts (each prompt walks while i < T - 1)."""
    visited = np.zeros(n, dtype=bool)
    idx = []
    for start, end in bounds:
        i, last = start, end - 1
        while i < last:
            idx.append(i)
            i += a[i] + 1
    visited[idx] = True
    return visited


def grow(
    rollouts: dict | Sequence[dict],
    max_depth: int,
    budget: int,
    rank_cap: int | None = None,
    progress: bool = True,
) -> GrowResult:
    """Greedily grow one tree of up to `budget` nodes (root excluded) and depth <= max_depth.

    Stops early only when no candidate is left (every node at rank_cap - 1 children or at max depth).
    """
    rolls = as_rollouts(rollouts)
    K = rank_cap_of(rolls, rank_cap)
    D = rolls[0]["rank_paths"].shape[1]
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= D:
        raise ValueError(f"max_depth must be an int in 1..{D} (the rollout's number of heads), got {max_depth!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int (nodes, root excluded), got {budget!r}")
    R = np.concatenate([r["rank_paths"][:, :max_depth] for r in rolls]).astype(np.int64)
    if R.size and R.max() > K:
        raise ValueError(f"rank_paths values must lie in 0..{K} (rank_cap), got max {R.max()}")
    n = len(R)
    bounds, start = [], 0
    for r in rolls:
        bounds.append((start, start + len(r["rank_paths"])))
        start += len(r["rank_paths"])
    tokens = sum(max(e - s - 1, 0) for s, e in bounds)
    if tokens == 0:
        raise ValueError("nothing to grow on: every continuation has T <= 1 tokens")
    base = key_base(K)
    # next_key[i, d]: key of R[i, :d+1] when that prefix could still be a node (its last rank < K), else -1
    next_key = np.where(R < K, prefix_keys(R, base), -1) if n else np.zeros((0, max_depth), np.int64)
    next_key = np.concatenate([next_key, np.full((n, 1), -1, dtype=np.int64)], axis=1)  # depth max_depth: nothing next
    rows = np.arange(n)
    a = np.zeros(n, dtype=np.int64)  # accepted length under the current tree (the empty tree at first)
    ext = next_key[rows, a]  # key of the prefix one past the accepted path

    result = GrowResult(max_depth=max_depth, rank_cap=K)
    tree: list[Path] = []
    n_children: dict[Path, int] = {(): 0}
    visited = _walk_mask(a.tolist(), bounds, n)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=budget, desc=f"grow depth<={max_depth}", leave=False)
    while len(tree) < budget:
        candidates = [
            p + (c,) for p, c in n_children.items() if len(p) < max_depth and c < K
        ]
        if not candidates:
            break
        vis_ext = ext[visited]
        keys, counts = np.unique(vis_ext[vis_ext >= 0], return_counts=True)
        gain_of = dict(zip(keys.tolist(), counts.tolist()))
        scored = [(-gain_of.get(path_key(c, base), 0), sum(c), len(c), c) for c in candidates]
        neg_gain, _, _, best = min(scored)
        n_vis = int(visited.sum())
        result.score.append((float(a[visited].sum()) - neg_gain) / n_vis)

        # add `best`: steps whose next prefix is `best` now accept one more token
        tree.append(best)
        n_children[best[:-1]] += 1
        n_children[best] = 0
        hit = np.flatnonzero(ext == path_key(best, base))
        a[hit] += 1
        ext[hit] = next_key[hit, a[hit]]

        visited = _walk_mask(a.tolist(), bounds, n)
        steps = int(visited.sum())
        result.trees.append(_sorted_paths(tree))
        result.added.append(best)
        result.tokens_per_step.append(tokens / steps)
        result.mean_accept.append(float(a[visited].sum()) / steps)
        result.mean_accept_uniform.append(float(a.sum()) / n)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(tps=f"{tokens / steps:.3f}", refresh=False)  # refresh=True would redraw every step
    if bar is not None:
        bar.close()
    return result


def grow_frontier(
    rollouts: dict | Sequence[dict],
    max_depth: int,
    budget: int,
    progress: bool = True,
    rank_cap: int | None = None,
) -> list[list[Path]]:
    """The nested greedy trees for budgets 1..budget (tree paths after each addition)."""
    return grow(rollouts, max_depth, budget, rank_cap=rank_cap, progress=progress).trees


def grow_all_depths(
    rollouts: dict | Sequence[dict],
    max_depth: int,
    budget: int,
    rank_cap: int | None = None,
    progress: bool = True,
) -> dict[int, GrowResult]:
    """`grow` for every max depth 1..max_depth (the acceptance frontier of the grow stage)."""
    return {d: grow(rollouts, d, budget, rank_cap=rank_cap, progress=progress) for d in range(1, max_depth + 1)}


# ----------------------------------------------------------------------------- position-uniform optimum


def _rank_arrays(rank_paths: Any, rank_cap: int | None) -> tuple[list[np.ndarray], int | None]:
    """Arrays [T, D] from one array, a list of arrays, or rollout dicts (whose K is then known)."""
    items = [rank_paths] if isinstance(rank_paths, (np.ndarray, dict)) else list(rank_paths)
    if not items:
        raise ValueError("no rank paths given")
    if all(isinstance(x, dict) for x in items):
        rolls = as_rollouts(items)
        return [r["rank_paths"] for r in rolls], rank_cap_of(rolls, rank_cap)
    return [np.asarray(x) for x in items], rank_cap


def _prefix_counts(rank_paths: Any, max_depth: int, rank_cap: int | None) -> tuple[dict[Path, int], int]:
    arrays, rank_cap = _rank_arrays(rank_paths, rank_cap)
    arrays = [np.asarray(x) for x in arrays]
    if any(x.ndim != 2 for x in arrays):
        raise ValueError("rank_paths must be int arrays [T, D]")
    D = min(x.shape[1] for x in arrays)
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= D:
        raise ValueError(f"max_depth must be an int in 1..{D} (the number of heads), got {max_depth!r}")
    R = np.concatenate([x[:, :max_depth] for x in arrays]).astype(np.int64)
    if R.size and R.min() < 0:
        raise ValueError("rank_paths has negative ranks")
    K = int(rank_cap) if rank_cap is not None else (int(R.max()) + 1 if R.size else 1)
    if R.size and R.max() > K:
        raise ValueError(f"rank_paths values must lie in 0..{K} (rank_cap), got max {R.max()}")
    base = key_base(K)
    ok = np.cumprod(R < K, axis=1).astype(bool)  # a prefix can be a node only if every rank < K
    keys, counts = np.unique(prefix_keys(R, base)[ok], return_counts=True)
    out: dict[Path, int] = {}
    for key, c in zip(keys.tolist(), counts.tolist()):
        digits = []
        while key:
            key, d = divmod(key, base)
            digits.append(d - 1)
        out[tuple(reversed(digits))] = c
    return out, K


def _fill(chosen: list[Path], budget: int, max_depth: int, K: int) -> list[Path]:
    """Top up with never-observed nodes (zero gain) in the growth order: smaller rank sum, shallower."""
    present = set(chosen)
    chosen = list(chosen)
    while len(chosen) < budget:
        n_children: dict[Path, int] = {(): 0}
        for p in chosen:
            n_children.setdefault(p, 0)
            n_children[p[:-1]] = n_children.get(p[:-1], 0) + 1
        cands = [p + (c,) for p, c in n_children.items() if len(p) < max_depth and c < K and p + (c,) not in present]
        if not cands:
            break
        best = min(cands, key=lambda c: (sum(c), len(c), c))
        chosen.append(best)
        present.add(best)
    return chosen


def _best_closed_subset(counts: dict[Path, int], budget: int) -> list[Path]:
    """Exact max-weight set of `budget` nodes closed under "parent and left sibling present".

    In the left-child/right-sibling view each node has one predecessor (its left sibling, or its
    parent for rank 0), so the valid trees are the rooted subtrees of a binary tree: a knapsack DP
    over it. Gap nodes (unobserved, weight 0) are added so that every observed node is reachable.
    """
    universe = set(counts)
    for p in list(counts):
        for r in range(p[-1]):
            universe.add(p[:-1] + (r,))
        for d in range(1, len(p)):
            universe.add(p[:d])
    for p in list(universe):  # gap fillers' own left siblings / prefixes
        for r in range(p[-1]):
            universe.add(p[:-1] + (r,))
    order = sorted(universe, key=lambda p: (-len(p), -p[-1]))  # children and right siblings first
    f: dict[Path, np.ndarray] = {}
    split: dict[Path, np.ndarray] = {}
    empty = np.zeros(1, dtype=np.int64)
    for v in order:
        fc = f.get(v + (0,), empty)
        fs = f.get(v[:-1] + (v[-1] + 1,), empty)
        L = min(len(fc) + len(fs) - 1, budget)  # sizes 0..L-1 of the combined children part
        g = np.full(L, -1, dtype=np.int64)
        arg = np.zeros(L, dtype=np.int64)
        for s1 in range(min(len(fc), L)):
            m = min(len(fs), L - s1)
            cand = fc[s1] + fs[:m]
            seg = g[s1 : s1 + m]
            better = cand > seg
            seg[better] = cand[better]
            arg[s1 : s1 + m][better] = s1
        f[v] = np.concatenate([[0], counts.get(v, 0) + g])
        split[v] = arg
    if (0,) not in f:
        return []
    chosen: list[Path] = []
    stack = [((0,), min(budget, len(f[(0,)]) - 1))]
    while stack:
        v, s = stack.pop()
        if s == 0:
            continue
        chosen.append(v)
        s1 = int(split[v][s - 1])
        stack.append((v + (0,), s1))
        stack.append((v[:-1] + (v[-1] + 1,), s - 1 - s1))
    return chosen


def top_count_tree(
    rank_paths: np.ndarray | Sequence[np.ndarray],
    budget: int,
    max_depth: int,
    rank_cap: int | None = None,
) -> list[Path]:
    """The valid tree of `budget` nodes (depth <= max_depth) with the largest mean accepted length
    over all step indices (the position-uniform objective), exactly.

    That mean is sum over nodes of count(node) / n, count = how many R[i] start with the node. The
    top-`budget` prefixes by count are prefix-closed (a prefix counts at least as often as its
    extension; ties go shallower first) and are returned when they also have no sibling gap; when
    a rank-(r+1) node outcounts its rank-r sibling a knapsack DP finds the best valid tree instead.
    With fewer observed prefixes than `budget`, zero-count nodes are added in growth order.
    rank_paths: one array [T, D], a list of them, or rollout dicts. rank_cap: K (prefixes holding
    K are never nodes); for rollout dicts it is read off the data when omitted, for bare arrays
    omitting it means every value is a real rank.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int (nodes, root excluded), got {budget!r}")
    counts, K = _prefix_counts(rank_paths, max_depth, rank_cap)
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    present = set(ranked)
    if all(p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present for p in ranked):
        chosen = ranked
    else:
        chosen = _best_closed_subset(counts, budget)
    return _sorted_paths(_fill(chosen, budget, max_depth, K))


def uniform_objective(rank_paths: Any, tree: Sequence[Path], rank_cap: int | None = None) -> float:
    """Mean accepted length of `tree` over every step index (what `top_count_tree` maximises)."""
    from pipeline.replay.accept import accept_lengths

    arrays, rank_cap = _rank_arrays(rank_paths, rank_cap)
    total = sum(int(accept_lengths(x, tree, rank_cap).sum()) for x in arrays)
    n = sum(len(x) for x in arrays)
    if n == 0:
        raise ValueError("no step indices to average over")
    return total / n
