"""A measured step-cost model: what one tree-decoding step costs on this machine, for any tree.

A step is draft + verify + fixed (see runtime/decoder.py):

* draft: the heads' `propose`. Hydra drafts level by level, each level one batch over the
  distinct parents one level up, so its cost is a sum over depth levels of a function of that
  level's width (rows). Medusa runs every head once from the context vector: one product whose
  cost depends on the depth only. An EAGLE-3 drafter (`runtime.eagle3`, kind "eagle3") drafts level
  by level too: level d >= 2 is one forward of its draft layer over the depth-(d-1) frontier (the
  nodes with children, the level's width) and the output product over those rows, so the same
  per-level table, measured the same way with the drafter's own `propose` on chains of each width
  and depth, prices it (level 1: the output product over the root's one row). It differs from
  Hydra only in a batch: `Eagle3Drafter.propose_batch` drafts the sequences one after another over
  their own caches, so B sequences cost B drafts, where Hydra's levels are one product over the
  B sequences' rows. The draft layer's attention also reads the committed rows; the table holds it
  at the timed prompt's context (a one-layer drafter's share of a step, next to the L-layer verify).
* verify: one base-model forward with N new rows (the tree's nodes) at context length L, read
  from a measured grid of N and L by piecewise-linear interpolation (linear extrapolation past
  its ends).
* fixed: the rest of the step (accept, KV-cache compaction, the heads' observation of the
  accepted positions, the host transfer, Python), measured inside real decodes as the step time
  minus its draft and verify calls, and fitted as a + b * depth + c * nodes.
* in situ: draft and verify measured alone run on caches warmed by their own repeats; inside a
  decode each follows the other and may run slower (a draft after a verify forward re-reads the
  heads from memory). The same probe decodes time their draft and verify calls, and the ratio of
  those to the tables' figures for the same trees (`in_situ`) scales both parts of a prediction
  (0.93-1.04 on a 2-core AMD EPYC: there the difference is within the noise).

Every figure is a median over many short repeats, with all probes of a round interleaved so that
the load of a shared machine hits them alike. A shared machine also runs whole seconds faster or
slower (identical one-row forwards of an AMD EPYC VM ranged 27-37 ms in 2-second windows), so each
draft and fixed measurement is taken as a ratio to a *phase probe* timed right after it (the median
of `PHASE_FORWARDS` one-row forwards) and scaled back by the run's median probe; the verify grid
is paired within each pass to its one-row cell, the probe's own forward (`paired_medians`), and
scaled by the same median, so that every part of the model stands at one speed. The timed decodes
that check the model are probed alike (`pipeline.timing.checks.TreeTimer`), so the check compares what
the model claims, a step's cost at the run's median speed, with a decode brought to that speed.
The model is what the time stage, pruning, bank selection and policy fitting use, so every
candidate tree has a cost without decoding it; timed decodes of a few trees check it
(`tree_entries`).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.artifacts import atomic_write_json
from runtime.decoder import Drafter, TreeDecoder
from runtime.device import clock
from runtime.model.llama import Transformer
from runtime.sampling import Sampler
from runtime.tree import Tree, TreeBuffers

log = logging.getLogger(__name__)

SCHEMA = 2  # 2: every figure scaled by phase probes (phase_ms), draft and verify by in_situ
# how a kind's drafting is priced (see the module docstring): per level ("hydra", "eagle3") or one product ("medusa")
COST_KINDS = ("hydra", "medusa", "eagle3")
PER_LEVEL = ("hydra", "eagle3")
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 32)
FIXED_WIDTH = 8                   # chains of the wide probe that separates a node cost from a depth cost
PROBE_WARMUP_STEPS = 2            # first steps of every probe decode are not used (allocator, caches)
VERIFY_PASSES = 3                 # passes over the verify grid per probe round, spread between its probe decodes
PHASE_FORWARDS = 3                # one-row forwards per phase probe (~0.1 s: short next to a speed phase)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation of ys over increasing xs, extrapolated linearly past both
    ends (from the nearest segment) and constant for a single point."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def nondecreasing(ys: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence to ys in least squares (pool adjacent violators): a
    forward over more rows, a longer context or a deeper draft never costs less, so a median that
    says otherwise is noise, and left in it makes a bigger tree look cheaper than a smaller one
    and flips the bank's choice between runs."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def _monotone_table(table: list[list[float]]) -> list[list[float]]:
    """`nondecreasing` along each row, then along each column, of a [outer][inner] table."""
    rows = [nondecreasing(r) for r in table]
    cols = [nondecreasing(c) for c in zip(*rows)]
    return [list(r) for r in zip(*cols)]


def level_widths(tree: Tree) -> list[int]:
    """Rows of each Hydra drafting level d = 1..depth: the distinct depth-(d-1) nodes with children."""
    return [len({p[:-1] for p in tree.paths if len(p) == d}) for d in range(1, tree.depth + 1)]


def chains_tree(width: int, depth: int) -> Tree:
    """`width` disjoint chains of length `depth` under the root: every Hydra level below the first
    has exactly `width` rows (the first always has one, the root)."""
    return Tree([tuple([c] + [0] * (d - 1)) for c in range(width) for d in range(1, depth + 1)]) if depth else Tree([])


@dataclass
class StepCostModel:
    """Step cost (milliseconds) of any tree on one machine, model, heads, dtype and thread count."""

    # drafter kind: "hydra" (per-level drafting), "medusa" (one product) or "eagle3" (per-level, as
    # hydra; a batch drafts its sequences one after another)
    kind: str
    num_heads: int
    verify_rows: list[int]               # grid of new rows N (increasing)
    verify_contexts: list[int]           # grid of context lengths L (increasing)
    verify_ms: list[list[float]]         # [L index][N index]: median forward ms
    draft_widths: list[int]              # Hydra: grid of level widths; Medusa: [1]
    # draft_ms[D][w]: median `propose` ms of chains_tree(width w, depth D), D = 0..num_heads (Medusa:
    # the chain of depth D, one column). A Hydra level d >= 2 of width w costs draft_ms[d][w] - draft_ms[d-1][w].
    draft_ms: list[list[float]]
    fixed_coef: list[float]              # fixed ms = a + b * depth + c * nodes
    fixed_points: list[dict[str, float]] = field(default_factory=list)  # the probe medians the fit came from
    # median phase probe (ms): the one-row forward every figure is scaled to, and the
    # context it ran at; the model's figures are the machine at this speed
    phase_ms: float = 0.0
    phase_context: int = 0
    # draft + verify inside the probe decodes over the tables' draft + verify of the same trees
    # (median over the probe trees; `in_situ_points` per tree); scales both parts of `predict`
    in_situ: float = 1.0
    in_situ_points: list[dict[str, float]] = field(default_factory=list)
    repeats: int = 0
    clock: str = "wall"                  # what the figures count (`step_clock`)
    dtype: str = ""
    threads: int = 0
    machine: dict[str, Any] = field(default_factory=dict)
    # the batch axis (`pipeline.timing.batch`): batch sizes measured, and per batch size and verify_rows
    # entry the batched forward of B sequences over the one-sequence forward at the reference context
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    batch_verify_ratio: list[list[float]] = field(default_factory=list)
    # per batch size and verify_rows entry: timed batched steps inside real decodes over the model's
    # figure for them (a calibration pass of batched decodes, checked by a second one); empty: 1.0
    batch_in_situ: list[list[float]] = field(default_factory=list)
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse a model whose tables do not fit together (a damaged or hand-edited file)."""
        what = "step-cost model"
        if self.schema != SCHEMA:
            raise ValueError(f"{what}: schema {self.schema}, this code reads {SCHEMA}; rebuild the time stage (force=true)")
        if self.kind not in COST_KINDS:
            raise ValueError(f"{what}: kind must be one of {COST_KINDS}, got {self.kind!r}")
        for name, grid in (("verify_rows", self.verify_rows), ("verify_contexts", self.verify_contexts),
                           ("draft_widths", self.draft_widths)):
            if not grid or any(b <= a for a, b in zip(grid, grid[1:])):
                raise ValueError(f"{what}: {name} must be a non-empty increasing grid, got {grid}")
        if len(self.verify_ms) != len(self.verify_contexts) or any(len(r) != len(self.verify_rows) for r in self.verify_ms):
            raise ValueError(f"{what}: verify_ms must be [{len(self.verify_contexts)} contexts][{len(self.verify_rows)} rows]")
        if len(self.draft_ms) != self.num_heads + 1 or any(len(r) != len(self.draft_widths) for r in self.draft_ms):
            raise ValueError(f"{what}: draft_ms must be [{self.num_heads + 1} depths][{len(self.draft_widths)} widths]")
        if len(self.fixed_coef) != 3:
            raise ValueError(f"{what}: fixed_coef must be [a, b, c] (a + b * depth + c * nodes), got {self.fixed_coef}")
        values = [v for r in self.verify_ms + self.draft_ms for v in r] + list(self.fixed_coef) + [self.phase_ms]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ValueError(f"{what}: every timing must be a finite number")
        if self.phase_ms < 0 or self.phase_context < 0:
            raise ValueError(f"{what}: phase_ms and phase_context must be >= 0")
        if self.batch_sizes != [1] and (len(self.batch_verify_ratio) != len(self.batch_sizes) or any(
                len(r) != len(self.verify_rows) or not all(math.isfinite(v) and v > 0 for v in r)
                for r in self.batch_verify_ratio)):
            raise ValueError(f"{what}: batch_verify_ratio must be [{len(self.batch_sizes)} batch sizes]"
                             f"[{len(self.verify_rows)} rows] of positive ratios; rebuild the time stage (force=true)")
        if self.batch_in_situ and (len(self.batch_in_situ) != len(self.batch_sizes) or any(
                len(r) != len(self.verify_rows) or not all(math.isfinite(v) and v > 0 for v in r)
                for r in self.batch_in_situ)):
            raise ValueError(f"{what}: batch_in_situ must be [{len(self.batch_sizes)} batch sizes]"
                             f"[{len(self.verify_rows)} rows] of positive factors; rebuild the time stage (force=true)")
        if not (isinstance(self.in_situ, (int, float)) and math.isfinite(self.in_situ) and self.in_situ > 0):
            raise ValueError(f"{what}: in_situ must be a positive number (draft + verify inside decodes over the same "
                             f"parts measured alone), got {self.in_situ}; rebuild the time stage (force=true)")

    # -- components ----------------------------------------------------------------------------

    def verify(self, rows: int, context: float) -> float:
        """ms of one forward with `rows` new tokens after `context` committed positions."""
        per_context = [_interp(self.verify_rows, r, rows) for r in self.verify_ms]
        return _interp(self.verify_contexts, per_context, context)

    def _draft_table(self, depth: int, width: int) -> float:
        return _interp(self.draft_widths, self.draft_ms[depth], width)

    def draft(self, tree: Tree, batch: int = 1) -> float:
        """ms of the heads' `propose` for `tree`, or of `propose_batch` of `batch` sequences that
        draft it together: each level then is one product over `batch` times its rows."""
        if tree.depth > self.num_heads:
            raise ValueError(f"a tree of depth {tree.depth}: the heads draft only {self.num_heads} levels")
        if self.kind == "medusa" or tree.depth == 0:
            return self._draft_table(tree.depth, 1)  # one product over `batch` rows: few rows cost as one
        if self.kind == "eagle3" and batch > 1:  # one sequence's draft after another
            return batch * self.draft(tree)
        widths = [batch * w for w in level_widths(tree)]
        total = self._draft_table(1, 1)  # level 1 has one row (the root); includes propose's prologue
        if batch > 1 and self.num_heads > 1:  # level 1 over `batch` roots: priced as a level 2 of that width
            total += (self._draft_table(2, batch) - self._draft_table(1, batch)) - (
                self._draft_table(2, 1) - self._draft_table(1, 1))
        for d in range(2, tree.depth + 1):
            total += self._draft_table(d, widths[d - 1]) - self._draft_table(d - 1, widths[d - 1])
        return total

    def fixed(self, depth: int, nodes: int) -> float:
        a, b, c = self.fixed_coef
        return a + b * depth + c * nodes

    def predict(self, tree: Tree, context: float) -> dict[str, float]:
        """{draft_ms, verify_ms, fixed_ms, step_ms} of one step with `tree` at context length `context`
        inside a decode: the tables' draft and verify times `in_situ`, plus the fixed part."""
        parts = {"draft_ms": self.in_situ * self.draft(tree),
                 "verify_ms": self.in_situ * self.verify(tree.num_nodes, context),
                 "fixed_ms": self.fixed(tree.depth, tree.num_nodes)}
        return {**parts, "step_ms": sum(parts.values())}

    # -- files ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCostModel:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"step-cost model: unknown fields {sorted(unknown)}; rebuild the time stage (force=true)")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the step-cost model {path}: {e}; rebuild the time stage (force=true)") from e
        return cls.from_dict(d)


