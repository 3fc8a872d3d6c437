"""The rebuild report's verdicts on bank.json records: the same choice everywhere, choices each build
reports within each other's interval, and a flip one build measured as a confident difference."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.experiments.rebuild_stability import main, report, verdicts, within

TREES = [{"paths": []}, {"paths": [[0]]}, {"paths": [[0], [0, 0]]}]


def doc(cells: dict[str, tuple[int | None, dict[int, tuple[float, float, float]]]]) -> dict:
    return {"trees": TREES, "provenance": {"task": "humaneval", "machine": {"cpu": "test cpu"}},
            "batch_sizes": {b: {"best_static": c, "paired": {"candidates": [
                {"tree": k, "median": m, "low": lo, "high": hi} for k, (m, lo, hi) in timed.items()]}}
                for b, (c, timed) in cells.items()}}


def test_within_reads_ar_as_exactly_one() -> None:
    timed = {1: (1.04, 0.96, 1.09), 2: (1.2, 1.05, 1.3)}
    assert within(None, 1, timed) and within(1, None, timed)
    assert not within(None, 2, timed)
    assert within(1, 2, timed) and not within(1, 2, {1: (1.0, 0.9, 1.05), 2: (1.2, 1.1, 1.3)})
    assert not within(1, 3, timed)  # a choice the build never timed is not within anything
    # a build that asks a tree for 2% over AR: a tree whose interval reaches below 1.02 is as good as AR
    assert not within(None, 1, {1: (1.04, 1.01, 1.06)}) and within(None, 1, {1: (1.04, 1.01, 1.06)}, 0.02)


def test_verdicts_same_within_and_differs() -> None:
    a = doc({"1": (2, {2: (1.4, 1.3, 1.5), 1: (1.3, 1.2, 1.45)}), "8": (None, {1: (1.04, 0.96, 1.09)}),
             "4": (1, {1: (1.2, 1.1, 1.3), 2: (1.05, 1.0, 1.08)})})
    b = doc({"1": (1, {2: (1.35, 1.25, 1.5), 1: (1.38, 1.3, 1.44)}), "8": (1, {1: (1.06, 1.05, 1.08)}),
             "4": (1, {1: (1.2, 1.1, 1.3)})})
    v = verdicts([a, b])
    assert v["1"] == ([2, 1], "within intervals")
    assert v["4"] == ([1, 1], "same")
    # build b measured tree 1 confidently above AR at B = 8: a flip, whatever build a says
    assert v["8"] == ([None, 1], "differs")
    assert list(v) == ["1", "4", "8"]
    # a build that never timed the other's choice does not judge; the one that timed both does
    c = doc({"1": (2, {2: (1.4, 1.3, 1.5)})})
    d = doc({"1": (1, {1: (1.38, 1.3, 1.44), 2: (1.2, 1.1, 1.32)})})
    assert verdicts([c, d])["1"] == ([2, 1], "within intervals")
    assert verdicts([c, doc({"1": (1, {1: (1.38, 1.35, 1.44), 2: (1.2, 1.1, 1.3)})})])["1"][1] == "differs"
    assert verdicts([c, doc({"1": (1, {1: (1.38, 1.35, 1.44)})})])["1"][1] == "differs"  # nobody timed both


def test_report_only_writes_the_table(tmp_path: Path) -> None:
    files = []
    for i, d in enumerate([doc({"1": (2, {2: (1.4, 1.3, 1.5)})}), doc({"1": (2, {2: (1.45, 1.35, 1.5)})})]):
        files.append(tmp_path / f"build-{i + 1}.json")
        files[-1].write_text(json.dumps(d))
    main(["--banks", *map(str, files), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "rebuilds.md").read_text()
    assert "| 1 | tree 2 (3 nodes): 1.40 [1.30, 1.50] | tree 2 (3 nodes): 1.45 [1.35, 1.50] | same |" in text
    assert "test cpu" in text
    minutes = report([json.loads(f.read_text()) for f in files], ["a", "b"], [{"time": 6.0, "bank": 4.25}] * 2)
    assert minutes.endswith("| minutes | time 6.0 + bank 4.2 | time 6.0 + bank 4.2 | |\n")
