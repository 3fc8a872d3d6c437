"""Which timed trees a bank keeps and which one it serves statically: the throughput hull, the
trees the per-step oracle uses, and the tie rule for the best static tree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.timing.paired import Cell, PairedSettings, candidates_at, cell_record, monotone_choices
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
    from pipeline.replay.oracle import oracle_replay

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
    """The bank's "batch_sizes" record (the contract in `runtime.export.schedule`) from the time stage's
    batch axis: at each batch size, every bank tree's modeled batched step and batch tok/s
    (`members`: the bank trees' indices among the timed candidates; `nodes`: their sizes), the
    best tree (the smallest within `tolerance` of the fastest; none where that is the root alone
    or not faster than AR by more than the model's error allows at that batch size: no speculation
    there; batch 1 keeps the bank's `best_static`), the best chain likewise, and AR's step.

    The model's error at a batch size, e, is the largest |model - timed| of its checked trees
    (`model_error_pct`, AR's included). A tree speculates there only if it still beats AR with its
    own step e slower and AR's e faster than modeled, a gain of more than (1 + e)^2 - 1: both sides
    of the ratio carry the model's error, and AR is never slower than AR."""
    out: dict[str, dict[str, Any]] = {}
    for b, entry in sorted(batch["per_batch"].items(), key=lambda kv: int(kv[0])):
        rows = [entry["trees"][i] for i in members]
        tok = [r["tok_per_s"] for r in rows]
        errors = [abs(r["model_error_pct"]) for r in entry["trees"] if "model_error_pct" in r]
        floor = entry["ar_tok_per_s"] * (1 + (max(errors) / 100 if errors and int(b) > 1 else 0.0)) ** 2
        k = best_static if int(b) == 1 else smallest_near_best(tok, tolerance)
        if nodes[k] == 1 or tok[k] <= floor:
            k = None
        chains = [c for c in entry.get("chains", []) if c["tok_per_s"] > floor]
        chain = max(chains, key=lambda c: c["tok_per_s"]) if chains else None
        out[b] = {"best_static": k, "best_chain": chain and {key: chain[key] for key in
                                                             ("depth", "tokens_per_step", "step_ms", "tok_per_s")},
                  "ar_step_ms": entry["ar_step_ms"], "ar_tok_per_s": entry["ar_tok_per_s"],
                  "step_ms": [r["step_ms"] for r in rows], "tok_per_s": tok}
    return out


def model_ratios(entry: dict[str, Any], tokens_per_step: Sequence[float]) -> list[float | None]:
    """Per bank tree, the step-cost model's ratio of its decode rate to AR's at one batch size
    (`batch_choices`' entry): tokens/step x modeled AR step / modeled tree step; the quantity the
    paired measurement times (`pipeline.timing.paired.RATIO`)."""
    return [tps * entry["ar_step_ms"] / ms if ms else None for tps, ms in zip(tokens_per_step, entry["step_ms"])]


def paired_candidates(batch: dict[str, dict[str, Any]], nodes: Sequence[int], tokens_per_step: Sequence[float],
                      settings: PairedSettings) -> dict[int, list[int]]:
    """{B: the bank trees to time against AR at B}: the `settings.candidates` of highest modeled
    batch tok/s there (`batch_choices`' rows; the root-only tree is AR and is not a candidate), less
    those the model prices below `settings.model_floor` times AR (the fastest is always timed)."""
    return {int(b): candidates_at(entry["tok_per_s"], nodes, settings.candidates, model_ratios(entry, tokens_per_step),
                                  settings.model_floor) for b, entry in batch.items()}


def apply_paired(batch: dict[str, dict[str, Any]], cells: dict[int, Cell], nodes: Sequence[int],
                 tokens_per_step: Sequence[float], settings: PairedSettings) -> None:
    """Set each measured batch size's choice in `batch` (`batch_choices`' record, changed in place)
    from its paired measurement (`pipeline.timing.paired`: the interval above 1, monotone in B), and
    record the measurement under "paired" with the step-cost model's predicted ratio of each
    candidate (tokens/step x modeled AR step / modeled tree step). Where AR is chosen, no chain is
    either: nothing measured there beats AR."""
    choices = monotone_choices(cells, nodes)
    for b, entry in batch.items():
        cell = cells.get(int(b))
        if cell is None or not cell.trees:  # no tree to time there (a bank of the root alone): AR
            entry["best_static"], entry["best_chain"] = None, None
            continue
        choice, free = choices[int(b)]
        modeled = model_ratios(entry, tokens_per_step)
        model = {k: modeled[k] for k in cell.trees if modeled[k] is not None}
        entry["best_static"] = choice
        entry["paired"] = cell_record(cell, choice, free, model, settings)
        if choice is None:
            entry["best_chain"] = None


def batch_replays(rollouts: list[dict], trees: list[Tree], policies: dict[str, dict], best_static: int,
                  batch: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Replayed batch tokens/s at each batch size (continuous batching over the calibration
    rollouts, step costs from the bank's batch record) for: one tree for all (EntMTP* of batch 1),
    the bank's tree for that batch size, the batch scheduler (`runtime.policy.BatchScheduler` over
    the expected-throughput policy's table) and the batch oracle (the same allocation knowing every
    sequence's accepted length), with each one's share of the oracle."""
    from pipeline.replay.policy import BankReplay, replay_batch
    from runtime.policy import BatchScheduler, ExpectedThroughputPolicy, make_signal, policy_from_dict

    data = BankReplay.build(rollouts, [t.paths for t in trees])
    expected = policies.get("expected_throughput")
    out: dict[str, dict[str, float]] = {}
    for b, entry in sorted(batch.items(), key=lambda kv: int(kv[0])):
        size, ms = int(b), entry["step_ms"]

        def cost(picks: list[int]) -> float:
            return sum(ms[k] for k in picks) / len(picks)

        def fixed(k: int):  # noqa: ANN202 - a choose function
            return lambda lanes, _states: [k] * len(lanes)

        static_b = entry["best_static"] if entry["best_static"] is not None else 0
        rates = {"one tree for all": replay_batch(data, size, fixed(best_static), cost)["tokens_per_second"],
                 "static per batch size": replay_batch(data, size, fixed(static_b), cost)["tokens_per_second"]}
        scheduler = BatchScheduler(policy_from_dict(expected) if expected else ExpectedThroughputPolicy(
            [], [[1.0] * len(trees)], [1.0] * len(trees)), {size: ms})

        def oracle(lanes: list[tuple[int, int]], _states: list) -> list[int]:
            gains = [[data.accept_rows[n][k][i] + 1 for k in range(len(trees))] for n, i in lanes]
            return scheduler.choose([], gains=gains)

        rates["batch oracle"] = replay_batch(data, size, oracle, cost)["tokens_per_second"]
        if expected:
            pol = scheduler.policy

            def by_signal(lanes: list[tuple[int, int]], states: list) -> list[int]:
                signals = []
                for (n, i), sig in zip(lanes, states):
                    p0 = data.p0[n][i] if data.p0[n] else 0.0
                    heads = data.head_top1[n][i] if data.head_top1[n] else ()
                    ent = data.entropy[n][i] if data.entropy[n] else 0.0
                    signals.append(sig.observe(p0, heads, ent))
                return scheduler.choose(signals)

            rates["batch scheduler"] = replay_batch(data, size, by_signal, cost,
                                                    lane_state=lambda: make_signal(pol.signal, pol.signal_params),
                                                    update=lambda sig, a: sig.update(a))["tokens_per_second"]
        best = rates["batch oracle"]
        out[b] = {**{k: round(v, 3) for k, v in rates.items()},
                  **{f"{k} share of oracle": round(v / best, 4) for k, v in rates.items() if k != "batch oracle"}}
    return out
