"""The batch-size axis of the step-cost model: what a step costs when B sequences decode together.

In a batched step (`runtime.decoder.TreeDecoder.generate_batch`) the heads draft the sequences
that chose the same tree together (`DraftHeads.propose_batch`: each level one product over all
their rows), one forward verifies the rows of all B sequences (`Transformer.forward_batch`: the
matrix products once over B x N rows, attention per sequence over its own cache), and each
sequence then accepts, compacts its cache and feeds its heads in turn. So

    step_B(tree) = draft_B(tree) + B * fixed + verify_B(N rows per sequence, context)

with draft_B from the single-sequence draft table at B times each level's rows
(`StepCostModel.draft(tree, batch)`), fixed from the single-sequence model and verify_B measured: forwards of B
sequences x N rows at the reference context, each a ratio to the one-sequence forward of the
same N timed in the same pass (a shared machine's speed phases cancel), times the model's own
verify(N). A tree that pays for one sequence stops paying once B x N rows leave the
memory-bound regime: the ratio grows with B faster for big N than for small.

Inside real batched decodes a step runs at its own speed (its forward is partly compute-bound, and
a shared machine's slow phases slow that less than a one-row forward), so calibration passes of timed
batched decodes of every timed tree set in-situ factors per batch size and tree size
(`batch_in_situ`: timed over modeled step, by node count, `in_situ_row`) and check passes, alternating
with them, check the calibrated model per tree and batch size (`check_batch_steps`; timing.json "batch").
A (tree, batch size) whose two kinds disagree by more than BATCH_RETIME_ABOVE is timed again with
more passes of both kinds (`pass_spread`; timing.json records each cell's pass count).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeline.timing.step_cost import (StepCostModel, _interp, error_pct, fill_cache, nondecreasing,
                                       timing_tree_ancestors)
from runtime.decoder import TreeDecoder
from runtime.model.batch import BatchItem
from runtime.model.cache import KVCache
from runtime.model.llama import Transformer
from runtime.sampling import Sampler
from runtime.tree import Tree

WARMUP = 1
# calibration passes, and as many check passes, per (tree, batch size). Two, not more: at B > 1 the
# model only ranks the trees the bank stage then times against batched AR (`pipeline.timing.paired`),
# and cells whose passes disagree are timed again (below)
BATCH_CHECK_PASSES = 2
# a (tree, batch size) whose fastest calibration and check passes differ by more than this is timed
# again (BATCH_CHECK_PASSES more of each kind, the order continued), at most BATCH_RETIME_ROUNDS times
BATCH_RETIME_ABOVE = 0.05
BATCH_RETIME_ROUNDS = 2


def calibration_pass(index: int) -> bool:
    """Whether back-to-back pass `index` of a (tree, batch size) calibrates (else it checks): in the
    order C K K C C K K C ..., so that a drift along the passes (a machine warming up or slowing
    down) falls on both kinds alike instead of favouring the kind that always runs first."""
    return index % 4 in (0, 3)


@torch.inference_mode()
def measure_batch_verify(model: Transformer, batch_sizes: Sequence[int], rows: Sequence[int], context: int,
                         repeats: int, now: Callable[[], float]) -> dict[tuple[int, int], float]:
    """Median over `repeats` passes of verify_B(N) / verify_1(N) for every B in `batch_sizes` and N
    in `rows`: one `forward_batch` of B sequences x N new rows (each `timing_tree_ancestors`) after `context`
    committed positions per sequence, over the one-sequence forward of N rows in the same pass.
    The model's own cache is left as it was."""
    if not batch_sizes or min(batch_sizes) < 1 or not rows or min(rows) < 1:
        raise ValueError(f"batch sizes and row counts must be positive, got {list(batch_sizes)} and {list(rows)}")
    own = model.cache
    gen = torch.Generator().manual_seed(2)
    caches: list[KVCache] = []
    try:
        for _ in range(max(batch_sizes)):
            cache = model.new_cache()
            model.use_cache(cache)
            fill_cache(model, context, gen)
            caches.append(cache)
        dev = model.device
        samples: dict[tuple[int, int], list[float]] = {}
        for rep in range(WARMUP + repeats):
            for n in rows:
                anc = timing_tree_ancestors(n)
                pos = torch.tensor([context + len(a) - 1 for a in anc], device=dev)
                for b in sorted(set(batch_sizes) | {1}):
                    items = [BatchItem(c, torch.randint(0, model.args.vocab_size, (n,), generator=gen).to(dev), pos, anc)
                             for c in caches[:b]]
                    t0 = now()
                    model.forward_batch(items)
                    dt = now() - t0
                    for c in caches[:b]:
                        c.length = context
                    if rep >= WARMUP:
                        samples.setdefault((b, n), []).append(dt)
    finally:
        if own is not None:
            model.use_cache(own)
    return {(b, n): statistics.median(x / ref for x, ref in zip(samples[(b, n)], samples[(1, n)]))
            for b in batch_sizes for n in rows}