def paired_medians(samples: dict[Any, list[float]], ref: Any, level: float | None = None) -> dict[Any, float]:
    """Per cell, a median of its samples where sample j of every cell comes from pass j: `level`
    (default: the reference cell's median) times the median of the cell's ratio to the reference
    sample of the same pass. A speed phase of a shared machine slows one pass's forwards alike, so
    it cancels in the ratios, and the differences between row counts (what decides between trees)
    keep only the noise within a pass; with plain medians each cell kept its own share of the phases."""
    base = samples[ref]
    if not base or any(len(xs) != len(base) for xs in samples.values()):
        raise ValueError("paired_medians needs the same number of samples (one per pass) in every cell")
    level = statistics.median(base) if level is None else level
    return {key: level * statistics.median([x / b for x, b in zip(xs, base)]) for key, xs in samples.items()}


def fit_fixed(points: Sequence[tuple[int, int, float]]) -> list[float]:
    """Least-squares [a, b, c] of fixed_ms = a + b * depth + c * nodes over (depth, nodes, ms) points.
    Components the points cannot tell apart (e.g. only chains, where nodes = depth + 1) are dropped
    from the fit (set to 0) rather than given arbitrary opposite values."""
    if not points:
        raise ValueError("fit_fixed needs at least one (depth, nodes, ms) point")
    x = np.array([[1.0, d, n] for d, n, _ in points])
    y = np.array([ms for _, _, ms in points])
    cols = [0]
    for j in (1, 2):  # keep a column only if it adds rank
        if np.linalg.matrix_rank(x[:, cols + [j]]) > len(cols):
            cols.append(j)
    coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
    out = [0.0, 0.0, 0.0]
    for j, v in zip(cols, coef):
        out[j] = float(v)
    return out


