"""Rollout stage: greedy continuations of the calibration prompts and their rank paths.

Greedy acceptance is a rank path (see `pipeline.replay`): the decoded text does not depend on the tree,
so one AR greedy continuation y per prompt, one teacher-forced pass of the base model over
prompt + y, and the heads run along y give, for every step index i, the rank path
R[i, d-1] = rank of y_{i+1+d} in head d's distribution (capped at K). Every tree, policy and
oracle is then replayed from these arrays without running the model again.

Shardable by prompt (`shard`, `num_shards`): shard k takes prompts k, k+n, k+2n, ...; `merge`
restores prompt order, so a merged sharded rollout equals a single-process one.

Head scores for EntMTP-dyn (`runtime.dynamic`): a DynamicPolicy chooses each step's tree from the
heads' probabilities of a super-tree S's nodes, drafted from the step's context vector. The
smallest exact record of that is, per step index i, the [N-1] float32 probabilities of S's
non-root nodes as `DraftHeads.propose_scored` gives them for S itself (a Hydra node's probability
depends on the tokens of its path, and the heads' products round by their row count, so the
scores of a larger tree are not S's). `score_prompt` computes them from the context vectors a
decoder sees (`decode_contexts`: the prefill, then the continuation in one causal-masked forward,
which a row-invariant model computes as bit-identically as any decode forward). They are kept
beside the rollout in a versioned file (`save_scores` / `load_scores`, SCORES_FORMAT), one array
per candidate super-tree, checked against the rollout they belong to on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.rollout.record import ARRAYS, load_rollout, save_rollout


def merge_rollouts(shard_dirs: list[Path], order: list[str], out_dir: Path) -> dict[str, Any]:
    """Merge shard folders back into prompt order `order` (the ids of the unsharded split)."""
    by_id: dict[str, dict] = {}
    caps = set()
    for d in shard_dirs:
        for r in load_rollout(d):
            by_id[r["id"]] = r
            caps.add(r["rank_cap"])
    if len(caps) > 1:
        raise ValueError(f"cannot merge shards rolled out with different rank caps {sorted(caps)}; rerun them with one profile")
    missing = [i for i in order if i not in by_id]
    if missing:
        raise ValueError(f"cannot merge: {len(missing)} prompts have no shard output (first: {missing[0]}); rerun the missing shards")
    per_prompt = [{k: by_id[i][k] for k in ARRAYS} for i in order]
    save_rollout(out_dir, order, per_prompt, caps.pop() if caps else 0)
    return {"prompts": len(order), "shards": len(shard_dirs), "tokens": int(sum(len(r["tokens"]) for r in per_prompt))}

