"""EntMTP-dyn priced as it runs (`build_dynamic` with `price`): the cost per step the step-cost model
leaves out, measured against EntMTP*, is added to every step cost before the fit runs again; the
refitted policy is timed again and its record says whether the bank offers it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bank.dynamic import build_dynamic, dynamic_step_ms
from pipeline.replay.dynamic import replay_dynamic
from pipeline.timing.paired import DynamicCell
from runtime.dynamic import DynamicPolicy
from runtime.bank import TopologyBank
from tests.helpers.step_cost import LinearCosts
from tests.helpers import SUPER, invariant_model, make_bank, random_prompts, scored_rollouts, tiny_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def scored() -> tuple[list[dict], dict]:
    model = invariant_model("padded")
    rolls, (scores,) = scored_rollouts(model, tiny_heads(model, "hydra"), random_prompts(3), [SUPER])
    return rolls, {"super_trees": [list(SUPER.paths)], "scores": [scores]}


def pricer(overheads: list[float], ratios: list[float]):  # noqa: ANN201 - build_dynamic's `price`
    """A `price` that answers call i with rounds of dyn's ratio `ratios[i]` and overhead `overheads[i]`."""
    calls: list[tuple] = []

    def price(policy, replay_ratio: float, acceptance=None) -> DynamicCell:  # noqa: ANN001 - a DynamicPolicy
        i = len(calls)
        calls.append((list(policy.step_ms), replay_ratio, acceptance))
        return DynamicCell([ratios[i] * f for f in (0.98, 1.0, 1.02, 1.01)], [overheads[i]] * 4, acceptance=acceptance)

    return price, calls


def test_the_measured_overhead_is_priced_into_every_step_and_the_refit(scored, tmp_path: Path) -> None:
    rolls, scores = scored
    plain = build_dynamic(rolls, scores, LinearCosts(), 100.0, None)
    price, calls = pricer([0.8, 0.05], [1.1, 0.9])
    dyn = build_dynamic(rolls, scores, LinearCosts(), 100.0, None, price=price, static_tok_per_s=50.0)
    assert len(calls) == 2 and calls[0][0] == pytest.approx(plain["step_ms"])
    unpriced = dynamic_step_ms(LinearCosts(), SUPER, 100.0)
    assert dyn["step_ms"] == pytest.approx([c + 0.8 for c in unpriced]) and calls[1][0] == pytest.approx(dyn["step_ms"])
    assert dyn["replay"]["tokens_per_second"] < plain["replay"]["tokens_per_second"]   # its figures pay for it
    assert calls[1][1] == pytest.approx(dyn["replay"]["tokens_per_second"] / 50.0)
    rec = dyn["paired"]
    assert rec["priced_overhead_ms"] == pytest.approx(0.8) and rec["measured_overhead_ms"] == pytest.approx(0.8)
    assert rec["overhead_ms"] == pytest.approx(0.05) and rec["median"] < 1.0 and rec["offered"] is False
    bank = make_bank()
    bank.dynamic = dyn
    back = TopologyBank.load(bank.save(tmp_path / "bank"), max_depth=4)
    assert back.dynamic["paired"] == rec
    assert "EntMTP-dyn paired against EntMTP*: " in back.summary() and "not offered" in back.summary()
    assert back.dynamic_policy().step_ms == pytest.approx(dyn["step_ms"])


def test_dyns_interval_resamples_the_calibration_prompts_behind_its_replayed_speed_up(scored) -> None:
    rolls, scores = scored
    price, calls = pricer([0.0, 0.0], [1.3, 1.3])
    plain = build_dynamic(rolls, scores, LinearCosts(), 100.0, None, price=price, static_tok_per_s=50.0)
    assert calls[-1][2] is None and plain["paired"]["interval"] == "rounds"
    # EntMTP*'s replayed seconds per prompt: one prompt far slower than dyn's replay of it, so the
    # speed-up depends on which prompts a draw takes
    static = [replay_dynamic([r], [sc], DynamicPolicy(SUPER, plain["step_ms"], plain["calibration"],
                                                      draft_ms=plain["draft_ms"], stop_below=plain["stop_below"])).time_s
              for r, sc in zip(rolls, scores["scores"][0])]
    static[0] *= 2.0
    price, calls = pricer([0.0, 0.0], [1.3, 1.3])
    dyn = build_dynamic(rolls, scores, LinearCosts(), 100.0, None, price=price, static_tok_per_s=50.0,
                        static_prompt_seconds=static)
    draws = calls[-1][2]
    assert draws.shape == (2000,) and draws.min() < 0.95 and draws.max() > 1.05
    assert dyn["paired"]["interval"] == "rounds and calibration prompts"
    assert dyn["paired"]["high"] - dyn["paired"]["low"] > plain["paired"]["high"] - plain["paired"]["low"]
    with pytest.raises(ValueError, match="prompts"):
        build_dynamic(rolls, scores, LinearCosts(), 100.0, None, price=price, static_tok_per_s=50.0,
                      static_prompt_seconds=static[:1])


def test_a_winning_dyn_is_offered_and_a_negative_excess_prices_nothing(scored) -> None:
    rolls, scores = scored
    price, calls = pricer([-0.5, 0.0], [1.3, 1.3])
    dyn = build_dynamic(rolls, scores, LinearCosts(), 100.0, None, price=price, static_tok_per_s=50.0)
    assert dyn["paired"]["priced_overhead_ms"] == 0.0 and dyn["paired"]["measured_overhead_ms"] == pytest.approx(-0.5)
    assert dyn["step_ms"] == pytest.approx(dynamic_step_ms(LinearCosts(), SUPER, 100.0)) and dyn["paired"]["offered"] is True
