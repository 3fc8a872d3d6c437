"""The bank's choices timed as paired ratios: the interleaving of a round, the per-round ratio, the
interval and when more rounds run, the choice rule, its monotonicity in the batch size, and one
measurement with real tiny decoders (the runtime's batched AR against its tree decoder); EntMTP-dyn
timed against EntMTP* (its unpriced cost per step, the corrected ratio), fake and real."""

from __future__ import annotations

import random

import numpy as np
import pytest

import runtime.ar
from pipeline.timing.paired import (Block, Cell, PairedSettings, PricedBlock, acceptance_draws, candidates_at,
                                    dynamic_blocks, joint_interval,
                                    dynamic_round, measure_cell, measure_choices, measure_dynamic, monotone_choices,
                                    round_order, round_ratios)
from runtime.decoder import TreeDecoder
from runtime.tree import Tree, TreeBuffers
from tests.helpers import invariant_model, random_prompts, tiny_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NODES = [1, 3, 5, 9]   # tree 0 is the root alone (AR), then three trees by size
QUICK = PairedSettings(min_rounds=4, max_rounds=9)


class FakeMachine:
    """Blocks of a machine whose speed drifts linearly with every block (`drift` per block) and
    jitters (`noise`, seeded): AR steps cost 10 ms, tree k's `cost[k]` times that and accept
    `tps[k]` tokens per step, so its true ratio to AR is tps[k] / cost[k]. Logs the arms it ran."""

    def __init__(self, cost: dict[int, float], tps: dict[int, float], drift: float = 0.0, noise: float = 0.0,
                 seed: int = 0, new_tokens: int = 32) -> None:
        self.cost, self.tps, self.drift, self.noise, self.n = cost, tps, drift, noise, new_tokens
        self.rng = random.Random(seed)
        self.log: list[int | None] = []

    def true_ratio(self, k: int) -> float:
        return self.tps[k] / self.cost[k]

    def __call__(self, arm: int | None, _round: int) -> Block:
        speed = (1 + self.drift * len(self.log)) * self.rng.lognormvariate(0, self.noise) if self.noise else \
            1 + self.drift * len(self.log)
        self.log.append(arm)
        steps = self.n - 1 if arm is None else max(1, round((self.n - 1) / self.tps[arm]))
        step_s = 0.010 * (1.0 if arm is None else self.cost[arm]) * speed
        return Block(steps * step_s, steps)


def cell_of(rounds: list[dict[int, float]], trees: list[int] | None = None, b: int = 1) -> Cell:
    return Cell(b, trees or sorted({k for r in rounds for k in r}), rounds)


# ---------------------------------------------------------------------------------- one round


def test_a_round_is_ar_the_trees_the_trees_backwards_ar() -> None:
    assert round_order([3]) == [None, 3, 3, None]
    assert round_order([1, 2, 3]) == [None, 1, 2, 3, 3, 2, 1, None]


def test_measuring_warms_up_each_side_then_interleaves_every_round() -> None:
    machine = FakeMachine({1: 1.2, 2: 1.5}, {1: 1.9, 2: 2.4})
    cell = measure_cell(machine, 2, [1, 2], dict(machine.tps), NODES, QUICK)
    assert machine.log[:3] == [None, 1, 2]                       # untimed warm-up blocks
    assert machine.log[3:11] == [None, 1, 2, 2, 1, None] + [None, 1]
    assert len(cell.rounds) == QUICK.min_rounds                  # both decided: no extra round


def test_the_ratio_pools_each_side_and_scales_the_step_ratio_by_tokens_per_step() -> None:
    blocks = [(None, Block(1.0, 10)), (4, Block(0.9, 5)), (4, Block(1.1, 5)), (None, Block(1.2, 10))]
    # AR 0.11 s/step, the tree 0.2 s/step at 2.5 tokens/step: 2.5 * 0.11 / 0.2
    assert round_ratios(blocks, {4: 2.5}) == {4: pytest.approx(1.375)}
    with pytest.raises(ValueError, match="without an AR block"):
        round_ratios([(4, Block(1.0, 5))], {4: 2.5})
    with pytest.raises(ValueError, match=">= 1 step"):
        round_ratios([(None, Block(1.0, 0))], {})


