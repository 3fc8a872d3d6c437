"""Replay of EntMTP-dyn: per-step subsets of a super-tree chosen from recorded head scores, its
hindsight ceiling, and the step-by-step comparison with a real decode."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.replay.accept import Path, as_rollouts, rank_cap_of


@dataclass
class DynamicReplay:
    """A DynamicPolicy replayed over rollouts (`replay_dynamic`)."""

    steps: int
    tokens: int
    tokens_per_step: float
    time_s: float | None
    tokens_per_second: float | None
    node_steps: np.ndarray                 # [N + 1]: steps that verified n nodes (index n)
    visited: list[np.ndarray]              # per prompt: step indices visited
    accepted: list[np.ndarray]             # per prompt: accepted length at each visited step
    nodes: list[np.ndarray]                # per prompt: nodes verified at each visited step
    depth_steps: np.ndarray                # [depth + 1]: steps that drafted the super-tree to depth d

    def summary(self) -> dict[str, Any]:
        used = {int(n): int(c) for n, c in enumerate(self.node_steps) if c}
        drafted = {int(d): int(c) for d, c in enumerate(self.depth_steps) if c}
        return {"steps": self.steps, "tokens": self.tokens, "tokens_per_step": self.tokens_per_step,
                "time_s": self.time_s, "tokens_per_second": self.tokens_per_second,
                "mean_nodes": float(sum(n * c for n, c in used.items()) / max(self.steps, 1)), "nodes_used": used,
                "drafted_depths": drafted}


def _super_index(policy: Any) -> dict[Path, int]:
    """Node index of each rank path of the policy's super-tree (the root, (), is node 0)."""
    tree = policy.super_tree.to_tree()
    return {(): 0, **{tuple(p): tree.node_index(p) for p in tree.paths}}


def accepted_in_subset(rank_path: np.ndarray, index: dict[Path, int], kept: Sequence[bool]) -> int:
    """Accepted length of a step that verifies the `kept` nodes of a super-tree (`index`: node index
    of each rank path): the longest prefix of the step's rank path that is a kept node."""
    a = 0
    for d in range(1, len(rank_path) + 1):
        j = index.get(tuple(int(x) for x in rank_path[:d]), -1)
        if j < 0 or not kept[j]:
            break
        a = d
    return a


def _checked_index(policy: Any, rolls: Sequence[dict], K: int) -> dict[Path, int]:
    """`_super_index(policy)`, after checking that the rollouts' rank paths can score its super-tree."""
    index = _super_index(policy)
    paths = [p for p in index if p]
    if paths and max(max(p) for p in paths) >= K:
        raise ValueError(f"the super-tree has a rank >= rank_cap {K}: the rollout cannot score it")
    if policy.depth > rolls[0]["rank_paths"].shape[1]:
        raise ValueError(f"the super-tree has depth {policy.depth} but the rank paths cover {rolls[0]['rank_paths'].shape[1]} heads")
    return index


def replay_dynamic(rollouts: dict | Sequence[dict], scores: Sequence[np.ndarray], policy: Any,
                   rank_cap: int | None = None, exact_costs: bool = True,
                   policy_at: Callable[[int, int], Any] | None = None) -> DynamicReplay:
    """Replay a `runtime.dynamic.DynamicPolicy` exactly over rollouts and their head scores.

    `scores[n]` is prompt n's [T, N-1] float32 head probabilities of the policy's super-tree
    (`pipeline.rollout.score_prompt`). At each visited step i the policy's own `select` picks the
    subset from those probabilities (the same float32 operations as in a decode), the step accepts
    the longest prefix of R[i] that is a node of the subset, and costs `policy.step_ms[n-1]` ms
    for n nodes; with `policy.stop_below`, the depth a decode drafts to (`drafted_depth`: the same
    per-depth rule a decode applies as it drafts) bounds the subset and prices the step
    (`step_costs`). Counting as everywhere here (module docstring): tokens per step = sum(T - 1) /
    steps, tokens per second = the same tokens / the summed step costs.
    `exact_costs=False` leaves time out (tokens per step only). `policy_at(prompt, step index)`, for
    studies, names the policy that picks each step's subset (default: `policy` at every step);
    every one must share `policy`'s super-tree and costs, which price the steps."""
    import torch

    rolls = as_rollouts(rollouts)
    if len(scores) != len(rolls):
        raise ValueError(f"{len(rolls)} rollouts but head scores for {len(scores)} prompts")
    index = _checked_index(policy, rolls, rank_cap_of(rolls, rank_cap))
    N = policy.num_nodes
    costs = [policy.step_costs(d) for d in range(policy.depth + 1)]
    steps = tokens = 0
    time_ms = 0.0
    node_steps = np.zeros(N + 1, dtype=np.int64)
    depth_steps = np.zeros(policy.depth + 1, dtype=np.int64)
    visited, accepted, nodes = [], [], []
    one = torch.ones(1, dtype=torch.float32)
    for n, (r, sc) in enumerate(zip(rolls, scores)):
        R = r["rank_paths"]
        T = len(R)
        sc = np.asarray(sc)
        if sc.shape != (T, N - 1) or sc.dtype != np.float32:
            raise ValueError(f"prompt {n}: head scores must be float32 [{T}, {N - 1}] (steps x non-root nodes of the "
                             f"super-tree), got {sc.dtype} {sc.shape}")
        probs = torch.from_numpy(np.ascontiguousarray(sc))
        vis, acc, nod = [], [], []
        i = 0
        while i < T - 1:
            prob = torch.cat([one, probs[i]])
            pol = policy if policy_at is None else policy_at(n, i)
            drafted = pol.drafted_depth(prob)
            keep, k, _ = pol.select(prob, drafted)
            a = accepted_in_subset(R[i], index, keep.tolist())
            size = int(k)
            vis.append(i)
            acc.append(a)
            nod.append(size)
            node_steps[size] += 1
            depth_steps[drafted] += 1
            time_ms += costs[drafted][size - 1]
            i += a + 1
        steps += len(vis)
        tokens += max(T - 1, 0)
        visited.append(np.asarray(vis, dtype=np.int64))
        accepted.append(np.asarray(acc, dtype=np.int64))
        nodes.append(np.asarray(nod, dtype=np.int64))
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    secs = time_ms / 1000 if exact_costs else None
    return DynamicReplay(steps, tokens, tokens / steps, secs, tokens / secs if secs else None, node_steps, visited,
                         accepted, nodes, depth_steps)


