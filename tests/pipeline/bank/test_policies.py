"""Policy fitting by replay (pipeline/bank/policies.py) and the bank's members (selection.py), on
synthetic rollouts."""

from __future__ import annotations

import json

import pytest

from pipeline.bank.policies import PAPER_TAUS, fit_all_policies, fit_policies
from pipeline.grow import grow
from pipeline.replay.oracle import oracle_replay
from pipeline.replay.policy import BankReplay, replay_policy
from runtime.policy import StaticPolicy, policy_from_dict
from tests.helpers import synthetic_rollouts


@pytest.fixture(scope="module")
def bank_setup():
    rolls = synthetic_rollouts(8, 96, 4, rank_cap=8, seed=4)
    res = grow(rolls, 4, 30, progress=False)
    trees = [res.trees[b - 1] for b in (2, 8, 16, 30)]
    costs = [0.010, 0.0115, 0.0135, 0.017]  # a machine where bigger trees cost more
    return rolls, trees, costs


def test_fit_policies_beats_nothing_above_the_oracle(bank_setup) -> None:
    rolls, trees, costs = bank_setup
    data = BankReplay.build(rolls, trees)
    fit = fit_policies(data, None, costs, n_quantiles=8)
    orc = oracle_replay(data, None, costs)
    assert fit["oracle"]["tokens_per_second"] == pytest.approx(orc.tokens_per_second)
    kinds = ("static", "hysteresis", "hysteresis_paper_grid", "ladder", "expected_throughput")
    for k in kinds:
        assert fit[k]["tokens_per_second"] <= orc.tokens_per_second + 1e-9
        # the stored policy reproduces its figure
        rep = replay_policy(data, None, policy_from_dict(json.loads(json.dumps(fit[k]["policy"]))), costs)
        assert rep.tokens_per_second == pytest.approx(fit[k]["tokens_per_second"])
    # static is the best single tree; the wider hysteresis search includes the paper grid
    statics = [replay_policy(data, None, StaticPolicy(j), costs).tokens_per_second for j in range(len(trees))]
    assert fit["static"]["tokens_per_second"] == pytest.approx(max(statics))
    assert fit["hysteresis"]["tokens_per_second"] >= fit["hysteresis_paper_grid"]["tokens_per_second"] - 1e-9
    assert fit["hysteresis_paper_grid"]["policy"]["tau_on"] in PAPER_TAUS
    best = fit["best_kind"]
    assert all(fit[best]["tokens_per_second"] >= fit[k]["tokens_per_second"] for k in ("static", "hysteresis", "ladder", "expected_throughput"))
    # on this synthetic data (a hidden easy/hard regime drives the signals) switching pays
    assert fit[best]["tokens_per_second"] > fit["static"]["tokens_per_second"]


def test_fit_all_policies_for_the_bank_stage(bank_setup) -> None:
    rolls, trees, costs = bank_setup
    out = fit_all_policies(rolls, trees, costs, {"name": "hysteresis", "signal": "paper", "tau_grid": list(PAPER_TAUS), "fine_search": False})
    assert set(out["policies"]) == {"static", "hysteresis", "ladder", "expected_throughput"}
    hyst = out["policies"]["hysteresis"]["policy"]
    assert hyst["signal"] == "paper" and hyst["tau_on"] in PAPER_TAUS  # the configured recipe
    for f in out["policies"].values():
        assert f["replay"]["tokens_per_second"] <= out["oracle"]["tokens_per_second"] + 1e-9
        policy_from_dict(f["policy"])
    json.dumps(out)
    with pytest.raises(ValueError, match="policy.name"):
        fit_all_policies(rolls, trees, costs, {"name": "nope"})
    with pytest.raises(ValueError, match="positive seconds"):
        fit_all_policies(rolls, trees, costs[:2])


