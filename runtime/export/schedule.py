"""Serving schedules: what a bank chose at each batch size, for engines that switch drafts by load.

A `ServingSchedule` holds, per *measured* batch size B (sorted, distinct ints >= 1), a `ServingChoice`:

* ``tree``: the best static tree at B (a `runtime.tree.Tree`), or None = no tree speculation at B;
* ``chain_len``: the best *chain*'s draft length at B, for engines that draft chains only
  (vLLM, TensorRT-LLM, SGLang's adaptive mode); 0 = no speculation at B;
* ``nodes``, ``depth``, ``topk``: the tree's shape (nodes include the root; ``topk`` is the smallest
  EAGLE beam width whose trees contain it, see `tree_topk`); 1, 0, 0 without a tree;
* ``tokens_per_step``, ``step_ms``, ``tok_per_s``: the tree's measured figures at B, where ``step_ms``
  is one verify step for the whole batch and ``tok_per_s`` the batch throughput (tokens/s summed
  over the batch); the ``chain_*`` figures are the same for the chain;
* ``ar_step_ms``: one plain autoregressive step for the whole batch at B;
* the cost row of B: ``tree_step_ms`` / ``tree_tok_per_s``, one entry per bank tree (``ServingSchedule.trees``).

Between measured batch sizes, and when an engine is told the schedule, one rule applies everywhere
(`ServingSchedule.choice_for`): a load of b sequences uses the choice of the smallest measured batch
size >= b, and there is no speculation above the largest measured batch size. Every interval ends at
a batch size where the choice was measured to pay, which is the conservative side when drafts shrink
as load grows, and nothing is claimed beyond the evidence. It is also TensorRT-LLM's native rule
(``draft_len_schedule``, see `runtime.export.engines`); the vLLM and SGLang exports spell it out explicitly.

The bank.json contract: key ``"batch_sizes"``
---------------------------------------------
The bank stage records its per-batch-size choices in bank.json under ``"batch_sizes"``, and a loaded
bank exposes the same mapping as ``bank.batch_schedule``. `choices_from_batch_sizes` reads it in this
shape (every number a finite JSON number; ``k`` indexes the bank's ``"trees"`` list); the bank side
(`runtime.bank.TopologyBank.serving_schedule`) turns a bank into a `ServingSchedule` with it, and this
module knows no bank::

    "batch_sizes": {
      "<B>": {                                   # batch size as a decimal string: "1", "8", "32", ...
        "best_static": <int k> | null,           # the best tree at B; null = no tree speculation at B
        "best_chain": {                          # the best chain (0,), (0, 0), ... at B; null = none
          "depth": <int >= 1>,                   #   draft length (chain tokens after the root)
          "tokens_per_step": <number >= 1>,      #   tokens accepted per step and sequence
          "step_ms": <number > 0>,               #   one verify step for the whole batch
          "tok_per_s": <number > 0>              #   batch throughput, tokens/s summed over the batch
        } | null,
        "ar_step_ms": <number > 0> | null,       # one plain AR step for the whole batch
        "step_ms": [<number > 0> | null, ...],   # per bank tree, in bank order: one verify step for the batch
        "tok_per_s": [<number > 0> | null, ...]  # per bank tree: batch throughput (null = not measured)
      },
      ...
    }

Keys must be distinct batch sizes >= 1; ``step_ms`` and ``tok_per_s`` hold exactly one entry per
bank tree, and the entry of ``best_static`` must be measured. A tree's tokens per step do not
depend on the batch size (acceptance is per sequence); they come from the bank's per-tree figures.
In memory, ``bank.batch_schedule`` holds the same mapping (int keys allowed). Every bank has the
record: the loader refuses one without it (built before the batch axis) with a rebuild message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.tree import Tree

RECORD = "batch_sizes"  # the record's name in error messages (bank.json's key for it)


class ScheduleError(ValueError):
    """An invalid serving schedule, or a bank's per-batch-size record that breaks the contract."""


# ------------------------------------------------------------------------------------ tree shape


def tree_topk(tree: Tree) -> int:
    """The smallest EAGLE beam width (SGLang's ``--speculative-eagle-topk``) whose draft trees contain `tree`.

    SGLang's EAGLE drafter (``select_top_k_tokens`` in python/sglang/srt/speculative/eagle_utils.py)
    keeps ``topk`` nodes per depth and gives each ``topk`` children, so a tree fits when no node has
    more than ``topk`` children and no depth has more than ``topk`` nodes with children. 0 for the
    root-only tree.
    """
    children: dict[tuple[int, ...], int] = {}
    for p in tree.paths:
        children[p[:-1]] = children.get(p[:-1], 0) + 1
    if not children:
        return 0
    parents_per_depth: dict[int, int] = {}
    for parent in children:
        parents_per_depth[len(parent)] = parents_per_depth.get(len(parent), 0) + 1
    return max(max(children.values()), max(parents_per_depth.values()))


