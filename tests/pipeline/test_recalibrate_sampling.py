"""Rank-path replay at temperature > 0: a rollout made with seeded sampling replays tree decoding
with the same sampler exactly (the pipeline's rollout -> grow -> recalibrate chain at T > 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.paths import Layout, decoding_tag
from pipeline.recalibrate import compare_step_by_step
from pipeline.rollout.record import rollout_prompt
from runtime.decoder import TreeDecoder
from runtime.sampling import Sampler, SamplingConfig
from runtime.tree import Tree, TreeBuffers
from tests.helpers import tiny_heads, tiny_model

TREES = [Tree.chain(3), Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]), Tree.named("mc_sim_7b_63")]


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampled_rollout_replays_real_decoding_step_by_step(kind: str, temperature: float) -> None:
    model = tiny_model(seed=3)
    heads = tiny_heads(model, kind, seed=4)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    compared = agreed = 0
    for seed, prompt in enumerate(([1, 5, 9, 2], [7, 3, 3, 8, 11], [2, 4])):
        sampler = Sampler(SamplingConfig(temperature=temperature, top_k=0, top_p=0.95 if temperature else 1.0, seed=seed))
        ro = rollout_prompt(model, heads, prompt, 40, rank_cap=10, sampler=sampler)
        assert not ro["tf_mismatch"].any()  # fp32, tiny model: no ties
        for k, tree in enumerate(TREES):
            res = dec.generate(prompt, 40, choose=k, sampler=sampler)
            cmp = compare_step_by_step(ro, tree, [s.accepted for s in res.steps], res.tokens, rank_cap=10)
            assert cmp["same_tokens"], (kind, temperature, k)
            assert cmp["steps_agree"] == cmp["steps_compared"], cmp["disagreements"]
            compared += cmp["steps_compared"]
            agreed += sum(s.accepted for s in res.steps)
    assert compared > 30 and agreed > 0  # real steps, and some drafts were accepted


def test_sampled_banks_have_their_own_folders() -> None:
    assert decoding_tag(None) == "" and decoding_tag({"temperature": 0.0, "top_k": 5, "top_p": 0.5, "seed": 3}) == ""
    tag = decoding_tag({"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": 0})
    assert tag == "T0.7s0"
    assert decoding_tag({"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 2}) == "T1k40p0.9s2"
    greedy = Layout(Path("a"), Path("d"), "m", "h", "humaneval", "cpu")
    sampled = Layout(Path("a"), Path("d"), "m", "h", "humaneval", "cpu", tag)
    assert greedy.bank_dir.name == "humaneval" and sampled.bank_dir.name == "humaneval@T0.7s0"
    assert greedy.work != sampled.work and greedy.task_data() == sampled.task_data()  # same prompts


def test_numerical_arithmetic_has_its_own_folders() -> None:
    """lossless=numerical decodes in another arithmetic than the row-invariant default: its rollout
    and bank live beside the default's instead of rebuilding them."""
    from pipeline.paths import arithmetic_tag

    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    assert arithmetic_tag({"sampling": greedy, "lossless": "exact"}) == ""
    assert arithmetic_tag({"sampling": greedy, "lossless": "numerical"}) == "numerical"
    assert arithmetic_tag({"sampling": {**greedy, "temperature": 0.7}, "lossless": "numerical"}) == "T0.7s0-numerical"
    # a forced low-precision dtype gets its own folders; auto and float32 keep the plain name
    assert arithmetic_tag({"sampling": greedy, "lossless": "exact", "dtype": "bfloat16"}) == "bfloat16"
    assert arithmetic_tag({"sampling": greedy, "lossless": "numerical", "dtype": "float16"}) == "numerical-float16"
    assert arithmetic_tag({"sampling": greedy, "lossless": "exact", "dtype": "float32"}) == ""
    assert arithmetic_tag({"sampling": greedy, "lossless": "exact", "dtype": "auto"}) == ""
    num = Layout(Path("a"), Path("d"), "m", "h", "gsm8k", "cpu", "numerical")
    assert num.bank_dir.name == "gsm8k@numerical" and num.work != Layout(Path("a"), Path("d"), "m", "h", "gsm8k", "cpu").work
