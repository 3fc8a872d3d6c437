"""The batch-size axis of the step-cost model and of the bank: what a step of B sequences costs,
which tree pays at each batch size, and the bank record the serving exports read."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.bank.selection import batch_choices
from pipeline.timing.batch import batch_table, in_situ_row, batch_tokens_per_second, measure_batch_verify, predict_batch
from pipeline.timing.step_cost import StepCostModel
from runtime.bank import BankError, TopologyBank
from runtime.tree import Tree
from tests.helpers import make_bank, reseal, tiny_model
from tests.helpers import level_ms, synthetic_step_model as step_model


def _with_batch(model: StepCostModel, sizes: list[int], per_row: float) -> StepCostModel:
    """The model with a batch axis whose verify ratio grows with B and with the rows."""
    model.batch_sizes = sizes
    model.batch_verify_ratio = [[1 + per_row * (b - 1) * n for n in model.verify_rows] for b in sizes]
    model.validate()
    return model


def test_a_batched_step_drafts_together_finishes_each_sequence_and_verifies_all_rows_at_once() -> None:
    model = _with_batch(step_model(), [1, 2, 4], per_row=0.01)
    tree = Tree([(0,), (1,), (0, 0)])
    one = model.predict(tree, 200)
    assert predict_batch(model, tree, 200, 1) == one
    four = predict_batch(model, tree, 200, 4)
    # one propose_batch: level 1 over 4 roots, level 2 over 4 x 1 parents (synthetic level costs)
    assert four["draft_ms"] == pytest.approx(0.2 + level_ms(1, 4) + level_ms(2, 4))
    assert one["draft_ms"] < four["draft_ms"] < 4 * one["draft_ms"]
    assert four["fixed_ms"] == pytest.approx(4 * one["fixed_ms"])
    assert four["verify_ms"] == pytest.approx((1 + 0.01 * 3 * tree.num_nodes) * one["verify_ms"])
    with pytest.raises(ValueError, match="batch size 3 was not measured"):
        predict_batch(model, tree, 200, 3)


def test_the_batch_axis_is_checked_when_a_model_is_loaded() -> None:
    model = step_model()
    model.batch_sizes, model.batch_verify_ratio = [1, 2], [[1.0] * len(model.verify_rows)]
    with pytest.raises(ValueError, match="batch_verify_ratio"):
        model.validate()
    assert StepCostModel.from_dict(_with_batch(step_model(), [1, 2], 0.01).to_dict()).batch_sizes == [1, 2]


def test_ratios_become_monotone_in_rows_and_batch() -> None:
    ratios = {(1, 1): 1.0, (1, 4): 1.0, (2, 1): 1.3, (2, 4): 1.2, (4, 1): 1.25, (4, 4): 2.0}
    table = batch_table(ratios, [1, 2, 4], [1, 4])
    assert all(a <= b for row in table for a, b in zip(row, row[1:]))
    assert all(a <= b for col in zip(*table) for a, b in zip(col, col[1:]))


@torch.inference_mode()
def test_measured_batch_verify_ratios_on_a_real_forward() -> None:
    model = tiny_model()
    model.set_row_invariance(4)
    ratios = measure_batch_verify(model, [1, 2, 4], [1, 3], context=20, repeats=2, now=__import__("time").perf_counter)
    assert set(ratios) == {(b, n) for b in (1, 2, 4) for n in (1, 3)}
    assert all(r == 1.0 for (b, _), r in ratios.items() if b == 1)
    assert all(math.isfinite(r) and r > 0 for r in ratios.values())
    assert model.cache_len == 0  # the model's own cache is left as it was


def _batch_record(ar_ms: dict[int, float], tree_ms: dict[int, list[float]], tps: list[float]) -> dict:
    """A time stage's batch axis for trees with these tokens/step and step costs (ms) per batch size."""
    per = {}
    for b, ms in tree_ms.items():
        per[str(b)] = {"ar_step_ms": ar_ms[b], "ar_tok_per_s": batch_tokens_per_second(b, 1.0, ar_ms[b] / 1e3, 0.05, 64),
                       "trees": [{"step_ms": m, "tok_per_s": batch_tokens_per_second(b, t, m / 1e3, 0.05, 64)}
                                 for m, t in zip(ms, tps)],
                       "chains": [{"depth": 1, "tokens_per_step": tps[1], "step_ms": ms[1],
                                   "tok_per_s": batch_tokens_per_second(b, tps[1], ms[1] / 1e3, 0.05, 64)}]}
    return {"sizes": sorted(tree_ms), "per_batch": per}


