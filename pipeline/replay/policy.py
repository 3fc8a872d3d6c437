"""Replay of per-step policies over a bank of trees (`replay_policy`), for one sequence and for a
batch of sequences decoding together (`replay_batch`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.replay.accept import PrefixIndex, as_rollouts
from runtime.policy import HysteresisPolicy, Policy, Scheduler, make_signal

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