# -- measuring ---------------------------------------------------------------------------------


class StepParts:
    """Times, inside real decodes, each step and its `propose` (draft) and base-model forward
    (verify) calls: pass `mark` as the decoder's stream callback. Wrappers are instance attributes
    over the bound methods, removed by `close`; the prefill's forward falls before the first mark."""

    def __init__(self, model: Transformer, heads: Drafter, now: Callable[[], float]) -> None:
        self.model, self.heads, self.now = model, heads, now
        self.spent = {"draft": 0.0, "verify": 0.0}
        self.marks: list[tuple[float, float, float]] = []
        heads.propose = self._timed(heads.propose, "draft")
        model.forward = self._timed(model.forward, "verify")

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = self.now()
            out = fn(*args, **kwargs)
            self.spent[key] += self.now() - t0
            return out
        return run

    def mark(self, _tokens: list[int]) -> None:
        """The decoder's stream callback: called after the prefill and after every step."""
        self.marks.append((self.now(), self.spent["draft"], self.spent["verify"]))

    def steps(self) -> list[tuple[float, float, float]]:
        """(step, draft, verify) seconds of every step."""
        return [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(self.marks, self.marks[1:])]

    def rest(self) -> list[float]:
        """Seconds of every step spent outside draft and verify."""
        return [step - draft - verify for step, draft, verify in self.steps()]

    def inside(self) -> list[float]:
        """Seconds of every step spent in draft and verify."""
        return [draft + verify for _, draft, verify in self.steps()]

    def close(self) -> None:
        del self.heads.propose, self.model.forward


