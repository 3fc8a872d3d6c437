"""Timed decodes of candidate trees, pruning by modeled cost, the throughput hull.

The step cost the bank uses comes from `pipeline.timing.step_cost` (a model measured from many short
repeats); the timed decodes here (draft + verify + accept, warmed up, trees interleaved round by
round, and the rounds spread over the model's own probe rounds, so that drift of a shared machine
hits all alike) check it. End-to-end throughput per tree
combines a step cost with the tree's tokens per step on the whole calibration split (exact
replay) and the measured prefill time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from runtime.decoder import TreeDecoder, greedy_chain_top1
from runtime.device import clock
from runtime.ar import ar_generate
from runtime.sampling import Sampler


class TreeTimer:
    """Timed decodes of candidate trees, one round at a time, so that the rounds can be spread over
    the step-cost model's own measurement (the time stage runs one round between its probe rounds:
    a machine that drifts during the ~minute of measuring then moves the model and its check alike).

    Trees in `skip` (index -> why) are not decoded: they get a NaN latency and are listed in
    "pruned". Within a round the trees are interleaved prompt by prompt. `now` is the clock
    (default: wall clock after a device synchronisation); a step lasts from one emitted batch of
    tokens to the next, the prefill from the call to the first token.

    With `phase_context` set, a `pipeline.timing.step_cost.phase_probe` at that context follows every
    decode and AR run, and `result` also gives each figure as a ratio to it (what the step-cost
    model's check compares: the model's figures are the machine at its median probe)."""

    def __init__(self, decoder: TreeDecoder, rows: list[dict], new_tokens: int = 24, warmup_steps: int = 2,
                 skip: dict[int, str] | None = None, sampler: Sampler | None = None,
                 now: Callable[[], float] | None = None, phase_context: int | None = None) -> None:
        n = len(decoder.trees)
        self.pruned = dict(skip or {})
        if any(not 0 <= k < n for k in self.pruned):
            raise ValueError(f"skip lists tree indices outside [0, {n})")
        if len(self.pruned) == n:
            raise ValueError("every tree is skipped: nothing to time")
        self.decoder, self.rows, self.new_tokens, self.warmup_steps, self.sampler = \
            decoder, rows, new_tokens, warmup_steps, sampler
        self.now = now or (lambda: clock(decoder.model.device))
        self.phase_context = phase_context
        self._gen = torch.Generator().manual_seed(1)
        self.step_ratio: list[list[float]] = [[] for _ in range(n)]
        self.ar_ratio: list[float] = []
        self.timed = [k for k in range(n) if k not in self.pruned]
        self.step_s: list[list[float]] = [[] for _ in range(n)]
        self.ar_s: list[float] = []
        self.prefill_s: list[float] = []
        self.prompt_tokens: list[int] = []
        self.rounds = 0

    def _probe(self) -> float:
        """A phase probe at `phase_context` (the cache cut back or filled up to it)."""
        from pipeline.timing.step_cost import fill_cache, phase_probe

        assert self.phase_context is not None
        model = self.decoder.model
        fill_cache(model, self.phase_context, self._gen)
        return phase_probe(model, self.phase_context, self._gen, self.now)

    @property
    def runs_per_round(self) -> int:
        return len(self.rows) * (len(self.timed) + 1)

    def round(self, progress: Callable[[], None] | None = None) -> None:
        """One AR run and one decode per timed tree, for each prompt (`progress` after each run)."""
        dec, now, sampler = self.decoder, self.now, self.sampler
        if self.rounds == 0:  # warm-up: one short decode and one AR run (allocator, kernels, caches)
            dec.generate(self.rows[0]["input_ids"], 8, choose=self.timed[0], sampler=sampler)
            ar_generate(dec.model, self.rows[0]["input_ids"], 4, sampler=sampler)
        for row in self.rows:
            # AR per-token latency from its own stream: first token (the prefill's) to the last
            ar_marks: list[float] = []
            out = ar_generate(dec.model, row["input_ids"], self.new_tokens // 2, sampler=sampler,
                              stream=lambda _token: ar_marks.append(now()))
            ar_probe = self._probe() if self.phase_context is not None else None
            if progress:
                progress()
            for k in self.timed:
                marks = [now()]
                dec.generate(row["input_ids"], self.new_tokens, choose=k, sampler=sampler,
                             stream=lambda _tokens: marks.append(now()))
                steps = [b - a for a, b in zip(marks[1:], marks[2:])]
                kept = steps[self.warmup_steps:] or steps
                self.step_s[k].extend(kept)
                if self.phase_context is not None:
                    p = self._probe()
                    self.step_ratio[k].extend(x / p for x in kept)
                self.prefill_s.append(marks[1] - marks[0])
                self.prompt_tokens.append(len(row["input_ids"]))
                if progress:
                    progress()
            if len(out) > 1:
                self.ar_s.append(max(ar_marks[-1] - ar_marks[0], 1e-9) / (len(out) - 1))
                if ar_probe is not None:
                    self.ar_ratio.append(self.ar_s[-1] / ar_probe)
        self.rounds += 1

    def result(self) -> dict[str, Any]:
        """Median step latency (s) per tree, median AR per-token latency, prefill time, pruned trees,
        and (NaN without `phase_context`) the medians of steps and AR tokens over their phase probes."""
        if not self.rounds:
            raise RuntimeError("no timing round has run")
        return {
            "step_s": [statistics.median(s) if s else float("nan") for s in self.step_s],
            "ar_token_s": statistics.median(self.ar_s) if self.ar_s else float("nan"),
            "step_over_phase": [statistics.median(r) if r else float("nan") for r in self.step_ratio],
            "ar_token_over_phase": statistics.median(self.ar_ratio) if self.ar_ratio else float("nan"),
            "prefill_s": statistics.median(self.prefill_s),
            "prompt_tokens": statistics.median(self.prompt_tokens),
            "pruned": self.pruned,
            "rounds": self.rounds,
        }


def measure_and_check(
    decoder: TreeDecoder, rows: list[dict], trees: list, tokens_per_step: list[float], contexts: list[int],
    ref_context: int, *, repeats: int, rounds: int, fixed_tokens: int, new_tokens: int, prune_margin: float | None,
    sampler: Sampler | None, clock_kind: str, dtype: str, machine: dict[str, Any], bar: Any = None,
    max_depth: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The time stage's measurement: a `StepCostModel` over `repeats` probe rounds, with the
    `rounds` check rounds of a `TreeTimer` run between them, spread so that the mid-points of both
    coincide (machine drift then moves the model and its check alike). Trees are pruned
    (`prune_by_cost` with `early_margin(prune_margin)`, unless `prune_margin` is None) by the model
    of the probe rounds before the first check. Returns (model, the timer's result plus
    "after_probe_rounds": the probe rounds done before each check round, and
    "pruned_with_probe_rounds"). `bar`: a tqdm bar to advance; `max_depth`: the deepest tree the
    model prices (`measure_step_cost`)."""
    from pipeline.timing.step_cost import StepCostModel, measure_step_cost, step_clock

    # check round j after probe round index after[j]
    after = [min(repeats, max(1, math.floor((j + 0.5) * repeats / rounds + 0.5))) - 1 for j in range(rounds)]
    state: dict[str, Any] = {"timer": None, "pruned_with": 0, "probes": 0, "decodes": 0}

    def progress(done: int | None = None, total: int | None = None) -> None:
        if bar is None:
            return
        if total is not None:  # a probe round (from measure_step_cost), else one timed decode
            timer = state["timer"]
            per_round = timer.runs_per_round if timer else len(rows) * (len(trees) + 1)
            state["probes"], bar.total = done, total + rounds * per_round
        else:
            state["decodes"] += 1
        bar.n = state["probes"] + state["decodes"]
        bar.refresh()

    def check(i: int, so_far: StepCostModel) -> None:
        if i not in after:
            return
        if state["timer"] is None:
            costs = [so_far.predict(t, ref_context)["step_ms"] / 1000 for t in trees]
            skip = prune_by_cost(tokens_per_step, costs, early_margin(prune_margin)) if prune_margin is not None else {}
            state["timer"] = TreeTimer(decoder, rows, new_tokens=new_tokens, skip=skip, sampler=sampler,
                                       now=step_clock(clock_kind, decoder.model.device),
                                       phase_context=so_far.phase_context)
            state["pruned_with"] = i + 1
        for _ in range(after.count(i)):
            state["timer"].round(progress)

    model = measure_step_cost(decoder, rows[0]["input_ids"], [t.num_nodes for t in trees], contexts, repeats=repeats,
                              fixed_tokens=fixed_tokens, sampler=sampler, dtype=dtype, machine=machine,
                              progress=progress, clock_kind=clock_kind, between_rounds=check, max_depth=max_depth)
    result = state["timer"].result()
    result.update(after_probe_rounds=[k + 1 for k in after], pruned_with_probe_rounds=state["pruned_with"])
    return model, result


