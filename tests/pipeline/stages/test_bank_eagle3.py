"""A tiny bank built end to end with an EAGLE-3 drafter (`heads=eagle3 heads.dir=<speculators folder>`):
heads import, rollout with the drafter's rank paths, grow, EntMTP-dyn's scores, recalibrate, time
(kind "eagle3") and bank; the real decodes agree with the replayed rank paths step for step, and the
bank decodes exactly as AR through `EntMTP.load`, with each of its trees and policies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.paths import Layout
from runtime.eagle3 import Eagle3Drafter
from tests.helpers import MODEL_NAME, TinyBundle, tiny_pipeline_cfg
from tests.helpers.eagle3_folders import drafter_for, write_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_bank_with_an_eagle3_drafter_decodes_as_ar(bundle: TinyBundle, tmp_path: Path) -> None:
    from pipeline import graph
    from pipeline.rollout.record import load_rollout
    from pipeline.stages.prepare import split_rows
    from pipeline.timing.step_cost import StepCostModel
    from runtime import EntMTP

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    graph.clear_memo()
    graph.run(tiny_pipeline_cfg(artifacts, data, bundle, "stage=prepare"))
    # a drafter trained for a moment on the model's own continuations of the calibration prompts, so
    # that the rollout, the replay and the decodes see accepted drafts
    prompts = [r["input_ids"] for r in split_rows(tiny_pipeline_cfg(artifacts, data, bundle), "calib", 3)]
    drafter, _ = drafter_for(bundle.model_dir, (0, 1), draft_vocab=256, train_steps=60, prompts=prompts, new_tokens=16)
    src = write_drafter(drafter, tmp_path / "speculators", "speculators", embeddings=True)

    cfg = tiny_pipeline_cfg(artifacts, data, bundle, "heads=eagle3", f"heads.dir={src}", "heads.num_heads=4",
                            "dynamic.super_sizes=[3,6]")
    graph.clear_memo()
    bank_dir = graph.run(cfg)
    lay = Layout.from_cfg(cfg)
    assert bank_dir == lay.bank_dir and lay.heads_name == "eagle3"
    heads_dir = artifacts / "heads" / MODEL_NAME / "eagle3"
    assert json.loads((heads_dir / "manifest.json").read_text())["summary"]["layout"] == "speculators"

    # the rollout: the drafter's rank paths (max_depth columns), some of them accepted
    rollouts = load_rollout(lay.work / "rollout")
    assert all(r["rank_paths"].shape[1] == 8 for r in rollouts)
    assert sum(int((r["rank_paths"][:, 0] == 0).sum()) for r in rollouts) > 0
    # the real decodes of every candidate tree agree with the replay, step for step
    recal = json.loads((lay.work / "recalibrate" / "recalibrate.json").read_text())["trees"]
    assert all(t["step_agreement"] == 1.0 and t["token_mismatch_prompts"] == 0 for t in recal), recal
    assert max(t["real_tokens_per_step"] for t in recal) > 1.0
    # drafting priced as an EAGLE-3 drafter's, to the config's max draft depth
    cost = StepCostModel.load(lay.work / "time" / "step_cost.json")
    assert cost.kind == "eagle3" and cost.num_heads == 4

    engine = EntMTP.load(bank_dir)
    assert isinstance(engine.heads, Eagle3Drafter)
    doc = json.loads((bank_dir / "bank.json").read_text())
    policies = [*range(len(engine.bank.trees)), *doc["policies"], *(["dynamic"] if doc.get("dynamic") else [])]
    for ids in prompts[:2] + [[5, 9, 2, 7]]:
        ar = engine.generate_ar(ids, 12).tokens
        for policy in policies:
            assert engine.generate(ids, 12, policy=policy).tokens == ar, policy
