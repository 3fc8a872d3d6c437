"""`entmtp inspect` shows each batch size's paired timing: every candidate's ratio to batched AR with
its interval and rounds, and the step-cost model's ratio beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli import main
from tests.helpers import make_bank


def test_inspect_shows_the_paired_intervals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bank = make_bank()
    entry = bank.batch_schedule["1"]
    entry["best_static"] = 1
    entry["paired"] = {"ratio": "decode rate", "level": 0.9, "new_tokens": 24, "rounds": 5, "candidates": [
        {"tree": 1, "median": 1.21, "low": 1.12, "high": 1.27, "rounds": 5, "model_ratio": 1.15}]}
    assert main(["inspect", str(bank.save(tmp_path / "bank"))]) == 0
    out = capsys.readouterr().out
    assert "paired 1.21x AR [1.12, 1.27] in 5 rounds; model 1.15x (-5%)" in out   # the batch table's column
    assert "    tree [1] (3 nodes): 1.21x AR [1.12, 1.27] in 5 rounds; model 1.15x (-5%) <- chosen" in out.splitlines()
