"""Seeded sampling keyed on the output position: exact samples that tree decoding reproduces.

The token at output position t (t = 0 is the first new token, the one the prefill predicts;
t = 1 the next, and so on) is

    argmax over the processed support of  logits_t / T + G(seed, t, token)

where the support is what temperature, then top-k, then top-p leave (every other token scores
-inf), and G is i.i.d. standard Gumbel noise that depends on (seed, t, token id) only.

Why this is an exact sample (Gumbel-max). For independent standard Gumbel G_i and any scores
s_i, P(argmax_i s_i + G_i = j) = exp(s_j) / sum_i exp(s_i). With s = logits / T restricted to the
support, that is exactly the processed distribution. The noise at position t is independent of
the noise at every other position, and the prefix that produced logits_t depends only on noise at
positions before t, so each token is an exact draw from the processed distribution given its
prefix: seeded AR decoding samples the model's processed sequence distribution exactly.

Why a tree step emits exactly the seeded-AR tokens. A node at depth d of a step whose root is the
token at output position n - 1 holds the logits for position n + d along its own prefix (the
root's emitted prefix plus the drafts on its path). Every node at that depth uses the same noise
G(seed, n + d, .), so each node computes what seeded AR would emit next *if* its prefix were the
real one. The root's prefix is real, so its sample is AR's token at position n; the step
descends into the child whose draft equals that sample (a child with another draft is not AR's
prefix), whose sample is then AR's token at n + 1, and so on; the bonus token is the last
accepted node's sample. Which tree was drafted, and whether the tree changes from step to step,
decides only how many of these tokens one step confirms, never which tokens they are.
Temperature 0 is the limit case: plain argmax (greedy), no noise.

The noise is a counter-based hash computed with int64 tensor ops on the logits' device (no
generator state, vectorised over rows, the same bits on every device), turned into a uniform
u in (0, 1) with 53 random bits and into -log(-log u) in float64, then rounded to float32. Scores
are formed and compared in float32 whatever the model's dtype (bfloat16 logits convert exactly),
so a low-precision model changes the logits, not the noise. Rounding the scores to float32 moves
a token's probability by a relative amount of order 1e-7; that, and the 2**-53 grid of u, are the
only departures from an exact Gumbel-max draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.config import SamplingConfig

__all__ = ["SamplingConfig", "RowPositions", "Sampler", "gumbel_noise", "process_logits", "keyed_argmax"]

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 math)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's increment and finaliser multipliers (public-domain constants of that generator)
_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)
# a second odd multiplier, so that position and token counters walk different sequences
_POSITION_STEP = _signed64(0xD6E8FEB86659FD93)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> on int64 copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place: a bijection of 64-bit words whose output bits all depend
    on every input bit. int64 multiplication wraps modulo 2**64, which is the unsigned product's
    bits."""
    for bits, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        x ^= _shift_right(x, bits)
        if multiplier is not None:
            x *= multiplier
    return x


_COUNTERS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _token_counters(vocab_size: int, device: torch.device) -> torch.Tensor:
    """(token id + 1) * golden ratio increment for every token: splitmix64's stream positions."""
    key = (vocab_size, device)
    if key not in _COUNTERS:
        _COUNTERS.clear()  # one vocabulary at a time in practice; do not grow without bound
        _COUNTERS[key] = (torch.arange(vocab_size, dtype=torch.long, device=device) + 1) * _GOLDEN
    return _COUNTERS[key]