def test_the_best_tree_shrinks_as_the_batch_grows_and_ar_takes_over() -> None:
    # root, a 2-node and a 9-node tree: cheap rows at batch 1, rows that cost their share at batch 8
    tps = [1.0, 1.45, 2.0]
    record = _batch_record({1: 30, 2: 33, 8: 60},
                           {1: [30, 31, 38], 2: [33, 36, 55], 8: [60, 95, 240]}, tps)
    choices = batch_choices(record, [0, 1, 2], [1, 2, 9], best_static=2, tolerance=0.02)
    assert choices["1"]["best_static"] == 2       # batch 1 keeps the bank's own EntMTP*
    assert choices["2"]["best_static"] == 1       # a smaller tree pays at batch 2
    assert choices["8"]["best_static"] is None    # nothing beats AR at batch 8: no speculation
    assert choices["8"]["best_chain"] is None and choices["2"]["best_chain"]["depth"] == 1
    # a modeled gain that the model's measured error at that batch size, on the tree's step and on
    # AR's, could undo is no promise: AR there
    gain = choices["2"]["tok_per_s"][1] / record["per_batch"]["2"]["ar_tok_per_s"]
    bound = 100 * (gain ** 0.5 - 1)  # (1 + e)^2 = gain
    for err, speculates in ((bound - 0.5, True), (bound + 0.5, False)):
        record["per_batch"]["2"]["trees"][0]["model_error_pct"] = -err
        again = batch_choices(record, [0, 1, 2], [1, 2, 9], best_static=2, tolerance=0.02)
        assert (again["2"]["best_static"] is not None) == speculates
        assert (again["2"]["best_chain"] is not None) == speculates


def test_a_bank_keeps_its_batch_record_and_refuses_a_damaged_one(tmp_path) -> None:  # noqa: ANN001
    bank = make_bank()
    n = len(bank.trees)
    bank.batch_schedule = {str(b): {"best_static": n - 1 if b == 1 else 0, "best_chain": None, "ar_step_ms": 20.0 * b,
                                    "step_ms": [21.0 * b] * n, "tok_per_s": [50.0 / b] * n} for b in (1, 2, 4)}
    bank.oracle = {**bank.oracle, "batch": {"2": {"one tree for all": 80.0, "static per batch size": 90.0,
                                                  "batch oracle": 100.0, "one tree for all share of oracle": 0.8,
                                                  "static per batch size share of oracle": 0.9}}}
    folder = bank.save(tmp_path / "bank")
    loaded = TopologyBank.load(folder)
    assert loaded.batch_schedule == json.loads(json.dumps(bank.batch_schedule))
    assert [c.batch_size for c in loaded.serving_schedule().choices] == [1, 2, 4]
    assert "batch   4: tree [0]" in loaded.summary()
    # the replayed batch methods in one table, each with its share of the batch oracle
    assert "      2 | 80.0 (80%) | 90.0 (90%) | - | 100.0" in loaded.summary()
    doc = json.loads((folder / "bank.json").read_text())
    doc["batch_sizes"]["2"]["step_ms"] = [1.0]  # one entry for several trees
    (folder / "bank.json").write_text(json.dumps(doc))
    reseal(folder)
    with pytest.raises(BankError, match="batch_sizes"):
        TopologyBank.load(folder)


# --- the batch scheduler and its replay -------------------------------------------------------


def _expected(table: list[list[float]], edges: list[float]):  # noqa: ANN202 - an ExpectedThroughputPolicy
    from runtime.policy import ExpectedThroughputPolicy

    return ExpectedThroughputPolicy(edges, table, [0.02] * len(table[0]), signal="p0")