def test_a_linear_drift_cancels_within_each_round() -> None:
    # the machine slows down by 10% per block (a ratio timed minutes apart would be off by far more)
    machine = FakeMachine({1: 1.25, 2: 2.0, 3: 3.0}, {1: 1.5, 2: 2.5, 3: 3.1}, drift=0.10)
    cell = measure_cell(machine, 4, [1, 2, 3], dict(machine.tps), [1, 3, 5, 9], QUICK)
    for k in (1, 2, 3):
        assert cell.ratios(k) == pytest.approx([machine.true_ratio(k)] * len(cell.rounds), rel=1e-9)


# ---------------------------------------------------------------------------------- the interval


def test_a_known_ratio_under_noise_lies_in_its_interval_about_as_often_as_its_level_says() -> None:
    settings = PairedSettings(min_rounds=8, max_rounds=8)
    hits = 0
    for seed in range(40):
        machine = FakeMachine({2: 1.6}, {2: 2.0}, drift=0.01, noise=0.04, seed=seed)
        cell = measure_cell(machine, 1, [2], {2: 2.0}, NODES, settings)
        med, low, high = cell.interval(2)
        assert low <= med <= high and low > 1.0 and cell.choose(NODES) == 2   # 1.25x: clear of AR every time
        hits += low <= machine.true_ratio(2) <= high
    assert hits >= 32   # a 90% interval: 36 of 40 expected


def alternating(ratios: dict[int, tuple[float, float]]):  # noqa: ANN201 - a run_block
    """Blocks whose ratio to AR alternates round by round between tree k's two values (tokens/step 1)."""
    def run(arm: int | None, r: int) -> Block:
        return Block(1.0, 10) if arm is None else Block(1.0 / ratios[arm][r % 2], 10)
    return run


def logged(run):  # noqa: ANN001, ANN201 - a run_block that logs its arms
    log: list[int | None] = []

    def inner(arm: int | None, r: int) -> Block:
        log.append(arm)
        return run(arm, r)
    return inner, log


def test_more_rounds_only_while_an_interval_straddles_one_and_never_past_the_cap() -> None:
    clear = FakeMachine({2: 1.6}, {2: 2.0}, noise=0.03)
    assert len(measure_cell(clear, 1, [2], {2: 2.0}, NODES, QUICK).rounds) == QUICK.min_rounds
    # tree 1 alternates 0.9x / 1.1x AR: its interval keeps straddling 1, so rounds run to the cap
    run, log = logged(alternating({1: (0.9, 1.1), 3: (0.4, 0.4)}))
    cell = measure_cell(run, 1, [1, 3], {1: 1.0, 3: 1.0}, NODES, QUICK)
    assert len(cell.rounds) == QUICK.max_rounds
    # tree 3 (0.4x AR) was decided in the first rounds: the extra rounds time AR and tree 1 only
    assert log[3 + 6 * QUICK.min_rounds:] == [None, 1, 1, None] * (QUICK.max_rounds - QUICK.min_rounds)
    assert cell.choose(NODES) is None


def test_two_trees_that_tie_are_timed_until_they_separate_or_the_cap() -> None:
    run, log = logged(alternating({1: (1.3 * 0.95, 1.3 * 1.05), 2: (1.3 * 1.05, 1.3 * 0.95), 3: (0.5, 0.5)}))
    cell = measure_cell(run, 1, [1, 2, 3], {1: 1.0, 2: 1.0, 3: 1.0}, NODES, QUICK)
    assert len(cell.rounds) == QUICK.max_rounds      # both beat AR, neither beats the other
    assert log[-6:] == [None, 1, 2, 2, 1, None]       # the tie only, with AR
    c = cell.choose(NODES)                            # the better median of the tie, not AR or tree 3
    assert c in (1, 2) and cell.interval(c)[0] >= cell.interval(3 - c)[0]


# ---------------------------------------------------------------------------------- the choice