def gumbel_noise(seed: int | torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise G(seed, position, token) in float64, shape [*batch, vocab_size].

    `seed` (an int, or an int64 tensor) and `positions` (int64) broadcast to `batch`; the result
    lives on `positions`' device. Each (seed, position) pair keys a splitmix64 stream whose
    token-th word gives 53 bits of u = (k + 1/2) / 2**53, strictly inside (0, 1), so the noise is
    always finite."""
    positions = positions.to(torch.long)
    seeds = seed.to(device=positions.device, dtype=torch.long) if isinstance(seed, torch.Tensor) \
        else torch.tensor(_signed64(seed), dtype=torch.long, device=positions.device)
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    row_key = _mix64(_mix64(seeds + _GOLDEN) + (positions + 1) * _POSITION_STEP)
    bits = _mix64(row_key[..., None] + _token_counters(vocab_size, positions.device))
    u = _shift_right(bits, 11).to(torch.float64).add_(0.5).mul_(2.0 ** -53)
    return u.log_().neg_().log_().neg_()


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """float32 scores logits / T with -inf outside the support (temperature, then top-k, then
    top-p), shape as `logits` [..., V]; the most probable token is always in the support.

    top-k keeps every token scoring at least the k-th highest score (ties at the boundary stay
    in). top-p keeps a token when the probability of the tokens ranked strictly before it (sorted
    by probability, ties by token id) is below top_p."""
    if config.greedy:
        raise ValueError("process_logits is for temperature > 0; temperature 0 is a plain argmax")
    scores = logits.to(torch.float32) / config.temperature  # a fresh tensor: edited in place below
    vocab = scores.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores.masked_fill_(scores < kth, -math.inf)
    if config.top_p < 1:
        # top-k left at most k finite scores: the nucleus lies among them (or the candidates)
        candidates = min(config.top_k, NUCLEUS_CANDIDATES) if config.top_k else NUCLEUS_CANDIDATES
        scores.masked_fill_(_outside_nucleus(scores, config.top_p, candidates), -math.inf)
    return scores


# Top-p looks for the nucleus among this many most probable tokens first, and sorts the whole
# vocabulary only when they do not hold top_p of the mass (a flat distribution).
NUCLEUS_CANDIDATES = 1024


def _outside_nucleus(scores: torch.Tensor, top_p: float, candidates: int) -> torch.Tensor:
    """bool [..., V]: tokens whose more probable tokens (ties by lower id) already hold top_p.
    The `candidates` most probable tokens are tried first; if they do not hold top_p in every
    row, the whole vocabulary is sorted."""
    vocab = scores.shape[-1]
    log_norm = torch.logsumexp(scores.to(torch.float64), dim=-1, keepdim=True)
    if candidates < vocab:
        cand_scores, cand_ids = torch.topk(scores, candidates, dim=-1)
        # topk leaves the order of equal scores open: order the candidates by id, then stably by score
        cand_ids, by_id = torch.sort(cand_ids, dim=-1)
        cand_scores = cand_scores.gather(-1, by_id)
        cand_scores, by_score = torch.sort(cand_scores, dim=-1, descending=True, stable=True)
        cand_ids = cand_ids.gather(-1, by_score)
        probs = torch.exp(cand_scores.to(torch.float64) - log_norm)
        # one host read, only with top-p: do the candidates hold top_p in every row?
        if bool((probs.sum(-1) >= top_p).all()):
            mass_before = torch.cumsum(probs, dim=-1) - probs
            mass_before[..., 0] = 0.0  # the top token always stays, whatever the rounding
            keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, cand_ids, mass_before < top_p)
            return ~keep
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    probs = torch.exp(sorted_scores.to(torch.float64) - log_norm)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    mass_before[..., 0] = 0.0
    return torch.empty_like(scores, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)


def keyed_argmax(logits: torch.Tensor, noise: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """argmax over the processed support of logits / T + noise, row by row ([..., V] -> [...]),
    in float32 (the noise is rounded to float32 first, as the sampler stores it)."""
    scores = process_logits(logits, config)
    scores += noise.to(torch.float32)
    return scores.argmax(dim=-1)


@dataclass(frozen=True)
class RowPositions:
    """Output positions of logits rows in the factorised form a tree step has: row i predicts
    output position `first + offsets[i]`, with offsets in [0, span). Every row with the same
    offset (every node at one tree depth) shares one noise row, computed once."""

    first: int
    offsets: torch.Tensor  # int64 [N] on the logits' device
    span: int


class Sampler:
    """Chooses the next token for rows of logits at given output positions (see the module text).

    Greedy (temperature 0) is argmax on the logits as they are. Otherwise noise rows are memoised
    by position for the positions a `RowPositions` call names: consecutive tree steps overlap in
    the positions they look at, and a row costs a hash and two logs over the whole vocabulary."""

    def __init__(self, config: SamplingConfig | None = None) -> None:
        self.config = config if config is not None else SamplingConfig()
        self._noise: dict[int, torch.Tensor] = {}
        self._noise_key: tuple[int, torch.device] | None = None

    @property
    def greedy(self) -> bool:
        return self.config.greedy

    def next_tokens(self, logits: torch.Tensor, positions: torch.Tensor | RowPositions) -> torch.Tensor:
        """The token (int64, [N], on the logits' device) that each logits row [N, V] samples for
        the output position it predicts (an int64 tensor [N], or a `RowPositions`)."""
        if logits.dim() != 2:
            raise ValueError(f"next_tokens takes logits rows [N, V], got shape {tuple(logits.shape)}")
        if self.greedy:
            return logits.argmax(dim=-1)  # ties go to the lowest id
        if isinstance(positions, RowPositions):
            noise = self._noise_rows(positions.first, positions.span, logits.shape[-1], logits.device)
            noise = noise[positions.offsets]
        else:
            if positions.shape != logits.shape[:1]:
                raise ValueError(f"positions {tuple(positions.shape)} must give one output position per logits row "
                                 f"({logits.shape[0]} rows)")
            noise = gumbel_noise(self.config.seed, positions.to(logits.device), logits.shape[-1])
        return keyed_argmax(logits, noise, self.config)

    def _noise_rows(self, first: int, span: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Noise for positions first .. first + span - 1, [span, V]. Only that window is kept: the
        next tree step starts inside it (it moves forward by the tokens emitted, at most `span`)."""
        if first < 0 or span < 1:
            raise ValueError(f"RowPositions needs first >= 0 and span >= 1, got first={first}, span={span}")
        if self._noise_key != (vocab_size, device):
            self._noise, self._noise_key = {}, (vocab_size, device)
        self._noise = {p: row for p, row in self._noise.items() if first <= p < first + span}
        missing = [p for p in range(first, first + span) if p not in self._noise]
        if missing:
            fresh = gumbel_noise(self.config.seed, torch.tensor(missing, dtype=torch.long, device=device),
                                 vocab_size).to(torch.float32)
            self._noise.update(zip(missing, fresh.unbind(0)))
        return torch.stack([self._noise[p] for p in range(first, first + span)])
