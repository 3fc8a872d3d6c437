"""Fit the per-step policies of a bank by exact replay of the calibration rank paths.

Objective everywhere: replayed tokens per second = tokens / sum of the chosen trees' measured
step costs (see `pipeline.replay` for the counting). Fitted per signal, best kept per kind:

* static: the single best tree (EntMTP*);
* hysteresis (EntMTPτ): every (small, large) pair of bank trees, τ_on = τ_off = τ over the
  paper's grid {0.001, 0.005, 0.01, 0.02, 0.05} and the signal's quantiles; then a dead band
  τ_off < τ_on around the best τ for the best pair;
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
from dataclasses import replace
from typing import Any

import numpy as np

from pipeline.replay.policy import BankReplay, PolicyReplay, replay_policy
from pipeline.replay.oracle import oracle_replay
from runtime.policy import (
    ExpectedThroughputPolicy,
    HysteresisPolicy,
    LadderPolicy,
    Policy,
    StaticPolicy,
    make_signal,
    validate_policy_config,
)

PAPER_TAUS = (0.001, 0.005, 0.01, 0.02, 0.05)
DEFAULT_SIGNALS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("paper", {}),  # = p0 (see runtime.policy.paper_signal)
    ("greedy_path", {}),
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
    def __init__(self, data: BankReplay, step_costs: np.ndarray, signal_costs: dict[str, float] | None = None) -> None:
        self.data = data
        self.costs = step_costs
        self.signal_costs = dict(signal_costs or {})
        self.n_replays = 0

    def score(self, policy: Policy) -> tuple[float, PolicyReplay]:
        rep = replay_policy(self.data, None, policy, self.costs)
        self.n_replays += 1
        # a signal that runs the heads' greedy chain costs every step the same extra time; a
        # fit that ignored it would prefer such signals for accuracy they cannot pay for
        extra = self.signal_costs.get(policy.signal, 0.0) * rep.steps
        if extra and not isinstance(policy, StaticPolicy):
            rep = replace(rep, time_s=rep.time_s + extra, tokens_per_second=rep.tokens / (rep.time_s + extra))
        return rep.tokens_per_second, rep

    def smallest_near_best(self, policies: Sequence[Policy], tolerance: float) -> tuple[Policy, PolicyReplay]:
        """The first of `policies` (ordered by size) whose tokens/s is within `tolerance` of the best."""
        from pipeline.bank.selection import smallest_near_best

        scored = [(p, *self.score(p)) for p in policies]
        p, _, rep = scored[smallest_near_best([tps for _, tps, _ in scored], tolerance)]
        return p, rep

    def best(self, policies: Sequence[Policy]) -> tuple[Policy, PolicyReplay] | None:
        best = None
        for p in policies:
            tps, rep = self.score(p)
            if best is None or tps > best[0]:
                best = (tps, p, rep)
        return None if best is None else (best[1], best[2])


def fit_hysteresis(
    fitter: _Fitter,
    signal: str,
    params: dict[str, Any],
    grid: list[float],
    paper_only: bool = False,
    taus: Sequence[float] = PAPER_TAUS,
    band_width: int = 4,
) -> tuple[Policy, PolicyReplay] | None:
    """Best (small, large, tau) with tau_on = tau_off = tau over `taus` (plus `grid` unless
    paper_only), then, unless paper_only, a dead band: tau_on up to band_width grid steps above
    the best tau and tau_off up to band_width below it."""
    n = fitter.data.n_trees
    if n < 2:
        return None
    taus = sorted(set(taus) | (set() if paper_only else set(grid)))
    pairs = [(s, l) for s in range(n) for l in range(s + 1, n)]
    found = fitter.best([HysteresisPolicy(t, t, s, l, signal, params) for s, l in pairs for t in taus])
    if found is None or paper_only:
        return found
    pol, _ = found
    # a dead band tau_off < tau_on around the best tau, for the best pair only
    j = taus.index(pol.tau_on)
    band = [
        HysteresisPolicy(taus[on], taus[off], pol.small, pol.large, signal, params)
        for on in range(j, min(j + band_width + 1, len(taus)))
        for off in range(max(j - band_width, 0), j + 1)
        if off < on
    ]
    return fitter.best([pol] + band)


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


def fit_hysteresis_fixed(
    fitter: _Fitter, signal: str, params: dict[str, Any], tau_on: float, tau_off: float
) -> tuple[Policy, PolicyReplay] | None:
    """Hysteresis with thresholds fixed by the config: only the (small, large) pair is chosen."""
    n = fitter.data.n_trees
    pairs = [(s, l) for s in range(n) for l in range(s + 1, n)]
    return fitter.best([HysteresisPolicy(tau_on, tau_off, s, l, signal, params) for s, l in pairs])


def fit_ladder_fixed(
    fitter: _Fitter, signal: str, params: dict[str, Any], thresholds: Sequence[float], sweeps: int = 3
) -> tuple[Policy, PolicyReplay] | None:
    """Ladder with thresholds fixed by the config: choose the non-decreasing tree of each band by
    coordinate search (start: the bank's trees spread evenly over the bands)."""
    n, m = fitter.data.n_trees, len(thresholds) + 1
    trees = [round(j * (n - 1) / max(m - 1, 1)) for j in range(m)]

    def make(ts: list[int]) -> LadderPolicy:
        return LadderPolicy(list(thresholds), ts, signal, params)

    best_tps, best_rep = fitter.score(make(trees))
    for _ in range(sweeps):
        improved = False
        for j in range(m):
            lo = trees[j - 1] if j > 0 else 0
            hi = trees[j + 1] if j < m - 1 else n - 1
            for k in range(lo, hi + 1):
                if k == trees[j]:
                    continue
                trial = trees[:j] + [k] + trees[j + 1 :]
                tps, rep = fitter.score(make(trial))
                if tps > best_tps:
                    best_tps, best_rep, trees, improved = tps, rep, trial, True
        if not improved:
            break
    return make(trees), best_rep


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
    signals: Sequence[tuple[str, dict[str, Any]]] | dict[str, Sequence[tuple[str, dict[str, Any]]]] = DEFAULT_SIGNALS,
    rank_cap: int | None = None,
    n_quantiles: int = 16,
    tau_grid: Sequence[float] = PAPER_TAUS,
    fine_search: bool = True,
    bucket_counts: Sequence[int] = (2, 4, 8),
    fixed_taus: tuple[float, float] | None = None,
    fixed_thresholds: Sequence[float] | None = None,
    signal_costs: dict[str, float] | None = None,
    tie_tolerance: float = 0.0,
    static_index: int | None = None,
) -> dict[str, Any]:
    """Fit every policy kind over the bank `trees` (ordered by size) with measured `step_costs`.

    tie_tolerance: the static policy is the smallest tree within this share of the best one's
    replayed tokens/s (`bank.tie_tolerance`), so a near-tie does not flip it between timings.
    static_index: the static policy's tree when a measurement chose it (the bank's paired choice
    at batch size 1), instead of the replayed best; the other kinds read their signal along it.

    signal_costs: seconds a signal adds to every step (by signal name; e.g. `greedy_path` runs the
    heads' greedy chain every step), charged to dynamic policies.

    signals: the (name, params) pairs to try, for every kind, or a dict kind -> pairs.
    tau_grid: the hysteresis grid (the paper's by default); fine_search adds the signal's
    quantiles to the hysteresis grid and lets the ladder search them (without it the ladder
    searches tau_grid only). fixed_taus = (tau_on, tau_off) / fixed_thresholds: use these values
    for the hysteresis / ladder kind and fit only which trees they pick.

    Returns a JSON-able dict: per kind ("static", "hysteresis", "ladder", "expected_throughput")
    the best policy dict over the signals with its replayed figures (steps, tokens,
    tokens_per_step, time_s, tokens_per_second, tree_share); "hysteresis_paper_grid" (τ_on = τ_off
    on tau_grid only: the paper's recipe); "oracle" figures; "best_kind" (highest replayed tokens
    per second, the static policy on ties) and "n_replays".
    """
    data = rollouts if isinstance(rollouts, BankReplay) else BankReplay.build(rollouts, trees or [], rank_cap)
    costs = np.asarray(step_costs, dtype=np.float64)
    if costs.shape != (data.n_trees,) or not np.all(np.isfinite(costs)) or np.any(costs <= 0):
        raise ValueError(f"step_costs must be {data.n_trees} positive seconds (one per bank tree), got {step_costs!r}")
    kinds = ("hysteresis", "hysteresis_paper_grid", "ladder", "expected_throughput")
    if isinstance(signals, dict):
        given = dict(signals)
        given.setdefault("hysteresis_paper_grid", given.get("hysteresis", ()))  # same signals as hysteresis
        per_kind = {k: list(given.get(k, ())) for k in kinds}
    else:
        per_kind = {k: list(signals) for k in kinds}
    fitter = _Fitter(data, costs, signal_costs)
    out: dict[str, Any] = {}

    if static_index is None:
        static = fitter.smallest_near_best([StaticPolicy(k) for k in range(data.n_trees)], tie_tolerance)
    else:
        if not 0 <= static_index < data.n_trees:
            raise ValueError(f"static_index {static_index} is not one of the bank's {data.n_trees} trees")
        static = (StaticPolicy(static_index), fitter.score(StaticPolicy(static_index))[1])
    out["static"] = _entry(*static)
    ref_tree = static[0].index

    traces: dict[tuple[str, str], tuple] = {}

    def trace(name: str, params: dict[str, Any]) -> tuple:
        key = (name, repr(sorted(params.items())))
        if key not in traces:
            pooled, visits, values = signal_trace(data, name, params, ref_tree)
            traces[key] = (quantile_grid(pooled, n_quantiles), visits, values)
        return traces[key]

    taus = list(tau_grid)
    for kind in kinds:
        cands = []
        for name, params in per_kind[kind]:
            grid, visits, values = trace(name, params)
            if kind == "hysteresis" and fixed_taus is not None:
                fitted = fit_hysteresis_fixed(fitter, name, params, *fixed_taus)
            elif kind == "ladder" and fixed_thresholds is not None:
                fitted = fit_ladder_fixed(fitter, name, params, fixed_thresholds)
            elif kind == "hysteresis":
                fitted = fit_hysteresis(fitter, name, params, grid if fine_search else [], taus=taus)
            elif kind == "hysteresis_paper_grid":
                fitted = fit_hysteresis(fitter, name, params, [], paper_only=True, taus=taus)
            elif kind == "ladder":
                fitted = fit_ladder(fitter, name, params, grid if fine_search else sorted(set(taus)))
            else:
                fitted = fit_expected_throughput(fitter, name, params, visits, values, bucket_counts)
            if fitted is not None:
                cands.append(fitted)
        if cands:
            pol, rep = max(cands, key=lambda pr: pr[1].tokens_per_second)
            out[kind] = _entry(pol, rep)

    out["oracle"] = oracle_replay(data, None, costs).summary()
    ranked = [k for k in ("static", "hysteresis", "ladder", "expected_throughput") if k in out]
    out["best_kind"] = max(ranked, key=lambda k: out[k]["tokens_per_second"])
    out["n_replays"] = fitter.n_replays
    return out


