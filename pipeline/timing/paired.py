"""The bank's choice at each batch size, measured as a paired ratio (DESIGN section 10).

A choice ("tree k beats AR at batch size B") is a ratio, so it is timed as one: the few candidate
trees and the runtime's real batched AR (`runtime.ar.ar_generate_batch`, what `EntMTP.generate_batch`
decodes with where the bank says AR) decode the same batch of prompts in one round of short blocks
AR, T1, .., Tn, Tn, .., T1, AR. Every tree's two blocks sit symmetrically around the round's
centre, as do AR's, so a drift of a shared machine that is linear over the round cancels in each
tree's ratio to AR (and in any two trees' ratio to each other); with one tree the round is AR, T,
T, AR.

The ratio of a round (`round_ratios`) is the tree's decode rate over AR's at the tree's bank
tokens/step (replayed over the whole calibration split):

    ratio_k = tokens_per_step_k * (AR seconds per batch step) / (tree k's seconds per batch step)

where a block's seconds per step are its wall time less its prefills over its batch steps. Why
this and not the blocks' own tokens/s: the blocks decode a few prompts for a few tokens, and their
own acceptance is a sample of a handful of positions, whereas the replayed tokens/step averages
the whole calibration split; the timed part is then exactly what varies with the machine (the
step's cost relative to AR's), and the ratio is the one the step-cost model predicts from the same
figures (`model_ratio`), so their distance is the model's error and nothing else. The prefill,
the same for both sides, is left out: it only dilutes every ratio towards 1 and never changes
which side is faster. Every batch size, B = 1 included, is timed the same way. A batch holds B
copies of one prompt, so that it stays whole to the end on both sides (copies accept alike); the
prompt rotates over the rounds.

Each tree's per-round ratios give a median and a seeded bootstrap interval of it (`runtime.check.
median_interval`, the statistic `entmtp inspect --check` reports); rounds continue, with AR and only
the trees that can still change the decision, while an interval straddles it (`undecided`),
up to a cap. The interval (`joint_interval`) also resamples the calibration prompts behind the
tokens/step (`acceptance_draws`): the replayed tokens/step is a mean over a few prompts whose
acceptance spreads by 3-15% a prompt, so a tree that times 5% faster than AR can lose to it on
other prompts of the same task. More rounds cannot narrow that part (more calibration prompts
can); it is the same in every rebuild, so a close call timed to the cap is left to it. The choice
(`choose`): of the trees whose interval lies above 1 + `min_gain` (the lower bound beats AR by
that much), the best median; otherwise AR. The margin keeps out a tree whose
interval only grazes 1 (1.01x [1.00, 1.03]): a gain that small is within what the eval's own
prompts move by, and the runtime's batched AR is the safe side of such a call. Across batch sizes
the choices are kept monotone (`monotone_choices`): a larger B drafts no bigger tree than a smaller B chose,
unless the per-round ratio of the bigger tree to the alternative says it is faster with confidence.

EntMTP-dyn (`measure_dynamic`) is timed the same way against EntMTP* at batch size 1 (blocks S, D,
D, S): what its steps cost beyond what the step-cost model prices them at, relative to EntMTP*'s
steps, is its scheduling and scored drafting (`dynamic_round`); `pipeline.bank.dynamic` adds it
to dyn's step costs and fits again.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.check import LEVEL, median_interval

RESAMPLES = 2000  # bootstrap draws of every interval here (as `runtime.check.median_interval`)

# what a record's ratio is (bank.json "batch_sizes"[B]["paired"]["ratio"]); the evaluate stage's
# `decode_vs_batched_ar` is the same ratio measured on the eval split (its own acceptance)
RATIO = "decode rate of the tree over batched AR's, at the tree's replayed tokens/step"


@dataclass(frozen=True)
class Block:
    """One timed decode of a batch: its wall time less its prefills, and its batch steps."""

    seconds: float
    steps: int


@dataclass(frozen=True)
class PairedSettings:
    """The `bank.paired_*` settings (pipeline/config/schema.py `BankConfig` says what each does)."""

    candidates: int = 3
    model_floor: float = 0.8
    min_rounds: int = 4
    max_rounds: int = 12
    new_tokens: int = 32
    prompts: int = 4
    level: float = LEVEL
    min_gain: float = 0.02

    def __post_init__(self) -> None:
        if self.candidates < 1 or self.min_rounds < 2 or self.max_rounds < self.min_rounds:
            raise ValueError(f"paired settings need candidates >= 1 and 2 <= min_rounds <= max_rounds, got "
                             f"{self.candidates}, {self.min_rounds}, {self.max_rounds}")
        if self.new_tokens < 2 or self.prompts < 1 or not 0.5 <= self.level < 1.0 or not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"paired settings need new_tokens >= 2 (one batch step at least), prompts >= 1, a "
                             f"level in [0.5, 1) and a min_gain in [0, 1), got {self.new_tokens}, {self.prompts}, "
                             f"{self.level}, {self.min_gain}")

    @classmethod
    def from_bank_config(cls, bank: Mapping[str, Any]) -> PairedSettings:
        """From the plain `bank` config group (its `paired_*` keys)."""
        kinds = {"candidates": int, "model_floor": float, "min_rounds": int, "max_rounds": int, "new_tokens": int,
                 "prompts": int, "level": float, "min_gain": float}
        return cls(**{f: kind(bank[f"paired_{f}"]) for f, kind in kinds.items() if f"paired_{f}" in bank})


def acceptance_draws(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]], resamples: int = RESAMPLES,
                     seed: int = 0) -> np.ndarray:
    """[resamples, arms]: per bootstrap draw of the prompts (one draw shared by every arm, so two
    arms stay paired), each arm's pooled ratio sum(num) / sum(den) over the drawn prompts divided
    by its value over all of them. `num[a][p]`, `den[a][p]`: arm a's figures on prompt p (tokens
    and steps of a tree's replay: its tokens/step; EntMTP*'s and dyn's replayed seconds: dyn's
    speed-up). Seeded: the same figures always give the same draws."""
    n = np.asarray(num, dtype=np.float64)
    d = np.asarray(den, dtype=np.float64)
    if n.ndim != 2 or n.shape != d.shape or n.shape[1] < 1:
        raise ValueError(f"acceptance draws need [arms, prompts] figures of one shape, got {n.shape} and {d.shape}")
    if not (d.sum(axis=1) > 0).all():
        raise ValueError("every arm needs a positive denominator over the prompts")
    pick = np.random.default_rng(seed).integers(0, n.shape[1], size=(resamples, n.shape[1]))
    drawn = n[:, pick].sum(axis=2) / np.maximum(d[:, pick].sum(axis=2), 1e-300)   # [arms, resamples]
    return (drawn / (n.sum(axis=1) / d.sum(axis=1))[:, None]).T


def joint_interval(ratios: Sequence[float], factors: np.ndarray | None = None, level: float = LEVEL,
                   seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high) of the rounds' ratios, the interval resampling the rounds and, with
    `factors` (one column of `acceptance_draws`), the prompts behind the tokens/step at the same
    time: draw i is the median of resampled rounds times factors[i]. Without factors it is
    `runtime.check.median_interval`."""
    if factors is None:
        return median_interval(ratios, level)
    if not len(ratios):
        raise ValueError("no ratios: time at least one round")
    r = np.asarray(ratios, dtype=np.float64)
    f = np.asarray(factors, dtype=np.float64)
    pick = np.random.default_rng(seed).integers(0, len(r), size=(len(f), len(r)))
    meds = np.sort(np.median(r[pick], axis=1) * f)
    tail = int((1 - level) / 2 * len(f))
    med = float(np.median(r))
    return med, min(float(meds[tail]), med), max(float(meds[len(f) - 1 - tail]), med)


