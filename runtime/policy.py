"""Per-step tree choice: cheap confidence signals and the policies that map them to a bank index.

The decoder calls, once per step and before drafting,

    k = scheduler.choose(p0, head_top1, entropy)   # index into the bank (trees ordered by size)
    ... draft with tree k, verify, accept `accepted` draft tokens ...
    scheduler.update(accepted)

where `p0` is the base model's top-1 probability at the position being extended, `head_top1`
the heads' top-1 probabilities along their greedy chain (p_1..p_D) and `entropy` the base
model's entropy there (nats). Everything on the per-step path runs on plain Python floats: a tensor op per step
would cost more than the whole policy is allowed (the paper reports < 0.1 ms per step), so the
decoder converts its few scalars with one `.tolist()` and the policy never sees a tensor.

Every signal reads "higher = more predictable", so every policy maps a higher signal to a larger
(or equal) tree.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

# ----------------------------------------------------------------------------- signals


def paper_signal(p0: float, head_top1: Sequence[float]) -> float:
    """The paper's signal s = max(p0, g_1, ..., g_D) with g_d = p0 * prod_{i<=d} p_i.

    Implemented as written. Every p_i <= 1 makes every g_d <= p0, so s always equals p0: the
    heads' confidences never move it. `greedy_path_value` is the head-aware variant.
    """
    s = p0
    g = p0
    for p in head_top1:
        g *= p
        if g > s:
            s = g
    return s


def greedy_path_value(p0: float, head_top1: Sequence[float]) -> float:
    """g_D = p0 * p_1 * ... * p_D: the probability mass of the heads' greedy chain (EAGLE-2's path value)."""
    g = p0
    for p in head_top1:
        g *= p
    return g


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA alpha must be a number in (0, 1], got {alpha!r}")
    return float(alpha)


def _check_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


class Signal:
    """A per-step signal. `observe` is called before the step, `update` after it."""

    name: ClassVar[str] = "none"
    stateless: ClassVar[bool] = True  # the value depends on the current step's inputs only
    # What observe() reads, so the decoder computes only that: p0 / entropy are an exp pass over the
    # vocabulary (~0.1 ms on a 2-core CPU); the heads' greedy chain p_1..p_D is D more head
    # evaluations with a full-vocabulary output each (~4 lm_head products on the default model).
    reads_logits: ClassVar[bool] = True
    reads_heads: ClassVar[bool] = False

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        return 0.0

    def update(self, accepted: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def params(self) -> dict[str, Any]:
        return {}


class NoSignal(Signal):
    """For the static policy: nothing to compute."""

    reads_logits = False


class PaperSignal(Signal):
    """max(p0, g_1..g_D); numerically always p0 (see `paper_signal`). It does not read the heads:
    every g_d = p0 * p_1 * ... * p_d with p_i <= 1 is <= p0 also in floating point (a product by a
    factor <= 1 never rounds above p0), so the decoder passes an empty chain instead of paying for
    one that cannot change the value."""

    name = "paper"

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        return paper_signal(p0, head_top1)


class P0Signal(Signal):
    """The base model's top-1 probability (what the paper's signal reduces to)."""

    name = "p0"

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        return p0


class GreedyPathSignal(Signal):
    """g_D, the greedy path value through the heads: the signal that does read the heads."""

    name = "greedy_path"
    reads_heads = True

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        return greedy_path_value(p0, head_top1)


class AcceptEMA(Signal):
    """Exponential moving average of past tokens per step (accepted + 1).

    The value at a step only uses earlier steps (the current one is not verified yet); before the
    first update it is `init`. The paper's feature study found this the best single predictor of
    the next step's acceptance.
    """

    name = "accept_ema"
    stateless = False
    reads_logits = False

    def __init__(self, alpha: float = 0.5, init: float = 1.0) -> None:
        self.alpha = _check_alpha(alpha)
        self.init = _check_finite("AcceptEMA init", init)
        self.value = self.init

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        return self.value

    def update(self, accepted: int) -> None:
        self.value += self.alpha * (accepted + 1 - self.value)

    def reset(self) -> None:
        self.value = self.init

    def params(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "init": self.init}


class EntropyEMA(Signal):
    """EMA of the base entropy at the visited steps, reported as exp(-EMA).

    The current step's entropy is known when it starts (it comes from the previous verify), so it
    is folded in before reading. exp(-H) maps entropy to a confidence in (0, 1] (it is at most the
    top-1 probability), so like every other signal a higher value means a more predictable text.
    The raw EMA in nats is `self.entropy`.
    """

    name = "entropy_ema"
    stateless = False

    def __init__(self, alpha: float = 0.5) -> None:
        self.alpha = _check_alpha(alpha)
        self.entropy: float | None = None

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        h = self.entropy
        h = entropy if h is None else h + self.alpha * (entropy - h)
        self.entropy = h
        return math.exp(-h)

    def reset(self) -> None:
        self.entropy = None

    def params(self) -> dict[str, Any]:
        return {"alpha": self.alpha}


SIGNALS: dict[str, type[Signal]] = {
    "none": NoSignal,
    "paper": PaperSignal,
    "p0": P0Signal,
    "greedy_path": GreedyPathSignal,
    "accept_ema": AcceptEMA,
    "entropy_ema": EntropyEMA,
}


def make_signal(name: str, params: dict[str, Any] | None = None) -> Signal:
    """Build a signal by name (one of `SIGNALS`) with its parameters (only the EMAs take any)."""
    if not isinstance(name, str) or name not in SIGNALS:
        raise ValueError(f"unknown signal {name!r}; known signals: {sorted(SIGNALS)}")
    params = dict(params or {})
    try:
        return SIGNALS[name](**params)
    except TypeError as e:
        raise ValueError(f"bad parameters {params} for signal {name!r}: {e}") from None


# ----------------------------------------------------------------------------- policies


def _check_index(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (a tree index into the bank), got {value!r}")
    return value


def _check_increasing(name: str, values: Sequence[Any]) -> list[float]:
    out = [_check_finite(f"{name}[{i}]", v) for i, v in enumerate(values)]
    for i in range(1, len(out)):
        if not out[i] > out[i - 1]:
            raise ValueError(f"{name} must be strictly increasing, but {name}[{i}] = {out[i]} <= {out[i - 1]}")
    return out


class Policy:
    """Maps the step's signal to a tree index (trees of the bank ordered by size, ascending)."""

    kind: ClassVar[str] = ""

    def __init__(self, signal: str, signal_params: dict[str, Any] | None) -> None:
        make_signal(signal, signal_params)  # validates the name and the parameters now, not mid-decode
        self.signal = signal
        self.signal_params = dict(signal_params or {})

    def choose(self, signal: float) -> int:
        raise NotImplementedError

    # Memoryless policies (choice a function of the signal alone, `update` a no-op) also define
    # `choose_many(signals: np.ndarray) -> np.ndarray`, which offline replay uses to vectorise.

    def update(self, accepted: int) -> None:
        """Hook called after each step with the number of accepted draft tokens."""

    def reset(self) -> None:
        """Forget per-generation state (call before each new prompt)."""

    def indices(self) -> list[int]:
        """Every tree index this policy may return."""
        raise NotImplementedError

    def check_bank(self, n_trees: int) -> None:
        """Raise if the policy may pick a tree the bank does not have."""
        bad = [k for k in self.indices() if k >= n_trees]
        if bad:
            raise ValueError(
                f"{self.kind} policy uses tree index {max(bad)} but the bank has only {n_trees} trees; "
                "refit the policy for this bank"
            )

    def _params(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "signal": self.signal, "signal_params": dict(self.signal_params), **self._params()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self.to_dict() == other.to_dict()


class StaticPolicy(Policy):
    """EntMTP*: always the same tree."""

    kind = "static"

    def __init__(self, index: int, signal: str = "none", signal_params: dict[str, Any] | None = None) -> None:
        super().__init__(signal, signal_params)
        self.index = _check_index("index", index)

    def choose(self, signal: float) -> int:
        return self.index

    def choose_many(self, signals: np.ndarray) -> np.ndarray:
        return np.full(len(signals), self.index, dtype=np.int64)

    def indices(self) -> list[int]:
        return [self.index]

    def _params(self) -> dict[str, Any]:
        return {"index": self.index}


class LadderPolicy(Policy):
    """EntMTP-l: K-1 strictly increasing thresholds split the signal into K bands, band j -> trees[j].

    The band is `bisect_right(thresholds, s)`, so a signal equal to a threshold goes to the band
    above it. `trees` defaults to 0..K-1 (every tree of a K-tree bank); it must be non-decreasing
    so that a more confident step never gets a smaller tree.
    """

    kind = "ladder"

    def __init__(
        self,
        thresholds: Sequence[float],
        trees: Sequence[int] | None = None,
        signal: str = "paper",
        signal_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(signal, signal_params)
        if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence):
            raise ValueError(f"thresholds must be a list of numbers, got {thresholds!r}")
        self.thresholds = _check_increasing("thresholds", thresholds)
        if trees is None:
            trees = list(range(len(self.thresholds) + 1))
        trees = [_check_index(f"trees[{i}]", t) for i, t in enumerate(trees)]
        if len(trees) != len(self.thresholds) + 1:
            raise ValueError(
                f"a ladder over {len(trees)} trees needs {len(trees) - 1} thresholds, got {len(self.thresholds)}"
            )
        if any(b < a for a, b in zip(trees, trees[1:])):
            raise ValueError(f"ladder trees must be non-decreasing (higher signal -> larger tree), got {trees}")
        self.trees = trees

    def choose(self, signal: float) -> int:
        return self.trees[bisect_right(self.thresholds, signal)]

    def choose_many(self, signals: np.ndarray) -> np.ndarray:
        """`choose` over an array of signals (offline replay); searchsorted 'right' = bisect_right."""
        band = np.searchsorted(np.asarray(self.thresholds, dtype=np.float64), signals, side="right")
        return np.asarray(self.trees, dtype=np.int64)[band]

    def indices(self) -> list[int]:
        return list(self.trees)

    def _params(self) -> dict[str, Any]:
        return {"thresholds": list(self.thresholds), "trees": list(self.trees)}


class HysteresisPolicy(Policy):
    """EntMTPτ: two trees; switch up when s > tau_on, down when s <= tau_off (tau_off <= tau_on).

    Between the two thresholds the current tree is kept, which stops flapping on a noisy signal.
    A generation starts on `start` ("large" by default: most steps of predictable text want it).
    """

    kind = "hysteresis"

    def __init__(
        self,
        tau_on: float,
        tau_off: float,
        small: int,
        large: int,
        signal: str = "paper",
        signal_params: dict[str, Any] | None = None,
        start: str = "large",
    ) -> None:
        super().__init__(signal, signal_params)
        self.tau_on = _check_finite("tau_on", tau_on)
        self.tau_off = _check_finite("tau_off", tau_off)
        if self.tau_off > self.tau_on:
            raise ValueError(f"hysteresis needs tau_off <= tau_on, got tau_off={tau_off} > tau_on={tau_on}")
        self.small = _check_index("small", small)
        self.large = _check_index("large", large)
        if self.small > self.large:
            raise ValueError(f"small tree index {small} must not exceed large tree index {large} (bank is sorted by size)")
        if start not in ("small", "large"):
            raise ValueError(f"start must be 'small' or 'large', got {start!r}")
        self.start = start
        self.current = self.large if start == "large" else self.small

    def choose(self, signal: float) -> int:
        if self.current == self.small:
            if signal > self.tau_on:
                self.current = self.large
        elif signal <= self.tau_off:
            self.current = self.small
        return self.current

    def reset(self) -> None:
        self.current = self.large if self.start == "large" else self.small

    def indices(self) -> list[int]:
        return [self.small, self.large]

    def _params(self) -> dict[str, Any]:
        return {"tau_on": self.tau_on, "tau_off": self.tau_off, "small": self.small, "large": self.large, "start": self.start}


class ExpectedThroughputPolicy(Policy):
    """Pick the tree with the best predicted tokens per second for the signal's bucket.

    bucket = bisect_right(bucket_edges, s) in 0..len(bucket_edges); the prediction for tree k is
    tokens_per_step[bucket][k] / step_costs[k]. The argmax per bucket is computed once here, so a
    step costs one bisect.
    """

    kind = "expected_throughput"

    def __init__(
        self,
        bucket_edges: Sequence[float],
        tokens_per_step: Sequence[Sequence[float]],
        step_costs: Sequence[float],
        signal: str = "paper",
        signal_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(signal, signal_params)
        self.bucket_edges = _check_increasing("bucket_edges", bucket_edges)
        n_buckets = len(self.bucket_edges) + 1
        self.step_costs = [_check_finite(f"step_costs[{k}]", c) for k, c in enumerate(step_costs)]
        if not self.step_costs or any(c <= 0 for c in self.step_costs):
            raise ValueError(f"step_costs must be a non-empty list of positive seconds, got {list(step_costs)}")
        n_trees = len(self.step_costs)
        if len(tokens_per_step) != n_buckets:
            raise ValueError(
                f"tokens_per_step needs one row per bucket ({n_buckets} = len(bucket_edges) + 1), got {len(tokens_per_step)}"
            )
        table = []
        for b, row in enumerate(tokens_per_step):
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != n_trees:
                raise ValueError(f"tokens_per_step[{b}] must list one value per tree ({n_trees}), got {row!r}")
            table.append([_check_finite(f"tokens_per_step[{b}][{k}]", v) for k, v in enumerate(row)])
        self.tokens_per_step = table
        # Ties go to the smaller tree (first index): same predicted speed, less work.
        self._best = [
            max(range(n_trees), key=lambda k, r=row: (r[k] / self.step_costs[k], -k)) for row in table
        ]

    def choose(self, signal: float) -> int:
        return self._best[bisect_right(self.bucket_edges, signal)]

    def choose_many(self, signals: np.ndarray) -> np.ndarray:
        bucket = np.searchsorted(np.asarray(self.bucket_edges, dtype=np.float64), signals, side="right")
        return np.asarray(self._best, dtype=np.int64)[bucket]

    def indices(self) -> list[int]:
        return list(range(len(self.step_costs)))

    def _params(self) -> dict[str, Any]:
        return {
            "bucket_edges": list(self.bucket_edges),
            "tokens_per_step": [list(r) for r in self.tokens_per_step],
            "step_costs": list(self.step_costs),
        }


POLICIES: dict[str, type[Policy]] = {
    cls.kind: cls for cls in (StaticPolicy, LadderPolicy, HysteresisPolicy, ExpectedThroughputPolicy)
}


def policy_from_dict(d: dict[str, Any]) -> Policy:
    """Rebuild a policy from `Policy.to_dict()` output (e.g. read from a bank's JSON), validating it."""
    if not isinstance(d, dict):
        raise ValueError(f"a policy must be a dict with a 'kind' field, got {type(d).__name__}")
    kind = d.get("kind")
    if kind not in POLICIES:
        raise ValueError(f"unknown policy kind {kind!r}; known kinds: {sorted(POLICIES)}")
    cls = POLICIES[kind]
    fields = {k: v for k, v in d.items() if k != "kind"}
    if "signal" not in fields:
        if kind != "static":
            raise ValueError(f"{kind} policy dict has no 'signal' field naming the signal it consumes")
    if "signal_params" in fields and fields["signal_params"] is not None and not isinstance(fields["signal_params"], dict):
        raise ValueError(f"signal_params must be a dict, got {fields['signal_params']!r}")
    try:
        return cls(**fields)
    except TypeError as e:
        raise ValueError(f"bad fields for a {kind} policy ({sorted(fields)}): {e}") from None


# What a `conf/policy/*.yaml` group may hold (the fitting recipe, not a fitted policy):
#   name: static | ladder | hysteresis | expected_throughput   (the bank's default policy kind)
#   signal: a name in SIGNALS; signal_params: its parameters (EMA alpha / init)
#   tau_grid: hysteresis thresholds to sweep (the paper's {0.001, 0.005, 0.01, 0.02, 0.05})
#   fine_search: also search the signal's quantiles; num_buckets: expected-throughput buckets
#   n_quantiles: how many quantile levels the fine search uses
#   tau_on / tau_off (hysteresis), thresholds (ladder): fixed values instead of fitted ones; the
#   fitter then only chooses the trees. One of tau_on / tau_off alone means tau_on = tau_off.
POLICY_CONFIG_KEYS = ("name", "signal", "signal_params", "tau_grid", "fine_search", "num_buckets", "n_quantiles",
                      "tau_on", "tau_off", "thresholds")


def validate_policy_config(cfg: dict[str, Any]) -> None:
    """Check a policy *fitting* config (a `conf/policy` group) before any long work starts."""
    if not isinstance(cfg, dict):
        raise ValueError(f"policy config must be a mapping, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(POLICY_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown policy config keys {unknown}; allowed: {list(POLICY_CONFIG_KEYS)}")
    name = cfg.get("name")
    if name not in POLICIES:
        raise ValueError(f"policy.name must be one of {sorted(POLICIES)}, got {name!r}")
    make_signal(cfg.get("signal", "paper"), cfg.get("signal_params"))
    grid = cfg.get("tau_grid")
    if grid is not None:
        if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or not grid:
            raise ValueError(f"policy.tau_grid must be a non-empty list of numbers, got {grid!r}")
        for i, t in enumerate(grid):
            _check_finite(f"policy.tau_grid[{i}]", t)
    if "fine_search" in cfg and not isinstance(cfg["fine_search"], bool):
        raise ValueError(f"policy.fine_search must be true or false, got {cfg['fine_search']!r}")
    for key, lo in (("num_buckets", 1), ("n_quantiles", 2)):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise ValueError(f"policy.{key} must be an int >= {lo}, got {v!r}")
    # fixed thresholds instead of fitted ones (the fitter then only picks the trees)
    on, off = cfg.get("tau_on"), cfg.get("tau_off")
    if on is not None or off is not None:
        if name != "hysteresis":
            raise ValueError(f"policy.tau_on / policy.tau_off only apply to the hysteresis policy (policy.name is {name!r}); "
                             "remove them or use policy=hysteresis")
        on = _check_finite("policy.tau_on", on if on is not None else off)
        off = _check_finite("policy.tau_off", off if off is not None else on)
        if off > on:
            raise ValueError(f"policy.tau_off={off} > policy.tau_on={on}: hysteresis switches up when the signal exceeds "
                             "tau_on and down when it falls to tau_off, so it needs tau_off <= tau_on; swap or fix them")
    th = cfg.get("thresholds")
    if th is not None:
        if name != "ladder":
            raise ValueError(f"policy.thresholds only apply to the ladder policy (policy.name is {name!r}); "
                             "remove them or use policy=ladder")
        if isinstance(th, (str, bytes)) or not isinstance(th, Sequence) or not th:
            raise ValueError(f"policy.thresholds must be a non-empty list of numbers, got {th!r}")
        try:
            _check_increasing("policy.thresholds", th)
        except ValueError as e:
            raise ValueError(f"{e}; list the ladder thresholds in strictly increasing order") from None


# ----------------------------------------------------------------------------- scheduler


class Scheduler:
    """A policy plus the signal it consumes: what the decoder holds."""

    def __init__(self, policy: Policy, n_trees: int | None = None) -> None:
        if not isinstance(policy, Policy):
            raise ValueError(f"Scheduler needs a Policy, got {type(policy).__name__}; use policy_from_dict for dicts")
        if n_trees is not None:
            policy.check_bank(n_trees)
        self.policy = policy
        self.signal = make_signal(policy.signal, policy.signal_params)
        self._static = policy.index if isinstance(policy, StaticPolicy) else None

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_trees: int | None = None) -> "Scheduler":
        return cls(policy_from_dict(d), n_trees)

    def choose(self, p0: float, head_top1: Sequence[float], entropy: float) -> int:
        if self._static is not None:
            return self._static
        return self.policy.choose(self.signal.observe(p0, head_top1, entropy))

    def update(self, accepted: int) -> None:
        self.signal.update(accepted)
        self.policy.update(accepted)

    def reset(self) -> None:
        self.signal.reset()
        self.policy.reset()


class BatchScheduler:
    """Every live sequence's tree at once, for a batch: the expected tokens of each sequence under
    each tree (an `ExpectedThroughputPolicy`'s table for its signal's bucket) against the batch's
    step cost (each tree's modeled step at the batch size, `step_ms[B][k]`; a sequence on tree k
    adds step_ms[B][k] / B of it). All start on the smallest tree; then, while it raises the batch's
    expected tokens per second, one sequence moves to the larger tree with the best gain. A
    confident sequence gets a deep tree and an unsure one stays small, within one verify budget,
    as the serving engines' confidence schedulers split theirs."""

    def __init__(self, policy: ExpectedThroughputPolicy, step_ms: dict[int, Sequence[float]]) -> None:
        if not isinstance(policy, ExpectedThroughputPolicy):
            raise ValueError(f"a batch scheduler reads an expected_throughput policy's table, got {type(policy).__name__}")
        n = len(policy.step_costs)
        if not step_ms or any(len(v) != n or not all(c > 0 for c in v) for v in step_ms.values()):
            raise ValueError(f"step_ms needs, per batch size, one positive step cost per tree ({n})")
        self.policy = policy
        self.step_ms = {int(b): [float(c) for c in v] for b, v in sorted(step_ms.items())}

    def costs(self, batch: int) -> list[float]:
        """Per-tree step costs at the smallest measured batch size >= `batch` (the largest past them)."""
        sizes = list(self.step_ms)
        return self.step_ms[next((b for b in sizes if b >= batch), sizes[-1])]

    def choose(self, signals: Sequence[float], gains: Sequence[Sequence[float]] | None = None) -> list[int]:
        """One tree index per sequence, from their signals (or, for the oracle, each sequence's true
        tokens per tree in `gains`)."""
        table, edges = self.policy.tokens_per_step, self.policy.bucket_edges
        expect = gains if gains is not None else [table[bisect_right(edges, s)] for s in signals]
        batch = len(expect)
        cost = [c / batch for c in self.costs(batch)]
        picks = [0] * batch
        tokens = sum(e[0] for e in expect)
        seconds = cost[0] * batch
        while True:
            best, move = tokens / seconds, None
            for i, e in enumerate(expect):
                k = picks[i]
                for j in range(k + 1, len(cost)):
                    rate = (tokens + e[j] - e[k]) / (seconds + cost[j] - cost[k])
                    if rate > best:
                        best, move = rate, (i, j)
            if move is None:
                return picks
            i, j = move
            tokens += expect[i][j] - expect[i][picks[i]]
            seconds += cost[j] - cost[picks[i]]
            picks[i] = j
