"""The merge stage's library: rollout shards as one rollout in calibration order, equal to a
single-process rollout (shard k takes prompts k, k+n, k+2n, ...)."""

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

