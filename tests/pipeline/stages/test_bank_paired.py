"""The bank stage times its choices per batch size on the tiny bundle's real model and heads: every
batch size records its candidates' paired ratios to batched AR, the choice follows the rule (a tree
only where its interval lies above 1, monotone in B), and the bank reloads with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.bank import TopologyBank
from tests.helpers import MODEL_NAME, TinyBundle, tiny_pipeline_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_bank_stage_times_each_batch_sizes_choice_against_batched_ar(bundle: TinyBundle, tmp_path: Path) -> None:
    from pipeline import graph

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    # every tree timed and kept (random heads rarely pay for a tree: the hull alone is the root)
    cfg = tiny_pipeline_cfg(artifacts, data, bundle, "dynamic.enabled=false", "time.batch_sizes=[1,2]",
                            "time.prune=false", "bank.min_oracle_share=0.000001",
                            "bank.paired_candidates=2", "bank.paired_model_floor=0", "bank.paired_min_rounds=2",
                            "bank.paired_max_rounds=3", "bank.paired_new_tokens=6", "bank.paired_prompts=2")
    graph.clear_memo()
    bank_dir = graph.run(cfg)
    doc = json.loads((bank_dir / "bank.json").read_text())
    nodes = [len(t["paths"]) + 1 for t in doc["trees"]]
    for b, entry in doc["batch_sizes"].items():
        rec = entry["paired"]
        timed = [c["tree"] for c in rec["candidates"]]
        assert len(timed) == 2 and all(nodes[k] > 1 for k in timed) and 2 <= rec["rounds"] <= 3
        above = [c["tree"] for c in rec["candidates"] if c["low"] > 1.0 + rec["min_gain"]]
        assert (entry["best_static"] is None) == (not above)
        assert entry["best_static"] is None or entry["best_static"] in above
        assert all(c["model_ratio"] > 0 for c in rec["candidates"])
    # the runtime AR's step at the step-cost model's speed, for the eval's replayed ratios
    timing = json.loads((graph.stage_output("time", cfg) / "timing.json").read_text())
    assert doc["oracle"]["ar_step_ms"] == timing["ar_token_ms"] > 0
    one = doc["batch_sizes"]["1"]["best_static"]
    if one is not None:  # one convention at B = 1: EntMTP* decodes the tree the paired rounds chose
        assert doc["best_static"] == one and doc["policies"]["static"]["index"] == one
    bank = TopologyBank.load(bank_dir)
    assert bank.batch_schedule["1"]["paired"] == doc["batch_sizes"]["1"]["paired"]
    assert "paired" in bank.summary() and len(bank.paired_lines()) == 2 + sum(
        len(e["paired"]["candidates"]) for e in doc["batch_sizes"].values())
    assert (bank_dir / "batch_throughput.png").stat().st_size > 0
