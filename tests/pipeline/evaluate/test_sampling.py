"""The evaluate stage at temperature > 0: exact methods equal seeded AR, typical acceptance is
measured beside them, and the distance-from-the-model columns mean what they say."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.evaluate.run import compare_methods
from pipeline.evaluate.sampling import continuation_surprisal, distribution_columns, surprisal_and_entropy
from runtime.bank import TopologyBank
from runtime.sampling import Sampler, SamplingConfig
from tests.helpers import BANK_TREES, BEST_STATIC, fake_figures, tiny_heads, tiny_model, tiny_policies

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOG = math.log


def test_surprisal_and_entropy_on_a_hand_checked_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]] * 3))
    tokens = torch.tensor([0, 1, 2])
    s, h = surprisal_and_entropy(logits, tokens, SamplingConfig(temperature=1.0))
    assert s.tolist() == pytest.approx([LOG(2), LOG(4), LOG(4)])
    assert h.tolist() == pytest.approx([1.5 * LOG(2)] * 3)
    # T = 0.5 squares the probabilities: (1/4, 1/16, 1/16) normalised is (2/3, 1/6, 1/6)
    s, h = surprisal_and_entropy(logits, tokens, SamplingConfig(temperature=0.5))
    assert s.tolist() == pytest.approx([LOG(3 / 2), LOG(6), LOG(6)])
    assert h.tolist() == pytest.approx([-(2 / 3) * LOG(2 / 3) - 2 * (1 / 6) * LOG(1 / 6)] * 3)
    # top-k 1 leaves one token: it is certain, the others are outside the support
    s, h = surprisal_and_entropy(logits, tokens, SamplingConfig(temperature=1.0, top_k=1))
    assert s[0].item() == pytest.approx(0.0) and math.isinf(s[1].item()) and h.tolist() == pytest.approx([0.0] * 3)


def test_an_exact_sampler_has_no_nll_gap_and_the_argmax_a_negative_one() -> None:
    model = tiny_model(seed=5)
    config = SamplingConfig(temperature=0.7, seed=1)
    sampler = Sampler(config)
    from runtime.ar import ar_generate

    prompts = [[1, 5, 9, 2], [7, 3, 3, 8, 11], [2, 4], [6, 6, 1]]
    sampled = [ar_generate(model, p, 60, eos_ids=(), sampler=sampler) for p in prompts]
    greedy = [ar_generate(model, p, 60, eos_ids=()) for p in prompts]
    exact = distribution_columns(model, prompts, sampled, config)
    argmax = distribution_columns(model, prompts, greedy, config)
    assert abs(exact["nll_gap"]) < 3 * exact["nll_gap_se"]
    assert argmax["nll_gap"] < -3 * argmax["nll_gap_se"] < 0
    assert exact["outside_support"] == argmax["outside_support"] == 0.0
    # the pooled figures are per-token means of the teacher-forced ones
    s, h = continuation_surprisal(model, prompts[0], sampled[0], config)
    assert len(s) == len(sampled[0]) and torch.isfinite(s).all() and (h > 0).all()


def _tiny_bank() -> TopologyBank:
    return TopologyBank(trees=list(BANK_TREES), figures=[fake_figures(t, k) for k, t in enumerate(BANK_TREES)],
                        best_static=BEST_STATIC, policies=tiny_policies(), default_policy="hysteresis")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_evaluate_at_temperature_matches_seeded_ar_and_measures_typical_acceptance(temperature: float) -> None:
    model = tiny_model(seed=3)
    hydra, medusa = tiny_heads(model, "hydra", seed=4), tiny_heads(model, "medusa", seed=5)
    rows = [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(([1, 5, 9, 2], [7, 3, 3, 8, 11], [2, 4]))]
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=2))
    df, recs = compare_methods(model, hydra, _tiny_bank(), rows, 40, rank_cap=10, sampler=sampler, medusa=medusa)
    by = df.set_index("method")
    exact = ["Medusa default", "Hydra default", "EntMTP*", "EntMTP-l", "EntMTPτ"]
    assert set(exact) <= set(by.index)
    assert (by.loc[exact, "identical_to_ar"] == 1.0).all()
    assert max(by.loc[exact, "tokens_per_step"]) > 1.0  # drafts were accepted, not just bonus tokens
    typical = ["Hydra default + typical", "EntMTP* tree + typical"]
    assert set(typical) <= set(by.index)
    assert by.loc[typical, "nll_T"].notna().all() and by.loc[typical, "tokens_per_step"].min() >= 1.0
    # AR samples exactly: no surprisal gap beyond noise (how far typical acceptance moves is a
    # property of the model and heads, measured on the real ones, not asserted on random ones)
    assert abs(by.loc["AR", "nll_gap"]) < 3 * by.loc["AR", "nll_gap_se"]
    assert by.loc[typical, "nll_gap_se"].notna().all()
    # the sampled AR text is AR's with the same sampler, not greedy
    from runtime.ar import ar_generate

    assert recs["AR"][0]["tokens"] == ar_generate(model, rows[0]["input_ids"], 40, sampler=sampler)
    assert recs["AR"][0]["tokens"] != ar_generate(model, rows[0]["input_ids"], 40)


def test_greedy_evaluate_has_no_sampling_rows() -> None:
    model = tiny_model(seed=3)
    hydra = tiny_heads(model, "hydra", seed=4)
    df, _ = compare_methods(model, hydra, _tiny_bank(), [{"id": "p0", "input_ids": [1, 5, 9, 2]}], 24, rank_cap=10)
    assert not any("typical" in m for m in df.method) and "nll_gap" not in df.columns
    assert (df.loc[df.method != "oracle (replayed)", "identical_to_ar"] == 1.0).all()
    # the bank's methods replayed on the same continuations and costs as the oracle: never above it
    by = df.set_index("method")
    share = by.loc[["EntMTP*", "EntMTPτ"], "replayed_share_of_oracle"]
    assert share.notna().all() and (share > 0).all() and (share <= 1 + 1e-9).all()
    # the tiny ladder reads the heads' greedy chain, whose per-step cost the bank's costs lack
    assert np.isnan(by.loc["EntMTP-l", "replayed_share_of_oracle"])
    assert by.loc["oracle (replayed)", "replayed_share_of_oracle"] == 1.0
    assert np.isnan(by.loc["AR", "replayed_tok_per_s"])  # not a bank method
    # replayed and measured ratios to AR, each against its own run's AR (this bank has no root-only
    # tree and records no AR step: the measured AR stands in)
    assert all(t.num_nodes > 1 for t in BANK_TREES)
    assert by.loc["EntMTP*", "replayed_vs_ar"] == pytest.approx(by.loc["EntMTP*", "replayed_tok_per_s"]
                                                                / by.loc["AR", "decode_tok_per_s"])
    assert by.loc["oracle (replayed)", "replayed_vs_ar"] == pytest.approx(by.loc["oracle (replayed)", "speedup_vs_ar"])
    assert by.loc["AR", "decode_vs_ar"] == 1.0
    bank = _tiny_bank()
    bank.oracle = {"ar_step_ms": 4.0}   # a bank that records the runtime AR's modeled step: compared with it
    df, _ = compare_methods(model, hydra, bank, [{"id": "p0", "input_ids": [1, 5, 9, 2]}], 24, rank_cap=10)
    by = df.set_index("method")
    assert by.loc["EntMTP*", "replayed_vs_ar"] == pytest.approx(by.loc["EntMTP*", "replayed_tok_per_s"] * 4.0 / 1000)
    assert "predicted_vs_ar" not in df.columns   # no paired timing of EntMTP*'s tree at batch size 1
    # a bank whose paired rounds timed EntMTP*'s tree at 1.3x batched AR over its calibration
    # tokens/step: AR's step over the tree's is 1.3 / that; each method is predicted relative to EntMTP*
    best = bank.best_static
    bank.batch_schedule = {"1": {"paired": {"candidates": [{"tree": best, "median": 1.3, "low": 1.2, "high": 1.4}]}}}
    df, _ = compare_methods(model, hydra, bank, [{"id": "p0", "input_ids": [1, 5, 9, 2]}], 24, rank_cap=10)
    by = df.set_index("method")
    step_ratio = 1.3 / bank.figures[best]["tokens_per_step"]
    assert by.loc["EntMTP*", "predicted_vs_ar"] == pytest.approx(by.loc["EntMTP*", "tokens_per_step"] * step_ratio)
    assert by.loc["EntMTPτ", "predicted_vs_ar"] == pytest.approx(
        by.loc["EntMTPτ", "replayed_tok_per_s"] / by.loc["EntMTP*", "replayed_tok_per_s"]
        * by.loc["EntMTP*", "tokens_per_step"] * step_ratio)