def eagle_pool(depth: int, topk: int) -> int:
    """Draft candidates an EAGLE tree of this depth and width can hold (root excluded): ``topk`` at the
    first step, ``topk**2`` at each later one (SGLang PR #24054 states the same bound)."""
    return 0 if depth <= 0 or topk <= 0 else topk + (depth - 1) * topk * topk


# ---------------------------------------------------------------------------------- validation


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _figure(value: Any, name: str, where: str, at_least_one: bool = False) -> float | None:
    """A measured figure: None, or a finite number > 0 (>= 1 for tokens per step)."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ScheduleError(f"{where}: {name} must be a finite number or null, got {value!r}")
    if (at_least_one and value < 1) or value <= 0:
        raise ScheduleError(f"{where}: {name}={value!r} must be {'>= 1' if at_least_one else '> 0'}")
    return value


def _batch_size(value: Any, where: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value < 1:
        raise ScheduleError(f"{where}: a batch size must be an int >= 1, got {value!r}")
    return value


# ------------------------------------------------------------------------------------ the types


@dataclass(frozen=True)
class ServingChoice:
    """The bank's choice at one measured batch size (see the module docstring for every field).

    Give ``tree`` and the shape is derived from it. Without a tree, ``nodes``/``depth``/``topk`` may
    still describe a tree known only by its shape (what an engine config such as SGLang's flags
    carries); ``nodes == 1`` then means no tree speculation. A root-only tree is stored as None.
    """

    batch_size: int
    tree: Tree | None = None
    chain_len: int = 0
    nodes: int | None = None
    depth: int | None = None
    topk: int | None = None
    tokens_per_step: float | None = None
    step_ms: float | None = None
    tok_per_s: float | None = None
    chain_tokens_per_step: float | None = None
    chain_step_ms: float | None = None
    chain_tok_per_s: float | None = None
    ar_step_ms: float | None = None
    tree_index: int | None = None
    tree_step_ms: tuple[float | None, ...] = ()
    tree_tok_per_s: tuple[float | None, ...] = ()

    def __post_init__(self) -> None:
        where = f"batch size {self.batch_size!r}"
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ScheduleError(f"a batch size must be an int >= 1, got {self.batch_size!r}")
        tree = self.tree
        if tree is not None and not isinstance(tree, Tree):
            raise ScheduleError(f"{where}: tree must be a runtime.tree.Tree or None, got {type(tree).__name__}")
        if tree is not None and len(tree) == 0:
            tree = None  # the root alone is plain AR: no speculation
            object.__setattr__(self, "tree", None)
        if tree is not None:
            shape = (tree.num_nodes, tree.depth, tree_topk(tree))
        elif self.nodes is None or self.nodes == 1:
            shape = (1, 0, 0)
        else:
            shape = (self.nodes, self.depth, self.topk)
            if not all(_is_int(v) for v in shape) or not (
                    1 <= self.depth <= self.nodes - 1 and 1 <= self.topk <= self.nodes - 1
                    and self.nodes - 1 <= eagle_pool(self.depth, self.topk)):
                raise ScheduleError(f"{where}: nodes={self.nodes!r}, depth={self.depth!r}, topk={self.topk!r} "
                                    "is no tree shape (need 1 <= depth, topk <= nodes - 1 and nodes - 1 <= "
                                    "topk + (depth - 1) * topk**2)")
        for name, want in zip(("nodes", "depth", "topk"), shape):
            given = getattr(self, name)
            if given is not None and given != want:
                raise ScheduleError(f"{where}: {name}={given!r} does not match its tree ({name}={want})")
            object.__setattr__(self, name, want)
        if not _is_int(self.chain_len) or self.chain_len < 0:
            raise ScheduleError(f"{where}: chain_len must be an int >= 0, got {self.chain_len!r}")
        for name in ("tokens_per_step", "chain_tokens_per_step"):
            _figure(getattr(self, name), name, where, at_least_one=True)
        for name in ("step_ms", "tok_per_s", "chain_step_ms", "chain_tok_per_s", "ar_step_ms"):
            _figure(getattr(self, name), name, where)
        if self.tree_index is not None and (not _is_int(self.tree_index) or self.tree_index < 0):
            raise ScheduleError(f"{where}: tree_index must be an int >= 0 or None, got {self.tree_index!r}")
        for name in ("tree_step_ms", "tree_tok_per_s"):
            row = tuple(getattr(self, name))
            for v in row:
                _figure(v, name, where)
            object.__setattr__(self, name, row)
        if len(self.tree_step_ms) != len(self.tree_tok_per_s):
            raise ScheduleError(f"{where}: tree_step_ms and tree_tok_per_s must have one entry per bank tree each "
                                f"({len(self.tree_step_ms)} vs {len(self.tree_tok_per_s)})")

    @property
    def speculates(self) -> bool:
        """Whether the bank speculates at this batch size, with a tree or a chain."""
        return self.nodes > 1 or self.chain_len > 0


@dataclass(frozen=True)
class ServingSchedule:
    """The bank's choice per measured batch size, plus the bank's trees (the cost table's columns).

    ``source`` names where it came from (a bank folder).
    """

    choices: tuple[ServingChoice, ...]
    trees: tuple[Tree, ...] = ()
    source: str | None = None
    _by_size: dict[int, ServingChoice] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        choices = tuple(self.choices)
        if not choices or not all(isinstance(c, ServingChoice) for c in choices):
            raise ScheduleError("a serving schedule needs at least one ServingChoice")
        sizes = [c.batch_size for c in choices]
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ScheduleError(f"batch sizes must be distinct and ascending, got {sizes}")
        trees = tuple(self.trees)
        if not all(isinstance(t, Tree) for t in trees):
            raise ScheduleError("trees must be runtime.tree.Tree objects")
        for c in choices:
            if c.tree_index is not None:
                if c.tree_index >= len(trees) or trees[c.tree_index] != c.tree:
                    raise ScheduleError(f"batch size {c.batch_size}: tree_index {c.tree_index} is not its tree among "
                                        f"the {len(trees)} schedule trees")
            if c.tree_step_ms and len(c.tree_step_ms) != len(trees):
                raise ScheduleError(f"batch size {c.batch_size}: the cost row has {len(c.tree_step_ms)} entries for "
                                    f"{len(trees)} trees")
        if self.source is not None and not isinstance(self.source, str):
            raise ScheduleError(f"source must be a str or None, got {type(self.source).__name__}")
        object.__setattr__(self, "choices", choices)
        object.__setattr__(self, "trees", trees)
        object.__setattr__(self, "_by_size", {c.batch_size: c for c in choices})

    # --- queries --------------------------------------------------------------------------------

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(c.batch_size for c in self.choices)

    @property
    def max_chain_len(self) -> int:
        return max(c.chain_len for c in self.choices)

    def choice(self, batch_size: int) -> ServingChoice:
        """The choice measured at exactly `batch_size` (ValueError naming the measured ones otherwise)."""
        try:
            return self._by_size[batch_size]
        except (KeyError, TypeError):
            raise ScheduleError(f"batch size {batch_size!r} was not measured; this schedule has "
                                f"{list(self.batch_sizes)}") from None

    def choice_for(self, load: int) -> ServingChoice | None:
        """The choice serving `load` sequences: that of the smallest measured batch size >= load; None
        (no speculation) above the largest measured batch size."""
        if not _is_int(load) or load < 1:
            raise ScheduleError(f"a load must be an int >= 1, got {load!r}")
        for c in self.choices:
            if c.batch_size >= load:
                return c
        return None

    def chain_len_for(self, load: int) -> int:
        c = self.choice_for(load)
        return 0 if c is None else c.chain_len

    def restrict(self, batch_size: int) -> ServingSchedule:
        """This schedule reduced to the choice at one measured batch size (it then serves loads up to it)."""
        return replace(self, choices=(self.choice(batch_size),))

    def shifted(self, margin: int) -> ServingSchedule:
        """The boundary margin of the engine exports: every batch size moved up by `margin`, so a load
        of b takes the choice measured at the smallest batch size >= b - margin, and nothing speculates
        only above the largest measured batch size + margin. An engine counts every scheduled request in
        its batch size, prefills included, which the bank's timed decode batches did not hold; with a
        margin, up to `margin` such extra requests (or one request arriving at a boundary) no longer
        flip the draft length. The figures stay those measured at the original batch sizes."""
        if not _is_int(margin) or margin < 0:
            raise ScheduleError(f"the boundary margin must be an int >= 0 (sequences), got {margin!r}")
        if margin == 0:
            return self
        return replace(self, choices=tuple(replace(c, batch_size=c.batch_size + margin) for c in self.choices))

    def cost_table(self) -> dict[str, Any]:
        """Step cost by batch size and tree/chain, as columns: ``batch_sizes``, ``ar_step_ms``,
        ``tree_step_ms`` / ``tree_tok_per_s`` (one row per batch size, one column per tree; empty rows
        where not measured) and ``chain`` (the best chain's depth, step_ms and tok_per_s per batch size)."""
        return {
            "batch_sizes": list(self.batch_sizes),
            "ar_step_ms": [c.ar_step_ms for c in self.choices],
            "tree_step_ms": [list(c.tree_step_ms) for c in self.choices],
            "tree_tok_per_s": [list(c.tree_tok_per_s) for c in self.choices],
            "chain": [None if c.chain_len == 0 else {"depth": c.chain_len, "step_ms": c.chain_step_ms,
                                                    "tok_per_s": c.chain_tok_per_s}
                      for c in self.choices],
        }


# ------------------------------------------------------------------------ from a bank's record


def _check_index(k: Any, n: int, where: str) -> int | None:
    if k is None:
        return None
    if not _is_int(k) or not 0 <= k < n:
        raise ScheduleError(f"{where}: best_static={k!r} is not a tree index in 0..{n - 1} (or null)")
    return k


def _row(values: Any, name: str, n: int, where: str) -> tuple[float | None, ...]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ScheduleError(f"{where}: {name} must be a list with one entry per bank tree ({n}), got {values!r:.80}")
    return tuple(_figure(v, f"{name}[{i}]", where) for i, v in enumerate(values))


def choices_from_batch_sizes(batch_sizes: Mapping[Any, Any], trees: Sequence[Tree],
                             figures: Sequence[Mapping[str, Any]]) -> tuple[ServingChoice, ...]:
    """The choices recorded under bank.json's ``"batch_sizes"`` (the contract in the module docstring)."""
    if not isinstance(batch_sizes, Mapping) or not batch_sizes:
        raise ScheduleError(f"'{RECORD}' must be a non-empty object keyed by batch size, got {batch_sizes!r:.80}")
    n = len(trees)
    parsed: dict[int, ServingChoice] = {}
    for key, entry in batch_sizes.items():
        b = _batch_size(key, f"'{RECORD}' key {key!r}")
        where = f"'{RECORD}'[{key!r}]"
        if b in parsed:
            raise ScheduleError(f"{where}: batch size {b} is listed twice")
        if not isinstance(entry, Mapping):
            raise ScheduleError(f"{where} must be an object, got {type(entry).__name__}")
        missing = {"best_static", "best_chain", "ar_step_ms", "step_ms", "tok_per_s"} - set(entry)
        if missing:
            raise ScheduleError(f"{where} lacks {sorted(missing)}")
        k = _check_index(entry["best_static"], n, where)
        step_row, tps_row = _row(entry["step_ms"], "step_ms", n, where), _row(entry["tok_per_s"], "tok_per_s", n, where)
        chain = entry["best_chain"]
        if chain is not None:
            if not isinstance(chain, Mapping) or not _is_int(chain.get("depth")) or chain["depth"] < 1:
                raise ScheduleError(f"{where}: best_chain must be null or an object with an int depth >= 1, "
                                    f"got {chain!r:.80}")
            for name in ("tokens_per_step", "step_ms", "tok_per_s"):
                if chain.get(name) is None:
                    raise ScheduleError(f"{where}: best_chain lacks {name}")
        tree = trees[k] if k is not None and len(trees[k]) else None  # a root-only tree is no speculation
        if tree is not None and (step_row[k] is None or tps_row[k] is None):
            raise ScheduleError(f"{where}: best_static {k} has no measured step_ms/tok_per_s at this batch size")
        fig = figures[k] if tree is not None and k < len(figures) else {}
        parsed[b] = ServingChoice(
            batch_size=b, tree=tree, tree_index=k if tree is not None else None,
            chain_len=0 if chain is None else chain["depth"],
            tokens_per_step=fig.get("tokens_per_step"),
            step_ms=step_row[k] if tree is not None else None,
            tok_per_s=tps_row[k] if tree is not None else None,
            chain_tokens_per_step=None if chain is None else chain["tokens_per_step"],
            chain_step_ms=None if chain is None else chain["step_ms"],
            chain_tok_per_s=None if chain is None else chain["tok_per_s"],
            ar_step_ms=_figure(entry["ar_step_ms"], "ar_step_ms", where),
            tree_step_ms=step_row, tree_tok_per_s=tps_row,
        )
    return tuple(parsed[b] for b in sorted(parsed))