def in_situ_row(rows: Sequence[int], factors: dict[int, float], nodes: Sequence[int]) -> list[float]:
    """One batch size's in-situ factors on the `rows` grid: `factors` (tree index -> timed over
    modeled step) averaged per node count (`nodes[k]`: tree k's), interpolated between the timed
    node counts and held constant past them (a factor is a correction, not a trend to extend)."""
    by_n: dict[int, list[float]] = {}
    for k, f in factors.items():
        by_n.setdefault(nodes[k], []).append(f)
    xs = sorted(by_n)
    ys = [statistics.fmean(by_n[n]) for n in xs]
    return [ys[0] if n <= xs[0] else ys[-1] if n >= xs[-1] else _interp(xs, ys, n) for n in rows]


def batch_table(ratios: dict[tuple[int, int], float], batch_sizes: Sequence[int], rows: Sequence[int]) -> list[list[float]]:
    """[B index][N index] ratios, made non-decreasing in N and in B (more rows never cost less)."""
    table = [[ratios[(b, n)] for n in rows] for b in batch_sizes]
    table = [nondecreasing(r) for r in table]
    cols = [nondecreasing(c) for c in zip(*table)]
    return [list(r) for r in zip(*cols)]


def predict_batch(model: StepCostModel, tree: Tree, context: float, batch: int) -> dict[str, float]:
    """{draft_ms, verify_ms, fixed_ms, step_ms} of one batched step of `batch` sequences, each with
    `tree` at context length `context` (see the module docstring)."""
    single = model.predict(tree, context)
    if batch == 1:
        return single
    if batch not in model.batch_sizes:
        raise ValueError(f"batch size {batch} was not measured; the step-cost model has {model.batch_sizes}")
    at = model.batch_sizes.index(batch)
    ratio = _interp(model.verify_rows, model.batch_verify_ratio[at], tree.num_nodes)
    scale = _interp(model.verify_rows, model.batch_in_situ[at], tree.num_nodes) if model.batch_in_situ else 1.0
    parts = {"draft_ms": scale * model.in_situ * model.draft(tree, batch), "verify_ms": scale * ratio * single["verify_ms"],
             "fixed_ms": scale * batch * single["fixed_ms"]}
    return {**parts, "step_ms": sum(parts.values())}


def batch_tokens_per_second(batch: int, tokens_per_step: float, step_s: float, prefill_s: float, new_tokens: int) -> float:
    """Output tok/s summed over a batch of `batch` sequences of `new_tokens` each: their prefills run
    one after the other, then steps of the whole batch (`pipeline.timing.checks.e2e_tokens_per_second`
    at batch 1)."""
    return batch * new_tokens / (batch * prefill_s + (new_tokens - 1) / tokens_per_step * step_s)