def test_bank_members_hull_and_oracle(bank_setup) -> None:
    """The paper's hull drops a tree that is slower on average; the oracle rule keeps it when the
    best-in-hindsight schedule uses it, and never drops a hull tree."""
    from pipeline.bank.selection import bank_members
    from pipeline.timing.checks import e2e_tokens_per_second

    rolls, trees, costs = bank_setup
    data = BankReplay.build(rolls, trees)
    cands = []
    for t, c in zip(trees, costs):
        tps = replay_policy(data, None, StaticPolicy(len(cands)), costs).tokens_per_step
        cands.append({"paths": [list(p) for p in t], "nodes": len(t) + 1, "depth": max(len(p) for p in t),
                      "step_ms": 1000 * c, "tok_per_s": e2e_tokens_per_second(tps, c, 0.0, 96)})
    # make the second tree lose on average (but it is still the best on some steps)
    cands[1]["tok_per_s"] = 0.5 * cands[0]["tok_per_s"]
    hull = bank_members(cands, rolls, "hull")
    assert 1 not in hull and hull == sorted(hull)
    share = oracle_replay(data, None, costs).summary()["tree_share"]
    oracle = bank_members(cands, rolls, "oracle", min_oracle_share=0.01)
    assert 1 in oracle and set(hull) <= set(oracle) and oracle == sorted(oracle)
    assert set(oracle) == set(hull) | {k for k, s in enumerate(share) if s >= 0.01}
    assert bank_members(cands, rolls, "oracle", min_oracle_share=1.0) == hull
    with pytest.raises(ValueError, match="choose one of"):
        bank_members(cands, rolls, "everything")


def test_signal_cost_is_charged_to_dynamic_policies(bank_setup) -> None:
    """A head-chain signal costs time every step: with that cost charged, a fitted policy on it
    reports less throughput than without, and static (which reads no signal) is unchanged."""
    rolls, trees, costs = bank_setup
    data = BankReplay.build(rolls, trees)
    signals = {k: [("greedy_path", {})] for k in ("hysteresis", "ladder", "expected_throughput")}
    free = fit_policies(data, None, costs, signals=signals, n_quantiles=8)
    charged = fit_policies(data, None, costs, signals=signals, n_quantiles=8, signal_costs={"greedy_path": 0.005})
    assert charged["static"]["tokens_per_second"] == pytest.approx(free["static"]["tokens_per_second"])
    for k in ("hysteresis", "ladder", "expected_throughput"):
        assert charged[k]["tokens_per_second"] < free[k]["tokens_per_second"]
        rep = replay_policy(data, None, policy_from_dict(charged[k]["policy"]), costs)
        assert charged[k]["time_s"] == pytest.approx(rep.time_s + 0.005 * rep.steps)


def test_static_policy_takes_the_smallest_tree_within_the_tie_tolerance(bank_setup) -> None:
    """A near-tie must not decide the static tree: with `tie_tolerance` the smallest tree whose
    replayed tokens/s is within that share of the best one wins; without, the best one."""
    rolls, trees, costs = bank_setup
    data = BankReplay.build(rolls, trees)
    statics = [replay_policy(data, None, StaticPolicy(j), costs).tokens_per_second for j in range(len(trees))]
    best = max(range(len(trees)), key=statics.__getitem__)
    assert best > 0, "the fixture's best static tree is the smallest one: nothing to tie-break"
    # a tolerance that just admits the smallest tree scoring below the best
    smaller = max(range(best), key=statics.__getitem__)
    tol = 1 - statics[smaller] / statics[best] + 1e-6
    want = next(j for j in range(len(trees)) if statics[j] >= (1 - tol) * statics[best])
    strict = fit_policies(data, None, costs, n_quantiles=8)
    tied = fit_policies(data, None, costs, n_quantiles=8, tie_tolerance=tol)
    assert strict["static"]["policy"]["index"] == best
    assert tied["static"]["policy"]["index"] == want < best
    assert tied["static"]["tokens_per_second"] == pytest.approx(statics[want])


def test_a_measured_static_tree_overrides_the_replayed_best(bank_setup) -> None:
    """`static_index` (the bank's paired choice at batch size 1) names EntMTP*'s tree whatever the
    replay prefers; its figures are that tree's replay, and an index outside the bank is refused."""
    rolls, trees, costs = bank_setup
    data = BankReplay.build(rolls, trees)
    best = fit_policies(data, None, costs, n_quantiles=8)["static"]["policy"]["index"]
    other = 0 if best != 0 else 1
    fit = fit_policies(data, None, costs, n_quantiles=8, static_index=other)
    assert fit["static"]["policy"]["index"] == other
    assert fit["static"]["tokens_per_second"] == pytest.approx(
        replay_policy(data, None, StaticPolicy(other), costs).tokens_per_second)
    with pytest.raises(ValueError, match="not one of the bank"):
        fit_policies(data, None, costs, n_quantiles=8, static_index=len(trees))
