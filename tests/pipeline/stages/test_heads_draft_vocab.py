"""The heads stage derives frequency-ranked draft-vocabulary heads for any model (`heads.draft_vocab`),
here the tiny random Llama: the frequencies of its own greedy continuations of train prompts, then
`<heads.name>-draft<size>/`, which every later stage decodes with (their folders carry the name)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.heads.draft_vocab import read_frequencies
from pipeline.paths import Layout
from runtime.heads import load_heads
from tests.helpers import MODEL_NAME, TinyBundle, tiny_pipeline_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_heads_stage_derives_draft_vocab_heads_for_another_model(bundle: TinyBundle, tmp_path: Path) -> None:
    from pipeline.stages import heads as heads_stage
    from pipeline.stages import rollout as rollout_stage

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    cfg = tiny_pipeline_cfg(artifacts, data, bundle, "heads.draft_vocab.size=32", "heads.draft_vocab.prompts_per_task=3",
                            "heads.draft_vocab.max_new_tokens=5", "heads.train.tasks=[humaneval]")
    lay = Layout.from_cfg(cfg)
    assert lay.heads_name == f"{cfg.heads.name}-draft32"
    out = heads_stage.output(cfg)
    assert out == lay.heads_dir()
    heads = load_heads(out)
    assert heads.config.draft_vocab_size == 32
    (freq_dir,) = lay.frequencies_root.glob("freq-*")
    freq = read_frequencies(freq_dir, heads.config.vocab_size)
    assert freq["emitted"].sum() == 3 * 5  # 3 train prompts x 5 greedy tokens (the tiny model never stops early)
    draft_ids = heads.draft_ids.cpu().numpy()
    np.testing.assert_array_equal(draft_ids, freq["ranking"][:32])
    emitted_ids = set(np.flatnonzero(freq["emitted"]).tolist())
    assert emitted_ids <= set(draft_ids.tolist())  # at most 15 distinct ids: every one is in the 32
    # the full heads are untouched; the rollout is keyed and filed under the derived heads
    assert load_heads(bundle.heads_dir).config.draft_vocab_size is None
    assert f"{cfg.heads.name}-draft32" in str(rollout_stage.output(cfg))