CLOCKS = ("wall", "cpu")


def step_clock(kind: str, device: torch.device) -> Callable[[], float]:
    """The clock of timed regions. "wall": seconds after a device synchronisation (what a user
    waits on an idle machine). "cpu": this thread's CPU seconds, which other processes' load does
    not inflate; it counts the work of one thread only, so use it with one torch thread on a CPU."""
    if kind == "wall":
        return lambda: clock(device)
    if kind == "cpu":
        if torch.device(device).type != "cpu":
            raise ValueError(f"clock 'cpu' times work on the CPU only; the model is on {device}: use 'wall'")
        if torch.get_num_threads() != 1:
            raise ValueError(f"clock 'cpu' counts one thread's work, but torch runs {torch.get_num_threads()} threads: "
                             "set threads=1 or use the wall clock")
        return time.thread_time
    raise ValueError(f"clock must be one of {CLOCKS}, got {kind!r}")


def fill_cache(model: Transformer, length: int, gen: torch.Generator) -> None:
    """Make the committed cache exactly `length` positions (random tokens appended as needed)."""
    if model.cache_len > length:
        model.truncate_cache(length)
    while model.cache_len < length:
        start = model.cache_len
        n = min(256, length - start)  # chunks bound the activation memory
        ids = torch.randint(0, model.args.vocab_size, (1, n), generator=gen).to(model.device)
        model(ids, torch.arange(start, start + n, device=model.device), last_only=True)


