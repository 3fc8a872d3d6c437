"""A bank's per-batch-size paired record (`runtime.bank.PAIRED_KEY`): read back as written, shown in
the batch table beside the model's ratio, and refused where it breaks its rules."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from runtime.bank import BankError, TopologyBank
from tests.helpers import make_bank

# make_bank's trees: chains of 1, 2 and 4 drafts, then Medusa's 63-node default (2, 3, 5, 64 nodes)


def paired_bank(choice: int | None = 2) -> TopologyBank:
    """make_bank with, at batch size 1, trees 1 and 2 timed against AR (tree 2 at 1.18x [1.10, 1.25])."""
    bank = make_bank()
    entry = bank.batch_schedule["1"]
    entry["best_static"] = choice
    entry["ar_tok_per_s"] = 60.0
    entry["paired"] = {"ratio": "decode rate", "level": 0.9, "new_tokens": 32, "rounds": 6, "candidates": [
        {"tree": 2, "median": 1.18, "low": 1.10, "high": 1.25, "rounds": 6, "model_ratio": 1.30},
        {"tree": 1, "median": 1.05, "low": 0.97, "high": 1.12, "rounds": 6, "model_ratio": None}]}
    return bank


def test_the_record_is_read_back_as_written(tmp_path: Path) -> None:
    bank = paired_bank()
    again = TopologyBank.load(bank.save(tmp_path / "b"))
    assert again.batch_schedule["1"]["paired"] == bank.batch_schedule["1"]["paired"]


def test_the_batch_table_shows_the_interval_and_the_models_distance() -> None:
    line = next(x for x in paired_bank().summary().splitlines() if x.startswith("  batch   1"))
    assert "paired 1.18x AR [1.10, 1.25] in 6 rounds; model 1.30x (+10%)" in line
    line = next(x for x in paired_bank(None).summary().splitlines() if x.startswith("  batch   1"))
    assert "no speculation (AR)" in line and "paired: AR, its best tree [2] 1.18x AR" in line
    lines = paired_bank().paired_lines()
    assert lines[0].startswith("  paired at batch 1 (6 rounds of 32 tokens")
    assert lines[1] == "    tree [2] (5 nodes): 1.18x AR [1.10, 1.25] in 6 rounds; model 1.30x (+10%) <- chosen"
    assert lines[2] == "    tree [1] (3 nodes): 1.05x AR [0.97, 1.12] in 6 rounds; model -"
    assert make_bank().paired_lines() == []   # a bank without the record (built before it) still reads


def _broken(change) -> TopologyBank:  # noqa: ANN001 - a function of the record
    bank = paired_bank()
    rec = copy.deepcopy(bank.batch_schedule["1"]["paired"])
    change(rec, bank.batch_schedule["1"])
    bank.batch_schedule["1"]["paired"] = rec
    return bank


@pytest.mark.parametrize("change,message", [
    (lambda r, e: r.update(candidates=None), "must be an object with a 'candidates' list"),
    (lambda r, e: r["candidates"][0].update(tree=9), "does not name a distinct tree"),
    (lambda r, e: r["candidates"][1].update(tree=2), "does not name a distinct tree"),
    (lambda r, e: r["candidates"][0].update(low=1.2, median=1.1), "0 < low <= median <= high"),
    (lambda r, e: r["candidates"][0].update(rounds=0), "rounds >= 1"),
    (lambda r, e: r["candidates"][0].update(model_ratio=-1.0), "positive model_ratio"),
    (lambda r, e: e.update(best_static=1), "its interval reaches 1"),     # timed, but not above AR
    (lambda r, e: e.update(best_static=3), "was not timed there"),
])
def test_a_record_that_breaks_its_rules_is_refused(tmp_path: Path, change, message: str) -> None:  # noqa: ANN001
    with pytest.raises(BankError, match=message):
        _broken(change).save(tmp_path / "b")


DYN_PAIRED = {"versus": "EntMTP*", "median": 0.95, "low": 0.9, "high": 1.01, "rounds": 5, "level": 0.9,
              "replay_ratio": 1.02, "overhead_ms": 0.02, "offered": False, "measured_overhead_ms": 0.3,
              "priced_overhead_ms": 0.3}


@pytest.mark.parametrize("change,ok", [
    ({}, True),
    ({"offered": True}, False),                      # offered although its interval reaches 1
    ({"low": 1.02, "offered": True}, False),         # low above the median
    ({"rounds": 0}, False),
    ({"priced_overhead_ms": float("nan")}, False),
    ({"median": 1.02, "low": 1.01, "high": 1.05, "offered": True}, True),                     # above 1, no margin recorded
    ({"median": 1.02, "low": 1.01, "high": 1.05, "min_gain": 0.02, "offered": True}, False),  # inside its margin
    ({"median": 1.02, "low": 1.01, "high": 1.05, "min_gain": 0.02, "offered": False}, True),
    ({"min_gain": -0.1}, False),
])
def test_dyns_paired_record_is_checked(tmp_path: Path, change: dict, ok: bool) -> None:
    bank = make_bank()
    bank.dynamic = {"super_tree": [[0], [1]], "step_ms": [5.0, 6.0, 7.0], "calibration": {},
                    "paired": {**DYN_PAIRED, **change}}
    if ok:
        assert TopologyBank.load(bank.save(tmp_path / "b")).dynamic["paired"] == {**DYN_PAIRED, **change}
        offered = {**DYN_PAIRED, **change}["offered"]
        assert ("offered (beats EntMTP*)" if offered else "not offered (does not beat EntMTP* here)") in bank.summary()
    else:
        with pytest.raises(BankError, match="dynamic.paired needs"):
            bank.save(tmp_path / "b")