def prune_by_cost(tokens_per_step: list[float], step_s: list[float], margin: float = 0.15) -> dict[int, str]:
    """Trees (index -> why) that cannot pay for their modeled cost: even `margin` cheaper than
    modeled, their tokens per second stay below the best of the trees before them (trees come
    ordered by size). Only a tree faster than every smaller one can join the throughput hull;
    the margin leaves room for the model's error."""
    if len(tokens_per_step) != len(step_s):
        raise ValueError(f"{len(tokens_per_step)} tokens/step figures for {len(step_s)} step costs")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must lie in [0, 1), got {margin}")
    pruned: dict[int, str] = {}
    best = 0.0
    for k, (tps, s) in enumerate(zip(tokens_per_step, step_s)):
        rate = tps / s
        if tps / ((1 - margin) * s) < best:
            pruned[k] = (f"{tps:.3f} tokens/step at {1e3 * s:.1f} ms/step (modeled) cannot beat {best:.2f} tok/s "
                         f"even {100 * margin:.0f}% cheaper")
        best = max(best, rate)
    return pruned


def early_margin(margin: float) -> float:
    """The prune margin for the model of the first probe round, which decides which trees are never
    timed: that model is the noisiest one, and a tree it prunes cannot come back, so it gets the
    final margin twice over (0.15 -> 0.28). With the final margin alone, one EPYC run's first-round
    model put GSM8K's 9-node step at 54.8 ms against 49.0 ms after 12 rounds, pruned it untimed, and
    the bank lost a tree that the run before had kept; `prune_again` applies the final margin."""
    return 1 - (1 - margin) ** 2


