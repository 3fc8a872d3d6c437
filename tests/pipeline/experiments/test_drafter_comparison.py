"""The drafter comparison report (`python -m pipeline.experiments.drafter_comparison`): two fake
drafters with known rank paths, their trees replayed by hand, the ratio column, the skip notes and
the written files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.experiments.drafter_comparison import (Drafter, comparison_trees, compare_drafters, ratio_pairs,
                                                     replay_on_trees, training_cost)
from pipeline.paths import Layout
from pipeline.rollout.record import save_rollout

K = 10
# T = 6 steps, D = 2 heads; by the rank-path convention column d is K from row T - 1 - d on
HYDRA_RANKS = [(0, 1), (0, 0), (1, 0), (0, 2), (0, K), (K, K)]
EAGLE_RANKS = [(0, 0), (0, 0), (0, 0), (0, 0), (0, K), (K, K)]
SMALL_TREE = [[0], [1], [0, 0], [0, 1]]
MODEL = "tiny"


def rollout(ranks: list[tuple[int, int]], prompt_id: str = "p0") -> dict:
    """One prompt's rollout arrays with these rank paths (the signals are unused here)."""
    T, D = len(ranks), len(ranks[0])
    return {"tokens": np.arange(5, 5 + T, dtype=np.int64), "rank_paths": np.asarray(ranks, dtype=np.int16),
            "p0": np.full(T, 0.5, np.float32), "entropy": np.ones(T, np.float32),
            "head_top1": np.full((T, D), 0.5, np.float32), "greedy_top1": np.full((T, D), 0.5, np.float32),
            "tf_mismatch": np.zeros(T, bool), "id": prompt_id, "rank_cap": K}


