"""The context vectors the scores stage records, on the torch path past one forward's depth limit."""

from __future__ import annotations

import pytest
import torch

from pipeline.rollout.scores import CONTEXT_CHUNK, decode_contexts
from tests.helpers import invariant_model, tiny_heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_continuations_give_the_contexts_of_one_token_forwards(dtype: torch.dtype) -> None:
    """150 continuation tokens (the row-invariant torch path holds at most 63 new tokens deep in one
    forward): every context equals, bit for bit, the hidden state of that position decoded alone."""
    model = invariant_model("padded").to(dtype)
    model.setup_cache(256)
    heads = tiny_heads(model, "hydra").to(dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 40, (10,), generator=g).tolist()
    tokens = torch.randint(0, 40, (150,), generator=g).tolist()
    assert len(tokens) > 2 * CONTEXT_CHUNK
    got = decode_contexts(model, heads, prompt, tokens)

    model.reset_cache()
    _, hidden = model(torch.tensor([prompt]), torch.arange(len(prompt)), last_only=True)
    want = [hidden[0, -1]]
    for j, t in enumerate(tokens[:-1]):
        _, hidden = model(torch.tensor([[t]]), torch.tensor([len(prompt) + j]))
        want.append(hidden[0, -1])
    assert got.dtype == dtype and got.shape == (len(tokens), model.args.dim)
    assert torch.equal(got, torch.stack(want))
