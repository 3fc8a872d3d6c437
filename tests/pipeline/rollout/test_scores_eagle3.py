"""EntMTP-dyn's scores with an EAGLE-3 drafter (`score_prompt` -> `drafter_scores`): every step of a
real dynamic decode drafts its super-tree with the probabilities stored for that step index. A
decode commits each step's accepted rows to the drafter's cache together, the scores commit the
whole continuation at once, so the two may round apart in the last bits: compared to 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.rollout.scores import score_prompt
from runtime.decoder import TreeDecoder
from runtime.dynamic import DynamicPolicy
from runtime.tree import Tree, TreeBuffers
from tests.helpers import ARITHMETICS, GENTLE, SUPER, random_prompts
from tests.helpers.drafters import eagle3_from, eagle3_target, trained_eagle3_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    from tests.helpers import torch_threads

    with torch_threads(1):
        return trained_eagle3_weights()


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_drafter_scores_are_the_probabilities_a_decode_sees(arithmetic: str, weights: dict) -> None:
    model = eagle3_target(arithmetic)
    drafter = eagle3_from(weights, model)
    dec = TreeDecoder(model, drafter, [TreeBuffers.compile(Tree([]))])
    seen: list[torch.Tensor] = []
    scored = drafter.propose_scored

    def spy(h, root, buf, stop_after=None):  # noqa: ANN001, ANN202 - the protocol's call
        tokens, prob = scored(h, root, buf, stop_after)
        seen.append(prob.clone())
        return tokens, prob

    steps = accepted = 0
    for ids in random_prompts(3, seed=13):
        seen.clear()
        drafter.propose_scored = spy
        try:
            res = dec.generate(ids, 40, choose=DynamicPolicy(SUPER, GENTLE))
        finally:
            del drafter.propose_scored
        (sc,) = score_prompt(model, drafter, ids, res.tokens, [TreeBuffers.compile(SUPER)])
        assert sc.dtype == np.float32 and sc.shape == (len(res.tokens), SUPER.num_nodes - 1)
        assert drafter.length == 0        # the scoring leaves the drafter reset
        i = 0
        for step, prob in zip(res.steps, seen):
            np.testing.assert_allclose(prob[1:].numpy(), sc[i], rtol=1e-5, atol=1e-6, err_msg=f"step index {i}")
            i += step.accepted + 1
            steps += 1
            accepted += step.accepted
    assert steps > 20 and accepted > 0
