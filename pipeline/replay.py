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

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.policy import HysteresisPolicy, Policy, Scheduler, make_signal

Path = tuple[int, ...]

# ----------------------------------------------------------------------------- inputs


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


# ----------------------------------------------------------------------------- keys


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


# ----------------------------------------------------------------------------- accept lengths and walks


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


# ----------------------------------------------------------------------------- policies over a bank

_NEEDS = {"paper": ("p0", "head_top1"), "p0": ("p0",), "greedy_path": ("p0", "head_top1"), "entropy_ema": ("entropy",)}


@dataclass
class BankReplay:
    """Accepted lengths of every bank tree at every step index, per prompt, plus the signal inputs as
    Python lists: build once, replay many policies."""

    accept: list[np.ndarray]  # per prompt [n_trees, T] int32
    accept_rows: list[list[list[int]]]  # the same as lists (the per-step loop reads these)
    p0: list[list[float] | None]
    head_top1: list[list[list[float]] | None]
    entropy: list[list[float] | None]
    n_trees: int
    rank_cap: int
    _signal_cache: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, rollouts: dict | Sequence[dict], trees: Sequence[Any], rank_cap: int | None = None) -> "BankReplay":
        rolls = as_rollouts(rollouts)
        if not trees:
            raise ValueError("the bank has no trees")
        index = PrefixIndex(rolls, rank_cap)
        K = index.rank_cap
        per_tree = np.stack([index.accept_all(t) for t in trees])  # [n_trees, sum T]
        accept = np.split(per_tree, index.splits, axis=1)

        def lists(key: str) -> list:
            return [None if r.get(key) is None else np.asarray(r[key], dtype=np.float64).tolist() for r in rolls]

        greedy, teacher = lists("greedy_top1"), lists("head_top1")
        heads = [g if g is not None else h for g, h in zip(greedy, teacher)]
        return cls(accept, [a.tolist() for a in accept], lists("p0"), heads, lists("entropy"), len(trees), K)

    @property
    def tokens(self) -> int:
        return sum(max(a.shape[1] - 1, 0) for a in self.accept)

    def signal_values(self, name: str) -> list[np.ndarray]:
        """Per prompt, a stateless signal's value at every step index, computed by the runtime's own
        `observe` (so the floats are exactly what a decoder would see). Cached."""
        if name not in self._signal_cache:
            sig = make_signal(name)
            if not sig.stateless:
                raise ValueError(f"signal {name!r} depends on the decode's history; it has no per-position values")
            out = []
            for n, rows in enumerate(self.accept_rows):
                T = len(rows[0])
                for key in _NEEDS.get(name, ()):
                    if getattr(self, key)[n] is None:
                        raise ValueError(f"signal {name!r} needs '{key}' but rollout {n} has none")
                p0 = self.p0[n] or [0.0] * T
                ht = self.head_top1[n] or [()] * T
                ent = self.entropy[n] or [0.0] * T
                out.append(np.asarray([sig.observe(p0[i], ht[i], ent[i]) for i in range(T)], dtype=np.float64))
            self._signal_cache[name] = out
        return self._signal_cache[name]


@dataclass
class PolicyReplay:
    steps: int
    tokens: int
    tokens_per_step: float
    choices: list[np.ndarray]  # per prompt: tree index chosen at each step
    tree_steps: np.ndarray  # [n_trees] how many steps used each tree
    time_s: float | None = None  # sum of the chosen trees' step costs
    tokens_per_second: float | None = None
    visited: list[np.ndarray] = field(default_factory=list)  # per prompt: step indices visited

    def summary(self) -> dict[str, Any]:
        share = (self.tree_steps / max(self.steps, 1)).round(4).tolist()
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_step": self.tokens_per_step,
            "time_s": self.time_s,
            "tokens_per_second": self.tokens_per_second,
            "tree_share": share,
        }


def _check_costs(step_costs: Sequence[float] | np.ndarray | None, n_trees: int) -> np.ndarray | None:
    if step_costs is None:
        return None
    c = np.asarray(step_costs, dtype=np.float64)
    if c.shape != (n_trees,) or not np.all(np.isfinite(c)) or np.any(c <= 0):
        raise ValueError(f"step_costs must be {n_trees} positive finite seconds (one per bank tree), got {step_costs!r}")
    return c


