"""The EntMTP-dyn headroom study (`python -m pipeline.experiments.dynamic_headroom`): its learned
acceptance model on rollouts of a tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.bank.policies import calibration_samples
from pipeline.experiments.dynamic_headroom import (AcceptanceModel, accepted_labels, history_along, learned_replay,
                                                   learned_rows, node_features, with_history)
from pipeline.replay.dynamic import dynamic_ceiling
from runtime.dynamic import DynamicPolicy
from tests.helpers import DRAFTS, GENTLE, SUPER, invariant_model, random_prompts, scored_rollouts, tiny_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_learned_acceptance_model_study() -> None:
    """dynamic_headroom's learned acceptance model: its labels are the calibration's, the history
    feature follows the decode's own steps, the fit beats a constant rate in-sample, and a policy told
    the depth-1 outcome accepts a draft on every step whose accepted first draft is in the super-tree."""
    assert history_along(5, [0, 2], [1, 2], alpha=0.5).tolist() == [1.0, 1.0, 1.0, 1.5, 1.5]
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(4, seed=6), [SUPER])
    feats, names = zip(*(node_features(r, sc, SUPER) for r, sc in zip(rolls, scores)))
    T = len(rolls[0]["rank_paths"])
    assert feats[0].shape == (T, SUPER.num_nodes - 1, len(names[0]))
    labels = [accepted_labels(r, SUPER) for r in rolls]
    _, _, hits = calibration_samples(rolls, scores, SUPER)
    assert np.array_equal(np.concatenate([a[:-1].ravel() for a in labels]), hits)
    depths = np.asarray([len(p) for p in sorted(SUPER.paths, key=SUPER.node_index)])
    hist = [with_history(f, np.ones(len(f))) for f in feats]
    fit = AcceptanceModel.fit(hist, labels, depths)
    for d in range(1, SUPER.depth + 1):
        y = np.concatenate([a[:-1, depths == d].ravel() for a in labels]).astype(float)
        p = np.concatenate([fit.predict(h[:-1])[:, depths == d].ravel() for h in hist]).clip(1e-9, 1 - 1e-9)
        rate = y.mean().clip(1e-9, 1 - 1e-9)
        def logloss(q):
            return -(y * np.log(q) + (1 - y) * np.log(1 - q)).mean()
        # a depth whose nodes were never accepted has rate 0, clipped to 1e-9: the fit's float32
        # predictions there stay near 5e-8, a log loss of ~6e-8 against the clipped rate's 1e-9
        assert logloss(p) <= logloss(rate) + 1e-6
    policy = DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS)
    told = learned_replay(rolls, feats, fit, policy, 0.0, reveal=labels)
    firsts = {p[0] for p in SUPER.paths}
    for r, vis, acc in zip(rolls, told.visited, told.accepted):
        first_in_s = np.isin(np.asarray(r["rank_paths"])[vis, 0], list(firsts))
        assert (acc[first_in_s] >= 1).all() and (acc[~first_in_s] == 0).all()
    ceiling = dynamic_ceiling(rolls, policy)["tokens_per_second"]
    rows = learned_rows(rolls, scores, policy)
    assert set(rows) == {"in-sample", "2-fold", "in-sample, told the depth-1 outcome"}
    assert all(0 < v <= ceiling * (1 + 1e-9) for v in rows.values())
