"""The lossless modes on the default model (slow): the correctness verdict of
`python -m pipeline.benchmarks.lossless_modes`, which adds the speed part.

SmolLM2-135M with its shipped heads (the draft-vocabulary ones its banks use) and a bank of three
trees (a chain, a 6-node tree, the 63-node Medusa/Hydra tree; `tests.helpers.make_tiny_bank`), in
bfloat16 and float32, each under `lossless: exact` (row-invariant forwards) and `numerical` (the
ordinary arithmetic). Every variant decodes real HumanEval prompts with AR (in its own arithmetic),
the best static tree, the hysteresis policy and the largest tree, through the benchmark's own code.
Under exact every output must be AR's; under numerical every divergence from AR that
`pipeline.evaluate.list_divergences` finds must lie within the dtype's rounding bound. (The
largest tree's forwards hold over 32 rows: in bfloat16 on an Intel Xeon with AMX-BF16 they left
AR's output while `runtime.model.invariant.by_row_blocks` merged 16-bit blocks into wider calls.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = 2
NEW_TOKENS = 32


# ~50 s each on the 2-core bench machine
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_exact_mode_outputs_are_ars(smollm2_dir: Path, tmp_path: Path, dtype: str) -> None:
    import torch

    from pipeline.prepare import task_prompts
    from pipeline.benchmarks.lossless_modes import decode_interleaved, load_variants, summarize, verdict
    from pipeline.paths import REPO_ROOT, Layout
    from tests.helpers import make_tiny_bank

    lay = Layout.for_model(REPO_ROOT / "artifacts", smollm2_dir.name)
    heads_dir = next((lay.heads_dir(n) for n in ("hydra-draft8192", "hydra") if (lay.heads_dir(n) / "config.json").is_file()),
                     None)
    if heads_dir is None:
        pytest.skip(f"no shipped heads under {lay.heads_dir('hydra').parent}")
    bank_dir = make_tiny_bank(tmp_path / "bank", smollm2_dir, heads_dir)
    prompts = [{"id": f"{task}/{i}", "input_ids": ids}
               for i, (task, ids) in enumerate(task_prompts(smollm2_dir, ["humaneval"], PROMPTS, max_prompt_tokens=512))]
    exact, numerical = f"{dtype}:exact", f"{dtype}:numerical"
    variants = load_variants(bank_dir, [exact, numerical], rows=8, threads=1)
    torch.set_num_threads(1)
    decode_interleaved(variants, prompts, NEW_TOKENS, progress=False)
    summary, lines = summarize(variants, prompts)
    print("\n".join(lines))
    for key, v in summary.items():
        for d in v["divergences"]:
            print(f"{key} divergence: {d}")
    # numerical: whatever diverges from AR does so within the dtype's rounding bound
    assert all(d["within_bound"] for d in summary[numerical]["divergences"]), summary[numerical]["divergences"]
    # exact: every method's output is AR's
    table = summary[exact]["table"]
    assert len(table) == 4, table  # AR, best static tree, largest tree (64 nodes), hysteresis policy
    assert all(t["tokens_per_step"] > 1.0 for name, t in table.items() if name != "AR"), table  # the trees drafted
    assert {name: t["identical"] for name, t in table.items()} == {name: f"{PROMPTS}/{PROMPTS}" for name in table}
    assert summary[exact]["divergences"] == []
    assert verdict(summary) == []
