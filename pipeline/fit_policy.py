"""Fit the per-step policies of a bank by exact replay of the calibration rank paths.

Objective everywhere: replayed tokens per second = tokens / sum of the chosen trees' measured
step costs (see `pipeline.replay` for the counting). Fitted per signal, best kept per kind:

* static: the single best tree (EntMTP*);
* hysteresis (EntMTPτ): every (small, large) pair of bank trees, τ_on = τ_off = τ over the
  paper's grid {0.001, 0.005, 0.01, 0.02, 0.05} and the signal's quantiles; then τ_off < τ_on
  over the same grid for the best pair;
* ladder (EntMTP-l): K - 1 thresholds over all K trees, coordinate search over the signal's
  quantiles (plus values outside the signal's range, so a ladder can skip a tree);
* expected_throughput: signal buckets at quantiles, per bucket and tree the mean tokens per step,
  argmax tokens/step / cost per bucket;

plus the oracle schedule, the ceiling for any policy over this bank. Quantiles are taken from the
signal's values along the best static tree's decode (a stateful signal such as an EMA only has
values along a decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.replay import BankReplay, PolicyReplay, oracle_replay, replay_policy
from runtime.policy import (
    ExpectedThroughputPolicy,
    HysteresisPolicy,
    LadderPolicy,
    Policy,
    StaticPolicy,
    make_signal,
)

PAPER_TAUS = (0.001, 0.005, 0.01, 0.02, 0.05)
DEFAULT_SIGNALS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("paper", {}),  # = p0 (see runtime.policy.paper_signal)
    ("path_value", {}),
    ("accept_ema", {"alpha": 0.5, "init": 1.0}),
    ("entropy_ema", {"alpha": 0.5}),
)


def signal_trace(data: BankReplay, signal: str, params: dict[str, Any], tree: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Signal values along the decode with the fixed tree `tree`.

    Returns (all values pooled, per prompt visited step indices, per prompt values).
    """
    sig = make_signal(signal, params)
    vals, visits = [], []
    for n, rows in enumerate(data.accept_rows):
        row = rows[tree]
        T = len(row)
        p0 = data.p0[n] or [0.0] * T
        ht = data.head_top1[n] or [()] * T
        ent = data.entropy[n] or [0.0] * T
        sig.reset()
        v, vis = [], []
        i = 0
        while i < T - 1:
            v.append(sig.observe(p0[i], ht[i], ent[i]))
            vis.append(i)
            sig.update(row[i])
            i += row[i] + 1
        vals.append(np.asarray(v, dtype=np.float64))
        visits.append(np.asarray(vis, dtype=np.int64))
    return np.concatenate(vals) if vals else np.zeros(0), visits, vals


def quantile_grid(values: np.ndarray, n: int) -> list[float]:
    """Distinct interior quantiles of `values` (n - 1 levels), as Python floats."""
    if len(values) == 0 or n < 2:
        return []
    q = np.quantile(values, np.linspace(0, 1, n + 1)[1:-1])
    return sorted({float(x) for x in q})


def _entry(policy: Policy, rep: PolicyReplay) -> dict[str, Any]:
    return {"policy": policy.to_dict(), **rep.summary()}


class _Fitter:
    def __init__(self, data: BankReplay, step_costs: np.ndarray) -> None:
        self.data = data
        self.costs = step_costs
        self.n_replays = 0

    def score(self, policy: Policy) -> tuple[float, PolicyReplay]:
        rep = replay_policy(self.data, None, policy, self.costs)
        self.n_replays += 1
        return rep.tokens_per_second, rep

    def best(self, policies: Sequence[Policy]) -> tuple[Policy, PolicyReplay] | None:
        best = None
        for p in policies:
            tps, rep = self.score(p)
            if best is None or tps > best[0]:
                best = (tps, p, rep)
        return None if best is None else (best[1], best[2])


def fit_hysteresis(
    fitter: _Fitter, signal: str, params: dict[str, Any], grid: list[float], paper_only: bool = False
) -> tuple[Policy, PolicyReplay] | None:
    n = fitter.data.n_trees
    if n < 2:
        return None
    taus = sorted(set(PAPER_TAUS) | (set() if paper_only else set(grid)))
    pairs = [(s, l) for s in range(n) for l in range(s + 1, n)]
    found = fitter.best([HysteresisPolicy(t, t, s, l, signal, params) for s, l in pairs for t in taus])
    if found is None or paper_only:
        return found
    pol, _ = found
    # a dead band: tau_off < tau_on, for the best pair only
    band = [
        HysteresisPolicy(on, off, pol.small, pol.large, signal, params)
        for on in taus
        for off in taus
        if off < on
    ]
    cand = fitter.best([pol] + band)
    return cand


