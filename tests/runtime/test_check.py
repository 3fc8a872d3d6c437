"""`entmtp inspect BANK --check`: paired rounds of blocks AR, T, T, AR, a median and its interval
per batch size, and a verdict per choice by the bank's own rule (a tree holds above 1, AR holds
unless the fastest tree beats it); exit code 0 when all hold, 1 otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime.check
from runtime.check import Block, ChoiceCheck, fastest_tree, median_interval, paired_ratios, stored_ratio
from runtime.cli import main
from tests.helpers import TinyBundle, make_bank
from tests.helpers.banks import batch_choices_record
from tests.helpers.bundle import bank_choosing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHOICES = {1: 0, 2: 1, 4: None}   # a tree at B = 1 and 2, AR at B = 4 (the small trees: quick to time)
TREES_ONLY = {1: 1, 2: 0}
CHECK = ("--check", "--seconds", "1", "--new-tokens", "4")


@pytest.fixture(scope="module")
def banks(bundle: TinyBundle, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("check")
    return {"mixed": bank_choosing(bundle, root / "mixed", CHOICES),
            "trees": bank_choosing(bundle, root / "trees", TREES_ONLY)}


# ---------------------------------------------------------------------------------- the statistics


def test_rounds_interleave_ar_tree_tree_ar_and_pool_each_side() -> None:
    log: list[str] = []

    def ar() -> Block:
        log.append("A")
        return Block(tokens=10, seconds=1.0)

    def tree() -> Block:
        log.append("T")
        return Block(tokens=10, seconds=0.4 if len(log) % 4 == 2 else 0.6)  # the two tree blocks: 20 tokens in 1 s

    assert paired_ratios(ar, tree, keep_going=lambda r: False, min_rounds=2) == [2.0, 2.0]
    assert "".join(log) == "ATTAATTA"


def test_more_rounds_while_asked_up_to_the_cap() -> None:
    def block() -> Block:
        return Block(10, 1.0)

    assert len(paired_ratios(block, block, keep_going=lambda r: len(r) < 5, min_rounds=3)) == 5
    assert len(paired_ratios(block, block, keep_going=lambda r: True, min_rounds=3, max_rounds=7)) == 7


def test_the_interval_of_the_median() -> None:
    assert median_interval([1.2, 1.3, 1.25]) == (1.25, 1.2, 1.3)  # three rounds: their min and max
    # many rounds: one outlier no longer sets the bound
    med, low, high = median_interval([1.2] * 4 + [1.22] * 4 + [0.5])
    assert (med, low, high) == (1.2, 1.2, 1.22)
    assert median_interval([1.0, 2.0, 3.0, 4.0]) == median_interval([1.0, 2.0, 3.0, 4.0])  # seeded
    with pytest.raises(ValueError, match="no ratios"):
        median_interval([])


@pytest.mark.parametrize("chosen,ratios,holds,verdict", [
    (2, (1.3, 1.4, 1.35), True, "holds"),
    (2, (0.95, 1.1, 1.2), False, "not confirmed"),
    (2, (0.8, 0.9, 0.85), False, "does not hold: AR is at least as fast here"),
    (None, (0.8, 0.9, 1.05), True, "holds"),
    (None, (1.3, 1.4, 1.35), False, "does not hold: tree 2 beats AR here"),
])
def test_a_choice_holds_by_the_banks_rule(chosen: int | None, ratios: tuple[float, ...], holds: bool,
                                          verdict: str) -> None:
    check = ChoiceCheck(batch_size=4, chosen=chosen, timed=2, nodes=12, stored=1.18, ratios=ratios)
    assert check.holds is holds
    head, _, said = check.line().partition(" rounds): ")
    assert head.startswith("B=4: bank's choice ") and "stored 1.18x AR" in head and said.startswith(verdict)


def test_a_check_asks_the_banks_margin_over_ar() -> None:
    grazing = (1.01, 1.02, 1.015, 1.012)
    assert ChoiceCheck(8, 1, 1, 2, 1.01, ratios=grazing).holds
    strict = ChoiceCheck(8, 1, 1, 2, 1.01, ratios=grazing, min_gain=0.02)
    assert not strict.holds and strict.line().endswith("its gain over AR is under the bank's 2% margin here")
    assert ChoiceCheck(8, None, 1, 2, 1.01, ratios=grazing, min_gain=0.02).holds   # AR: the tree does not clear 1.02
    assert "reaches 1.02x" in ChoiceCheck(8, 1, 1, 2, 1.01, ratios=(1.0, 1.05, 1.04), min_gain=0.02).line()


def test_stored_ratio_and_fastest_tree_from_the_record() -> None:
    bank = make_bank()
    record = batch_choices_record(bank.trees, {2: 1, 4: None})
    assert stored_ratio(bank, record["2"], 1) == pytest.approx(1.2)
    assert stored_ratio(bank, record["2"], 3) == pytest.approx(0.9)
    del record["2"]["ar_tok_per_s"]
    assert stored_ratio(bank, record["2"], 1) is None  # no AR figure and no root-only tree
    assert fastest_tree(bank, record["4"]) == 0  # all equal: the smallest
    record["4"]["tok_per_s"][2] = 500.0
    assert fastest_tree(bank, record["4"]) == 2


def test_a_paired_timing_is_the_stored_ratio() -> None:
    bank = make_bank()
    entry = batch_choices_record(bank.trees, {4: None})["4"]
    entry["tok_per_s"][3] = 500.0  # the fastest by batch tok/s, but not paired-timed: the paired record decides
    entry["paired"] = {"candidates": [{"tree": 1, "median": 0.97, "low": 0.9, "high": 1.02, "rounds": 5},
                                      {"tree": 2, "median": 1.04, "low": 0.95, "high": 1.1, "rounds": 5}]}
    assert stored_ratio(bank, entry, 1) == 0.97 and stored_ratio(bank, entry, 3) == pytest.approx(2.5)
    assert fastest_tree(bank, entry) == 2
    line = ChoiceCheck(4, None, 2, 3, 1.04, (0.95, 1.1), (1.0, 1.02, 0.98)).line()
    assert "its fastest tree, tree 2 (3 nodes), stored 1.04x AR [0.95, 1.10])" in line and line.endswith(": holds")


# ---------------------------------------------------------------------------------------- the CLI


def _b_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("B=")]


def test_inspect_check_times_each_batch_size(banks: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["inspect", str(banks["mixed"]), *CHECK])
    out = capsys.readouterr().out
    lines = _b_lines(out)
    assert [line.split(":")[0] for line in lines] == ["B=1", "B=2", "B=4"]
    assert "bank's choice tree 0" in lines[0] and "bank's choice tree 1" in lines[1]
    # AR at B = 4 is timed against the bank's fastest tree there (of equals, the smallest)
    assert "bank's choice AR (its fastest tree, tree 0 (" in lines[2]
    assert all("x AR [" in line and "rounds)" in line for line in lines)
    assert rc == (0 if all(line.endswith(": holds") for line in lines) else 1)


@pytest.mark.parametrize("bank,ratio,rc", [("trees", 1.5, 0), ("mixed", 1.5, 1), ("mixed", 0.8, 1)])
def test_inspect_check_exit_code(banks: dict[str, Path], bank: str, ratio: float, rc: int,
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(runtime.check, "paired_ratios", lambda *a, **k: [ratio] * 3)
    assert main(["inspect", str(banks[bank]), *CHECK]) == rc
    out = capsys.readouterr().out
    lines = _b_lines(out)
    failed = [line for line in lines if not line.endswith(": holds")]
    assert len(failed) == {("trees", 1.5): 0, ("mixed", 1.5): 1, ("mixed", 0.8): 2}[(bank, ratio)]
    assert out.splitlines()[-1] == ("all 2 choices hold here" if rc == 0 else
                                    f"{len(failed)} of 3 choices do not hold here (B = "
                                    f"{', '.join(line.split(':')[0][2:] for line in failed)}): rebuild the bank on "
                                    "this machine (`make bank TASK=<task>`), or rerun with more --seconds where one "
                                    "is not confirmed")


def test_inspect_check_refuses_a_bad_budget(banks: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(banks["trees"]), "--check", "--seconds", "0"]) == 2
    assert "--seconds must be > 0" in capsys.readouterr().err