def test_the_choice_needs_an_interval_above_one_and_takes_the_best_median() -> None:
    # not confidently apart, yet the better median is chosen: a rule that took the smaller tree of a
    # tie swapped trees between rebuilds, as confidence in a few percent came and went
    tie = cell_of([{1: 1.30, 2: 1.31}, {1: 1.28, 2: 1.26}, {1: 1.33, 2: 1.34}, {1: 1.29, 2: 1.30}])
    assert not tie.faster(2, 1) and tie.choose(NODES) == 2
    ahead = cell_of([{1: 1.10, 2: 1.30}, {1: 1.12, 2: 1.31}, {1: 1.09, 2: 1.29}, {1: 1.11, 2: 1.33}])
    assert ahead.faster(2, 1) and ahead.choose(NODES) == 2
    reaches_one = cell_of([{1: 1.2, 2: 0.9}, {1: 0.99, 2: 0.8}, {1: 1.3, 2: 0.85}, {1: 1.1, 2: 0.95}])
    assert reaches_one.interval(1)[1] <= 1.0 and reaches_one.choose(NODES) is None
    assert ahead.choose(NODES, within=[1]) == 1


def test_a_tree_whose_interval_only_grazes_one_leaves_the_batch_size_to_ar() -> None:
    # a B = 8 cell as one EPYC build measured it: 1.01x [1.00, 1.03], then 0.996x in the eval
    rounds = [{1: 1.01}, {1: 1.03}, {1: 1.005}, {1: 1.02}, {1: 1.012}, {1: 1.008}]
    grazing = Cell(8, [1], rounds, min_gain=0.02)
    assert grazing.interval(1)[1] > 1.0 and grazing.choose(NODES) is None
    assert grazing.undecided(NODES) == [1]    # its interval straddles 1.02: worth more rounds
    assert Cell(8, [1], rounds).choose(NODES) == 1   # no margin: the old rule took it
    clear = Cell(8, [1], [{1: 1.10}, {1: 1.12}, {1: 1.09}, {1: 1.11}], min_gain=0.02)
    assert clear.choose(NODES) == 1 and clear.undecided(NODES) == []


def test_acceptance_draws_resample_prompts_once_for_every_arm() -> None:
    tokens = [[90, 90, 90, 90], [90, 90, 90, 90], [90, 90, 90, 90]]
    steps = [[60, 60, 60, 60], [50, 70, 55, 65], [50, 70, 55, 65]]
    d = acceptance_draws(tokens, steps)
    assert d.shape == (2000, 3) and (d[:, 0] == 1.0).all()          # the same tokens/step everywhere
    assert d[:, 1].min() < 0.97 and d[:, 1].max() > 1.03            # a spread over prompts shows
    assert (d[:, 1] == d[:, 2]).all()                                # one draw of prompts for every arm
    assert (acceptance_draws(tokens, steps) == d).all()              # seeded
    with pytest.raises(ValueError, match="one shape"):
        acceptance_draws(tokens, steps[:2])


def test_the_interval_widens_by_the_calibration_prompts_spread_and_rounds_do_not_narrow_it() -> None:
    ratios = [1.05, 1.052, 1.049, 1.051, 1.05, 1.048]
    assert joint_interval(ratios) == pytest.approx(cell_of([{1: r} for r in ratios]).interval(1))
    spread = acceptance_draws([[90] * 10] * 2, [[60] * 10, [52, 68, 56, 64, 54, 66, 58, 62, 57, 63]])
    med, low, high = joint_interval(ratios, spread[:, 1])
    assert med == 1.05 and low < 1.02 < 1.08 < high
    # a B = 8 cell as HumanEval's builds timed it: 1.05x tight by timing, but its tokens/step is a
    # mean over 10 prompts: AR is chosen, and the close call is timed on (to the cap)
    cell = Cell(8, [1], [{1: r} for r in ratios], min_gain=0.02, acceptance=spread)
    assert joint_interval(cell.ratios(1))[1] > 1.04 and cell.choose(NODES) is None and cell.undecided(NODES) == [1]
    clear = Cell(8, [1], [{1: r + 0.1} for r in ratios], min_gain=0.02, acceptance=spread)
    assert clear.choose(NODES) == 1 and clear.undecided(NODES) == []
    assert Cell(8, [1], [{1: r} for r in ratios], min_gain=0.02).choose(NODES) == 1
    # two trees on one draw of prompts: their pairwise interval keeps the pairing
    both = Cell(1, [1, 2], [{1: r, 2: r * 1.2} for r in ratios], acceptance=np.stack([spread[:, 1]] * 3, axis=1))
    assert both.versus(2, 1) == pytest.approx((1.2, 1.2, 1.2)) and both.faster(2, 1)


