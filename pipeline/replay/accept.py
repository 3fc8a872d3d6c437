"""Accepted lengths of a tree from rank paths, the positions a decode visits, and tokens per step of
one tree (`replay_tree`). The conventions are in the package docstring (`pipeline.replay`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Path = tuple[int, ...]


def tree_paths(tree: Any) -> list[Path]:
    """The paths of a tree: a `runtime.tree.Tree` (its `.paths`) or any iterable of rank sequences.

    Checks what replay relies on: non-empty tuples of non-negative ints, every prefix present.
    (Sibling-rank gaps do not matter to replay; `runtime.tree.Tree` checks those.)
    """
    raw = tree.paths if hasattr(tree, "paths") else tree
    paths: list[Path] = []
    for p in raw:
        if isinstance(p, (str, bytes)) or not isinstance(p, Iterable):
            raise ValueError(f"a tree path must be a sequence of ranks, got {p!r}")
        t = tuple(p)
        if not t or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0 for r in t):
            raise ValueError(f"a tree path must be a non-empty tuple of non-negative ints, got {p!r}")
        paths.append(tuple(int(r) for r in t))
    present = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"tree is not prefix-closed: path {p} is present but its prefix {p[:-1]} is not")
    return paths


def as_rollouts(rollouts: dict | Sequence[dict]) -> list[dict]:
    """Accept one rollout dict or a list of them; check `rank_paths` and the signal arrays' shapes."""
    items = [rollouts] if isinstance(rollouts, dict) else list(rollouts)
    if not items:
        raise ValueError("no rollouts given: need at least one prompt's arrays")
    out = []
    for n, r in enumerate(items):
        if not isinstance(r, dict) or "rank_paths" not in r:
            raise ValueError(f"rollout {n} must be a dict with a 'rank_paths' array [T, D]")
        rp = np.asarray(r["rank_paths"])
        if rp.ndim != 2 or not np.issubdtype(rp.dtype, np.integer):
            raise ValueError(f"rollout {n}: rank_paths must be an int array [T, D], got {rp.dtype} {rp.shape}")
        if rp.size and rp.min() < 0:
            raise ValueError(f"rollout {n}: rank_paths has negative ranks")
        T, D = rp.shape
        for key, shape in (("p0", (T,)), ("head_top1", (T, D)), ("greedy_top1", (T, D)), ("entropy", (T,))):
            if key in r and r[key] is not None and np.shape(r[key]) != shape:
                raise ValueError(f"rollout {n}: {key} has shape {np.shape(r[key])}, expected {shape} to match rank_paths")
        out.append({**r, "rank_paths": rp})
    depths = {r["rank_paths"].shape[1] for r in out}
    if len(depths) != 1:
        raise ValueError(f"rollouts disagree on the number of heads D: {sorted(depths)}")
    return out


def rank_cap_of(rollouts: Sequence[dict], rank_cap: int | None = None) -> int:
    """K: the explicit argument, else the rollouts' `rank_cap` field, else read off the data.

    By the rank-path convention the last row R[T-1] is all K (no y_{T+1..T+D} exists), so a
    rollout carries its own K; all prompts must agree, and no rank may exceed it.
    """
    if rank_cap is None:
        caps = {int(r["rank_cap"]) for r in rollouts if r.get("rank_cap") is not None}
        if not caps:
            for n, r in enumerate(rollouts):
                rp = np.asarray(r["rank_paths"])
                if len(rp) == 0 or rp.shape[1] == 0:
                    continue
                last = np.unique(rp[-1])
                if len(last) != 1:
                    raise ValueError(
                        f"rollout {n}: cannot infer rank_cap, its last row {rp[-1].tolist()} is not all K "
                        "(rank-path convention); pass rank_cap= or store 'rank_cap' in the rollout"
                    )
                caps.add(int(last[0]))
        if len(caps) > 1:
            raise ValueError(f"rollouts disagree on rank_cap: {sorted(caps)}")
        if not caps:
            raise ValueError("rank_cap (K) unknown and the rollouts are empty: pass rank_cap=")
        rank_cap = caps.pop()
    if isinstance(rank_cap, bool) or not isinstance(rank_cap, (int, np.integer)) or rank_cap < 1:
        raise ValueError(f"rank_cap must be a positive int, got {rank_cap!r}")
    K = int(rank_cap)
    for n, r in enumerate(rollouts):
        rp = np.asarray(r["rank_paths"])
        if rp.size and rp.max() > K:
            raise ValueError(f"rollout {n}: rank {int(rp.max())} exceeds rank_cap {K}; ranks are capped at K")
    return K