def round_order(trees: Sequence[int]) -> list[int | None]:
    """The blocks of one round: AR (None), the trees, the trees backwards, AR."""
    return [None, *trees, *reversed(trees), None]


def round_ratios(blocks: Sequence[tuple[int | None, Block]], tokens_per_step: Mapping[int, float]) -> dict[int, float]:
    """Each tree's ratio to AR in one round (the module docstring): every side's blocks pooled,
    seconds over steps."""
    seconds: dict[int | None, float] = {}
    steps: dict[int | None, int] = {}
    for arm, b in blocks:
        if b.steps < 1 or not b.seconds > 0:
            raise ValueError(f"a timed block needs >= 1 step and a positive time, got {b} for "
                             f"{'AR' if arm is None else f'tree {arm}'}")
        seconds[arm] = seconds.get(arm, 0.0) + b.seconds
        steps[arm] = steps.get(arm, 0) + b.steps
    if None not in seconds:
        raise ValueError("a round without an AR block has no ratio")
    ar = seconds[None] / steps[None]
    return {k: tokens_per_step[k] * ar / (seconds[k] / steps[k]) for k in seconds if k is not None}


@dataclass
class Cell:
    """The paired measurement at one batch size: per round, each timed tree's ratio to AR."""

    batch_size: int
    trees: list[int]                                   # the candidates, in the order they were timed
    rounds: list[dict[int, float]] = field(default_factory=list)
    level: float = LEVEL
    min_gain: float = 0.0                              # a chosen tree's interval lies above 1 + min_gain
    # `acceptance_draws` of every bank tree's tokens/step over the calibration prompts ([draws,
    # trees], bank order); None: the intervals cover the timing alone
    acceptance: np.ndarray | None = None

    def ratios(self, k: int) -> list[float]:
        return [r[k] for r in self.rounds if k in r]

    def interval(self, k: int) -> tuple[float, float, float]:
        """Tree k's (median, low, high) ratio to AR: the rounds and the calibration prompts
        resampled (`joint_interval`)."""
        return joint_interval(self.ratios(k), None if self.acceptance is None else self.acceptance[:, k], self.level)

    def versus(self, i: int, j: int) -> tuple[float, float, float]:
        """(median, low, high) of tree i's ratio to tree j over the rounds that timed both: the AR
        blocks cancel, so this is the pairwise comparison, tighter than two intervals against AR
        (and both trees' tokens/step come from one draw of the prompts)."""
        both = [r[i] / r[j] for r in self.rounds if i in r and j in r]
        f = None if self.acceptance is None else self.acceptance[:, i] / self.acceptance[:, j]
        return joint_interval(both, f, self.level)

    def faster(self, i: int, j: int) -> bool:
        """Whether tree i is faster than tree j with confidence (their ratio's interval above 1)."""
        return self.versus(i, j)[1] > 1.0

    def choose(self, nodes: Sequence[int], within: Sequence[int] | None = None) -> int | None:
        """The choice among `within` (default: every candidate): of the trees whose interval lies
        above 1 + `min_gain`, the one of best median (the smaller on an equal one); None (AR) where
        no tree beats AR with confidence. Not "the smallest tree not confidently slower than the best": whether
        a pairwise difference of a few percent reaches confidence varies from build to build, so
        that rule swapped adjacent trees between rebuilds of one machine; two medians swap order
        only where the trees lie within each other's interval."""
        pool = self.trees if within is None else [k for k in self.trees if k in within]
        eligible = [k for k in pool if self.ratios(k) and self.interval(k)[1] > 1.0 + self.min_gain]
        if not eligible:
            return None
        return max(eligible, key=lambda k: (self.interval(k)[0], -nodes[k], -k))

    def undecided(self, nodes: Sequence[int]) -> list[int]:
        """The trees more rounds should time: where AR is chosen, those whose interval straddles
        1 + min_gain; where a tree is, that tree and every other tree not confidently faster or
        slower than it (either could still become the choice). Empty when the decision stands.
        Rounds narrow only the timing part of an interval; the calibration prompts' part is the
        same in every rebuild, so timing a close call to the cap leaves a rebuild's choice to it."""
        c = self.choose(nodes)
        if c is None:
            bar = 1.0 + self.min_gain
            return [k for k in self.trees if self.interval(k)[1] <= bar <= self.interval(k)[2]]
        open_ = [k for k in self.trees if k != c and self.versus(c, k)[1] <= 1.0 <= self.versus(c, k)[2]]
        return [c, *open_] if open_ else []