def test_choices_stay_monotone_in_the_batch_size_unless_confidently_faster() -> None:
    small = [{1: 1.20, 3: 1.05}, {1: 1.22, 3: 1.04}, {1: 1.19, 3: 1.06}, {1: 1.21, 3: 1.02}]
    # at B = 2 the 9-node tree has the best median but ties the 3-node tree: B = 1's tree stays
    tied = [{1: 1.20, 3: 1.22}, {1: 1.25, 3: 1.20}, {1: 1.18, 3: 1.23}, {1: 1.22, 3: 1.24}]
    ahead = [{1: 1.10, 3: 1.40}, {1: 1.11, 3: 1.42}, {1: 1.09, 3: 1.39}, {1: 1.12, 3: 1.41}]
    got = monotone_choices({1: cell_of(small), 2: cell_of(tied), 4: cell_of(ahead)}, NODES)
    assert got[1] == (1, 1)
    assert got[2] == (1, 3)     # alone B = 2 takes the 9-node tree's better median; not confidently faster: B = 1's stays
    assert got[4] == (3, 3)     # the bigger tree beats B = 2's with confidence: kept
    # the 9-node tree beats B = 1's 3-node tree with confidence at B = 2: kept
    three = [{1: 1.20, 2: 1.15, 3: 1.40}, {1: 1.21, 2: 1.45, 3: 1.42}, {1: 1.19, 2: 1.18, 3: 1.39},
             {1: 1.20, 2: 1.44, 3: 1.41}]
    assert cell_of(three).choose(NODES) == 3
    assert monotone_choices({1: cell_of(small), 2: cell_of(three)}, NODES)[2] == (3, 3)
    # AR at a smaller batch size leaves a tree that beats AR with confidence in place
    slow = [{1: 0.9, 3: 0.8}] * 4
    got = monotone_choices({1: cell_of(slow), 2: cell_of(ahead)}, NODES)
    assert got == {1: (None, None), 2: (3, 3)}


def test_the_candidates_are_the_fastest_modeled_trees_without_the_root() -> None:
    assert candidates_at([100.0, 120.0, 130.0, 90.0], NODES, 2) == [2, 1]
    assert candidates_at([100.0, None, 99.0, 101.0], NODES, 3) == [3, 2]
    assert candidates_at([100.0], [1], 3) == []
    # trees the model prices far below AR are not timed, but the fastest always is
    assert candidates_at([100.0, 120.0, 130.0, 90.0], NODES, 3, [None, 0.9, 0.7, 0.5], floor=0.8) == [2, 1]
    assert candidates_at([100.0, 120.0, 130.0, 90.0], NODES, 3, [None, 0.6, 0.7, 0.5], floor=0.8) == [2]


def test_settings_are_checked_and_read_from_the_bank_config() -> None:
    got = PairedSettings.from_bank_config({"paired_candidates": 2, "paired_max_rounds": 6, "members": "oracle"})
    assert (got.candidates, got.max_rounds, got.min_rounds) == (2, 6, 4)
    # the config schema's defaults are these settings' defaults
    from dataclasses import asdict

    from pipeline.config.schema import BankConfig

    assert PairedSettings.from_bank_config(asdict(BankConfig())) == PairedSettings()
    with pytest.raises(ValueError, match="min_rounds <= max_rounds"):
        PairedSettings(min_rounds=5, max_rounds=4)
    with pytest.raises(ValueError, match="new_tokens >= 2"):
        PairedSettings(new_tokens=1)
    with pytest.raises(ValueError, match="min_gain in"):
        PairedSettings(min_gain=-0.01)
    assert PairedSettings.from_bank_config({"paired_min_gain": 0.05}).min_gain == 0.05


# ---------------------------------------------------------------------------------- real decoders


