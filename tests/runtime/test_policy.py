"""Signals, policies, their serialisation and the scheduler (runtime/policy.py); fitting them by
replay is tests/pipeline/bank/test_policies.py."""

from __future__ import annotations

import ast
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.bank.policies import PAPER_TAUS
from runtime.policy import (
    AcceptEMA,
    EntropyEMA,
    ExpectedThroughputPolicy,
    HysteresisPolicy,
    LadderPolicy,
    Scheduler,
    StaticPolicy,
    greedy_path_value,
    make_signal,
    paper_signal,
    policy_from_dict,
    validate_policy_config,
)
from tests.helpers import REPO

probs = st.floats(0.0, 1.0, allow_nan=False)


# --------------------------------------------------------------------------- signals


@settings(max_examples=200, deadline=None)
@given(probs, st.lists(probs, min_size=0, max_size=6))
def test_paper_signal_always_equals_p0(p0: float, heads: list[float]) -> None:
    assert paper_signal(p0, heads) == p0
    g = p0
    for p in heads:
        g *= p
    assert greedy_path_value(p0, heads) == pytest.approx(g)
    assert greedy_path_value(p0, heads) <= p0


def test_emas() -> None:
    s = AcceptEMA(alpha=0.5, init=1.0)
    assert s.observe(0.3, [], 1.0) == 1.0
    s.update(3)  # 4 tokens this step
    assert s.observe(0.3, [], 1.0) == pytest.approx(2.5)
    s.update(0)
    assert s.observe(0.3, [], 1.0) == pytest.approx(1.75)
    s.reset()
    assert s.observe(0.3, [], 1.0) == 1.0

    e = EntropyEMA(alpha=0.25)
    assert e.observe(0.5, [], 2.0) == pytest.approx(math.exp(-2.0))  # first value taken as is
    assert e.observe(0.5, [], 0.0) == pytest.approx(math.exp(-1.5))
    assert e.entropy == pytest.approx(1.5)
    e.reset()
    assert e.entropy is None
    for bad in (0.0, 1.5, -0.1, True, "x"):
        with pytest.raises(ValueError, match="alpha"):
            AcceptEMA(alpha=bad)
    with pytest.raises(ValueError, match="unknown signal"):
        make_signal("g4")
    with pytest.raises(ValueError, match="bad parameters"):
        make_signal("paper", {"alpha": 0.5})


# --------------------------------------------------------------------------- policies


def test_ladder_uses_bisect_right() -> None:
    lad = LadderPolicy([0.2, 0.5, 0.8], signal="p0")
    assert [lad.choose(s) for s in (0.0, 0.2, 0.3, 0.5, 0.79, 0.8, 1.0)] == [0, 1, 1, 2, 2, 3, 3]
    sub = LadderPolicy([0.5], trees=[1, 3], signal="p0")
    assert [sub.choose(s) for s in (0.1, 0.5, 0.9)] == [1, 3, 3]
    assert np.array_equal(lad.choose_many(np.array([0.0, 0.2, 0.8, 0.9])), [0, 1, 3, 3])