def pass_spread(times: Sequence[float]) -> float:
    """How far the fastest calibration pass and the fastest check pass of one (tree, batch size)
    lie apart, |calibration / check - 1|, over its passes in order (`calibration_pass`)."""
    calib = min(t for i, t in enumerate(times) if calibration_pass(i))
    check = min(t for i, t in enumerate(times) if not calibration_pass(i))
    return abs(calib / check - 1.0)


@torch.inference_mode()
def check_batch_steps(decoder: TreeDecoder, prompt: list[int], trees: Sequence[int], batch_sizes: Sequence[int],
                      new_tokens: int, sampler: Sampler | None, now: Callable[[], float],
                      progress: Callable[[], None] | None = None, warmup_steps: int = 2,
                      passes: int = 1) -> list[dict[tuple[int, int], float]]:
    """Median seconds of a batched step, per (tree index, batch size), once per pass:
    `generate_batch` of B copies of `prompt` (identical sequences accept alike, so the batch stays
    whole to the end), its first `warmup_steps` steps dropped. A median, so that one stall of a
    shared machine does not count. The passes' decodes of one (tree, batch size) run back to back,
    so that a slow phase of the machine falls on all of them rather than on one pass.
    Raw wall time: a batched step is partly compute-bound, and a shared machine's slow phases (memory
    bandwidth taken by its neighbours) slow it less than the one-row forward of a phase probe, so
    scaling it by one would over-correct."""
    out: list[dict[tuple[int, int], float]] = [{} for _ in range(passes)]
    decoder.generate_batch([prompt], 4, choose=trees[0], sampler=sampler)  # warm-up
    for b in batch_sizes:
        for k in trees:
            for timed in out:
                marks = [now()]
                decoder.generate_batch([prompt] * b, new_tokens, choose=k, sampler=sampler,
                                       on_step=lambda: marks.append(now()))
                steps = [y - x for x, y in zip(marks[1:], marks[2:])]
                timed[(k, b)] = statistics.median(steps[warmup_steps:] or steps or [marks[-1] - marks[0]])
                if progress:
                    progress()
    return out


def batch_entries(model: StepCostModel, trees: Sequence[Tree], tokens_per_step: Sequence[float],
                  measured: dict[tuple[int, int], float], context: float, prefill_s: float,
                  new_tokens: int) -> dict[str, Any]:
    """What timing.json records of the batch axis: per batch size, every tree's modeled step and batch
    tok/s (and, where timed, the measured step and the model's error), and AR's."""
    out: dict[str, Any] = {"sizes": list(model.batch_sizes), "context": context, "per_batch": {}}
    ar = Tree([])
    for b in model.batch_sizes:
        ar_ms = predict_batch(model, ar, context, b)["step_ms"]
        entry: dict[str, Any] = {"ar_step_ms": ar_ms,
                                 "ar_tok_per_s": batch_tokens_per_second(b, 1.0, ar_ms / 1000, prefill_s, new_tokens),
                                 "trees": []}
        for k, (t, tps) in enumerate(zip(trees, tokens_per_step)):
            ms = predict_batch(model, t, context, b)["step_ms"]
            row: dict[str, Any] = {"step_ms": ms, "tok_per_s": batch_tokens_per_second(b, tps, ms / 1000, prefill_s,
                                                                                        new_tokens)}
            if (k, b) in measured:
                row["measured_step_ms"] = 1000 * measured[(k, b)]
                row["model_error_pct"] = error_pct(ms, row["measured_step_ms"])
            entry["trees"].append(row)
        out["per_batch"][str(b)] = entry
    return out