def fit_all_policies(
    rollouts: dict | Sequence[dict] | BankReplay,
    trees: Sequence[Any] | None,
    step_costs: Sequence[float] | np.ndarray,
    policy_cfg: dict[str, Any] | None = None,
    rank_cap: int | None = None,
    signal_costs: dict[str, float] | None = None,
    tie_tolerance: float = 0.0,
    static_index: int | None = None,
) -> dict[str, Any]:
    """What the bank stage stores: every policy kind fitted, plus the oracle.

    policy_cfg is a `conf/policy` group (see `runtime.policy.validate_policy_config`): its kind
    (`name`) is fitted on its own `signal` only, so the bank's default policy is the configured
    recipe (with its fixed tau_on/tau_off or thresholds when the config gives them); the other
    kinds take the best of DEFAULT_SIGNALS. Returns {"policies": {kind:
    {"policy": dict, "replay": figures}}, "oracle": figures, "best_kind", "hysteresis_paper_grid",
    "n_replays"}.
    """
    cfg = dict(policy_cfg or {"name": "hysteresis", "signal": "paper"})
    validate_policy_config(cfg)
    name = cfg["name"]
    own = [(cfg.get("signal", "paper"), dict(cfg.get("signal_params") or {}))]
    kinds = ("hysteresis", "hysteresis_paper_grid", "ladder", "expected_throughput")
    signals = {k: (own if k == name or (k == "hysteresis_paper_grid" and name == "hysteresis") else DEFAULT_SIGNALS) for k in kinds}
    nb = cfg.get("num_buckets")
    on, off = cfg.get("tau_on"), cfg.get("tau_off")
    fixed_taus = None if on is None and off is None else (float(on if on is not None else off), float(off if off is not None else on))
    fitted = fit_policies(
        rollouts,
        trees,
        step_costs,
        signals=signals,
        rank_cap=rank_cap,
        n_quantiles=int(cfg.get("n_quantiles", 16)),
        tau_grid=tuple(cfg.get("tau_grid") or PAPER_TAUS),
        fine_search=bool(cfg.get("fine_search", True)),
        bucket_counts=(int(nb),) if nb is not None and name == "expected_throughput" else (2, 4, 8),
        fixed_taus=fixed_taus,
        fixed_thresholds=cfg.get("thresholds"),
        signal_costs=signal_costs,
        tie_tolerance=tie_tolerance,
        static_index=static_index,
    )
    policies = {
        k: {"policy": fitted[k]["policy"], "replay": {f: v for f, v in fitted[k].items() if f != "policy"}}
        for k in ("static", "hysteresis", "ladder", "expected_throughput")
        if k in fitted
    }
    return {
        "policies": policies,
        "oracle": fitted["oracle"],
        "best_kind": fitted["best_kind"],
        "hysteresis_paper_grid": fitted.get("hysteresis_paper_grid"),
        "n_replays": fitted["n_replays"],
    }


