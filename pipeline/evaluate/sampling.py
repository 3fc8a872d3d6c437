"""The evaluate stage at temperature > 0: typical acceptance beside the seeded lossless sampler,
and how far each method's output moves from the model's sampling distribution.

At T > 0 the reference is seeded AR (runtime/sampling.py): every exact method (the bank's trees
and policies, the Hydra / Medusa default trees) must emit the same tokens. Typical acceptance
(Medusa's and Hydra's, with the paper's epsilon 0.09 and alpha 0.3 at the run's temperature) is
not lossless; it runs on the Hydra default tree and on the bank's best static tree.

Distance from the model's distribution. Let p_t be the model's processed distribution
(softmax of the logits / T, restricted to the top-k / top-p support) for output position t
given the tokens a method emitted before t. Per emitted token y_t we record the surprisal
-log p_t(y_t) and the entropy H(p_t), and report, pooled over every emitted token:

* `nll_T`: mean surprisal (nats per token),
* `entropy_T`: mean entropy,
* `nll_gap` = nll_T - entropy_T, with `nll_gap_se`, its standard error.

For an exact sampler each term -log p_t(y_t) - H(p_t) has mean zero given the past (the
expected surprisal of a draw from p_t is its entropy), so the terms are martingale differences:
uncorrelated, and `nll_gap` is 0 up to sqrt(sum of squares) / n, the reported standard error.
A method that prefers probable tokens (typical acceptance, greedy) has a negative gap. Unlike a
raw NLL, the gap compares methods whose texts differ (each term is measured against the model's
distribution on that method's own prefix).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from runtime.decoder import TreeDecoder, TypicalAcceptance
from runtime.heads import DraftHeads
from runtime.model.llama import Transformer
from runtime.sampling import SamplingConfig, process_logits
from runtime.tree import TreeBuffers

# the typical-acceptance settings of the Medusa / Hydra papers (their temperature is the run's)
TYPICAL_EPSILON = 0.09
TYPICAL_ALPHA = 0.3


def paper_typical_acceptance(config: SamplingConfig) -> TypicalAcceptance:
    """Typical acceptance at the run's temperature with the papers' epsilon and alpha."""
    return TypicalAcceptance(temperature=float(config.temperature), epsilon=TYPICAL_EPSILON, alpha=TYPICAL_ALPHA)


def typical_decoders(model: Transformer, heads: DraftHeads, default_tree: TreeBuffers, best_static_tree: TreeBuffers,
                     config: SamplingConfig) -> dict[str, TreeDecoder]:
    """{method name: decoder} for typical acceptance on the Hydra default tree and on the bank's
    best static tree (each decodes with tree index 0)."""
    acceptance = paper_typical_acceptance(config)
    return {"Hydra default + typical": TreeDecoder(model, heads, [default_tree], acceptance=acceptance),
            "EntMTP* tree + typical": TreeDecoder(model, heads, [best_static_tree], acceptance=acceptance)}


def surprisal_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, config: SamplingConfig
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [N, V] and its token [N]: (-log p(token), H(p)) in nats, float64 [N],
    with p the processed distribution (temperature, top-k, top-p). A token outside the support
    has surprisal inf."""
    logp = torch.log_softmax(process_logits(logits, config).to(torch.float64), dim=-1)
    surprisal = -logp.gather(-1, tokens.to(torch.long)[:, None])[:, 0]
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)  # 0 log 0 = 0 outside the support
    return surprisal, entropy


@torch.inference_mode()
def continuation_surprisal(model: Transformer, prompt: Sequence[int], cont: Sequence[int], config: SamplingConfig
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(surprisal, entropy) of every token of `cont` after `prompt` (see `surprisal_and_entropy`),
    from one teacher-forced forward; float64 [len(cont)] on the host."""
    if not cont:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    dev = model.device
    seq = torch.tensor([list(prompt) + list(cont[:-1])], device=dev)
    model.reset_cache()
    logits, _ = model(seq, torch.arange(seq.shape[1], device=dev))
    s, h = surprisal_and_entropy(logits[0, len(prompt) - 1:], torch.tensor(list(cont), device=dev), config)
    return s.cpu(), h.cpu()


def distribution_columns(model: Transformer, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                         config: SamplingConfig) -> dict[str, Any]:
    """The evaluate table's columns nll_T, entropy_T, nll_gap, nll_gap_se and outside_support
    (share of tokens outside the processed support) for one method, pooled over its outputs."""
    surprisal, entropy = zip(*(continuation_surprisal(model, p, y, config) for p, y in zip(prompts, outputs)))
    s, h = torch.cat(surprisal), torch.cat(entropy)
    n = s.numel()
    if n == 0:
        return {"nll_T": math.nan, "entropy_T": math.nan, "nll_gap": math.nan, "nll_gap_se": math.nan,
                "outside_support": math.nan}
    gap = s - h
    return {"nll_T": float(s.mean()), "entropy_T": float(h.mean()), "nll_gap": float(gap.mean()),
            "nll_gap_se": float(gap.square().sum().sqrt() / n), "outside_support": float(torch.isinf(s).double().mean())}