def measure_batch_axis(decoder: TreeDecoder, model: StepCostModel, trees: Sequence[Tree], tokens_per_step: Sequence[float],
                       timed: Sequence[int], batch_sizes: Sequence[int], context: int, prompt: list[int], *,
                       repeats: int, new_tokens: int, check_tokens: int, prefill_s: float, sampler: Sampler | None,
                       now: Callable[[], float], chains: Sequence[tuple[Tree, float]] = (),
                       progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """The batch axis of `model` (set in place: `batch_sizes`, `batch_verify_ratio`), then every
    tree's (and chain's) modeled batched step and batch tok/s, checked against timed batched
    decodes of the trees in `timed` at every batch size > 1."""
    sizes = sorted({int(b) for b in batch_sizes} | {1})
    ratios = measure_batch_verify(decoder.model, sizes, model.verify_rows, context, repeats, now)
    model.batch_sizes = sizes
    model.batch_verify_ratio = batch_table(ratios, sizes, model.verify_rows)
    model.batch_in_situ = []
    larger = [b for b in sizes if b > 1]
    check_ctx = len(prompt) + check_tokens / 2  # the context of a batched decode of `prompt`: compare there
    # calibration and check passes alternate (`calibration_pass`), back to back per (tree, batch
    # size): the fastest calibration pass sets the in-situ factors (timed over modeled step, by batch
    # size and tree size), the fastest check pass checks the calibrated model. The fastest, not the
    # median: a shared machine only ever slows a pass, and its slow phases last seconds, so two
    # adjacent passes of one kind (C C in the order) can both be slow, which moves a median of four.
    # Both kinds time the same decodes, so where their fastest passes disagree, a slow phase of the
    # machine outlasted every pass of one kind: such a cell gets more passes of both kinds (nothing
    # is dropped, so the fastest of each can only come closer to the machine's own speed).
    passes = check_batch_steps(decoder, prompt, list(timed), larger, check_tokens, sampler, now, progress,
                               passes=2 * BATCH_CHECK_PASSES)
    runs = {key: [p[key] for p in passes] for key in passes[0]}
    for _ in range(BATCH_RETIME_ROUNDS):
        for k, b in [key for key, times in runs.items() if pass_spread(times) > BATCH_RETIME_ABOVE]:
            more = check_batch_steps(decoder, prompt, [k], [b], check_tokens, sampler, now, progress,
                                     passes=2 * BATCH_CHECK_PASSES)
            runs[(k, b)] += [p[(k, b)] for p in more]
    calib, measured = ({key: min(t for i, t in enumerate(times) if calibration_pass(i) == kind)
                        for key, times in runs.items()} for kind in (True, False))
    model.batch_in_situ = [[1.0] * len(model.verify_rows)] + [
        in_situ_row(model.verify_rows, {k: 1000 * calib[(k, b)] / predict_batch(model, trees[k], check_ctx, b)["step_ms"]
                                        for k in timed}, [trees[k].num_nodes for k in range(len(trees))])
        for b in larger]
    out = batch_entries(model, trees, tokens_per_step, {}, context, prefill_s, new_tokens)
    checked = batch_entries(model, trees, tokens_per_step, measured, check_ctx, prefill_s, new_tokens)
    for b, entry in out["per_batch"].items():
        for row_k, (row, chk) in enumerate(zip(entry["trees"], checked["per_batch"][b]["trees"])):
            if "measured_step_ms" in chk:
                row.update(measured_step_ms=chk["measured_step_ms"], model_error_pct=chk["model_error_pct"],
                           check_context=check_ctx, passes=len(runs[(row_k, int(b))]))
        entry["chains"] = [{"depth": t.depth, "tokens_per_step": tps,
                            "step_ms": predict_batch(model, t, context, int(b))["step_ms"]} for t, tps in chains]
        for c in entry["chains"]:
            c["tok_per_s"] = batch_tokens_per_second(int(b), c["tokens_per_step"], c["step_ms"] / 1000, prefill_s,
                                                     new_tokens)
    errors = [abs(r["model_error_pct"]) for e in out["per_batch"].values() for r in e["trees"] if "model_error_pct" in r]
    out["max_abs_error_pct"] = max(errors) if errors else None
    out["in_situ"] = {str(b): dict(zip(model.verify_rows, f)) for b, f in zip(sizes, model.batch_in_situ)}
    return out