# ----------------------------------------------------------------------------- EntMTP-dyn


def calibration_samples(rollouts: Sequence[dict], scores: Sequence[np.ndarray], super_tree: Any
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(path values, depths, accepted) of every non-root super-tree node at every step index
    i < T - 1 of every prompt: the node's path value (the product of the head probabilities on
    its path, as `DynamicPolicy.values` computes it before calibration) and whether a step at i
    would accept it (its rank path is a prefix of R[i]). Every step index counts, not only those a
    decode visits: the calibration is a property of the heads, not of one schedule."""
    import torch

    from runtime.dynamic import DynamicPolicy
    from runtime.tree import Tree

    tree = super_tree if isinstance(super_tree, Tree) else Tree(super_tree)
    pol = DynamicPolicy(tree, [1.0] * tree.num_nodes)
    paths = [()] + [None] * (tree.num_nodes - 1)
    for p in tree.paths:
        paths[tree.node_index(p)] = tuple(p)
    depths = np.asarray([len(p) for p in paths[1:]], dtype=np.int64)
    xs, ds, ys = [], [], []
    for r, sc in zip(rollouts, scores):
        R = np.asarray(r["rank_paths"])
        T = len(R)
        if T < 2:
            continue
        sc = np.asarray(sc, dtype=np.float32)[: T - 1]
        probs = torch.cat([torch.ones(T - 1, 1), torch.from_numpy(np.ascontiguousarray(sc))], dim=1)
        mask = pol.super_tree.attn_mask
        vals = torch.where(mask[None], probs[:, None, :], 1.0).prod(dim=2)[:, 1:].numpy()  # [T-1, N-1]
        hit = np.zeros_like(vals, dtype=bool)
        for j, p in enumerate(paths[1:]):
            hit[:, j] = (R[: T - 1, : len(p)] == np.asarray(p)[None]).all(axis=1)
        xs.append(vals.ravel())
        ds.append(np.broadcast_to(depths[None], vals.shape).ravel())
        ys.append(hit.ravel())
    if not xs:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    return np.concatenate(xs), np.concatenate(ds), np.concatenate(ys)


def _pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression by pooling adjacent violators."""
    vals, wts, sizes = [], [], []
    for v, c in zip(y.tolist(), w.tolist()):
        vals.append(v)
        wts.append(c)
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, s2 = vals.pop(), wts.pop(), sizes.pop()
            vals[-1] = (vals[-1] * wts[-1] + v2 * w2) / (wts[-1] + w2)
            wts[-1] += w2
            sizes[-1] += s2
    return np.repeat(np.asarray(vals), sizes)


