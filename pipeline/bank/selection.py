"""Which timed trees a bank keeps and which one it serves statically: the throughput hull, the
trees the per-step oracle uses, and the tie rule for the best static tree."""

from __future__ import annotations

from typing import Any

from runtime.tree import Tree

MEMBERS = ("hull", "oracle")


def bank_members(cands: list[dict], rollouts: list[dict], members: str = "oracle",
                 min_oracle_share: float = 0.02) -> list[int]:
    """Indices (ordered by size) of the timed candidate trees that go into the bank.

    "hull" is the paper's rule: a tree stays only if it is faster end to end than every smaller
    tree. "oracle" adds every tree that the per-step oracle (best tree in hindsight, replayed with
    the measured step costs) picks on at least `min_oracle_share` of the calibration steps: a tree
    that loses on average can still win on the confident steps, and only a tree in the bank can
    be switched to. Where the hull already holds those trees, both rules give the same bank."""
    from pipeline.replay import oracle_replay

    if members not in MEMBERS:
        raise ValueError(f"bank members {members!r}: choose one of {MEMBERS}")
    hull = throughput_hull([c["nodes"] for c in cands], [c["tok_per_s"] for c in cands])
    if members == "hull":
        return hull
    share = oracle_replay(rollouts, [Tree(c["paths"]).paths for c in cands],
                          [c["step_ms"] / 1000 for c in cands]).summary()["tree_share"]
    keep = set(hull) | {k for k, s in enumerate(share) if s >= min_oracle_share}
    return sorted(keep, key=lambda k: (cands[k]["nodes"], cands[k]["depth"]))



def smallest_near_best(tok_per_s: list[float], tolerance: float) -> int:
    """Index of the first (smallest, when ordered by size) entry within `tolerance` (a share) of
    the highest: how the bank breaks near-ties (`bank.tie_tolerance`), so that two timings of
    one machine, a few percent apart, pick the same tree."""
    if not tok_per_s:
        raise ValueError("no trees to choose from")
    top = max(tok_per_s)
    return next(k for k, v in enumerate(tok_per_s) if v >= (1 - tolerance) * top)


def throughput_hull(nodes: list[int], tok_per_s: list[float]) -> list[int]:
    """Indices kept by the paper's rule: a tree stays only if faster than every smaller tree."""
    order = sorted(range(len(nodes)), key=lambda k: (nodes[k], -tok_per_s[k]))
    keep, best = [], float("-inf")
    for k in order:
        if tok_per_s[k] > best:
            keep.append(k)
            best = tok_per_s[k]
    return keep


def batch_choices(batch: dict[str, Any], members: list[int], nodes: list[int], best_static: int,
                  tolerance: float) -> dict[str, dict[str, Any]]:
    """The bank's "batch_sizes" record (the contract in `runtime.schedule`) from the time stage's
    batch axis: at each batch size, every bank tree's modeled batched step and batch tok/s
    (`members`: the bank trees' indices among the timed candidates; `nodes`: their sizes), the
    best tree (the smallest within `tolerance` of the fastest; none where that is the root alone
    or no faster than AR: no speculation at that batch size; batch 1 keeps the bank's
    `best_static`), the best chain likewise, and AR's step."""
    out: dict[str, dict[str, Any]] = {}
    for b, entry in sorted(batch["per_batch"].items(), key=lambda kv: int(kv[0])):
        rows = [entry["trees"][i] for i in members]
        tok = [r["tok_per_s"] for r in rows]
        k = best_static if int(b) == 1 else smallest_near_best(tok, tolerance)
        if nodes[k] == 1 or tok[k] <= entry["ar_tok_per_s"]:
            k = None
        chains = [c for c in entry.get("chains", []) if c["tok_per_s"] > entry["ar_tok_per_s"]]
        chain = max(chains, key=lambda c: c["tok_per_s"]) if chains else None
        out[b] = {"best_static": k, "best_chain": chain and {key: chain[key] for key in
                                                             ("depth", "tokens_per_step", "step_ms", "tok_per_s")},
                  "ar_step_ms": entry["ar_step_ms"], "ar_tok_per_s": entry["ar_tok_per_s"],
                  "step_ms": [r["step_ms"] for r in rows], "tok_per_s": tok}
    return out