def test_ladder_errors() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LadderPolicy([0.5, 0.5])
    with pytest.raises(ValueError, match="strictly increasing"):
        LadderPolicy([0.6, 0.2])
    with pytest.raises(ValueError, match="needs 2 thresholds"):
        LadderPolicy([0.5], trees=[0, 1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        LadderPolicy([0.5], trees=[2, 1])
    with pytest.raises(ValueError, match="finite"):
        LadderPolicy([float("nan")])
    with pytest.raises(ValueError, match="only 3 trees"):
        Scheduler(LadderPolicy([0.1, 0.2, 0.3]), n_trees=3)


def test_hysteresis_switching() -> None:
    h = HysteresisPolicy(tau_on=0.6, tau_off=0.3, small=0, large=2, signal="p0", start="small")
    seq = [0.5, 0.6, 0.61, 0.5, 0.31, 0.3, 0.5, 0.7]
    assert [h.choose(s) for s in seq] == [0, 0, 2, 2, 2, 0, 0, 2]
    h.reset()
    assert h.choose(0.5) == 0
    h2 = HysteresisPolicy(0.6, 0.3, 0, 2, signal="p0")  # starts large
    assert h2.choose(0.5) == 2 and h2.choose(0.3) == 0
    eq = HysteresisPolicy(0.4, 0.4, 1, 2, signal="p0")  # no dead band: switch at the same tau
    assert [eq.choose(s) for s in (0.4, 0.41, 0.4)] == [1, 2, 1]


def test_hysteresis_errors() -> None:
    with pytest.raises(ValueError, match="tau_off <= tau_on"):
        HysteresisPolicy(0.2, 0.3, 0, 1)
    with pytest.raises(ValueError, match="must not exceed"):
        HysteresisPolicy(0.3, 0.2, 2, 1)
    with pytest.raises(ValueError, match="non-negative int"):
        HysteresisPolicy(0.3, 0.2, -1, 1)
    with pytest.raises(ValueError, match="start"):
        HysteresisPolicy(0.3, 0.2, 0, 1, start="medium")


def test_expected_throughput_picks_best_per_bucket() -> None:
    costs = [1.0, 2.0, 3.0]
    table = [[1.0, 1.5, 1.8], [1.2, 3.0, 3.3], [1.5, 3.5, 6.0]]  # per second: [1, .75, .6], [1.2, 1.5, 1.1], [1.5, 1.75, 2]
    p = ExpectedThroughputPolicy([0.3, 0.7], table, costs, signal="p0")
    assert [p.choose(s) for s in (0.1, 0.3, 0.5, 0.7, 0.9)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="one row per bucket"):
        ExpectedThroughputPolicy([0.3], table, costs)
    with pytest.raises(ValueError, match="one value per tree"):
        ExpectedThroughputPolicy([0.3, 0.7], [[1.0, 2.0]] * 3, costs)
    with pytest.raises(ValueError, match="positive"):
        ExpectedThroughputPolicy([0.3, 0.7], table, [1.0, 0.0, 2.0])


def _examples() -> list:
    return [
        StaticPolicy(2),
        LadderPolicy([0.1, 0.4, 0.9], signal="greedy_path"),
        LadderPolicy([1.5], trees=[0, 3], signal="accept_ema", signal_params={"alpha": 0.3, "init": 2.0}),
        HysteresisPolicy(0.005, 0.001, 1, 3, signal="paper"),
        HysteresisPolicy(0.5, 0.5, 0, 3, signal="entropy_ema", signal_params={"alpha": 0.2}, start="small"),
        ExpectedThroughputPolicy([0.2], [[1, 2, 3, 4], [2, 3, 4, 5]], [1.0, 1.1, 1.2, 1.3], signal="p0"),
    ]


@pytest.mark.parametrize("pol", _examples(), ids=lambda p: p.kind)
def test_policy_dict_round_trip(pol) -> None:
    d = json.loads(json.dumps(pol.to_dict()))
    back = policy_from_dict(d)
    assert back == pol and type(back) is type(pol)
    assert d["signal"] == pol.signal and "kind" in d
    # same choices on a signal sequence
    xs = [0.0, 0.05, 0.3, 0.7, 1.2, 2.5, 0.004]
    assert [pol.choose(x) for x in xs] == [back.choose(x) for x in xs]


def test_policy_from_dict_errors() -> None:
    with pytest.raises(ValueError, match="unknown policy kind"):
        policy_from_dict({"kind": "magic", "signal": "p0"})
    with pytest.raises(ValueError, match="no 'signal' field"):
        policy_from_dict({"kind": "ladder", "thresholds": [0.5]})
    with pytest.raises(ValueError, match="bad fields"):
        policy_from_dict({"kind": "ladder", "signal": "p0", "thresholds": [0.5], "colour": "red"})
    with pytest.raises(ValueError, match="unknown signal"):
        policy_from_dict({"kind": "hysteresis", "signal": "g4", "tau_on": 0.1, "tau_off": 0.1, "small": 0, "large": 1})
    with pytest.raises(ValueError, match="tau_off <= tau_on"):
        policy_from_dict({"kind": "hysteresis", "signal": "p0", "tau_on": 0.1, "tau_off": 0.2, "small": 0, "large": 1})
    with pytest.raises(ValueError, match="a dict"):
        policy_from_dict(["ladder"])
    assert policy_from_dict({"kind": "static", "index": 1}) == StaticPolicy(1)


def test_validate_policy_config() -> None:
    validate_policy_config({"name": "hysteresis", "signal": "paper", "tau_grid": list(PAPER_TAUS), "fine_search": True})
    validate_policy_config({"name": "expected_throughput", "signal": "accept_ema", "num_buckets": 8})
    for bad, msg in [
        ({"name": "hyst"}, "policy.name"),
        ({"name": "ladder", "signal": "nope"}, "unknown signal"),
        ({"name": "hysteresis", "tau_grid": []}, "tau_grid"),
        ({"name": "hysteresis", "tau_grid": [0.1, "x"]}, "tau_grid"),
        ({"name": "ladder", "fine_search": "yes"}, "fine_search"),
        ({"name": "expected_throughput", "num_buckets": 0}, "num_buckets"),
        ({"name": "static", "treshold": 1}, "unknown policy config keys"),
    ]:
        with pytest.raises(ValueError, match=msg):
            validate_policy_config(bad)


def test_scheduler_runs_signal_then_policy() -> None:
    sched = Scheduler(HysteresisPolicy(2.0, 1.5, 0, 1, signal="accept_ema", signal_params={"alpha": 0.5, "init": 1.0}, start="small"))
    ks = []
    for acc in (3, 3, 0, 0, 0):
        ks.append(sched.choose(0.5, [0.5], 1.0))
        sched.update(acc)
    # EMA before each step: 1.0, 2.5, 3.25, 2.125, 1.5625 -> small, large, large, large, large(1.5625 > 1.5)
    assert ks == [0, 1, 1, 1, 1]
    sched.reset()
    assert sched.choose(0.5, [0.5], 1.0) == 0


def test_runtime_policy_imports_only_allowed_modules() -> None:
    src = REPO / "runtime" / "policy.py"
    tree = ast.parse(src.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"__future__", "math", "random", "time", "bisect", "collections", "typing", "numpy"}, mods