def test_replay_on_the_same_trees_by_hand() -> None:
    """Chain 1: Hydra accepts [1,1,0,1,1,0] and visits steps 0, 2, 3 (5 tokens / 3 steps), EAGLE-3
    accepts [1,1,1,1,1,0] and visits 0, 2, 4 (5 / 3). Chain 2: Hydra [1,2,0,1,1,0] visits 0, 2, 3
    (5 / 3), EAGLE-3 [2,2,2,2,1,0] visits 0, 3 (5 / 2). The small tree {0, 1, 00, 01}: Hydra
    [2,2,1,1,1,0] visits 0, 3 (5 / 2); EAGLE-3 as with chain 2. Depth-3 trees are beyond D = 2."""
    drafters = [Drafter("eagle3", "eagle3"), Drafter("hydra-x", "hydra")]
    pairs = ratio_pairs(drafters)
    assert pairs == [("eagle3", "hydra-x")]
    trees = comparison_trees({"hydra-x": [[], SMALL_TREE, [[0]]]})
    names = [t for t, _ in trees]
    # the bank's chain is the fixed chain1, listed once under both names; the root-only tree is left out
    assert names == ["chain1 = hydra-x bank #2", "chain2", "chain3", "chain4", "mc_sim_7b_63", "hydra-x bank #1"]
    rep = replay_on_trees({"hydra-x": [rollout(HYDRA_RANKS)], "eagle3": [rollout(EAGLE_RANKS)]}, trees, pairs)
    by = {n: dict(zip(names, v)) for n, v in rep.tokens_per_step.items()}
    assert by["hydra-x"]["chain1 = hydra-x bank #2"] == by["eagle3"]["chain1 = hydra-x bank #2"] == 5 / 3
    assert (by["hydra-x"]["chain2"], by["eagle3"]["chain2"]) == (5 / 3, 2.5)
    assert by["hydra-x"]["hydra-x bank #1"] == by["eagle3"]["hydra-x bank #1"] == 2.5
    assert by["hydra-x"]["chain3"] is None and by["eagle3"]["mc_sim_7b_63"] is None
    ratio = dict(zip(names, rep.ratios[("eagle3", "hydra-x")]))
    assert ratio["chain2"] == 1.5 and ratio["hydra-x bank #1"] == 1.0 and ratio["chain4"] is None


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_the_report_with_a_skipped_task_and_table(tmp_path: Path) -> None:
    """Both drafters have a humaneval rollout; Hydra a bank, an evaluate table and a draft-vocabulary
    folder that refers to its weights; nothing exists for gsm8k: the md says so and both files are written."""
    art = tmp_path / "artifacts"
    lay = {n: Layout(art, tmp_path / "data", MODEL, n, "humaneval", "cpu") for n in ("hydra-x", "eagle3")}
    for n, ranks in (("hydra-x", HYDRA_RANKS), ("eagle3", EAGLE_RANKS)):
        out = lay[n].work / "rollout"
        out.mkdir(parents=True)
        save_rollout(out, ["p0"], [rollout(ranks)], K)
    _write_json(lay["hydra-x"].bank_dir / "bank.json", {"trees": [{"paths": []}, {"paths": SMALL_TREE}]})
    table = lay["hydra-x"].reports / "evaluate"
    table.mkdir(parents=True)
    (table / "table.csv").write_text(
        "method,tok_per_s,speedup_vs_ar,identical_to_ar,replayed_share_of_oracle\n"
        "AR,30.0,1.0,1.0,\nHydra default,18.0,0.6,1.0,\nEntMTP-dyn,45.0,1.5,1.0,0.9\n")
    (table / "table.md").write_text("### humaneval: tiny + hydra heads, greedy, batch 1, float32, Test CPU (2 threads), "
                                    "10 eval prompts x 96 new tokens\n")
    heads = lay["hydra-x"].heads_root
    _write_json(heads / "hydra-x" / "config.json", {"kind": "hydra"})
    _write_json(heads / "hydra-x" / "report.json", {
        "wall_s": {"data": 10.0, "train_this_run": 90.0, "total_this_run": 100.0},
        "cpu_s": {"data": 5.0, "total_this_run": 180.0}, "train_positions": 5000, "train_sequences": 40, "steps": 60,
        "machine": {"cpu": "Test CPU", "cores": 2}})
    _write_json(heads / "hydra-x-draft64" / "config.json", {"kind": "hydra"})
    _write_json(heads / "hydra-x-draft64" / "weights_from.json", {"base": {"folder": "../hydra-x"}})
    _write_json(heads / "eagle3" / "config.json", {"format": "entmtp-eagle3"})
    _write_json(heads / "eagle3" / "report.json", {
        "wall_s": {"generate": 1.0, "teacher": 2.0, "train": 300.0, "total": 303.0}, "cpu_s": 600.0,
        "train_positions": 7000, "train_tokens_seen": 14000, "train_sequences": {"selfdistill": 30, "references": 20}})

    assert training_cost(heads / "hydra-x-draft64")["trained_as"] == "hydra-x"
    md, path = compare_drafters(art, MODEL, ["humaneval", "gsm8k"])
    assert path == art / "reports" / MODEL / "drafters" / "comparison.md"
    assert path.read_text() == md
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "drafters: hydra-x (Hydra), hydra-x-draft64 (Hydra), eagle3 (EAGLE-3)" in md
    # section 1: drafters in kind order (Hydra, then EAGLE-3), the ratio column last
    assert "| tree | nodes | depth | hydra-x | eagle3 | EAGLE-3 / Hydra |" in md
    assert "| chain2 | 3 | 2 | 1.667 | 2.500 | 1.50x |" in md
    assert "| hydra-x bank #1 | 5 | 2 | 2.500 | 2.500 | 1.00x |" in md
    assert "| chain3 | 4 | 3 | - | - | - |" in md
    assert "1.00x to 1.50x over 3 trees; does not pass the >= 1.25x" in md
    # section 2: only Hydra has a table; the machine from its header
    assert "| AR | 30.0 tok/s |" in md and "| EntMTP-dyn | 1.50x · 90% |" in md and "| Hydra default | 0.60x |" in md
    assert "* hydra-x: measured on Test CPU (2 threads)" in md
    # section 3: the keys each report has, '-' for the others
    assert "| hydra-x | Hydra | hydra-x | 100 | 90 | 180 | 5000 | - | 40 | 60 | Test CPU (2 cores) |" in md
    assert "| hydra-x-draft64 | Hydra | hydra-x | 100 |" in md
    assert "| eagle3 | EAGLE-3 | eagle3 | 303 | 300 | 600 | 7000 | 14000 | 50 | - | - |" in md
    # skipped: a whole task, the table EAGLE-3 lacks, a folder with heads only, what a rollout cannot score
    assert "No drafter has a rollout for this task." in md
    assert "* humaneval, eagle3: no bank, no evaluate table; skipped there" in md
    assert "* gsm8k, eagle3: no rollout, no bank, no evaluate table; skipped there" in md
    assert "* hydra-x-draft64: no rollout, bank or evaluate table for any task" in md
    assert "* humaneval: hydra-x's rollout cannot score chain3, chain4, mc_sim_7b_63" in md