def replay_policy(
    rollouts: dict | Sequence[dict] | BankReplay,
    trees: Sequence[Any] | None,
    policy: Policy | Scheduler | dict,
    step_costs: Sequence[float] | np.ndarray | None = None,
    rank_cap: int | None = None,
    exact_loop: bool = False,
) -> PolicyReplay:
    """Replay a per-step tree choice over the bank `trees` (ordered by size).

    At each visited step i the scheduler sees (p0[i], head_top1[i], entropy[i]) exactly as the
    decoder would, picks tree k, the step accepts a_k(i) drafts, and the scheduler is updated with
    a_k(i). Pass a prebuilt `BankReplay` (and trees=None) to replay many policies cheaply.
    exact_loop=True turns the fast paths off (every step through `Scheduler`, as in a decoder);
    the results are the same, which the tests check.
    """
    data = rollouts if isinstance(rollouts, BankReplay) else BankReplay.build(rollouts, trees or [], rank_cap)
    sched = policy if isinstance(policy, Scheduler) else Scheduler.from_dict(policy) if isinstance(policy, dict) else Scheduler(policy)
    sched.policy.check_bank(data.n_trees)
    costs = _check_costs(step_costs, data.n_trees)
    pol = sched.policy
    need = _NEEDS.get(pol.signal, ())
    # Fast paths, same results: a stateless signal is precomputed per position (by the same
    # `observe`), and a memoryless policy (choose_many, no-op update) is then vectorised.
    stateless = sched.signal.stateless and not exact_loop
    vectorised = stateless and hasattr(pol, "choose_many") and type(pol).update is Policy.update
    signals = data.signal_values(pol.signal) if stateless else None
    all_choices, all_visited = [], []
    steps = 0
    for n, rows in enumerate(data.accept_rows):
        T = len(rows[0])
        ch: list[int] = []
        vis: list[int] = []
        i = 0
        if vectorised:
            choice = pol.choose_many(signals[n])
            a_pol = data.accept[n][choice, np.arange(T)].tolist()
            while i < T - 1:
                vis.append(i)
                i += a_pol[i] + 1
            ch = choice[vis].tolist()
        elif stateless and type(pol) is HysteresisPolicy:
            # the hysteresis state machine with its two comparisons done per position up front
            up = (signals[n] > pol.tau_on).tolist()
            down = (signals[n] <= pol.tau_off).tolist()
            small, large = pol.small, pol.large
            row_s, row_l = rows[small], rows[large]
            cur = large if pol.start == "large" else small
            while i < T - 1:
                if cur == small:
                    if up[i]:
                        cur = large
                elif down[i]:
                    cur = small
                a = row_s[i] if cur == small else row_l[i]
                ch.append(cur)
                vis.append(i)
                i += a + 1
        elif stateless:
            sig = signals[n].tolist()
            pol.reset()
            choose, update = pol.choose, pol.update
            while i < T - 1:
                k = choose(sig[i])
                a = rows[k][i]
                update(a)
                ch.append(k)
                vis.append(i)
                i += a + 1
        else:
            for key in need:
                if getattr(data, key)[n] is None:
                    raise ValueError(f"signal {pol.signal!r} needs '{key}' but rollout {n} has none")
            p0 = data.p0[n] or [0.0] * T
            ht = data.head_top1[n] or [()] * T
            ent = data.entropy[n] or [0.0] * T
            sched.reset()
            choose, update = sched.choose, sched.update
            while i < T - 1:
                k = choose(p0[i], ht[i], ent[i])
                a = rows[k][i]
                update(a)
                ch.append(k)
                vis.append(i)
                i += a + 1
        steps += len(ch)
        all_choices.append(np.asarray(ch, dtype=np.int64))
        all_visited.append(np.asarray(vis, dtype=np.int64))
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    tokens = data.tokens
    tree_steps = np.bincount(np.concatenate(all_choices), minlength=data.n_trees)
    out = PolicyReplay(steps, tokens, tokens / steps, all_choices, tree_steps, visited=all_visited)
    if costs is not None:
        out.time_s = float(tree_steps @ costs)
        out.tokens_per_second = tokens / out.time_s
    return out