# depth of the timing trees' branches: as deep as verified trees go, and well inside the exact
# attention's limit (runtime.model.invariant.KEY_CHUNK - 1 new tokens on one path)
TIMING_BRANCH_DEPTH = 8


def timing_tree_ancestors(rows: int, depth: int = TIMING_BRANCH_DEPTH) -> list[list[int]]:
    """Ancestor lists (each ending at the token itself) of the tree every verify cost is timed on:
    a root, then branches of up to `depth` tokens hanging off it. A verify's cost follows its row
    count and, in exact mode, its rows' key counts; a tree-shaped mask gets both as real trees do
    (a chain of N rows would be N deep, and exact attention refuses forwards past 63)."""
    out = [[0]]
    for i in range(1, rows):
        start = 1 + (i - 1) // depth * depth
        out.append([0, *range(start, i + 1)])
    return out


def time_forward(model: Transformer, context: int, rows: int, gen: torch.Generator, now: Callable[[], float]) -> float:
    """Seconds of one forward of `rows` random new tokens shaped as `timing_tree_ancestors` after
    the first `context` committed positions, which must be in the cache; the cache is cut back to
    `context`."""
    if model.cache_len < context:
        raise ValueError(f"time_forward at context {context}: the cache holds {model.cache_len} positions")
    model.truncate_cache(context)
    dev = model.device
    ids = torch.randint(0, model.args.vocab_size, (1, rows), generator=gen).to(dev)
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    depth = torch.zeros(rows, dtype=torch.long)
    for i, anc in enumerate(timing_tree_ancestors(rows)):
        mask[i, anc] = True
        depth[i] = len(anc) - 1
    mask, pos = mask.to(dev), (context + depth).to(dev)
    t0 = now()
    model(ids, pos, mask, check_mask=False)
    t = now() - t0
    model.truncate_cache(context)
    return t


@torch.inference_mode()
def phase_probe(model: Transformer, context: int, gen: torch.Generator, now: Callable[[], float]) -> float:
    """The machine's speed right now: median seconds of `PHASE_FORWARDS` one-row forwards at
    `context` (committed positions the cache holds; it is cut back to `context`). A figure divided
    by the probe timed right after it is free of the speed phase both fell in."""
    return statistics.median(time_forward(model, context, 1, gen, now) for _ in range(PHASE_FORWARDS))


def drafter_kind(heads: Drafter) -> str:
    """The `StepCostModel.kind` of a drafter: its heads kind ("hydra" / "medusa"), or "eagle3"."""
    from runtime.eagle3 import Eagle3Drafter

    return "eagle3" if isinstance(heads, Eagle3Drafter) else str(heads.config.kind)


def prompt_context(model: Transformer, heads: Drafter, prompt: Sequence[int]) -> tuple[torch.Tensor, int]:
    """The drafter's context after `prompt` and the base model's greedy next token (the draft's
    inputs), from fresh caches: heads observe the prompt's hidden states; a drafter that reads the
    target's features (EAGLE-3) observes those of the same forward, each position paired with its
    next token (the last one's is the root), as `TreeDecoder`'s prefill does."""
    from runtime.eagle3 import target_forward

    model.reset_cache()
    heads.reset()
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    pos = torch.arange(ids.shape[1], device=model.device)
    aux = tuple(heads.aux_layer_ids)
    if not aux:
        logits, hidden = model(ids, pos, last_only=True)
        return heads.observe(hidden, pos), int(logits[0, -1].argmax())
    logits, hidden, features = target_forward(model, ids, pos, aux, last_only=True)
    root = logits[0, -1].argmax().reshape(1)
    h = heads.observe(hidden, pos, torch.cat([ids[0, 1:], root]), features)
    return h, int(root)


