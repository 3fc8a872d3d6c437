"""The evaluate stage's EAGLE-2 row: EAGLE-2's dynamic tree drafted by the bank's own drafter (Hydra
heads or an EAGLE-3 drafter), decoded beside the bank's methods with AR's output (greedy and seeded
sampling), its settings from `evaluate.eagle2` (capped to the drafter's depth) named in the table."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from pipeline.evaluate.labels import EAGLE2_LABEL
from pipeline.evaluate.run import compare_methods, eagle2_settings, table_markdown
from runtime.bank import TopologyBank
from runtime.dynamic import DYNAMIC_TREE
from runtime.eagle2 import Eagle2Settings
from runtime.sampling import Sampler, SamplingConfig
from tests.helpers import BANK_TREES, BEST_STATIC, fake_figures, random_prompts, tiny_heads, tiny_model, tiny_policies
from tests.helpers.drafters import eagle3_target, random_eagle3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny_bank() -> TopologyBank:
    return TopologyBank(trees=list(BANK_TREES), figures=[fake_figures(t, k) for k, t in enumerate(BANK_TREES)],
                        best_static=BEST_STATIC, policies=tiny_policies(), default_policy="hysteresis")


def _rows(n: int = 3) -> list[dict]:
    return [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(random_prompts(n, seed=9))]


def _cfg(**eagle2) -> OmegaConf:  # noqa: ANN201 - a DictConfig
    return OmegaConf.create({"task": {"name": "tiny"}, "model": {"name": "tiny-llama"}, "heads": {"name": "hydra"},
                             "profile": {"eval_prompts": 3, "rank_cap": 10}, "sampling": {"temperature": 0.0},
                             "evaluate": {"max_new_tokens": 24, **({"eagle2": eagle2} if eagle2 else {})}})


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_eagle2_row_decodes_as_ar_with_the_banks_heads(temperature: float) -> None:
    model = tiny_model(seed=3)
    hydra = tiny_heads(model, "hydra", seed=4)            # 4 heads: SGLang's depth 5 is capped to 4
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=2))
    df, recs = compare_methods(model, hydra, _tiny_bank(), _rows(), 32, rank_cap=10, sampler=sampler)
    by = df.set_index("method")
    assert by.loc[EAGLE2_LABEL, "identical_to_ar"] == 1.0
    assert by.loc[EAGLE2_LABEL, "tokens_per_step"] >= 1.0 and by.loc[EAGLE2_LABEL, "speedup_vs_ar"] > 0
    assert math.isnan(by.loc[EAGLE2_LABEL, "replayed_tok_per_s"])   # no replay: not a bank tree
    assert df.attrs["eagle2"] == {"depth": 4, "topk": 4, "total_tokens": 8}
    steps = [(t, n) for r in recs[EAGLE2_LABEL] for t, n in zip(r["trees"], r["nodes"])]
    assert steps and all(t == DYNAMIC_TREE and n == 8 for t, n in steps)
    assert sum(a for r in recs[EAGLE2_LABEL] for a in r["accepted"]) > 0, "no draft accepted: nothing was verified"
    table = table_markdown(df, _cfg(), "float32")
    assert f"| {EAGLE2_LABEL} |" in table and "depth 4, top-4, 8 nodes verified per step" in table


def test_the_eagle2_row_drafts_with_an_eagle3_drafter() -> None:
    model = eagle3_target("padded")
    drafter = random_eagle3(model, seed=1)
    settings = Eagle2Settings(3, 3, 6)
    df, recs = compare_methods(model, drafter, _tiny_bank(), _rows(2), 24, rank_cap=10, eagle2=settings)
    by = df.set_index("method")
    assert by.loc[EAGLE2_LABEL, "identical_to_ar"] == 1.0 and (by.drop("oracle (replayed)").identical_to_ar == 1.0).all()
    assert df.attrs["eagle2"] == settings.to_dict()
    assert all(n == 6 for r in recs[EAGLE2_LABEL] for n in r["nodes"])


def test_the_row_is_left_out_when_disabled_and_its_settings_come_from_the_config() -> None:
    model = tiny_model(seed=3)
    hydra = tiny_heads(model, "hydra", seed=4)
    df, recs = compare_methods(model, hydra, _tiny_bank(), _rows(1), 12, rank_cap=10, eagle2=None)
    assert EAGLE2_LABEL not in set(df.method) and EAGLE2_LABEL not in recs and "eagle2" not in df.attrs
    assert EAGLE2_LABEL not in table_markdown(df, _cfg(), "float32")
    assert eagle2_settings(_cfg()) == Eagle2Settings()                    # no block: SGLang's defaults
    assert eagle2_settings(_cfg(enabled=False, depth=5, topk=4, total_tokens=8)) is None
    assert eagle2_settings(_cfg(enabled=True, depth=3, topk=2, total_tokens=5)) == Eagle2Settings(3, 2, 5)
    with pytest.raises(ValueError, match="total_tokens 40 exceeds"):
        eagle2_settings(_cfg(enabled=True, depth=2, topk=2, total_tokens=40))