# ----------------------------------------------------------------------------- oracle


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


# ----------------------------------------------------------------------------- batches


def replay_batch(data: BankReplay, batch: int, choose: Callable[[list[tuple[int, int]], list[Any]], list[int]],
                 step_ms: Callable[[list[int]], float], lane_state: Callable[[], Any] | None = None,
                 update: Callable[[Any, int], None] | None = None) -> dict[str, float]:
    """Replay a batch of `batch` sequences over the rollouts: each lane decodes one prompt after
    another (continuous batching: a lane that finishes takes the next prompt; at the end the batch
    shrinks). At each step `choose(lanes, states)` gets every live lane's (prompt, position) and its
    state (`lane_state()` per prompt, e.g. a signal; `update(state, accepted)` after each step) and
    returns a tree per lane; the lanes accept their replayed lengths, and the step costs
    `step_ms(picks)` milliseconds. Returns tokens, steps, seconds and tokens per second."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    queue = list(range(len(data.accept_rows)))
    lanes: list[list[Any]] = []  # [prompt, position, state]

    def refill() -> None:
        while len(lanes) < batch and queue:
            n = queue.pop(0)
            if len(data.accept_rows[n][0]) > 1:
                lanes.append([n, 0, lane_state() if lane_state else None])

    refill()
    tokens = steps = 0
    ms = 0.0
    while lanes:
        picks = choose([(lane[0], lane[1]) for lane in lanes], [lane[2] for lane in lanes])
        ms += step_ms(picks)
        steps += 1
        for lane, k in zip(lanes, picks):
            rows = data.accept_rows[lane[0]]
            a = rows[k][lane[1]]
            if update:
                update(lane[2], a)
            moved = min(a + 1, len(rows[0]) - 1 - lane[1])
            tokens += moved
            lane[1] += a + 1
        lanes[:] = [lane for lane in lanes if lane[1] < len(data.accept_rows[lane[0]][0]) - 1]
        refill()
    return {"tokens": tokens, "steps": steps, "seconds": ms / 1000, "tokens_per_second": tokens / (ms / 1000)}


# ----------------------------------------------------------------------------- EntMTP-dyn


@dataclass
class DynamicReplay:
    """A DynamicPolicy replayed over rollouts (`replay_dynamic`)."""

    steps: int
    tokens: int
    tokens_per_step: float
    time_s: float | None
    tokens_per_second: float | None
    node_steps: np.ndarray                 # [N + 1]: steps that verified n nodes (index n)
    visited: list[np.ndarray]              # per prompt: step indices visited
    accepted: list[np.ndarray]             # per prompt: accepted length at each visited step
    nodes: list[np.ndarray]                # per prompt: nodes verified at each visited step
    depth_steps: np.ndarray                # [depth + 1]: steps that drafted the super-tree to depth d

    def summary(self) -> dict[str, Any]:
        used = {int(n): int(c) for n, c in enumerate(self.node_steps) if c}
        drafted = {int(d): int(c) for d, c in enumerate(self.depth_steps) if c}
        return {"steps": self.steps, "tokens": self.tokens, "tokens_per_step": self.tokens_per_step,
                "time_s": self.time_s, "tokens_per_second": self.tokens_per_second,
                "mean_nodes": float(sum(n * c for n, c in used.items()) / max(self.steps, 1)), "nodes_used": used,
                "drafted_depths": drafted}


def _super_index(policy: Any) -> dict[Path, int]:
    """Node index of each rank path of the policy's super-tree (the root, (), is node 0)."""
    tree = policy.super_tree.to_tree()
    return {(): 0, **{tuple(p): tree.node_index(p) for p in tree.paths}}