@torch.inference_mode()
def measure_step_cost(
    decoder: TreeDecoder, prompt: Sequence[int], verify_rows: Sequence[int], verify_contexts: Sequence[int],
    repeats: int = 7, fixed_tokens: int = 12, sampler: Sampler | None = None, dtype: str = "",
    machine: dict[str, Any] | None = None, progress: Callable[[int, int], None] | None = None,
    clock_kind: str = "wall", between_rounds: Callable[[int, StepCostModel], None] | None = None,
    max_depth: int | None = None,
) -> StepCostModel:
    """Measure a `StepCostModel` for the decoder's model and heads (wall clock, medians over `repeats`
    interleaved rounds). `prompt` is a real prompt (the draft and fixed probes decode from it).
    `between_rounds(i, model)`, if given, runs after round i with the model of rounds 0..i (the time
    stage decodes its check rounds there, so model and check see the same state of the machine).
    `max_depth`: the deepest tree priced (default and at most: the drafter's `max_depth`, the heads'
    count for heads; an EAGLE-3 drafter drafts deeper than the trees a bank may use).

    Each round runs, in this order: the fixed probes (one decode of `fixed_tokens` new tokens with
    each of: chains of depth 0, 1 and max, `FIXED_WIDTH` chains of depth 1 and of depth max) with
    `VERIFY_PASSES` passes over the verify grid between and after them (contexts in increasing
    order, the cache filled with random tokens and truncated back after each forward; each cell's
    figure is a `paired_medians` over the passes), then the draft probes (`propose` of every
    chains_tree). A `phase_probe` at the first context follows every probe decode and precedes the
    draft probes; their figures are medians of ratios to it, and the verify cells medians of ratios
    to the one-row cell of their pass, all times the median probe (`StepCostModel.phase_ms`).
    `clock_kind`: see `step_clock`."""
    model, heads = decoder.model, decoder.heads
    dev = model.device
    n_heads = heads.max_depth if max_depth is None else min(int(max_depth), heads.max_depth)
    kind = drafter_kind(heads)
    rows = sorted({int(n) for n in verify_rows if n >= 1} | {1})
    contexts = sorted({int(c) for c in verify_contexts if c >= 0})
    if not contexts:
        raise ValueError("measure_step_cost needs at least one context length")
    if max(contexts) + max(rows) > model.max_seq_len:
        raise ValueError(f"context {max(contexts)} + {max(rows)} rows exceed the KV cache ({model.max_seq_len} positions); "
                         "load the model with a larger max_seq_len or measure shorter contexts")
    widths = list(DRAFT_WIDTHS) if kind in PER_LEVEL else [1]
    draft_trees = {(d, w): TreeBuffers.compile(chains_tree(w, d)).to(dev) for d in range(n_heads + 1) for w in widths}
    probe_trees = [chains_tree(1, 0), chains_tree(1, 1), chains_tree(1, n_heads), chains_tree(FIXED_WIDTH, 1),
                   chains_tree(FIXED_WIDTH, n_heads)]
    probe = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in probe_trees], acceptance=decoder.acceptance)
    gen = torch.Generator().manual_seed(0)
    verify_s: dict[tuple[int, int], list[float]] = {(c, n): [] for c in contexts for n in rows}
    draft_s: dict[tuple[int, int], list[float]] = {k: [] for k in draft_trees}  # / the round's draft phase probe
    rest_s: list[list[float]] = [[] for _ in probe_trees]   # each step's rest / the phase probe after its decode
    inside_s: list[list[float]] = [[] for _ in probe_trees]  # each step's draft + verify / the same probe
    now = step_clock(clock_kind, dev)

    # phase probes run at the verify grid's first context, so that its one-row cell (the reference
    # of its passes) is the probe itself and the whole model stands at one level
    p_ctx = contexts[0]
    phase_s: list[float] = []

    def probed() -> float:
        fill_cache(model, p_ctx, gen)
        phase_s.append(phase_probe(model, p_ctx, gen, now))
        return phase_s[-1]

    # warm-up: every probe decode once, every verify size once, every draft tree once
    for k in range(len(probe_trees)):
        probe.generate(prompt, 6, choose=k, eos_ids=(), sampler=sampler)
    fill_cache(model, contexts[0], gen)
    for n in rows:
        time_forward(model, contexts[0], n, gen, now)
    h, root = prompt_context(model, heads, prompt)
    for buf in draft_trees.values():
        heads.propose(h, root, buf)
    def so_far(rounds: int) -> StepCostModel:
        level = statistics.median(phase_s)
        verify_med = paired_medians(verify_s, (contexts[0], 1), level)
        fixed_points = [{"depth": t.depth, "nodes": t.num_nodes, "ms": 1e3 * level * statistics.median(r)}
                        for t, r in zip(probe_trees, rest_s)]
        # medians, made non-decreasing in rows and context (verify) and in depth and width (draft)
        tables = StepCostModel(
            kind=kind, num_heads=n_heads, verify_rows=rows, verify_contexts=contexts,
            verify_ms=_monotone_table([[1e3 * verify_med[(c, n)] for n in rows] for c in contexts]),
            draft_widths=widths,
            draft_ms=_monotone_table([[1e3 * level * statistics.median(draft_s[(d, w)]) for w in widths]
                                      for d in range(n_heads + 1)]),
            fixed_coef=fit_fixed([(p["depth"], p["nodes"], p["ms"]) for p in fixed_points]),
            fixed_points=fixed_points, repeats=rounds, dtype=dtype, threads=torch.get_num_threads(),
            machine=dict(machine or {}), clock=clock_kind, phase_ms=1e3 * level, phase_context=p_ctx,
        )
        # the probe decodes' steps sit, on average, halfway through their new tokens
        mid = len(prompt) + fixed_tokens / 2
        tables.in_situ_points = [
            {"depth": t.depth, "nodes": t.num_nodes, "inside_ms": 1e3 * level * statistics.median(r),
             "tables_ms": tables.draft(t) + tables.verify(t.num_nodes, mid)} for t, r in zip(probe_trees, inside_s)]
        tables.in_situ = statistics.median(q["inside_ms"] / q["tables_ms"] for q in tables.in_situ_points)
        tables.validate()
        return tables

    # the verify grid runs VERIFY_PASSES times per round, between the probe decodes: a pass takes
    # under a second, and the shared machine's speed moves for seconds at a time, so one pass per
    # round would sample as few of its phases as there are rounds
    after_probe = {round((j + 1) * len(probe_trees) / VERIFY_PASSES) - 1 for j in range(VERIFY_PASSES)}
    total = repeats * (len(probe_trees) + VERIFY_PASSES * len(verify_s) + len(draft_s))
    done = 0
    for i in range(repeats):
        for k in range(len(probe_trees)):
            parts = StepParts(model, heads, now)
            try:
                probe.generate(prompt, fixed_tokens, choose=k, eos_ids=(), stream=parts.mark, sampler=sampler)
            finally:
                parts.close()
            rest, inside = parts.rest(), parts.inside()
            p = probed()
            rest_s[k].extend(r / p for r in rest[PROBE_WARMUP_STEPS:] or rest)
            inside_s[k].extend(r / p for r in inside[PROBE_WARMUP_STEPS:] or inside)
            done += 1
            if k not in after_probe:
                continue
            model.reset_cache()
            for ctx in contexts:
                fill_cache(model, ctx, gen)
                for n in rows:
                    verify_s[(ctx, n)].append(time_forward(model, ctx, n, gen, now))
                    done += 1
        h, root = prompt_context(model, heads, prompt)
        p = probed()
        for key, buf in draft_trees.items():
            t0 = now()
            heads.propose(h, root, buf)
            draft_s[key].append((now() - t0) / p)
            done += 1
        if progress:
            progress(done, total)
        if between_rounds:
            between_rounds(i, so_far(i + 1))
            model.reset_cache()
            heads.reset()
    model.reset_cache()
    heads.reset()
    return so_far(repeats)