def measure_cell(run_block: Callable[[int | None, int], Block], batch_size: int, trees: Sequence[int],
                 tokens_per_step: Mapping[int, float], nodes: Sequence[int], settings: PairedSettings,
                 progress: Callable[[], None] | None = None, acceptance: np.ndarray | None = None) -> Cell:
    """Time `trees` against AR at one batch size: `run_block(arm, round)` decodes the batch with
    tree `arm` (None: AR) on round `round`'s prompt and returns its `Block`. One untimed block per
    side first; then `settings.min_rounds` rounds of every tree, then rounds of AR and the
    `undecided` trees while there are any, `settings.max_rounds` rounds in all at most.
    `acceptance`: `Cell.acceptance`."""
    cell = Cell(batch_size, list(trees), level=settings.level, min_gain=settings.min_gain, acceptance=acceptance)
    if not trees:
        return cell
    for arm in [None, *trees]:
        run_block(arm, 0)  # warm-up: caches, allocator, the tree's first use
    while len(cell.rounds) < settings.max_rounds:
        timed = list(trees)
        if len(cell.rounds) >= settings.min_rounds:
            timed = cell.undecided(nodes)
            if not timed:
                break
        r = len(cell.rounds)
        cell.rounds.append(round_ratios([(arm, run_block(arm, r)) for arm in round_order(timed)], tokens_per_step))
        if progress:
            progress()
    return cell