def accepted_in_subset(rank_path: np.ndarray, index: dict[Path, int], kept: Sequence[bool]) -> int:
    """Accepted length of a step that verifies the `kept` nodes of a super-tree (`index`: node index
    of each rank path): the longest prefix of the step's rank path that is a kept node."""
    a = 0
    for d in range(1, len(rank_path) + 1):
        j = index.get(tuple(int(x) for x in rank_path[:d]), -1)
        if j < 0 or not kept[j]:
            break
        a = d
    return a


def _checked_index(policy: Any, rolls: Sequence[dict], K: int) -> dict[Path, int]:
    """`_super_index(policy)`, after checking that the rollouts' rank paths can score its super-tree."""
    index = _super_index(policy)
    paths = [p for p in index if p]
    if paths and max(max(p) for p in paths) >= K:
        raise ValueError(f"the super-tree has a rank >= rank_cap {K}: the rollout cannot score it")
    if policy.depth > rolls[0]["rank_paths"].shape[1]:
        raise ValueError(f"the super-tree has depth {policy.depth} but the rank paths cover {rolls[0]['rank_paths'].shape[1]} heads")
    return index


def replay_dynamic(rollouts: dict | Sequence[dict], scores: Sequence[np.ndarray], policy: Any,
                   rank_cap: int | None = None, exact_costs: bool = True,
                   policy_at: Callable[[int, int], Any] | None = None) -> DynamicReplay:
    """Replay a `runtime.dynamic.DynamicPolicy` exactly over rollouts and their head scores.

    `scores[n]` is prompt n's [T, N-1] float32 head probabilities of the policy's super-tree
    (`pipeline.rollout.score_prompt`). At each visited step i the policy's own `select` picks the
    subset from those probabilities (the same float32 operations as in a decode), the step accepts
    the longest prefix of R[i] that is a node of the subset, and costs `policy.step_ms[n-1]` ms
    for n nodes; with `policy.stop_below`, the depth a decode drafts to (`drafted_depth`: the same
    per-depth rule a decode applies as it drafts) bounds the subset and prices the step
    (`step_costs`). Counting as everywhere here (module docstring): tokens per step = sum(T - 1) /
    steps, tokens per second = the same tokens / the summed step costs.
    `exact_costs=False` leaves time out (tokens per step only). `policy_at(prompt, step index)`, for
    studies, names the policy that picks each step's subset (default: `policy` at every step);
    every one must share `policy`'s super-tree and costs, which price the steps."""
    import torch

    rolls = as_rollouts(rollouts)
    if len(scores) != len(rolls):
        raise ValueError(f"{len(rolls)} rollouts but head scores for {len(scores)} prompts")
    index = _checked_index(policy, rolls, rank_cap_of(rolls, rank_cap))
    N = policy.num_nodes
    costs = [policy.step_costs(d) for d in range(policy.depth + 1)]
    steps = tokens = 0
    time_ms = 0.0
    node_steps = np.zeros(N + 1, dtype=np.int64)
    depth_steps = np.zeros(policy.depth + 1, dtype=np.int64)
    visited, accepted, nodes = [], [], []
    one = torch.ones(1, dtype=torch.float32)
    for n, (r, sc) in enumerate(zip(rolls, scores)):
        R = r["rank_paths"]
        T = len(R)
        sc = np.asarray(sc)
        if sc.shape != (T, N - 1) or sc.dtype != np.float32:
            raise ValueError(f"prompt {n}: head scores must be float32 [{T}, {N - 1}] (steps x non-root nodes of the "
                             f"super-tree), got {sc.dtype} {sc.shape}")
        probs = torch.from_numpy(np.ascontiguousarray(sc))
        vis, acc, nod = [], [], []
        i = 0
        while i < T - 1:
            prob = torch.cat([one, probs[i]])
            pol = policy if policy_at is None else policy_at(n, i)
            drafted = pol.drafted_depth(prob)
            keep, k, _ = pol.select(prob, drafted)
            a = accepted_in_subset(R[i], index, keep.tolist())
            size = int(k)
            vis.append(i)
            acc.append(a)
            nod.append(size)
            node_steps[size] += 1
            depth_steps[drafted] += 1
            time_ms += costs[drafted][size - 1]
            i += a + 1
        steps += len(vis)
        tokens += max(T - 1, 0)
        visited.append(np.asarray(vis, dtype=np.int64))
        accepted.append(np.asarray(acc, dtype=np.int64))
        nodes.append(np.asarray(nod, dtype=np.int64))
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    secs = time_ms / 1000 if exact_costs else None
    return DynamicReplay(steps, tokens, tokens / steps, secs, tokens / secs if secs else None, node_steps, visited,
                         accepted, nodes, depth_steps)