def fit_ladder(
    fitter: _Fitter, signal: str, params: dict[str, Any], grid: list[float], sweeps: int = 2
) -> tuple[Policy, PolicyReplay] | None:
    n = fitter.data.n_trees
    if n < 2 or not grid:
        return None
    # below/above-range sentinels let a ladder skip trees (a band that no signal value reaches)
    lo, hi = grid[0], grid[-1]
    span = max(hi - lo, 1.0)
    ext = [lo - span * (n - j) for j in range(n - 1)] + list(grid) + [hi + span * (j + 1) for j in range(n - 1)]
    # start: the real grid split evenly
    m = len(grid)
    idx = [n - 1 + min(m - 1, (j + 1) * m // n) for j in range(n - 1)]
    for j in range(1, n - 1):  # keep strictly increasing
        idx[j] = max(idx[j], idx[j - 1] + 1)
    if idx[-1] >= len(ext):
        idx = list(range(n - 1, 2 * (n - 1)))

    def make(ix: list[int]) -> LadderPolicy:
        return LadderPolicy([ext[i] for i in ix], None, signal, params)

    best_tps, best_rep = fitter.score(make(idx))
    for _ in range(sweeps):
        improved = False
        for j in range(n - 1):
            lo_i = idx[j - 1] + 1 if j > 0 else 0
            hi_i = idx[j + 1] - 1 if j < n - 2 else len(ext) - 1
            for c in range(lo_i, hi_i + 1):
                if c == idx[j]:
                    continue
                trial = idx[:j] + [c] + idx[j + 1 :]
                tps, rep = fitter.score(make(trial))
                if tps > best_tps:
                    best_tps, best_rep, idx, improved = tps, rep, trial, True
        if not improved:
            break
    return make(idx), best_rep


def fit_expected_throughput(
    fitter: _Fitter,
    signal: str,
    params: dict[str, Any],
    visits: list[np.ndarray],
    values: list[np.ndarray],
    bucket_counts: Sequence[int] = (2, 4, 8),
) -> tuple[Policy, PolicyReplay] | None:
    data = fitter.data
    pooled = np.concatenate(values) if values else np.zeros(0)
    if len(pooled) == 0:
        return None
    # tokens each tree would emit at each traced step: min(a + 1, T - 1 - i)
    emitted = np.concatenate(
        [np.minimum(acc[:, v] + 1, acc.shape[1] - 1 - v) for acc, v in zip(data.accept, visits)], axis=1
    ).astype(np.float64)  # [n_trees, steps]
    overall = emitted.mean(axis=1)
    policies = []
    for nb in bucket_counts:
        edges = quantile_grid(pooled, nb)
        bucket = np.searchsorted(np.asarray(edges), pooled, side="right")
        table = []
        for b in range(len(edges) + 1):
            sel = bucket == b
            table.append((emitted[:, sel].mean(axis=1) if sel.any() else overall).tolist())
        policies.append(ExpectedThroughputPolicy(edges, table, fitter.costs.tolist(), signal, params))
    return fitter.best(policies)


def fit_policies(
    rollouts: dict | Sequence[dict] | BankReplay,
    trees: Sequence[Any] | None,
    step_costs: Sequence[float] | np.ndarray,
    signals: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_SIGNALS,
    rank_cap: int | None = None,
    n_quantiles: int = 16,
) -> dict[str, Any]:
    """Fit every policy kind over the bank `trees` (ordered by size) with measured `step_costs`.

    Returns a JSON-able dict: per kind ("static", "hysteresis", "hysteresis_paper_grid",
    "ladder", "expected_throughput") the best policy dict with its replayed figures (steps,
    tokens, tokens_per_step, time_s, tokens_per_second, tree_share), "oracle" figures,
    "best_kind" (highest replayed tokens per second) and "n_replays".
    """
    data = rollouts if isinstance(rollouts, BankReplay) else BankReplay.build(rollouts, trees or [], rank_cap)
    costs = np.asarray(step_costs, dtype=np.float64)
    if costs.shape != (data.n_trees,) or not np.all(np.isfinite(costs)) or np.any(costs <= 0):
        raise ValueError(f"step_costs must be {data.n_trees} positive seconds (one per bank tree), got {step_costs!r}")
    fitter = _Fitter(data, costs)
    out: dict[str, Any] = {}

    static = fitter.best([StaticPolicy(k) for k in range(data.n_trees)])
    assert static is not None
    out["static"] = _entry(*static)
    ref_tree = static[0].index

    fits: dict[str, list[tuple[Policy, PolicyReplay]]] = {"hysteresis": [], "hysteresis_paper_grid": [], "ladder": [], "expected_throughput": []}
    for name, params in signals:
        pooled, visits, values = signal_trace(data, name, params, ref_tree)
        grid = quantile_grid(pooled, n_quantiles)
        for kind, fitted in (
            ("hysteresis", fit_hysteresis(fitter, name, params, grid)),
            ("hysteresis_paper_grid", fit_hysteresis(fitter, name, params, grid, paper_only=True)),
            ("ladder", fit_ladder(fitter, name, params, grid)),
            ("expected_throughput", fit_expected_throughput(fitter, name, params, visits, values)),
        ):
            if fitted is not None:
                fits[kind].append(fitted)
    for kind, cands in fits.items():
        if cands:
            pol, rep = max(cands, key=lambda pr: pr[1].tokens_per_second)
            out[kind] = _entry(pol, rep)

    out["oracle"] = oracle_replay(data, None, costs).summary()
    kinds = [k for k in ("static", "hysteresis", "ladder", "expected_throughput") if k in out]
    out["best_kind"] = max(kinds, key=lambda k: out[k]["tokens_per_second"])
    out["n_replays"] = fitter.n_replays
    return out