def monotone_choices(cells: Mapping[int, Cell], nodes: Sequence[int]) -> dict[int, tuple[int | None, int | None]]:
    """{B: (choice, unconstrained choice)}, B ascending: each cell's `choose`, except that a tree
    bigger than the previous (smaller) batch size's choice gives way to the best candidate no bigger
    than that one, unless its ratio to that candidate lies above 1 with confidence. Where the
    alternative is AR the bigger tree already beats AR with confidence, and stays."""
    out: dict[int, tuple[int | None, int | None]] = {}
    cap: int | None = None   # nodes of the previous batch size's choice (1: AR)
    for b in sorted(cells):
        cell = cells[b]
        free = c = cell.choose(nodes)
        if c is not None and cap is not None and nodes[c] > cap:
            alt = cell.choose(nodes, within=[k for k in cell.trees if nodes[k] <= cap])
            if alt is not None and not cell.faster(c, alt):
                c = alt
        out[b] = (c, free)
        cap = nodes[c] if c is not None else 1
    return out


def candidates_at(tok_per_s: Sequence[float | None], nodes: Sequence[int], count: int,
                  model_ratio: Sequence[float | None] | None = None, floor: float = 0.0) -> list[int]:
    """The `count` trees (root-only excluded) of highest modeled batch tok/s at one batch size,
    fastest first, less those whose `model_ratio` to AR lies below `floor` (the step-cost model's
    error is far smaller than such a gap): the fastest one is timed whatever the model says, so
    that even a batch size where AR wins is decided by a measurement."""
    ranked = sorted((k for k, v in enumerate(tok_per_s) if v is not None and nodes[k] > 1),
                    key=lambda k: (-tok_per_s[k], nodes[k]))[:count]
    if model_ratio is None:
        return ranked
    return ranked[:1] + [k for k in ranked[1:] if (model_ratio[k] or 0.0) >= floor]


def cell_record(cell: Cell, choice: int | None, unconstrained: int | None, model_ratio: Mapping[int, float],
                settings: PairedSettings) -> dict[str, Any]:
    """What bank.json's "batch_sizes"[B]["paired"] holds (read back by `runtime.bank`): per candidate
    its median ratio to AR, the interval, its rounds and the step-cost model's predicted ratio."""
    cands = []
    for k in cell.trees:
        med, low, high = cell.interval(k)
        cands.append({"tree": k, "median": med, "low": low, "high": high, "rounds": len(cell.ratios(k)),
                      "model_ratio": model_ratio.get(k)})
    rec: dict[str, Any] = {"ratio": RATIO, "level": settings.level, "min_gain": settings.min_gain,
                           "new_tokens": settings.new_tokens, "rounds": len(cell.rounds), "candidates": cands,
                           "interval": "rounds" if cell.acceptance is None else "rounds and calibration prompts"}
    if unconstrained != choice:
        rec["unconstrained"] = unconstrained   # what the batch size alone chose, before `monotone_choices`
    return rec


