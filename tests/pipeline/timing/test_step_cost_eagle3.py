"""The step-cost model of an EAGLE-3 drafter (kind "eagle3"): drafting is priced per depth and per
frontier width from hydra's per-level table (one draft-layer forward over a depth's frontier, then the
output product over those rows, measured with the drafter's own `propose` on chains of each width
and depth), and a batch drafts its sequences one after another."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.timing.step_cost import DRAFT_WIDTHS, StepCostModel, level_widths, measure_step_cost, prompt_context
from runtime.decoder import TreeDecoder
from runtime.tree import Tree, TreeBuffers
from tests.helpers import random_prompts, synthetic_step_model
from tests.helpers.drafters import eagle3_target, random_eagle3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TREE = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def test_eagle3_drafting_is_priced_per_level_and_per_sequence_in_a_batch() -> None:
    hydra = synthetic_step_model("hydra")
    eagle3 = dataclasses.replace(hydra, kind="eagle3")
    assert level_widths(TREE) == [1, 2, 1]   # the frontiers: the root, (0,) and (1,), then (0, 0)
    # one sequence: hydra's per-level sum (level d >= 2: table(d, w) - table(d - 1, w) at the level's width)
    assert eagle3.draft(TREE) == hydra.draft(TREE)
    by_hand = hydra._draft_table(1, 1) + sum(hydra._draft_table(d, w) - hydra._draft_table(d - 1, w)
                                             for d, w in zip((2, 3), (2, 1)))
    assert eagle3.draft(TREE) == pytest.approx(by_hand)
    # B sequences: B drafts (each over its own cache), where hydra batches the rows of each level
    for b in (2, 4, 8):
        assert eagle3.draft(TREE, b) == pytest.approx(b * eagle3.draft(TREE))
        assert hydra.draft(TREE, b) < b * hydra.draft(TREE)
    assert eagle3.draft(Tree([]), 4) == hydra.draft(Tree([]), 4)      # AR drafts nothing
    with pytest.raises(ValueError, match="kind must be one of"):
        dataclasses.replace(hydra, kind="eagle")
    assert StepCostModel.from_dict(eagle3.to_dict()) == eagle3


def test_measured_model_of_an_eagle3_drafter() -> None:
    model = eagle3_target("padded")
    drafter = random_eagle3(model)
    assert drafter.max_depth == 8
    dec = TreeDecoder(model, drafter, [TreeBuffers.compile(TREE)])
    prompt = random_prompts(1, seed=3, lengths=(20, 21))[0]
    cm = measure_step_cost(dec, prompt, [1, 4, 8], [20, 40], repeats=1, fixed_tokens=6, clock_kind="cpu", max_depth=3)
    assert cm.kind == "eagle3" and cm.num_heads == 3 and cm.draft_widths == list(DRAFT_WIDTHS)
    assert len(cm.draft_ms) == 4 and all(v > 0 for r in cm.draft_ms[1:] for v in r)
    p = cm.predict(TREE, 30)
    assert p["draft_ms"] > 0 and p["step_ms"] == pytest.approx(p["draft_ms"] + p["verify_ms"] + p["fixed_ms"])
    with pytest.raises(ValueError, match="the heads draft only 3 levels"):
        cm.draft(Tree.chain(4))
    assert model.cache_len == 0 and drafter.length == 0   # left as found
    # a deeper max_depth than the drafter's is capped at its own
    deep = measure_step_cost(dec, prompt, [1], [20], repeats=1, fixed_tokens=4, clock_kind="cpu", max_depth=20)
    assert deep.num_heads == drafter.max_depth


def test_the_draft_probes_start_from_the_state_a_decode_holds() -> None:
    """`prompt_context` feeds the drafter the prompt's features paired with the next tokens, as the
    decoder's prefill does: the draft from it equals the first step's draft of a real decode."""
    model = eagle3_target("padded")
    drafter = random_eagle3(model, seed=2)
    buf = TreeBuffers.compile(TREE)
    prompt = random_prompts(1, seed=4)[0]
    h, root = prompt_context(model, drafter, prompt)
    assert drafter.length == len(prompt)
    want = drafter.propose(h, root, buf).tolist()
    seen: list[list[int]] = []
    propose = drafter.propose

    def spy(h, root, buf):  # noqa: ANN001, ANN202
        out = propose(h, root, buf)
        seen.append(out.tolist())
        return out

    drafter.propose = spy
    try:
        TreeDecoder(model, drafter, [buf]).generate(prompt, 3, choose=0, eos_ids=())
    finally:
        del drafter.propose
    assert seen[0] == want
    model.reset_cache()
    drafter.reset()
    torch.testing.assert_close(h, prompt_context(model, drafter, prompt)[0], rtol=0, atol=0)