def key_base(rank_cap: int) -> int:
    """Radix of prefix keys: digit r + 1 in 1..K + 1 (0 never occurs, so prefixes of different
    lengths get different keys)."""
    return int(rank_cap) + 2


def prefix_keys(rank_paths: np.ndarray, base: int) -> np.ndarray:
    """int64 [T, D]: column d is the key of the prefix R[i, :d+1]."""
    rp = np.asarray(rank_paths, dtype=np.int64)
    T, D = rp.shape
    if D and float(base) ** D >= 2.0**62:
        raise ValueError(f"prefix keys would overflow int64 (base {base}, depth {D}): lower rank_cap or depth")
    keys = np.empty((T, D), dtype=np.int64)
    k = np.zeros(T, dtype=np.int64)
    for d in range(D):
        k = k * base + rp[:, d] + 1
        keys[:, d] = k
    return keys


def path_key(path: Sequence[int], base: int) -> int:
    k = 0
    for r in path:
        k = k * base + int(r) + 1
    return k


_TABLE_MAX = 1 << 24  # membership by a lookup table over all possible keys when that few exist


def _check_tree_for(paths: list[Path], D: int, K: int | None) -> None:
    if paths and max(len(p) for p in paths) > D:
        raise ValueError(f"tree has depth {max(len(p) for p in paths)} but the rank paths only cover D = {D} heads")
    if K is not None:
        bad = [p for p in paths if max(p) >= K]
        if bad:
            raise ValueError(f"tree path {bad[0]} has a rank >= rank_cap {K}: the rollout cannot score it")


def _accept_from_keys(keys: np.ndarray, paths: list[Path], base: int) -> np.ndarray:
    """Run length of member prefixes from depth 1 (for a prefix-closed tree: the accepted length)."""
    N, D = keys.shape
    if N == 0 or not paths or D == 0:
        return np.zeros(N, dtype=np.int32)
    tree_keys = np.fromiter((path_key(p, base) for p in paths), dtype=np.int64, count=len(paths))
    if base**D <= _TABLE_MAX:
        table = np.zeros(base**D, dtype=bool)
        table[tree_keys] = True
        member = table[keys]
    else:
        member = np.isin(keys, tree_keys)
    # index of the first non-member prefix (argmin of a bool row), D when all are members
    return np.where(member.all(axis=1), D, member.argmin(axis=1)).astype(np.int32)


def accept_lengths(rank_paths: np.ndarray, tree: Any, rank_cap: int | None = None) -> np.ndarray:
    """Accepted draft length at every step index: longest prefix of R[i] that is a node of `tree`.

    rank_paths: int [T, D]. tree: a Tree or an iterable of paths. With `rank_cap` (K) given, tree
    ranks must be < K and R values <= K (pass it: K in R means "not in the top K", which a tree
    rank K must not match). Without it, ranks are matched literally.
    Returns int32 [T]. For many trees over many prompts, `PrefixIndex` computes the keys once.
    """
    rp = np.asarray(rank_paths)
    if rp.ndim != 2:
        raise ValueError(f"rank_paths must be [T, D], got shape {rp.shape}")
    D = rp.shape[1]
    paths = tree_paths(tree)
    _check_tree_for(paths, D, rank_cap)
    if rank_cap is not None:
        K = int(rank_cap)
        if rp.size and (rp.min() < 0 or rp.max() > K):
            raise ValueError(f"rank_paths values must lie in 0..{K} (rank_cap), got {rp.min()}..{rp.max()}")
    else:
        K = max([int(rp.max()) if rp.size else 0] + [max(p) for p in paths]) + 1
    base = key_base(K)
    return _accept_from_keys(prefix_keys(rp, base), paths, base)