def decoder_blocks(decoder: Any, prompts: Sequence[Sequence[int]], batch_size: int, new_tokens: int,
                   sampler: Any = None, now: Callable[[], float] | None = None) -> Callable[[int | None, int], Block]:
    """`run_block` for `measure_cell` over a `runtime.decoder.TreeDecoder`: round r decodes B copies
    of prompt r mod len(prompts) for `new_tokens` tokens (no early stop on EOS, so both sides decode
    the same count), AR with `runtime.ar.ar_generate_batch`, tree k with `decoder.generate_batch`.
    The wall clock (after a device synchronisation): the prefills the runtime times are wall time,
    and the pairing, not the clock, is what takes the machine's drift out."""
    from runtime.ar import ar_generate_batch
    from runtime.device import clock

    if not prompts:
        raise ValueError("no prompts to time the batch with")
    tick = now or (lambda: clock(decoder.model.device))

    def run(arm: int | None, r: int) -> Block:
        batch = [list(prompts[r % len(prompts)])] * batch_size
        t0 = tick()
        if arm is None:
            prefills: list[float] = []
            ar_generate_batch(decoder.model, batch, new_tokens, eos_ids=(), sampler=sampler, prefill_seconds=prefills)
            seconds, steps = tick() - t0 - sum(prefills), new_tokens - 1
        else:
            res = decoder.generate_batch(batch, new_tokens, choose=arm, eos_ids=(), sampler=sampler)
            seconds, steps = tick() - t0 - sum(x.prefill_seconds for x in res), max(len(x.steps) for x in res)
        return Block(seconds, steps)

    return run


def measure_choices(decoder: Any, prompts: Sequence[Sequence[int]], candidates: Mapping[int, Sequence[int]],
                    tokens_per_step: Sequence[float], settings: PairedSettings, sampler: Any = None,
                    progress: Callable[[], None] | None = None, acceptance: np.ndarray | None = None) -> dict[int, Cell]:
    """The paired measurement of a bank's choices: {B: `Cell`} for `candidates` {B: indices of the
    trees of `decoder` (a `runtime.decoder.TreeDecoder` over the bank's trees, in bank order) to
    time at B}, on `prompts` (token ids), each tree at its bank `tokens_per_step`; `acceptance`:
    `Cell.acceptance`."""
    nodes = [t.num_nodes for t in decoder.trees]
    tps = dict(enumerate(tokens_per_step))
    return {b: measure_cell(decoder_blocks(decoder, prompts[:settings.prompts], b, settings.new_tokens, sampler), b,
                            list(trees), tps, nodes, settings, progress, acceptance)
            for b, trees in sorted(candidates.items())}


@dataclass
class PairedRun:
    """What the bank stage gives `pipeline.bank.write.build_bank` to time its choices with: a
    `runtime.decoder.TreeDecoder` over given trees (built once the bank's trees are known), the
    prompts (token ids), the settings and the sampler of the bank's decodes."""

    decoder: Callable[[list[Any]], Any]
    prompts: list[list[int]]
    settings: PairedSettings = field(default_factory=PairedSettings)
    sampler: Any = None
    progress: Callable[[], None] | None = None


# ---------------------------------------------------------------------------------- EntMTP-dyn


@dataclass(frozen=True)
class PricedBlock:
    """One timed decode for EntMTP-dyn's pricing: its steps' wall seconds, what the step-cost model
    priced those same steps at (seconds), and the step count."""

    measured_s: float
    modeled_s: float
    steps: int


@dataclass
class DynamicCell:
    """EntMTP-dyn timed against EntMTP* at batch size 1: per round, dyn's ratio to EntMTP* and its
    unpriced cost per step (`dynamic_round`)."""

    ratios: list[float] = field(default_factory=list)
    overhead_ms: list[float] = field(default_factory=list)
    level: float = LEVEL
    min_gain: float = 0.0   # dyn is offered where its interval lies above 1 + this (as a tree over AR)
    # `acceptance_draws` of dyn's replayed speed-up over EntMTP* across the calibration prompts
    # ([draws]); None: the interval covers the timing alone
    acceptance: np.ndarray | None = None

    def interval(self) -> tuple[float, float, float]:
        """(median, low, high): the rounds and the calibration prompts resampled."""
        return joint_interval(self.ratios, self.acceptance, self.level)

    def overhead(self) -> float:
        """The median over rounds of dyn's unpriced ms per step."""
        return statistics.median(self.overhead_ms)

    def record(self, replay_ratio: float) -> dict[str, Any]:
        """What the bank's `dynamic` entry holds under "paired" (`runtime.bank` reads it back)."""
        med, low, high = self.interval()
        return {"versus": "EntMTP*", "median": med, "low": low, "high": high, "rounds": len(self.ratios),
                "interval": "rounds" if self.acceptance is None else "rounds and calibration prompts",
                "level": self.level, "min_gain": self.min_gain, "replay_ratio": replay_ratio,
                "overhead_ms": self.overhead(), "offered": low > 1.0 + self.min_gain}


