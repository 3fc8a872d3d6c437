"""The speculators package loads the folders `runtime.export.drafters.write_speculators` writes, and
its draft logits equal the runtime's on the same inputs.

Run where an interpreter with speculators exists (tests/helpers/engine_envs.py; checked with
speculators 0.9.0, installed with --no-deps, and its transformers 5.19): a random drafter of the tiny
bundle's model, written in float32 (with and without ``norm_before_residual``, which speculators'
first layer implements: speculators/models/eagle3/model_definitions.py) and in bfloat16, is loaded by
``Eagle3DraftModel.from_pretrained`` (speculators/models/eagle3/core.py, with the bundle's model
folder as its verifier) and run once over the same target features and tokens as the runtime's
``Eagle3Drafter.extend``; speculators numbers positions from 1 and the runtime from 0, which RoPE
attention cannot tell apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.export.drafters import write_speculators
from tests.helpers import TinyBundle
from tests.helpers.engine_envs import engine_python, run_check
from tests.helpers.eagle3_folders import drafter_for

pytestmark = pytest.mark.engines

AUX = (0, 1)  # the tiny model has 2 layers: the embeddings and the first layer's output


def _case(bundle: TinyBundle, tmp_path: Path, name: str, seed: int, dtype: torch.dtype,
          **config: bool) -> tuple[dict, torch.Tensor]:
    from runtime.eagle3 import Eagle3Drafter

    drafter, model = drafter_for(bundle.model_dir, AUX, draft_vocab=512, seed=seed)
    if config:  # the same weights under another layer setting
        changed = Eagle3Drafter(type(drafter.config)(**{**drafter.config.to_dict(), **config}))
        changed.load_state_dict(drafter.state_dict())
        drafter = changed.to(model.dtype)
        drafter.bind(model)
    drafter = drafter.to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    n = 24
    features = torch.randn(n, len(AUX) * model.args.dim, generator=g).to(dtype)
    tokens = torch.randint(0, model.args.vocab_size, (n,), generator=g)
    drafter.reset()
    with torch.no_grad():
        ours = drafter.logits(drafter.extend(features, tokens, return_all=True))
    folder = write_speculators(drafter, tmp_path / name, str(bundle.model_dir))
    save_file({"hidden_states": features[None].float().contiguous(), "input_ids": tokens[None].contiguous()},
              str(tmp_path / f"{name}-inputs.safetensors"))
    return {"folder": str(folder), "inputs": str(tmp_path / f"{name}-inputs.safetensors"),
            "logits": str(tmp_path / f"{name}-logits.safetensors"), "attn_implementation": "eager"}, ours


def test_speculators_loads_the_folder_and_drafts_the_runtimes_logits(bundle: TinyBundle, tmp_path: Path) -> None:
    python = engine_python("speculators")
    if python is None:
        pytest.skip("no interpreter with speculators (tests/helpers/engine_envs.py says where one is looked for)")
    cases = [_case(bundle, tmp_path, "plain", 0, torch.float32),
             _case(bundle, tmp_path, "nbr", 1, torch.float32, norm_before_residual=True),
             _case(bundle, tmp_path, "bf16", 2, torch.bfloat16)]
    answers = run_check(python, "speculators_check.py", {"cases": [c for c, _ in cases]}, tmp_path)
    for (case, ours), answer, nbr, dtype in zip(cases, answers, (False, True, False),
                                               ("torch.float32", "torch.float32", "torch.bfloat16")):
        assert answer == {"draft_vocab_size": 512, "eagle_aux_hidden_state_layer_ids": list(AUX),
                          "norm_before_residual": nbr, "dtype": dtype, "finite": True}, case["folder"]
        theirs = load_file(case["logits"])["logits"]
        assert theirs.shape == ours.shape == (24, 512)
        if dtype == "torch.float32":
            torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        else:  # bf16 products in another order: within a few bf16 steps of the logits' scale, same top drafts
            assert (theirs - ours).abs().max() <= 0.03 * ours.abs().max()
            assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9
    # the comparison can fail: another drafter's logits are far from these
    other = load_file(cases[1][0]["logits"])["logits"]
    assert not torch.allclose(other, cases[0][1], atol=1e-2)
