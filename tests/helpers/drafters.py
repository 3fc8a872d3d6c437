"""EAGLE-3 drafters for the tests: a 3-layer tiny target (so three distinct aux layers exist) in
each arithmetic, a random drafter bound to it, and one briefly trained on the target's own
continuations (so that the decoder tests accept several drafts per step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runtime.ar import ar_generate
from runtime.eagle3 import Eagle3Config, Eagle3Drafter, target_forward
from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from runtime.sampling import Sampler, SamplingConfig
from tests.helpers.models import random_prompts, tiny_transformer

EAGLE3_VOCAB, EAGLE3_DRAFT_VOCAB = 48, 40
EAGLE3_AUX = (0, 1, 2)   # every layer's input of the 3-layer target: low, mid, high
EAGLE3_ARGS = ModelArgs(vocab_size=EAGLE3_VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                        intermediate_size=64, eos_token_ids=(EAGLE3_VOCAB - 1,), max_position_embeddings=512)


def eagle3_target(arithmetic: str | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
                  cache: int = 256) -> Transformer:
    """The tiny 3-layer target in an arithmetic: None (the plain forward), "padded" (row-invariant
    blocks of 4 rows, torch's products) or "kernel" (the small-row kernels), in `dtype`."""
    model = tiny_transformer(EAGLE3_ARGS, seed, cache=cache)
    if dtype != torch.float32:
        model.to(dtype)
        model.setup_cache(cache)
    if arithmetic == "kernel":
        model.add_fast_paths()
        assert model.kernel_decode
    if arithmetic is not None:
        model.set_row_invariance(4)
    return model


def random_eagle3(model: Transformer, seed: int = 0, draft_vocab: int = EAGLE3_DRAFT_VOCAB,
                  aux: tuple[int, ...] = EAGLE3_AUX, **config: Any) -> Eagle3Drafter:
    """A drafter with wide random weights (norms in [0.5, 1.5], the rest N(0, 0.3)) and a random draft
    vocabulary, in the model's dtype, bound to `model`; `config`: more `Eagle3Config` settings."""
    cfg = Eagle3Config.for_model(model.args, draft_vocab_size=draft_vocab, aux_layer_ids=aux, **config)
    g = torch.Generator().manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * 0.3)
    drafter.set_draft_vocab(torch.randperm(model.args.vocab_size, generator=g)[:draft_vocab].sort().values)
    drafter.to(model.dtype).bind(model)
    return drafter.eval()


def trained_eagle3_weights(seed: int = 0, prompts: int = 16, tokens: int = 80,
                           steps: int = 240) -> dict[str, torch.Tensor]:
    """The state dict of a drafter for `eagle3_target(seed=seed)` trained for a few seconds (depth 1,
    teacher-forced) on the target's own greedy and sampled continuations: it then drafts well
    enough that most decoding steps accept a draft or several."""
    model = eagle3_target(seed=seed)
    drafter = random_eagle3(model, seed=seed)
    draft_of = torch.full((EAGLE3_VOCAB,), -1, dtype=torch.long)
    draft_of[drafter.target_ids()] = torch.arange(EAGLE3_DRAFT_VOCAB)
    data = []
    for i, prompt in enumerate(random_prompts(prompts, seed=100 + seed)):
        sampler = Sampler(SamplingConfig(temperature=0.7, seed=i)) if i % 2 else None
        x = torch.tensor(prompt + ar_generate(model, prompt, tokens, eos_ids=(), sampler=sampler))
        model.reset_cache()
        with torch.inference_mode():
            _, _, features = target_forward(model, x[None, :-1], torch.arange(len(x) - 1), EAGLE3_AUX)
        data.append((features.clone(), x[1:].clone()))
    fit_depth1(drafter, data, draft_of, steps)
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def fit_depth1(drafter: Eagle3Drafter, data: list[tuple[torch.Tensor, torch.Tensor]], draft_of: torch.Tensor,
               steps: int) -> None:
    """Train `drafter` for `steps` Adam steps on depth-1 teacher forcing over `data` ([(features,
    next tokens)] of whole sequences); `draft_of` maps target ids to draft ids (-1: not drafted)."""
    drafter.train().requires_grad_(True)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        features, nxt = data[step % len(data)]
        _, g = drafter._sequence_rows(features, nxt, 1, 0)   # the committed rows, differentiable
        target = draft_of[nxt[1:]]
        keep = target >= 0
        loss = F.cross_entropy(drafter.logits(g[:-1])[keep], target[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval().requires_grad_(False)


def eagle3_from(weights: dict[str, torch.Tensor], model: Transformer) -> Eagle3Drafter:
    """A drafter holding `weights` (`trained_eagle3_weights`), in the model's dtype, bound to it."""
    drafter = Eagle3Drafter(Eagle3Config.for_model(model.args, draft_vocab_size=EAGLE3_DRAFT_VOCAB,
                                                   aux_layer_ids=EAGLE3_AUX))
    drafter.load_state_dict(weights)
    drafter.to(model.dtype).bind(model)
    drafter.add_fast_paths()
    return drafter.eval().requires_grad_(False)