def test_the_batch_scheduler_spends_the_verify_budget_on_confident_sequences() -> None:
    from runtime.policy import BatchScheduler

    # tokens/step of a root, a 3-node and a 9-node tree for an unsure (p0 < 0.5) and a sure sequence
    policy = _expected([[1.0, 1.1, 1.15], [1.0, 1.8, 2.6]], [0.5])
    cheap = BatchScheduler(policy, {2: [30.0, 32.0, 36.0], 8: [40.0, 90.0, 200.0]})
    assert cheap.choose([0.9, 0.1]) == [2, 0]          # the sure sequence gets the deep tree, the unsure none
    assert cheap.choose([0.9] * 8) == [0] * 8          # at batch 8 extra rows cost more than they bring
    assert cheap.costs(3) == cheap.step_ms[8] and cheap.costs(20) == cheap.step_ms[8]
    with pytest.raises(ValueError, match="one positive step cost per tree"):
        BatchScheduler(policy, {2: [30.0, 32.0]})


def test_batch_replay_of_one_lane_is_the_single_sequence_replay() -> None:
    from pipeline.replay.policy import BankReplay, replay_batch, replay_policy
    from runtime.policy import StaticPolicy
    from tests.helpers import synthetic_rollouts

    rolls = synthetic_rollouts(n_prompts=5, length=60)
    trees = [Tree([]), Tree.chain(2), Tree([(0,), (1,), (0, 0), (0, 0, 0)])]
    data = BankReplay.build(rolls, [t.paths for t in trees])
    ms = [20.0, 24.0, 30.0]
    for k in range(3):
        one = replay_batch(data, 1, lambda lanes, _s, k=k: [k] * len(lanes), lambda picks: sum(ms[j] for j in picks))
        ref = replay_policy(data, None, StaticPolicy(k), [m / 1000 for m in ms])
        assert one["tokens"] == ref.tokens and one["steps"] == ref.steps
        assert one["tokens_per_second"] == pytest.approx(ref.tokens_per_second)
    four = replay_batch(data, 4, lambda lanes, _s: [2] * len(lanes), lambda picks: 30.0)
    assert four["tokens"] == data.tokens and four["steps"] < ref.steps  # the same tokens in fewer, shared steps


def test_batch_replays_put_the_oracle_on_top() -> None:
    from pipeline.bank.selection import batch_replays
    from tests.helpers import synthetic_rollouts

    rolls = synthetic_rollouts(n_prompts=6, length=80)
    trees = [Tree([]), Tree.chain(2), Tree([(0,), (1,), (0, 0), (0, 0, 0)])]
    policy = {"kind": "expected_throughput", "signal": "p0", "bucket_edges": [0.5],
              "tokens_per_step": [[1.0, 1.2, 1.3], [1.0, 1.9, 2.5]], "step_costs": [0.02, 0.022, 0.026]}
    batch = {"1": {"best_static": 2, "step_ms": [20.0, 22.0, 26.0]}, "4": {"best_static": 1, "step_ms": [24.0, 40.0, 70.0]}}
    out = batch_replays(rolls, trees, {"expected_throughput": policy}, 2, batch)
    for b in ("1", "4"):
        for method in ("one tree for all", "static per batch size", "batch scheduler"):
            assert 0 < out[b][f"{method} share of oracle"] <= 1.0 + 1e-9, (b, method, out[b])



