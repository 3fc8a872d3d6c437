"""Which timed trees a bank keeps and which one it serves statically: the throughput hull, the
trees the per-step oracle uses, and the tie rule for the best static tree."""

from __future__ import annotations

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