def dynamic_ceiling(rollouts: dict | Sequence[dict], policy: Any, rank_cap: int | None = None) -> dict[str, float]:
    """The hindsight ceiling of a dynamic policy's super-tree: tokens per second of the best schedule
    that knows each step's accepted path. Knowing it, a step verifies exactly the accepted chain:
    k + 1 nodes (the root and the k accepted drafts, k no longer than the path S holds at i),
    drafted down to depth max(k, 1), at `policy.step_costs(max(k, 1))[k]`; a dynamic program over
    the step indices (as `oracle_schedule`) picks every k. No subset of S, chosen from any signal,
    emits more per step or costs less, so no `DynamicPolicy` on S with these costs replays faster:
    EntMTP-dyn's replayed tok/s over this is how much of what its super-tree allows its path
    values recover. (A policy without early stop pays the whole draft on every step, so its own
    ceiling is lower; this is the ceiling of the super-tree and cost model.)"""
    rolls = as_rollouts(rollouts)
    index = _checked_index(policy, rolls, rank_cap_of(rolls, rank_cap))
    every = [True] * policy.num_nodes
    costs = [policy.step_costs(max(k, 1))[k] for k in range(policy.depth + 1)]
    time_ms = 0.0
    tokens = steps = 0
    for r in rolls:
        R = np.asarray(r["rank_paths"])
        T = len(R)
        if T < 2:
            continue
        reach = [accepted_in_subset(R[i], index, every) for i in range(T)]   # the longest prefix of R[i] in S
        best = [0.0] * T
        arg = [0] * T
        for i in range(T - 2, -1, -1):
            t_best, k_best = math.inf, 0
            for k in range(reach[i] + 1):
                t = costs[k] + best[min(i + k + 1, T - 1)]
                if t < t_best:
                    t_best, k_best = t, k
            best[i], arg[i] = t_best, k_best
        i = 0
        while i < T - 1:
            i = min(i + arg[i] + 1, T - 1)
            steps += 1
        time_ms += best[0]
        tokens += T - 1
    if steps == 0:
        raise ValueError("nothing to replay: every continuation has T <= 1 tokens")
    return {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps, "time_s": time_ms / 1000,
            "tokens_per_second": 1000 * tokens / time_ms}


def compare_dynamic_steps(replay: DynamicReplay, prompt: int, accepted_real: Sequence[int], nodes_real: Sequence[int],
                          T: int, limit: int = 10) -> dict[str, Any]:
    """A real EntMTP-dyn decode of prompt `prompt` against its replay, step by step (recalibrate's
    check for the dynamic policy): the steps compared, how many agree on both the accepted length
    and the subset's size, and the first few disagreements. A real step may accept drafts past the
    rollout's end (then truncated), so its accepted length is compared capped at T - 1 - i."""
    vis, acc, nod = (x[prompt].tolist() for x in (replay.visited, replay.accepted, replay.nodes))
    agree, compared, out = 0, 0, []
    i = 0
    for s, (a_real, n_real) in enumerate(zip(accepted_real, nodes_real)):
        if s >= len(vis) or vis[s] != i:
            if len(out) < limit:
                out.append({"step": s, "index": i, "what": "the replay visits other step indices"})
            break
        compared += 1
        if min(a_real, T - 1 - i) == acc[s] and n_real == nod[s]:
            agree += 1
        elif len(out) < limit:
            out.append({"step": s, "index": i, "replay": [acc[s], nod[s]], "real": [a_real, n_real]})
        i += a_real + 1
    return {"steps_compared": compared, "steps_agree": agree, "real_steps": len(accepted_real),
            "replay_steps": len(vis), "disagreements": out}

