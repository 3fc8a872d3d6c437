"""Rollouts for the pipeline tests: seeded fake ones (`synthetic_rollouts`: ranks and signals
driven by a hidden easy/hard regime), and real ones of a tiny model with their head scores on
super-trees (`scored_rollouts`)."""

from __future__ import annotations

import numpy as np

from runtime.tree import Tree, TreeBuffers


def synthetic_rollouts(
    n_prompts: int = 4, length: int = 64, depth: int = 4, rank_cap: int = 8, seed: int = 0, switch: float = 0.1
) -> list[dict]:
    """Seeded fake rollouts for tests: a hidden easy/hard regime (Markov, switching
    with probability `switch`) drives both the ranks (geometric, worse with depth) and the signals,
    so confidence-driven policies have something to find. Follows the rank-path convention,
    including K beyond the end of the continuation."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_prompts):
        T = int(length)
        easy = np.empty(T, dtype=bool)
        state = bool(rng.random() < 0.5)
        for t in range(T):
            if rng.random() < switch:
                state = not state
            easy[t] = state
        q_top = np.where(easy, 0.85, 0.35)  # probability that head 1's top-1 is right
        q = q_top[:, None] * (0.93 ** np.arange(depth))[None, :]
        ranks = rng.geometric(np.clip(q, 1e-3, 1.0)) - 1
        ranks = np.minimum(ranks, rank_cap)
        for d in range(depth):  # y_{i+2+d} exists only while i + 2 + d <= T
            ranks[max(T - 1 - d, 0) :, d] = rank_cap
        p0 = np.clip(q_top + rng.normal(0, 0.1, T), 0.01, 1.0)
        head_top1 = np.clip(q + rng.normal(0, 0.1, (T, depth)), 0.01, 1.0)
        entropy = np.clip(-np.log(p0) + rng.normal(0, 0.2, T), 0.0, None)
        out.append(
            {
                "rank_paths": ranks.astype(np.int16),
                "p0": p0.astype(np.float32),
                "head_top1": head_top1.astype(np.float32),
                "entropy": entropy.astype(np.float32),
                "rank_cap": int(rank_cap),
            }
        )
    return out


def scored_rollouts(model, heads, prompts: list[list[int]], trees: list[Tree], new_tokens: int = 30,  # noqa: ANN001
                    rank_cap: int = 10) -> tuple[list[dict], list[list[np.ndarray]]]:
    """Greedy rollouts of `prompts` (`new_tokens` each, ranks capped at `rank_cap`) and their head
    scores on `trees` (per tree, per prompt), as the rollout and scores stages record them."""
    from pipeline.rollout.record import rollout_prompt
    from pipeline.rollout.scores import score_prompt

    rolls, scores = [], [[] for _ in trees]
    bufs = [TreeBuffers.compile(t) for t in trees]
    for n, ids in enumerate(prompts):
        ro = rollout_prompt(model, heads, ids, new_tokens, rank_cap)
        ro["id"], ro["rank_cap"] = f"p{n}", rank_cap
        rolls.append(ro)
        for s, sc in enumerate(score_prompt(model, heads, ids, ro["tokens"], bufs)):
            scores[s].append(sc)
    return rolls, scores