def error_pct(predicted_ms: float, measured_ms: float) -> float:
    """Signed error of a prediction in percent of the measured figure."""
    return 100.0 * (predicted_ms - measured_ms) / measured_ms


def cost_contexts(timed_prompt_tokens: float, task_prompt_tokens: float, max_new_tokens: int,
                  check_tokens: int) -> tuple[list[int], int, int]:
    """(grid of measured contexts, the reference context of the bank's costs, the context of the
    check decodes). The reference is the mean context of a `max_new_tokens` generation after a
    prompt of the task's mean length (`task_prompt_tokens`, over the calib split: a step's cost
    grows linearly with the context, so the mean context gives the mean cost, and the one prompt
    that is decoded for the check need not be typical of the task); the check decodes run after
    the timed prompt (`timed_prompt_tokens`). The grid spans both prompts to the end of a generation."""
    timed, task = int(round(timed_prompt_tokens)), int(round(task_prompt_tokens))
    ref, check = task + max_new_tokens // 2, timed + check_tokens // 2
    return sorted({min(timed, task), ref, max(timed, task) + max_new_tokens}), ref, check


def phase_corrected(timed: dict[str, Any], k: int, model: StepCostModel) -> float:
    """Tree k's timed step (ms) at the speed the model's figures stand for: its median ratio to the
    phase probes after its decodes times the model's median probe. NaN when either is missing (a
    timer without phase probes, a model from before them)."""
    ratio = timed.get("step_over_phase", [float("nan")] * (k + 1))[k]
    return ratio * model.phase_ms if model.phase_ms > 0 else float("nan")