def prune_again(entries: list[dict], margin: float) -> None:
    """`prune_by_cost` once more on timing entries' final modeled costs ("tokens_per_step",
    "step_ms"), marking the trees it prunes that the early model (the probe rounds before the
    first check decode) had kept: a tree at the rule's edge must not join the bank in one run and
    miss it in the next for what one or two probe rounds said. Their timed check stays recorded."""
    final = prune_by_cost([e["tokens_per_step"] for e in entries], [e["step_ms"] / 1000 for e in entries], margin)
    for k, why in final.items():
        entries[k].setdefault("pruned", f"{why} (final model; timed all the same)")


@torch.inference_mode()
def time_head_chain(decoder: TreeDecoder, row: dict, repeats: int = 10) -> float:
    """Median seconds of one `greedy_chain_top1` call (the per-step extra of the signals that read
    the heads, `runtime.decoder.HEAD_SIGNALS`), from the context vector after the prompt of `row`."""
    from pipeline.timing.step_cost import prompt_context

    model, heads = decoder.model, decoder.heads
    h, root = prompt_context(model, heads, row["input_ids"])
    greedy_chain_top1(heads, h, root)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock(model.device)
        greedy_chain_top1(heads, h, root)
        times.append(clock(model.device) - t0)
    model.reset_cache()
    heads.reset()
    return statistics.median(times)


def e2e_tokens_per_second(tokens_per_step: float, step_s: float, prefill_s: float, new_tokens: int) -> float:
    """Output tok/s of a `new_tokens` generation: the prefill yields the first token, then steps."""
    return new_tokens / (prefill_s + (new_tokens - 1) / tokens_per_step * step_s)