class PrefixIndex:
    """The prefix keys of many prompts' rank paths, computed once, to score many trees fast."""

    def __init__(self, rollouts: dict | Sequence[dict], rank_cap: int | None = None) -> None:
        rolls = as_rollouts(rollouts)
        self.rank_cap = rank_cap_of(rolls, rank_cap)
        self.base = key_base(self.rank_cap)
        self.lengths = [len(r["rank_paths"]) for r in rolls]
        self.splits = np.cumsum(self.lengths)[:-1]
        self.depth = rolls[0]["rank_paths"].shape[1]
        self.keys = prefix_keys(np.concatenate([r["rank_paths"] for r in rolls]), self.base)

    def accept_all(self, tree: Any) -> np.ndarray:
        """Accepted lengths at every step index of every prompt, concatenated, int32 [sum T]."""
        paths = tree_paths(tree)
        _check_tree_for(paths, self.depth, self.rank_cap)
        return _accept_from_keys(self.keys, paths, self.base)

    def accept(self, tree: Any) -> list[np.ndarray]:
        """Accepted lengths per prompt."""
        return np.split(self.accept_all(tree), self.splits)


def walk(accept_len: Sequence[int] | np.ndarray, start: int = 0) -> np.ndarray:
    """Step indices a fixed-tree decode visits: i_0 = start, i_{s+1} = i_s + a(i_s) + 1, while i < T - 1.

    (At i = T - 1 all T tokens are known, so no step runs there; see the module docstring.)
    """
    a = np.asarray(accept_len).tolist()
    T = len(a)
    out = []
    i = start
    while i < T - 1:
        out.append(i)
        i += a[i] + 1
    return np.asarray(out, dtype=np.int64)


def step_tokens(accept_len: np.ndarray, visited: np.ndarray) -> np.ndarray:
    """Tokens emitted by each visited step: min(a + 1, T - 1 - i)."""
    a = np.asarray(accept_len)
    T = len(a)
    return np.minimum(a[visited] + 1, T - 1 - visited)


def replay_tokens_per_step(
    accept_lens: np.ndarray | Sequence[np.ndarray] | dict | Sequence[dict], tree: Any = None, rank_cap: int | None = None
) -> float:
    """Tokens per step of a fixed-tree decode, pooled over prompts: sum(T - 1) / sum(steps).

    Either `replay_tokens_per_step(accept_lens)` with one prompt's accepted lengths [T] or a list
    of them, or `replay_tokens_per_step(rollouts, tree)` with rollout dicts and a tree.
    """
    if tree is not None:
        return replay_tree(accept_lens, tree, rank_cap).tokens_per_step  # type: ignore[arg-type]
    if isinstance(accept_lens, np.ndarray) and accept_lens.ndim == 1:
        accept_lens = [accept_lens]
    steps = tokens = 0
    for a in accept_lens:
        if isinstance(a, dict):
            raise ValueError("replay_tokens_per_step got rollout dicts but no tree: call it as (rollouts, tree)")
        steps += len(walk(a))
        tokens += max(len(a) - 1, 0)
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    return tokens / steps


def prompt_replays(rollouts: dict | Sequence[dict], trees: Sequence[Any], rank_cap: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """([trees, prompts] tokens, [trees, prompts] steps) of each fixed tree's replay on each prompt:
    the parts `replay_tree` pools, kept apart so the prompts can be resampled."""
    index = PrefixIndex(rollouts, rank_cap)
    tokens, steps = [], []
    for tree in trees:
        accepts = index.accept(tree)
        tokens.append([max(len(a) - 1, 0) for a in accepts])
        steps.append([len(walk(a)) for a in accepts])
    return np.asarray(tokens, dtype=np.int64), np.asarray(steps, dtype=np.int64)


@dataclass
class TreeReplay:
    steps: int
    tokens: int  # emitted by steps: sum(T - 1)
    tokens_per_step: float
    mean_accept_visited: float  # mean accepted draft length over the visited steps (clip not applied)
    mean_accept_uniform: float  # mean accepted length over all step indices (the position-uniform objective)


def replay_tree(rollouts: dict | Sequence[dict], tree: Any, rank_cap: int | None = None) -> TreeReplay:
    """Replay a fixed tree over rollouts."""
    index = PrefixIndex(rollouts, rank_cap)
    steps = tokens = acc_vis = acc_all = n_all = 0
    for a in index.accept(tree):
        v = walk(a)
        steps += len(v)
        tokens += max(len(a) - 1, 0)
        acc_vis += int(a[v].sum())
        acc_all += int(a.sum())
        n_all += len(a)
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    return TreeReplay(steps, tokens, tokens / steps, acc_vis / steps, acc_all / max(n_all, 1))