def fit_calibration(values: np.ndarray, depths: np.ndarray, accepted: np.ndarray, max_depth: int,
                    bins: int = 12, min_samples: int = 50) -> dict[str, list[list[float]]]:
    """Per depth 1..max_depth, a monotone map from path value to the observed acceptance rate
    (`runtime.dynamic.Calibration`'s dict): the samples of a depth in `bins` quantile bins of the
    path value, each bin's mean value and acceptance rate, made non-decreasing by isotonic
    regression (weighted by the bins' counts), bins with the same mean value merged. A depth with
    fewer than `min_samples` samples or one distinct value keeps the identity (knots (0, 0), (1, 1)).
    Why: the heads' probabilities are over-confident or shy by depth, and the policy sums these
    estimates as expected accepted tokens to decide how many nodes a step pays for."""
    xs_out, ys_out = [], []
    for d in range(1, max_depth + 1):
        sel = depths == d
        x, y = values[sel].astype(np.float64), accepted[sel].astype(np.float64)
        knots = None
        if len(x) >= min_samples:
            order = np.argsort(x, kind="stable")
            x, y = x[order], y[order]
            groups = [g for g in np.array_split(np.arange(len(x)), min(bins, len(x))) if len(g)]
            mx = np.asarray([x[g].mean() for g in groups])
            my = np.asarray([y[g].mean() for g in groups])
            cnt = np.asarray([len(g) for g in groups], dtype=np.float64)
            fy = _pav(my, cnt)
            kx, ky = [], []
            for a, b in zip(np.clip(mx, 0.0, 1.0).tolist(), np.clip(fy, 0.0, 1.0).tolist()):
                if kx and a <= kx[-1]:
                    ky[-1] = max(ky[-1], b)   # same mean value: one knot (still non-decreasing)
                    continue
                kx.append(a)
                ky.append(b)
            if len(kx) >= 2:
                knots = (kx, ky)
        if knots is None:
            knots = ([0.0, 1.0], [0.0, 1.0])
        xs_out.append([float(v) for v in knots[0]])
        ys_out.append([float(v) for v in knots[1]])
    return {"xs": xs_out, "ys": ys_out}