def test_real_tiny_decoders_time_trees_against_the_runtimes_batched_ar(monkeypatch: pytest.MonkeyPatch) -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    trees = [Tree([]), Tree.chain(1), Tree([(0,), (1,), (0, 0)]), Tree.chain(4)]
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees])
    ar_calls: list[int] = []
    real_ar = runtime.ar.ar_generate_batch

    def counted(model_, prompts, *args, **kwargs):  # noqa: ANN001, ANN202 - runtime.ar's signature
        ar_calls.append(len(prompts))
        return real_ar(model_, prompts, *args, **kwargs)

    monkeypatch.setattr(runtime.ar, "ar_generate_batch", counted)
    settings = PairedSettings(min_rounds=2, max_rounds=3, new_tokens=8, prompts=2)
    cells = measure_choices(dec, random_prompts(3, seed=5), {1: [1, 2], 2: [2, 3]}, [1.0, 1.3, 1.6, 1.8], settings)
    assert sorted(cells) == [1, 2]
    for b, cell in cells.items():
        assert settings.min_rounds <= len(cell.rounds) <= settings.max_rounds
        for k in cell.trees:
            med, low, high = cell.interval(k)
            assert 0 < low <= med <= high < 100
    # every round's AR blocks are the runtime's batched AR, at the cell's batch size
    assert ar_calls.count(1) == 1 + 2 * len(cells[1].rounds) and ar_calls.count(2) == 1 + 2 * len(cells[2].rounds)


# ---------------------------------------------------------------------------------- EntMTP-dyn


def test_a_dyn_round_prices_its_excess_over_entmtp_star_and_corrects_the_replayed_ratio() -> None:
    # EntMTP* runs 10% slower than modeled, dyn 32% slower: dyn's excess is 20% of its modeled 5 ms step
    blocks = [(False, PricedBlock(1.1, 1.0, 100)), (True, PricedBlock(1.32, 1.0, 200)),
              (True, PricedBlock(1.32, 1.0, 200)), (False, PricedBlock(1.1, 1.0, 100))]
    ratio, overhead = dynamic_round(blocks, replay_ratio=1.2)
    assert ratio == pytest.approx(1.2 / 1.2) and overhead == pytest.approx(0.2 * 5.0)
    with pytest.raises(ValueError, match="both EntMTP\\* and EntMTP-dyn"):
        dynamic_round(blocks[:1], 1.0)


def test_dyn_is_timed_static_dyn_dyn_static_until_its_interval_decides() -> None:
    log: list[bool] = []

    def run(dyn: bool, r: int) -> PricedBlock:
        log.append(dyn)
        wobble = 1.3 if r % 2 else 0.8   # dyn alternately far slower and faster: its interval straddles 1
        return PricedBlock(1.0 * (wobble if dyn else 1.0), 1.0, 10)

    cell = measure_dynamic(run, 1.05, QUICK)
    assert log[:6] == [False, True, False, True, True, False] and len(cell.ratios) == QUICK.max_rounds
    clear = measure_dynamic(lambda dyn, r: PricedBlock(1.0, 1.0, 10), 1.3, QUICK)
    assert len(clear.ratios) == QUICK.min_rounds and clear.record(1.3)["offered"]
    assert clear.record(1.3)["median"] == pytest.approx(1.3) and clear.overhead() == pytest.approx(0.0)
    assert not measure_dynamic(lambda dyn, r: PricedBlock(1.0, 1.0, 10), 0.9, QUICK).record(0.9)["offered"]
    # 1% faster than EntMTP* with confidence, but not by the bank's 2% margin: not offered
    margin = PairedSettings(min_rounds=QUICK.min_rounds, max_rounds=QUICK.max_rounds, min_gain=0.02)
    grazing = measure_dynamic(lambda dyn, r: PricedBlock(1.0, 1.0, 10), 1.01, margin).record(1.01)
    assert grazing["low"] > 1.0 and not grazing["offered"] and grazing["min_gain"] == 0.02


def test_real_tiny_decoders_price_a_dynamic_policy_step_by_step() -> None:
    from runtime.dynamic import DynamicPolicy
    from tests.helpers import SUPER

    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in (Tree([]), Tree.chain(2))])
    policy = DynamicPolicy(SUPER, [5.0 + 0.2 * n for n in range(SUPER.num_nodes)])
    run = dynamic_blocks(dec, random_prompts(2, seed=3), 1, 6.0, policy, new_tokens=8)
    static, dyn = run(False, 0), run(True, 0)
    assert static.modeled_s == pytest.approx(6.0e-3 * static.steps) and static.measured_s > 0
    assert 5.2e-3 * dyn.steps <= dyn.modeled_s <= (5.0 + 0.2 * SUPER.num_nodes) * 1e-3 * dyn.steps
    cell = measure_dynamic(run, 1.0, PairedSettings(min_rounds=2, max_rounds=3, new_tokens=8))
    assert 2 <= len(cell.ratios) <= 3 and all(r > 0 for r in cell.ratios)