def dynamic_round(blocks: Sequence[tuple[bool, PricedBlock]], replay_ratio: float) -> tuple[float, float]:
    """(ratio, overhead_ms) of one round of EntMTP* (False) and EntMTP-dyn (True) blocks.

    Each side's measured over modeled seconds (its blocks pooled) is the machine's speed as that side
    sees it; EntMTP*'s is the reference, so dyn's excess over it is what the model does not price in
    a dyn step (its scheduling, its scored drafting): overhead_ms, in the model's ms per dyn step.
    The ratio is the replayed ratio (dyn's replayed tok/s over EntMTP*'s, over the whole calibration
    split) corrected by that excess: replay_ratio * speed(EntMTP*) / speed(dyn)."""
    pooled = {side: [0.0, 0.0, 0] for side in (False, True)}
    for side, b in blocks:
        if b.steps < 1 or not (b.measured_s > 0 and b.modeled_s > 0):
            raise ValueError(f"a priced block needs >= 1 step and positive times, got {b}")
        acc = pooled[side]
        acc[0], acc[1], acc[2] = acc[0] + b.measured_s, acc[1] + b.modeled_s, acc[2] + b.steps
    if not pooled[False][2] or not pooled[True][2]:
        raise ValueError("a round needs blocks of both EntMTP* and EntMTP-dyn")
    static_speed, dyn_speed = (pooled[s][0] / pooled[s][1] for s in (False, True))
    dyn_model_ms = 1000 * pooled[True][1] / pooled[True][2]
    return replay_ratio * static_speed / dyn_speed, (dyn_speed / static_speed - 1.0) * dyn_model_ms


def measure_dynamic(run_block: Callable[[bool, int], PricedBlock], replay_ratio: float, settings: PairedSettings,
                    progress: Callable[[], None] | None = None, acceptance: np.ndarray | None = None) -> DynamicCell:
    """Rounds of blocks EntMTP*, dyn, dyn, EntMTP* (`run_block(dyn, round)`), one untimed block of
    each first; `settings.min_rounds`, then more while the ratio's interval straddles 1 +
    `settings.min_gain`, at most `settings.max_rounds`. `acceptance`: `DynamicCell.acceptance`."""
    cell = DynamicCell(level=settings.level, min_gain=settings.min_gain, acceptance=acceptance)
    run_block(False, 0), run_block(True, 0)  # warm-up
    while len(cell.ratios) < settings.max_rounds:
        if len(cell.ratios) >= settings.min_rounds:
            _, low, high = cell.interval()
            if not low <= 1.0 + cell.min_gain <= high:
                break
        r = len(cell.ratios)
        ratio, overhead = dynamic_round([(arm is not None, run_block(arm is not None, r))
                                         for arm in round_order([1])], replay_ratio)
        cell.ratios.append(ratio)
        cell.overhead_ms.append(overhead)
        if progress:
            progress()
    return cell


def dynamic_blocks(decoder: Any, prompts: Sequence[Sequence[int]], static: int, static_step_ms: float, policy: Any,
                   new_tokens: int, sampler: Any = None) -> Callable[[bool, int], PricedBlock]:
    """`run_block` for `measure_dynamic` over a `runtime.decoder.TreeDecoder`: round r decodes prompt
    r mod len(prompts) alone for `new_tokens` tokens (no early stop on EOS) with the bank's tree
    `static` (priced `static_step_ms` a step) or with `policy` (a `runtime.dynamic.DynamicPolicy`,
    each step priced by its own `step_costs` at the depth it drafted and the nodes it verified)."""
    if not prompts:
        raise ValueError("no prompts to time EntMTP-dyn with")

    def run(dyn: bool, r: int) -> PricedBlock:
        res = decoder.generate(list(prompts[r % len(prompts)]), new_tokens, choose=policy if dyn else static,
                               eos_ids=(), sampler=sampler)
        if dyn:
            modeled = sum(policy.step_costs(max(s.depth, 0))[s.nodes - 1] for s in res.steps)
        else:
            modeled = static_step_ms * len(res.steps)
        return PricedBlock(sum(s.seconds for s in res.steps), modeled / 1000, len(res.steps))

    return run
