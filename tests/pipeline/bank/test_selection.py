"""The bank's choices per batch size from its paired measurement (`apply_paired`): which trees are
timed, the choice and its record (intervals, the model's ratio, the choice before monotonicity),
and a bank that stores them reloads with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bank.selection import apply_paired, paired_candidates
from pipeline.timing.paired import Cell, PairedSettings
from runtime.bank import TopologyBank
from runtime.tree import Tree
from tests.helpers import make_bank

TREES = [Tree([]), Tree.chain(1), Tree.chain(2), Tree.chain(4)]   # 1, 2, 3 and 5 nodes
NODES = [t.num_nodes for t in TREES]
TPS = [1.0, 1.5, 1.9, 2.2]


def record(sizes: tuple[int, ...] = (1, 2, 4)) -> dict[str, dict]:
    """A batch record as `batch_choices` writes it: AR's step 10 ms, tree k's 10 + 2k ms, a chain."""
    out = {}
    for b in sizes:
        step = [10.0 + 2 * k for k in range(len(TREES))]
        out[str(b)] = {"best_static": 3, "best_chain": {"depth": 2, "tokens_per_step": 1.9, "step_ms": 14.0,
                                                         "tok_per_s": 120.0 * b},
                       "ar_step_ms": 10.0, "ar_tok_per_s": 90.0 * b, "step_ms": step,
                       "tok_per_s": [1000 * b * t / s for t, s in zip(TPS, step)]}
    return out


def cell(b: int, rounds: list[dict[int, float]]) -> Cell:
    return Cell(b, sorted({k for r in rounds for k in r}), rounds)


def test_the_candidates_are_each_batch_sizes_fastest_modeled_trees() -> None:
    got = paired_candidates(record(), NODES, TPS, PairedSettings(candidates=2))
    # modeled tok/s: 1.5/12, 1.9/14, 2.2/16 per ms: tree 3, then tree 2
    assert got == {1: [3, 2], 2: [3, 2], 4: [3, 2]}
    # modeled ratios to AR 1.25, 1.36, 1.38: a floor between the last two leaves the fastest only
    assert paired_candidates(record((1,)), NODES, TPS, PairedSettings(model_floor=1.37)) == {1: [3]}
    assert paired_candidates(record((1,)), NODES, TPS, PairedSettings(model_floor=1.3)) == {1: [3, 2]}


def test_paired_choices_and_their_record_go_into_the_batch_sizes_entries() -> None:
    batch = record()
    settings = PairedSettings()
    cells = {
        1: cell(1, [{3: 1.30, 2: 1.20}, {3: 1.32, 2: 1.21}, {3: 1.29, 2: 1.19}, {3: 1.31, 2: 1.22}]),
        # tree 2 (smaller) ties tree 3 here: tree 2
        2: cell(2, [{3: 1.10, 2: 1.12}, {3: 1.12, 2: 1.09}, {3: 1.09, 2: 1.13}, {3: 1.11, 2: 1.10}]),
        4: cell(4, [{3: 0.9, 2: 0.95}, {3: 0.92, 2: 1.01}, {3: 0.88, 2: 0.97}, {3: 0.91, 2: 1.02}]),
    }
    apply_paired(batch, cells, NODES, TPS, settings)
    assert [batch[b]["best_static"] for b in ("1", "2", "4")] == [3, 2, None]
    one = batch["1"]["paired"]
    assert one["rounds"] == 4 and one["level"] == settings.level and "unconstrained" not in one
    by_tree = {c["tree"]: c for c in one["candidates"]}
    assert by_tree[3]["low"] > 1.0 and by_tree[3]["low"] <= by_tree[3]["median"] <= by_tree[3]["high"]
    assert by_tree[3]["model_ratio"] == pytest.approx(2.2 * 10.0 / 16.0)   # tokens/step x modeled AR / tree step
    assert batch["2"]["best_chain"] is not None
    assert batch["4"]["best_chain"] is None   # AR there: no chain either


def test_a_choice_kept_monotone_records_what_the_batch_size_alone_chose() -> None:
    batch = record((1, 2))
    small = [{1: 1.20, 3: 1.05}, {1: 1.22, 3: 1.04}, {1: 1.19, 3: 1.06}, {1: 1.21, 3: 1.02}]
    # B = 2 alone: tree 3 (the better median), not confidently faster than B = 1's tree 1, which is kept
    tied = [{1: 1.20, 3: 1.22}, {1: 1.25, 3: 1.20}, {1: 1.18, 3: 1.23}, {1: 1.22, 3: 1.24}]
    apply_paired(batch, {1: cell(1, small), 2: cell(2, tied)}, NODES, TPS, PairedSettings())
    assert batch["1"]["best_static"] == 1 and "unconstrained" not in batch["1"]["paired"]
    assert batch["2"]["best_static"] == 1 and batch["2"]["paired"]["unconstrained"] == 3


def test_a_bank_of_the_root_alone_decodes_ar_everywhere() -> None:
    batch = record((1,))
    apply_paired(batch, {1: Cell(1, [])}, NODES, TPS, PairedSettings())
    assert batch["1"]["best_static"] is None and batch["1"]["best_chain"] is None and "paired" not in batch["1"]


def test_the_paired_record_survives_a_bank_round_trip(tmp_path: Path) -> None:
    bank = make_bank(TREES)
    batch = record((1, 2))
    cells = {1: cell(1, [{3: 1.30, 2: 1.20}, {3: 1.32, 2: 1.21}, {3: 1.29, 2: 1.19}, {3: 1.31, 2: 1.22}]),
             2: cell(2, [{3: 0.9, 2: 0.95}, {3: 0.92, 2: 0.99}, {3: 0.88, 2: 0.97}, {3: 0.91, 2: 1.02}])}
    apply_paired(batch, cells, NODES, [f["tokens_per_step"] for f in bank.figures], PairedSettings())
    bank.batch_schedule = batch
    again = TopologyBank.load(bank.save(tmp_path / "bank"))
    assert again.batch_schedule == batch
    assert again.serving_schedule().choice_for(1).tree_index == 3 and again.serving_schedule().choice_for(2).tree is None
