"""The rollout with an EAGLE-3 drafter: `rollout_prompt` records rank paths from the drafter's
teacher-forced ranks along the continuation, and replaying them gives exactly the accepted lengths
of real tree decoding (greedy and seeded sampling, in the row-invariant arithmetics); `head_top1` and
`greedy_top1` are the drafter's top-1 probabilities along the true path and along its own greedy
chain, which a decode's drafter-reading signals see."""

from __future__ import annotations

import pytest
import torch

from pipeline.recalibrate import compare_step_by_step
from pipeline.rollout.record import rollout_prompt
from runtime.decoder import TreeDecoder
from runtime.eagle3 import target_forward
from runtime.sampling import Sampler, SamplingConfig
from runtime.tree import Tree, TreeBuffers
from tests.helpers import ARITHMETICS, random_prompts
from tests.helpers.drafters import EAGLE3_AUX, eagle3_from, eagle3_target, trained_eagle3_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK_CAP = 10  # mc_sim_7b_63 ranks up to 9
N = 72   # past KEY_CHUNK = 64 new tokens (the row-invariant attention's second key chunk)
TREES = [Tree.chain(5), Tree.named("mc_sim_7b_63"), Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    from tests.helpers import torch_threads

    with torch_threads(1):
        return trained_eagle3_weights()


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rank_paths_replay_the_accepted_lengths_of_real_decoding(arithmetic: str, temperature: float,
                                                                  weights: dict) -> None:
    model = eagle3_target(arithmetic)
    drafter = eagle3_from(weights, model)
    dec = TreeDecoder(model, drafter, [TreeBuffers.compile(t) for t in TREES])
    longest = 0
    for seed, prompt in enumerate(random_prompts(3, seed=11)):
        sampler = (lambda: Sampler(SamplingConfig(temperature=temperature, seed=seed))) if temperature else Sampler
        ro = rollout_prompt(model, drafter, prompt, N, RANK_CAP, sampler=sampler())
        T = len(ro["tokens"])
        assert ro["rank_paths"].shape == (T, drafter.max_depth) and ro["rank_paths"].dtype.name == "int16"
        assert ro["head_top1"].shape == ro["greedy_top1"].shape == (T, drafter.max_depth)
        assert not ro["tf_mismatch"].any()
        # past the end of the continuation: rank_cap (never accepted)
        assert (ro["rank_paths"][T - 1] == RANK_CAP).all()
        for k, tree in enumerate(TREES):
            res = dec.generate(prompt, N, choose=k, sampler=sampler())
            cmp = compare_step_by_step(ro, tree, [s.accepted for s in res.steps], res.tokens, RANK_CAP)
            assert cmp["same_tokens"], (arithmetic, temperature, k)
            assert cmp["steps_compared"] > 0 and cmp["steps_agree"] == cmp["steps_compared"], cmp["disagreements"]
            assert cmp["replay_steps"] == cmp["real_steps"]
            longest = max([longest] + [s.accepted for s in res.steps])
    # (seeded samples at T = 0.7 leave the drafter's greedy guesses more often)
    assert longest >= (1 if temperature else 3), "the replay was never checked on a long accepted path"


def test_the_top1_arrays_are_what_a_decode_sees(weights: dict) -> None:
    """greedy_top1[i] is the drafter's `greedy_top1` from the state a decode holds at step index i
    (checked at the first one, after the prefill); head_top1[i, 0] is the same node's (depth 1 has
    no path yet), and deeper head_top1 follow the true tokens."""
    model = eagle3_target("padded")
    drafter = eagle3_from(weights, model)
    prompt = random_prompts(1, seed=12)[0]
    ro = rollout_prompt(model, drafter, prompt, 24, RANK_CAP)
    model.reset_cache()
    drafter.reset()
    pos = torch.arange(len(prompt))
    logits, hidden, features = target_forward(model, torch.tensor([prompt]), pos, EAGLE3_AUX, last_only=True)
    root = int(logits[0, -1].argmax())
    assert root == int(ro["tokens"][0])
    h = drafter.observe(hidden, pos, torch.tensor(prompt[1:] + [root]), features)
    chain = drafter.greedy_top1(h, root)
    assert ro["greedy_top1"][0].tolist() == pytest.approx(chain, rel=1e-4, abs=1e-6)
    assert ro["head_top1"][0, 0] == pytest.approx(chain[0], rel=1e-4, abs=1e-6)
    # the true path's depth-1 rank is the rank of y_2 among the root's children, as propose ranks them
    _, probs = drafter.propose_scored(h, root, TreeBuffers.compile(Tree([(r,) for r in range(RANK_CAP)])))
    tokens = drafter.propose(h, root, TreeBuffers.compile(Tree([(r,) for r in range(RANK_CAP)])))
    y2 = int(ro["tokens"][1])
    want = next((r for r in range(RANK_CAP) if int(tokens[1 + r]) == y2), RANK_CAP)
    assert int(ro["rank_paths"][0, 0]) == want
    assert float(probs[1]) == pytest.approx(chain[0], rel=1e-4)