def tree_entries(cands: list[dict], tokens_per_step: Sequence[float], modeled: Sequence[dict[str, float]],
                 timed: dict[str, Any], model: StepCostModel, check_context: int,
                 tok_per_s: Callable[[float, float], float]) -> list[dict[str, Any]]:
    """timing.json's per-tree entries: the modeled cost and its draft / verify / fixed parts, the
    tok/s they imply (`tok_per_s(tokens_per_step, step_seconds)`), and for every tree that
    the `TreeTimer` decoded (`timed`: its result) the measured step, the model's figure at the context of those
    decodes and its error. The error the check reports (`model_error_pct`) is against the decode brought to
    the model's speed by its phase probes (`phase_corrected`); `raw_model_error_pct` is against the plain
    median, which also holds how much faster or slower the machine ran while the check decoded. Each
    checked tree is logged."""
    trees = []
    for k, (c, m, measured) in enumerate(zip(cands, modeled, timed["step_s"])):
        tree = c["tree"]
        entry: dict[str, Any] = {
            "paths": [list(p) for p in tree.paths], "nodes": tree.num_nodes, "depth": tree.depth,
            "tokens_per_step": tokens_per_step[k], "step_ms": m["step_ms"],
            "cost_ms": {part: m[f"{part}_ms"] for part in ("draft", "verify", "fixed")},
            "tok_per_s": tok_per_s(tokens_per_step[k], m["step_ms"] / 1000),
        }
        if k in timed["pruned"]:
            entry["pruned"] = timed["pruned"][k]
        else:
            at_check = model.predict(tree, check_context)["step_ms"]
            corrected = phase_corrected(timed, k, model)
            entry.update({"measured_step_ms": 1000 * measured, "modeled_step_ms_at_check": at_check,
                          "raw_model_error_pct": error_pct(at_check, 1000 * measured)})
            if math.isfinite(corrected):
                entry.update({"phase_corrected_step_ms": corrected, "model_error_pct": error_pct(at_check, corrected)})
            else:
                entry["model_error_pct"] = entry["raw_model_error_pct"]
            log.info("[time] %2d nodes depth %d: modeled %.1f ms (draft %.1f, verify %.1f, fixed %.1f), timed decode "
                     "%.1f ms (%.1f at the model's speed), error %+.1f%% (raw %+.1f%%)", entry["nodes"], entry["depth"],
                     at_check, *entry["cost_ms"].values(), entry["measured_step_ms"],
                     entry.get("phase_corrected_step_ms", float("nan")), entry["model_error_pct"],
                     entry["raw_model_error_pct"])
        trees.append(entry)
    return trees
