"""A step-cost model whose tables were 'measured' from known cost functions (exact to interpolate)."""

from __future__ import annotations

from pipeline.timing.step_cost import StepCostModel
from runtime.tree import Tree

STEP_NUM_HEADS = 4
STEP_WIDTHS = [1, 2, 4, 8, 16, 32]


def verify_ms(n: float, ctx: float) -> float:
    """The known verify cost of `n` new rows at context `ctx`: bilinear, so interpolation is exact."""
    return 20.0 + 0.6 * n + 0.01 * ctx + 0.0004 * n * ctx


def level_ms(d: int, w: float) -> float:
    """The known cost of drafting level `d` of width `w`: linear in the width, exact too."""
    return 1.0 + 0.5 * d + 0.3 * w


def synthetic_step_model(kind: str = "hydra") -> StepCostModel:
    """A model whose tables were 'measured' from known cost functions."""
    rows, contexts = [1, 2, 3, 5, 9, 17, 33, 65], [100, 150, 250]
    widths = STEP_WIDTHS if kind == "hydra" else [1]
    prologue = 0.2

    def chains_ms(depth: int, w: int) -> float:  # propose of chains_tree(w, depth): level 1 has one row
        if kind == "medusa":
            return prologue + (2.0 + 0.7 * depth if depth else 0.0)
        return prologue + sum(level_ms(d, 1 if d == 1 else w) for d in range(1, depth + 1))

    return StepCostModel(kind=kind, num_heads=STEP_NUM_HEADS, verify_rows=rows, verify_contexts=contexts,
                         verify_ms=[[verify_ms(n, c) for n in rows] for c in contexts], draft_widths=widths,
                         draft_ms=[[chains_ms(d, w) for w in widths] for d in range(STEP_NUM_HEADS + 1)],
                         fixed_coef=[3.0, 0.4, 0.02])


class LinearCosts:
    """A stand-in for the time stage's StepCostModel with its interface (draft, verify, fixed): small
    linear costs, for the tests of EntMTP-dyn's pricing."""

    in_situ = 1.0
    kind = "hydra"
    verify_rows = [1, 2, 4, 8, 16, 32, 64]

    def draft(self, tree: Tree) -> float:
        return 0.1 * tree.depth

    def verify(self, rows: int, context: float) -> float:
        return 10.0 + 0.5 * rows + 0.001 * context

    def fixed(self, depth: int, nodes: int) -> float:
        return 0.3 + 0.01 * depth + 0.01 * nodes
