"""EntMTP-dyn: a per-step tree grown from the heads' own path values, inside a fixed super-tree.

Switching among a few compiled trees has a ceiling: the best tree for a step depends on where the
heads are confident *this* step. EAGLE-2 grows its draft tree per step from the drafter's path
values; this is that idea on top of tree heads, kept cheap and lossless:

1. the heads draft a bounded super-tree S every step and score it (`DraftHeads.propose_scored`:
   each node's head probability);
2. a node's path value is the product of the head probabilities on its path (root excluded), and a
   per-depth monotone calibration (`Calibration`, identity by default; the pipeline fits it) maps
   it to an estimate of P(node accepted);
3. with the nodes ranked by that estimate, the best n form a tree (an estimate never rises from a
   parent to its child, and ties rank the parent first), whose expected emitted tokens are 1 (the
   root's bonus) + the sum of the other n-1 estimates; the policy keeps the n that maximises
   expected tokens / step_ms[n-1] (`step_ms`: the modeled cost of a step verifying n nodes,
   drafting S included);
4. optionally (`stop_below` > 0) S is drafted depth by depth, and the drafting stops after depth d
   when no node at depth d is worth `stop_below` (its calibrated value): deeper nodes, whose
   values can only be lower, are then neither drafted nor verified, and the step's cost is that of
   drafting d levels (`draft_ms[d]` in place of `draft_ms[depth]` inside step_ms). This costs one
   host synchronisation per drafted depth and saves the deeper heads on steps where the heads are
   unsure, the steps a small tree serves as well as a big one;
5. the chosen subset's buffers (`TreeBuffers.subset`) are cached by the subset's bitmask, so a
   subset seen before costs a dictionary look-up; a new one is compiled once.

Verification does not care which tree it checks, so the output stays exactly AR's (greedy or
seeded sampling), as for the bank's trees.

    policy = DynamicPolicy(super_tree, step_ms, calibration)   # a Tree of <= 63 nodes; one cost per size
    policy = DynamicPolicy(super_tree, step_ms, calibration, draft_ms=draft_ms, stop_below=0.3)  # early stop
    decoder.generate(prompt, 128, choose=policy)               # every step: draft S, pick a subset, verify it
    decoder.generate_batch(prompts, 128, choose=policy)        # one policy serves every sequence
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.tree import Tree, TreeBuffers, TreeError

DYNAMIC_TREE = -1      # `StepRecord.tree` of a step whose tree a DynamicPolicy chose (see `StepRecord.nodes`)
MAX_SUPER_NODES = 63   # a subset's cache key is a bitmask in one int64


class Calibration:
    """Per-depth monotone maps from a node's path value to the probability that it is accepted.

    Depth d's map is piecewise linear through the knots (xs[d-1][j], ys[d-1][j]): xs strictly
    increasing, ys non-decreasing, both in [0, 1]; constant beyond the first and the last knot. No
    depths (the default) is the identity. Depths deeper than the maps given take the deepest one.
    Evaluated with a few tensor ops on every node at once (`__call__`)."""

    def __init__(self, xs: Sequence[Sequence[float]] = (), ys: Sequence[Sequence[float]] = ()) -> None:
        if len(xs) != len(ys):
            raise ValueError(f"calibration: {len(xs)} knot lists (xs) but {len(ys)} value lists (ys); give one of each "
                             "per depth")
        self.xs = [[float(x) for x in row] for row in xs]
        self.ys = [[float(y) for y in row] for row in ys]
        for d, (x, y) in enumerate(zip(self.xs, self.ys), start=1):
            if len(x) < 2 or len(x) != len(y):
                raise ValueError(f"calibration depth {d}: needs >= 2 knots with one value each, "
                                 f"got {len(x)} and {len(y)}")
            if not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in x + y):
                raise ValueError(f"calibration depth {d}: knots and values must lie in [0, 1]")
            if any(b <= a for a, b in zip(x, x[1:])):
                raise ValueError(f"calibration depth {d}: knots {x} must increase strictly")
            if any(b < a for a, b in zip(y, y[1:])):
                raise ValueError(f"calibration depth {d}: values {y} must not decrease (the map must be monotone)")
        self._tables: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def identity(cls) -> Calibration:
        return cls()

    @property
    def is_identity(self) -> bool:
        return not self.xs

    def to_dict(self) -> dict[str, Any]:
        return {"xs": self.xs, "ys": self.ys}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Calibration:
        """Inverse of `to_dict`; None or {} is the identity."""
        if not d:
            return cls()
        unknown = set(d) - {"xs", "ys"}
        if unknown:
            raise ValueError(f"calibration: unknown keys {sorted(unknown)}; expected xs and ys (per-depth knots)")
        return cls(d.get("xs", ()), d.get("ys", ()))

    def _table(self, depth: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """xs, ys as [depth + 1, K] float32 tables on `device` (row d for depth d; row 0 unused), short
        rows padded by repeating their last knot."""
        key = (str(device), depth)
        if key not in self._tables:
            width = max(len(x) for x in self.xs)
            rows = [min(max(d, 1), len(self.xs)) - 1 for d in range(depth + 1)]
            xs = [self.xs[r] + [self.xs[r][-1]] * (width - len(self.xs[r])) for r in rows]
            ys = [self.ys[r] + [self.ys[r][-1]] * (width - len(self.ys[r])) for r in rows]
            self._tables[key] = (torch.tensor(xs, dtype=torch.float32, device=device),
                                 torch.tensor(ys, dtype=torch.float32, device=device))
        return self._tables[key]

    def __call__(self, values: torch.Tensor, depths: torch.Tensor, depth: int) -> torch.Tensor:
        """The calibrated values [N] of path values [N] at node depths [N] (a tree `depth` deep)."""
        if self.is_identity:
            return values
        xs, ys = self._table(depth, values.device)
        x, y = xs[depths], ys[depths]                                     # [N, K]
        j = (x <= values[:, None]).sum(1, keepdim=True).clamp(1, x.shape[1] - 1)
        x0, x1, y0, y1 = x.gather(1, j - 1), x.gather(1, j), y.gather(1, j - 1), y.gather(1, j)
        t = ((values[:, None] - x0) / (x1 - x0).clamp_min(1e-12)).clamp(0.0, 1.0)
        return (y0 + t * (y1 - y0))[:, 0]

    def __repr__(self) -> str:
        return "Calibration(identity)" if self.is_identity else f"Calibration({len(self.xs)} depths)"


class StepTreePolicy:
    """A `choose` for `runtime.decoder.TreeDecoder` that builds every step's tree itself from the
    drafter's scores, rather than picking one of the decoder's compiled trees: EntMTP-dyn's
    `DynamicPolicy` and EAGLE-2's dynamic tree (`runtime.eagle2.Eagle2Policy`). The decoder reads
    `num_nodes` (the most nodes a step verifies: room in the KV cache) and `depth` (the deepest a
    step drafts), calls `prepare` when a decode starts and `draft` every step; its steps are
    recorded with tree index DYNAMIC_TREE. Verification does not care which tree it checks, so
    every such policy is lossless."""

    @property
    def num_nodes(self) -> int:
        raise NotImplementedError

    @property
    def depth(self) -> int:
        raise NotImplementedError

    def prepare(self, device: torch.device | str, num_heads: int) -> None:
        """Check the policy against a drafter that drafts `num_heads` deep, and move what it holds
        to `device` (once per decode, before the first step)."""
        raise NotImplementedError

    def draft(self, heads: Any, h: torch.Tensor, root: int) -> tuple[TreeBuffers, torch.Tensor, int]:
        """One step's tree, drafted with `heads` (a `runtime.decoder.Drafter`) from context h after
        token `root`: (its buffers, its tokens [n] in buffer order, the depth drafted)."""
        raise NotImplementedError


@dataclass
class _Subset:
    """A cached subset of the super-tree: its node indices in S [n] and its buffers."""

    idx: torch.Tensor
    buffers: TreeBuffers


class DynamicPolicy(StepTreePolicy):
    """Pass as `choose` to `TreeDecoder.generate` / `generate_batch`: every step drafts the
    super-tree S, scores it, and verifies the best subset of its nodes (see the module docstring).

    `super_tree`: S, a `Tree` (or its compiled `TreeBuffers`), at most MAX_SUPER_NODES nodes and no
    deeper than the heads. `step_ms`: step_ms[n-1] is the cost of a step verifying an n-node tree,
    for n = 1..S.num_nodes (any positive unit; only ratios matter), including S's drafting.
    `calibration`: a `Calibration` or its dict (None: identity). `cache_size`: the most subsets
    kept compiled (the oldest is dropped past it). `draft_ms`: draft_ms[d] is the cost of drafting
    S down to depth d, d = 0..S.depth (draft_ms[S.depth] is the drafting inside step_ms), needed
    when `stop_below` > 0: drafting stops after the first depth whose best calibrated value is
    below it (module docstring, step 4); 0 drafts the whole super-tree every step.

    Stateless between steps apart from the subset cache, so one policy may serve every sequence of
    a batch (each gets its own subset every step) and several decodes; `hits` / `misses` count the
    cache's look-ups (`hit_rate`)."""

    def __init__(self, super_tree: Tree | TreeBuffers, step_ms: Sequence[float],
                 calibration: Calibration | Mapping[str, Any] | None = None, cache_size: int = 4096,
                 draft_ms: Sequence[float] | None = None, stop_below: float = 0.0) -> None:
        if isinstance(super_tree, Tree):
            super_tree = TreeBuffers.compile(super_tree)
        if not isinstance(super_tree, TreeBuffers):
            raise TypeError(f"super_tree must be a runtime.tree.Tree or TreeBuffers, got {type(super_tree).__name__}")
        n = super_tree.num_nodes
        if n > MAX_SUPER_NODES:
            raise TreeError(f"the super-tree has {n} nodes; a dynamic policy takes at most {MAX_SUPER_NODES} "
                            "(its subsets are keyed by an int64 bitmask): give a smaller super-tree")
        costs = [float(c) for c in step_ms]
        if len(costs) != n or not all(math.isfinite(c) and c > 0 for c in costs):
            raise ValueError(f"step_ms needs one positive, finite cost per tree size 1..{n} (the super-tree's nodes), "
                             f"got {len(costs)} values")
        if calibration is None or isinstance(calibration, Mapping):
            calibration = Calibration.from_dict(calibration)
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration, its dict or None, got {type(calibration).__name__}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be an int >= 1, got {cache_size!r}")
        stop_below = float(stop_below)
        if not (math.isfinite(stop_below) and 0.0 <= stop_below <= 1.0):
            raise ValueError(f"stop_below must lie in [0, 1] (a calibrated acceptance estimate), got {stop_below}")
        depth = super_tree.depth
        if draft_ms is None:
            if stop_below > 0:
                raise ValueError("stop_below > 0 needs draft_ms (the cost of drafting the super-tree to each depth) "
                                 "to price a step that stops early")
            drafts = [0.0] * (depth + 1)
        else:
            drafts = [float(c) for c in draft_ms]
            if len(drafts) != depth + 1 or not all(math.isfinite(c) and c >= 0 for c in drafts):
                raise ValueError(f"draft_ms needs one non-negative, finite cost per drafted depth 0..{depth}, "
                                 f"got {len(drafts)} values")
            if any(b < a for a, b in zip(drafts, drafts[1:])) or drafts[-1] >= min(costs):
                raise ValueError(f"draft_ms {drafts} must not decrease with depth, and drafting the whole super-tree "
                                 f"must cost less than the cheapest step ({min(costs)}): it is part of step_ms")
        self.step_ms = costs
        self.draft_ms = drafts
        self.stop_below = stop_below
        self.calibration = calibration
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._super = super_tree
        self._device: torch.device | None = None
        self._bind(super_tree.depths.device)

    # -- setup ---------------------------------------------------------------------------------

    @property
    def super_tree(self) -> TreeBuffers:
        return self._super

    @property
    def num_nodes(self) -> int:
        return self._super.num_nodes

    @property
    def depth(self) -> int:
        return self._super.depth

    def _bind(self, device: torch.device) -> None:
        self._super = self._super.to(device)
        self._device = self._super.depths.device
        dev = self._device
        # _cost[d]: step costs [N] when the drafting stopped after depth d (row `depth`: step_ms)
        self._cost = torch.tensor([self.step_costs(d) for d in range(self.depth + 1)], dtype=torch.float32,
                                  device=dev)
        self._arange = torch.arange(self.num_nodes, device=dev)
        self._bits = torch.ones(self.num_nodes, dtype=torch.long, device=dev) << self._arange
        self._cache: dict[int, _Subset] = {}

    def prepare(self, device: torch.device | str, num_heads: int) -> None:
        """Check S against the heads and move it (and a fresh cache) to `device` if it lives elsewhere:
        the decoder calls this when a decode starts, so the steps find everything in place."""
        if self.depth > num_heads:
            raise ValueError(f"the super-tree has depth {self.depth} but the heads draft only {num_heads} tokens")
        if torch.device(device) != self._device:
            self._bind(torch.device(device))

    def step_costs(self, drafted: int) -> list[float]:
        """Costs of a step verifying n = 1..N nodes when S was drafted down to depth `drafted`."""
        saved = self.draft_ms[self.depth] - self.draft_ms[drafted]
        return [c - saved for c in self.step_ms]

    def reset_stats(self) -> None:
        self.hits = self.misses = 0

    @property
    def hit_rate(self) -> float:
        looks = self.hits + self.misses
        return self.hits / looks if looks else math.nan

    def stats(self) -> dict[str, float | int]:
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate, "cached": len(self._cache)}

    # -- one step ------------------------------------------------------------------------------

    def values(self, node_prob: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance estimates [N] of S's nodes from their head probabilities [N]
        (`DraftHeads.propose_scored`: each in [0, 1], the root's 1): path products, the
        calibration, then the minimum over each node's path (the root's 1 included), so that no
        node ranks above an ancestor, whatever the calibration or the rounding do."""
        mask = self._super.attn_mask
        path = torch.where(mask, node_prob.float(), 1.0).prod(dim=1)
        if not self.calibration.is_identity:
            path = self.calibration(path, self._super.depths, self._super.depth).clamp(0.0, 1.0)
            path[0] = 1.0
        return torch.where(mask, path, 1.0).amin(dim=1)

    def stops_after(self, depth: int, node_prob: torch.Tensor) -> bool:
        """Whether drafting stops after `depth`: no node at that depth has a calibrated value of
        `stop_below` or more. Reads only node_prob down to `depth` (a value depends on its path
        alone), so a decode that has drafted that far and a replay that holds every depth decide
        alike. One host synchronisation."""
        if self.stop_below <= 0.0 or depth >= self.depth:
            return False
        return self._below(self.values(node_prob), depth)

    def _below(self, vals: torch.Tensor, depth: int) -> bool:
        start, end = self._super.depth_slices[depth - 1]
        return bool(vals[start:end].max() < self.stop_below)

    def drafted_depth(self, node_prob: torch.Tensor) -> int:
        """The depth a decode drafts S to, given every node's probability (a replay's view): the
        rule of `stops_after`, on values computed once (a node's value reads only its path)."""
        if self.stop_below <= 0.0:
            return self.depth
        vals = self.values(node_prob)
        return next((d for d in range(1, self.depth) if self._below(vals, d)), self.depth)

    def _rank(self, node_prob: torch.Tensor, drafted: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values [N], nodes by decreasing value [N], n - 1 [1]) on the device (see `select`)."""
        vals = self.values(node_prob)
        if drafted < self.depth:   # nodes not drafted are never verified
            vals = vals.masked_fill(self._super.depths > drafted, -math.inf)
        ranked, order = torch.sort(vals, descending=True, stable=True)    # the root (1.0, index 0) first
        last = (ranked.cumsum(0) / self._cost[drafted]).argmax(dim=0, keepdim=True)
        return vals, order, last

    def select(self, node_prob: torch.Tensor, drafted: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keep [N] bool, n [1] int64, values [N]) on the device: the n nodes with the highest
        `values` (ties: the lower node index first, so a parent before its child), n maximising
        (1 + sum of the n-1 best non-root values) / step cost of n nodes (ties: the smaller n).
        `drafted`: the depth S was drafted to (default: all of it); deeper nodes are left out and
        the step costs `step_costs(drafted)`."""
        vals, order, last = self._rank(node_prob, self.depth if drafted is None else drafted)
        rank = torch.empty_like(order)
        rank[order] = self._arange
        return rank <= last, last + 1, vals

    def _lookup(self, key: int, nodes: Callable[[], torch.Tensor]) -> _Subset:
        """The cached subset under bitmask `key`; on a miss, compiled from `nodes()` (its node
        indices, increasing)."""
        entry = self._cache.get(key)
        if entry is not None:
            self.hits += 1
            return entry
        self.misses += 1
        idx = nodes()
        entry = _Subset(idx, self._super.subset(idx))
        if len(self._cache) >= self.cache_size:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = entry
        return entry

    def subset(self, keep: torch.Tensor) -> _Subset:
        """The cached subset for a keep mask [N] (compiled on a miss)."""
        return self._lookup(int((self._bits * keep).sum()), lambda: keep.nonzero().flatten())

    def draft(self, heads: Any, h: torch.Tensor, root: int) -> tuple[TreeBuffers, torch.Tensor, int]:
        """One step's tree: draft S with `heads` (a `runtime.decoder.Drafter`: heads or an EAGLE-3
        drafter) from context vector h after token `root` and choose its subset, as `select` does;
        (the subset's buffers, its tokens [n], the depth S was drafted to).

        The subset's bitmask is the sum of its nodes' bits, taken along the ranking; reading it
        is the step's one host synchronisation here (with `stop_below`, one more per depth drafted
        before the last), and a cache hit needs nothing else."""
        drafted = self.depth

        def stop(d: int, prob: torch.Tensor) -> bool:
            nonlocal drafted
            if self.stops_after(d, prob):
                drafted = d
                return True
            return False

        tokens, node_prob = heads.propose_scored(h, root, self._super, stop if self.stop_below > 0 else None)
        _, order, last = self._rank(node_prob, drafted)
        key = int(self._bits[order].cumsum(0)[last])
        entry = self._lookup(key, lambda: order[: int(last) + 1].sort().values)
        return entry.buffers, tokens.index_select(0, entry.idx), drafted

    def __repr__(self) -> str:
        stop = f", stop below {self.stop_below:g}" if self.stop_below > 0 else ""
        return (f"DynamicPolicy(super-tree {self.num_nodes} nodes, depth {self.depth}, {self.calibration!r}{stop}, "
                f"cache {len(self._cache)}/{self.cache_size})")
