"""The bank stage fits EntMTP-dyn on the tiny bundle: the calibration rollout is scored on the
candidate super-trees beside the rollout, the bank stores the dynamic policy, and it reloads into
a DynamicPolicy that decodes exactly as AR."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.rollout.record import load_rollout
from pipeline.rollout.scores import load_scores
from runtime.bank import TopologyBank
from runtime.decoder import TreeDecoder
from runtime.ar import ar_generate
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model
from runtime.tree import Tree, TreeBuffers
from tests.helpers import MODEL_NAME, TinyBundle, tiny_pipeline_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bank_stage_fits_and_stores_entmtp_dyn(bundle: TinyBundle, tmp_path: Path) -> None:
    from pipeline import graph
    from pipeline.config.schema import DynamicConfig

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    cfg = tiny_pipeline_cfg(artifacts, data, bundle, "dynamic.super_sizes=[3,6]")
    graph.clear_memo()
    bank_dir = graph.run(cfg)
    work = artifacts / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu"
    rollouts = load_rollout(work / "rollout")
    scores = load_scores(work / "scores", rollouts)
    assert [len(p) for p in scores["super_trees"]] == [3, 6]
    doc = json.loads((bank_dir / "bank.json").read_text())
    dyn = doc["dynamic"]
    assert dyn is not None and dyn["super_tree"] in [[list(p) for p in t] for t in scores["super_trees"]]
    assert len(dyn["step_ms"]) == len(dyn["super_tree"]) + 1
    # every candidate with the identity and the fitted calibration, and (deeper than 1) each early stop
    grid = sorted(set(DynamicConfig().stop_below) | {0.0})
    assert len(dyn["candidates"]) == sum(2 * (len(grid) if Tree(t).depth > 1 else 1) for t in scores["super_trees"])
    assert dyn["replay"]["share_of_oracle"] > 0 and dyn["stop_below"] in grid
    assert len(dyn["draft_ms"]) == Tree(dyn["super_tree"]).depth + 1
    # priced as it runs: timed against EntMTP*, its unpriced cost per step added to its step costs
    paired = dyn["paired"]
    assert paired["rounds"] >= 4 and paired["offered"] == (paired["low"] > 1.0 + paired["min_gain"]) and paired["priced_overhead_ms"] >= 0
    bank = TopologyBank.load(bank_dir)
    policy = bank.dynamic_policy()
    assert policy.super_tree.to_tree() == Tree(dyn["super_tree"]) and policy.stop_below == dyn["stop_below"]

    model = load_model(bundle.model_dir, max_seq_len=256)
    model.set_row_invariance(4)
    heads = load_heads(bundle.heads_dir, model=model)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(Tree([]))])
    for ids in ([5, 9, 2, 7], [11, 3, 8]):
        assert dec.generate(ids, 16, choose=policy).tokens == ar_generate(model, ids, 16)