def fit_dynamic(rollouts: Sequence[dict], super_trees: Sequence[Any], scores: Sequence[Sequence[np.ndarray]],
                step_ms_for: Any, rank_cap: int | None = None, calibrate: bool = True,
                draft_ms_for: Any = None, stop_below: Sequence[float] = (0.0,)) -> dict[str, Any]:
    """EntMTP-dyn fitted by exact replay on the calibration split: for every candidate super-tree
    (`super_trees[s]` with head scores `scores[s]`, per prompt [T, N-1]) and its per-size step costs
    (`step_ms_for(tree)`: ms of a step verifying n = 1..N nodes, drafting the whole super-tree), the
    identity calibration and the one fitted on these rollouts (`fit_calibration`) are replayed
    (`pipeline.replay.replay_dynamic`) with each early-stop threshold in `stop_below` (0: draft the
    whole super-tree; > 0 needs `draft_ms_for(tree)`: ms of drafting it to depth 0..depth); the
    fastest (replayed tokens/s) is kept.

    Returns {"super_tree": paths, "step_ms": [...], "draft_ms": [...], "stop_below": threshold,
    "calibration": dict, "replay": figures, "candidates": [per candidate, calibration and threshold:
    nodes, calibrated, stop_below, tokens/step, tokens/s]}."""
    from pipeline.replay.dynamic import replay_dynamic
    from runtime.dynamic import Calibration, DynamicPolicy
    from runtime.tree import Tree

    if not super_trees:
        raise ValueError("no candidate super-trees to fit EntMTP-dyn on")
    thresholds = sorted({float(x) for x in stop_below} | {0.0})
    if any(x > 0 for x in thresholds) and draft_ms_for is None:
        raise ValueError("early-stop thresholds need draft_ms_for (the cost of drafting a super-tree to each depth)")
    best: dict[str, Any] | None = None
    candidates = []
    for tree, sc in zip(super_trees, scores):
        t = tree if isinstance(tree, Tree) else Tree(tree)
        costs = [float(c) for c in step_ms_for(t)]
        drafts = None if draft_ms_for is None else [float(c) for c in draft_ms_for(t)]
        cals: list[dict[str, Any]] = [{}]
        if calibrate:
            v, d, a = calibration_samples(rollouts, sc, t)
            cals.append(fit_calibration(v, d, a, t.depth))
        for cal in cals:
            for stop in thresholds if t.depth > 1 else (0.0,):
                pol = DynamicPolicy(t, costs, Calibration.from_dict(cal), draft_ms=drafts, stop_below=stop)
                rep = replay_dynamic(rollouts, sc, pol, rank_cap)
                entry = {"nodes": t.num_nodes, "depth": t.depth, "calibrated": bool(cal), "stop_below": stop,
                         "tokens_per_step": rep.tokens_per_step, "tokens_per_second": rep.tokens_per_second}
                candidates.append(entry)
                if best is None or rep.tokens_per_second > best["replay"]["tokens_per_second"] * (1 + 1e-9):
                    best = {"super_tree": [list(p) for p in t.paths], "step_ms": costs, "draft_ms": drafts,
                            "stop_below": stop, "calibration": cal, "replay": rep.summary()}
    assert best is not None
    best["candidates"] = candidates
    return best
