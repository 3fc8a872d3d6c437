"""A published EAGLE-3 drafter for the default model, in each published layout, through the real
pipeline: `heads=eagle3 heads.dir=<folder>` imports it, the bank stage builds a bank for one task, and
that bank decodes exactly as AR (slow: a few minutes a layout on one thread).

In its own artifacts folder (the converted default model linked from the repo's `artifacts/models`):

1. a drafter with the default model's real shapes (hidden size, vocabulary, GQA heads, EAGLE-3's
   default layers 2, L//2, L-3), random and then fitted for a few seconds on the model's own
   continuations of the calibration prompts (so that drafts get accepted and the decodes below run
   the accept path, not only the bonus token), written in
   * EAGLE's own layout as `pytorch_model.bin` (`midlayer.*`, `d2t` / `t2d`, no embeddings, the layer
     ids in SGLang's convention under `eagle_config`), or
   * the speculators layout (`layers.0.*`, the target's embeddings in the file, vLLM's ids);
2. `stage=bank task=humaneval` at a small size (every stage runs for real);
3. the bank loads through `EntMTP.load` with the imported drafter, and its default policy, its
   largest tree and EntMTP-dyn (when fitted) decode two calibration prompts as AR, token for token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.paths import REPO_ROOT, Layout

pytestmark = pytest.mark.slow

TASK = "humaneval"
DECODE_TOKENS = 64
DRAFT_VOCAB = 2048
TRAIN_STEPS = 60
FIT_TOKENS = 32      # the fitted continuations: the first half of each checked decode
# small enough for a few minutes on one thread; every stage still runs for real on the default model
SIZE = ["threads=1", "dtype=float32", "profile.calib_prompts=2", "profile.eval_prompts=2",
        "profile.max_new_tokens=24", "profile.recalib_prompts=1", "profile.timing_prompts=1",
        "profile.grow_budget=8", "grow.candidate_sizes=[0,2,4,8]", "time.rounds=2", "time.new_tokens=8",
        "time.cost_repeats=2", "time.cost_tokens=4", "time.batch_sizes=[1]", "bank.paired_min_rounds=2",
        "bank.paired_max_rounds=2", "bank.paired_new_tokens=8", "bank.paired_prompts=1", "dynamic.super_sizes=[8]"]


def compose_bank(root: Path, heads_dir: Path):  # noqa: ANN201 - DictConfig
    from hydra import compose, initialize_config_dir

    import pipeline.config.schema  # noqa: F401 - registers the schemas

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            "stage=bank", f"task={TASK}", "heads=eagle3", f"heads.dir={heads_dir}", f"artifacts_dir={root}",
            f"data_dir={root / 'data'}", *SIZE])


def write_published(drafter, folder: Path, layout: str) -> Path:  # noqa: ANN001 - Eagle3Drafter
    """`drafter` in a published layout: EAGLE's as pytorch_model.bin, or speculators' safetensors."""
    import torch
    from safetensors.torch import load_file

    from runtime.export.drafters import sglang_layer_ids
    from tests.helpers.eagle3_folders import write_drafter

    if layout == "speculators":
        return write_drafter(drafter, folder, "speculators", embeddings=True)
    write_drafter(drafter, folder, "eagle", file_ids=sglang_layer_ids(drafter.aux_layer_ids))
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_a_published_drafter_for_the_default_model_builds_a_bank_that_decodes_as_ar(
        smollm2_dir: Path, tmp_path: Path, layout: str) -> None:
    from pipeline import graph
    from pipeline.stages.prepare import split_rows
    from runtime import EntMTP
    from runtime.config import ModelArgs
    from runtime.eagle3 import Eagle3Drafter, default_aux_layer_ids
    from tests.helpers import torch_threads
    from tests.helpers.eagle3_folders import drafter_for

    root = tmp_path / "artifacts"
    root.mkdir()
    (root / "models").symlink_to((REPO_ROOT / "artifacts" / "models").resolve(), target_is_directory=True)
    src = tmp_path / f"published-{layout}"
    cfg = compose_bank(root, src)
    start = time.perf_counter()
    graph.clear_memo()
    try:
        with torch_threads(1):  # the stages set threads=1 for the process; restored afterwards
            prompts = [r["input_ids"] for r in split_rows(cfg, "calib", 2)]
            aux = default_aux_layer_ids(ModelArgs.from_hf_config(json.loads((smollm2_dir / "config.json").read_text()))
                                        .n_layers)
            drafter, _ = drafter_for(smollm2_dir, aux, draft_vocab=DRAFT_VOCAB, train_steps=TRAIN_STEPS,
                                     prompts=prompts, new_tokens=FIT_TOKENS)
            write_published(drafter, src, layout)
            drafted = time.perf_counter()
            bank_dir = graph.run(cfg)
            built = time.perf_counter()

            lay = Layout.from_cfg(cfg)
            assert bank_dir == lay.bank_dir and (bank_dir / "bank.json").is_file()
            summary = json.loads((lay.heads_dir() / "manifest.json").read_text())["summary"]
            assert summary["layout"] == layout and summary["aux_layer_ids"] == list(aux) == [2, 15, 27]
            # the speculators file carries the model's embeddings (compared with the model's); EAGLE's has none
            assert summary["base_embeddings_checked"] == (layout == "speculators")
            recal = json.loads((lay.work / "recalibrate" / "recalibrate.json").read_text())["trees"]
            assert all(t["step_agreement"] == 1.0 and t["token_mismatch_prompts"] == 0 for t in recal), recal

            engine = EntMTP.load(bank_dir)
            assert isinstance(engine.heads, Eagle3Drafter) and engine.heads.aux_layer_ids == aux
            doc = json.loads((bank_dir / "bank.json").read_text())
            largest = max(range(len(engine.bank.trees)), key=lambda k: engine.bank.trees[k].num_nodes)
            policies = [None, largest, *(["dynamic"] if doc.get("dynamic") else [])]
            per_step = {}
            for i, ids in enumerate(prompts):
                ar = engine.generate_ar(ids, DECODE_TOKENS).tokens
                for policy in policies:
                    got = engine.generate(ids, DECODE_TOKENS, policy=policy)
                    assert got.tokens == ar, (layout, i, policy)
                    per_step[f"prompt {i}, policy {policy}"] = round(float(got.stats["tokens_per_step"]), 2)
            decoded = time.perf_counter()
    finally:
        graph.clear_memo()
    print(f"[published-eagle3-bank] {layout}: trees {[t.num_nodes for t in engine.bank.trees]}, default policy "
          f"{doc['default_policy']}, dynamic {bool(doc.get('dynamic'))}, tokens/step {json.dumps(per_step)}; "
          f"drafter {drafted - start:.0f} s, bank {built - drafted:.0f} s, decodes {decoded - built:.0f} s")
    # the fitted drafter gets drafts accepted on the prompts it was fitted on: the accept path ran
    assert per_step[f"prompt 0, policy {largest}"] > 1.0, per_step