def dynamic_ceiling(rollouts: dict | Sequence[dict], policy: Any, rank_cap: int | None = None) -> dict[str, float]:
    """The hindsight ceiling of a dynamic policy's super-tree: tokens per second of the best schedule
    that knows each step's accepted path. Knowing it, a step verifies exactly the accepted chain:
    k + 1 nodes (the root and the k accepted drafts, k no longer than the path S holds at i),
    drafted down to depth max(k, 1), at `policy.step_costs(max(k, 1))[k]`; a dynamic program over
    the step indices (as `oracle_schedule`) picks every k. No subset of S, chosen from any signal,
    emits more per step or costs less, so no `DynamicPolicy` on S with these costs replays faster:
    EntMTP-dyn's replayed tok/s over this is how much of what its super-tree allows its path
    values recover. (A policy without early stop pays the whole draft on every step, so its own
    ceiling is lower; this is the ceiling of the super-tree and cost model.)"""
    rolls = as_rollouts(rollouts)
    index = _checked_index(policy, rolls, rank_cap_of(rolls, rank_cap))
    every = [True] * policy.num_nodes
    costs = [policy.step_costs(max(k, 1))[k] for k in range(policy.depth + 1)]
    time_ms = 0.0
    tokens = steps = 0
    for r in rolls:
        R = np.asarray(r["rank_paths"])
        T = len(R)
        if T < 2:
            continue
        reach = [accepted_in_subset(R[i], index, every) for i in range(T)]   # the longest prefix of R[i] in S
        best = [0.0] * T
        arg = [0] * T
        for i in range(T - 2, -1, -1):
            t_best, k_best = math.inf, 0
            for k in range(reach[i] + 1):
                t = costs[k] + best[min(i + k + 1, T - 1)]
                if t < t_best:
                    t_best, k_best = t, k
            best[i], arg[i] = t_best, k_best
        i = 0
        while i < T - 1:
            i = min(i + arg[i] + 1, T - 1)
            steps += 1
        time_ms += best[0]
        tokens += T - 1
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    return {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps, "time_s": time_ms / 1000,
            "tokens_per_second": 1000 * tokens / time_ms}


def compare_dynamic_steps(replay: DynamicReplay, prompt: int, accepted_real: Sequence[int], nodes_real: Sequence[int],
                          T: int, limit: int = 10) -> dict[str, Any]:
    """A real EntMTP-dyn decode of prompt `prompt` against its replay, step by step (recalibrate's
    check for the dynamic policy): the steps compared, how many agree on both the accepted length
    and the subset's size, and the first few disagreements. A real step may accept drafts past the
    rollout's end (then truncated), so its accepted length is compared capped at T - 1 - i."""
    vis, acc, nod = (x[prompt].tolist() for x in (replay.visited, replay.accepted, replay.nodes))
    agree, compared, out = 0, 0, []
    i = 0
    for s, (a_real, n_real) in enumerate(zip(accepted_real, nodes_real)):
        if s >= len(vis) or vis[s] != i:
            if len(out) < limit:
                out.append({"step": s, "index": i, "what": "the replay visits other step indices"})
            break
        compared += 1
        if min(a_real, T - 1 - i) == acc[s] and n_real == nod[s]:
            agree += 1
        elif len(out) < limit:
            out.append({"step": s, "index": i, "replay": [acc[s], nod[s]], "real": [a_real, n_real]})
        i += a_real + 1
    return {"steps_compared": compared, "steps_agree": agree, "real_steps": len(accepted_real),
            "replay_steps": len(vis), "disagreements": out}