@torch.inference_mode()
def test_the_batch_axis_is_calibrated_in_situ_and_checked_by_other_passes() -> None:
    """measure_batch_axis on a real tiny decoder: ratios from batched forwards, one in-situ factor
    per batch size from calibration passes of timed batched decodes, and every timed tree checked at
    every batch size > 1 by as many check passes; a clock that ticks once per call makes them alike."""
    from pipeline.timing.batch import BATCH_CHECK_PASSES, calibration_pass, measure_batch_axis
    from runtime.decoder import TreeDecoder
    from runtime.tree import TreeBuffers
    from tests.helpers import DECODER_TREES, tiny_heads

    tiny = tiny_model()
    tiny.set_row_invariance(4)
    dec = TreeDecoder(tiny, tiny_heads(tiny, "hydra"), [TreeBuffers.compile(t) for t in DECODER_TREES])
    cost = step_model()
    ticks = iter(range(10**7))
    runs = []
    out = measure_batch_axis(dec, cost, list(DECODER_TREES), [1.0 + 0.1 * k for k in range(len(DECODER_TREES))], [0, 1],
                             [1, 2, 4], 20, list(range(3, 15)), repeats=2, new_tokens=16, check_tokens=10,
                             prefill_s=0.01, sampler=None, now=lambda: float(next(ticks)), progress=lambda: runs.append(1))
    assert len(runs) == 2 * BATCH_CHECK_PASSES * 2 * 2  # calibration + check passes x two timed trees x B=2, 4
    kinds = [calibration_pass(i) for i in range(2 * BATCH_CHECK_PASSES)]
    assert sum(kinds) == BATCH_CHECK_PASSES and kinds[:4] == [True, False, False, True]  # C K K C: drift cancels
    assert cost.batch_sizes == [1, 2, 4] and len(cost.batch_in_situ) == 3
    assert cost.batch_in_situ[0] == [1.0] * len(cost.verify_rows)
    assert StepCostModel.from_dict(cost.to_dict()).batch_in_situ == cost.batch_in_situ
    for b in ("2", "4"):
        rows = out["per_batch"][b]["trees"]
        assert all("model_error_pct" in rows[k] for k in (0, 1)) and all("model_error_pct" not in r for r in rows[2:])
    assert in_situ_row([1, 2, 4, 8], {0: 2.0, 1: 1.0, 2: 3.0}, [2, 4, 4]) == [2.0, 2.0, 2.0, 2.0]
    assert in_situ_row([1, 3, 9], {0: 1.0, 1: 3.0}, [2, 4]) == [1.0, 2.0, 3.0]
    # a clock that ticks once per call times every step as 1 s; the factors follow the node count, so
    # the second pass meets the calibrated model on both timed trees (up to the rows grid's interpolation)
    assert out["max_abs_error_pct"] < 3
    factors = list(out["in_situ"]["2"].values())
    assert factors[0] > factors[-1] > 0  # the 5-node chain is modeled cheaper than the 64-node tree
    cost.batch_in_situ = [[1.0] * len(cost.verify_rows), [-1.0] * len(cost.verify_rows), [1.0] * len(cost.verify_rows)]
    with pytest.raises(ValueError, match="batch_in_situ"):
        cost.validate()


@torch.inference_mode()
def test_a_cell_whose_two_kinds_of_pass_disagree_is_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow phase that outlasts every calibration pass of one (tree, batch size) shows as a gap
    between its fastest calibration and check passes: that cell, and only it, gets more passes of
    both kinds (all kept), and the model checks out once a calibration pass runs at full speed."""
    from pipeline.timing import batch
    from runtime.decoder import TreeDecoder
    from runtime.tree import TreeBuffers
    from tests.helpers import DECODER_TREES, tiny_heads

    assert batch.pass_spread([1.2, 1.0, 1.0, 1.2]) == pytest.approx(0.2)
    assert batch.pass_spread([1.0, 1.1, 1.0, 1.3, 1.0, 1.0]) == pytest.approx(0.0)
    calls: list[tuple[list[int], list[int]]] = []

    def timed(decoder, prompt, trees, sizes, new_tokens, sampler, now, progress=None, warmup_steps=2, passes=1):  # noqa: ANN001, ANN202
        first = not calls
        calls.append((list(trees), list(sizes)))
        # the first round: calibration passes of (tree 1, B=2) all 25% slow; later rounds at full speed
        return [{(k, b): 0.01 * (1.25 if first and (k, b) == (1, 2) and batch.calibration_pass(i) else 1.0)
                 for k in trees for b in sizes} for i in range(passes)]

    monkeypatch.setattr(batch, "check_batch_steps", timed)
    tiny = tiny_model()
    tiny.set_row_invariance(4)
    dec = TreeDecoder(tiny, tiny_heads(tiny, "hydra"), [TreeBuffers.compile(t) for t in DECODER_TREES])
    ticks = iter(range(10**7))
    out = batch.measure_batch_axis(dec, step_model(), list(DECODER_TREES), [1.0 + 0.1 * k for k in range(len(DECODER_TREES))],
                                   [0, 1], [1, 2, 4], 20, list(range(3, 15)), repeats=2, new_tokens=16, check_tokens=10,
                                   prefill_s=0.01, sampler=None, now=lambda: float(next(ticks)))
    assert calls == [([0, 1], [2, 4]), ([1], [2])]   # one more round, for that cell only
    passes = {(k, b): out["per_batch"][str(b)]["trees"][k]["passes"] for k in (0, 1) for b in (2, 4)}
    n = 2 * batch.BATCH_CHECK_PASSES
    assert passes == {(0, 2): n, (1, 2): 2 * n, (0, 4): n, (1, 4): n}
    assert abs(out["per_batch"]["2"]["trees"][1]["model_error_pct"]) < 3
