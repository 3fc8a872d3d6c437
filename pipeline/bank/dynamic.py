"""EntMTP-dyn in the bank: which super-trees are scored, what a dynamic step costs, and the fit.

A DynamicPolicy (`runtime.dynamic`) drafts its super-tree S every step and verifies the n nodes it
picks, so a step verifying n nodes costs draft(S) + verify(n) + fixed (the time stage's
`StepCostModel`, at the bank's reference context); one that stops drafting after depth d
(`dynamic.stop_below`) pays draft(S to depth d) instead. Candidate super-trees are the grow frontier's
trees at its deepest max depth and the sizes `dynamic.super_sizes` (draft nodes), at most
MAX_SUPER_NODES nodes (a subset is keyed by a bitmask in one int64) and no more rows than the cost
model measured (past them its verify cost is only extrapolated). The calibration rollout is scored
for every candidate (`pipeline.rollout.score_prompt`), and `pipeline.bank.policies.fit_dynamic` keeps
the candidate and calibration with the best replayed tokens per second. The bank stage then prices
dyn as it runs (`build_dynamic`'s `price`): what a dyn step costs beyond its modeled cost (choosing
and building its subset, scoring the drafts), timed against EntMTP* in paired rounds, is added to
every step cost and the fit runs again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.timing.paired import DynamicCell
    from runtime.tree import Tree

# the format of the head scores (`pipeline.rollout.save_scores`); a reader refuses any other, and
# the scores' stage key holds it, so scores of another format are rebuilt (no torch here: an
# up-to-date check must not import it)
SCORES_FORMAT = 1


def super_tree_candidates(frontier: dict[str, Any], sizes: Sequence[int], num_heads: int,
                          max_nodes: int | None = None) -> list[Tree]:
    """The frontier trees (`grow`'s frontier.json) at the deepest max depth the heads can draft,
    one per size in `sizes` (draft nodes; a size past the frontier takes its largest tree), at most
    `max_nodes` nodes with the root (default MAX_SUPER_NODES), distinct, ordered by size."""
    from runtime.dynamic import MAX_SUPER_NODES
    from runtime.tree import Tree

    max_nodes = MAX_SUPER_NODES if max_nodes is None else max_nodes
    depths = sorted(int(d) for d in frontier.get("frontier", {}) if int(d) <= num_heads)
    if not depths:
        raise ValueError(f"the grow frontier has no tree the heads ({num_heads} draft tokens) can draft")
    entries = frontier["frontier"][str(depths[-1])]
    by_size = {len(e["paths"]): e["paths"] for e in entries if 0 < len(e["paths"]) < max_nodes}
    if not by_size:
        raise ValueError(f"the grow frontier has no tree of 1..{max_nodes - 1} draft nodes for a super-tree")
    out: list[Tree] = []
    for s in sorted(int(x) for x in sizes):
        fits = [n for n in by_size if n <= s]
        if not fits:
            continue
        t = Tree(by_size[max(fits)])
        if t not in out:
            out.append(t)
    return sorted(out, key=lambda t: t.num_nodes)


def dynamic_step_ms(cost_model: Any, super_tree: Tree, context: float) -> list[float]:
    """ms of a dynamic step verifying n = 1..N nodes of `super_tree` (N nodes): the whole super-tree
    drafted, n rows verified, the fixed part at n nodes and the depth an n-node subset reaches at
    most; draft and verify scaled by the model's `in_situ` factor, as `StepCostModel.predict` does."""
    draft = cost_model.draft(super_tree)
    out = []
    for n in range(1, super_tree.num_nodes + 1):
        depth = min(n - 1, super_tree.depth)
        out.append(cost_model.in_situ * (draft + cost_model.verify(n, context)) + cost_model.fixed(depth, n))
    return out


def dynamic_draft_ms(cost_model: Any, super_tree: Tree) -> list[float]:
    """ms of drafting `super_tree` down to depth d = 0..depth (scaled by `in_situ`, as in
    `dynamic_step_ms`): what a step that stops drafting early (`DynamicPolicy.stop_below`) spends.
    Medusa heads draft every depth in one product, so stopping saves them nothing: every entry is
    the whole draft."""
    from runtime.tree import Tree

    full = cost_model.in_situ * cost_model.draft(super_tree)
    if cost_model.kind == "medusa":
        return [full] * (super_tree.depth + 1)
    out = [cost_model.in_situ * cost_model.draft(Tree([p for p in super_tree.paths if len(p) <= d]))
           for d in range(super_tree.depth)]
    return [min(c, full) for c in out] + [full]


def cost_rows_limit(cost_model: Any) -> int:
    """The most nodes a super-tree may have under this cost model: its largest measured row count."""
    return int(max(cost_model.verify_rows))


def prompt_speedup_draws(rollouts: list[dict], scores: Sequence[Any], policy: Any, static_prompt_seconds: Sequence[float],
                         rank_cap: int | None = None) -> Any:
    """`pipeline.timing.paired.acceptance_draws` of dyn's replayed speed-up over EntMTP* (EntMTP*'s
    seconds over dyn's, the same tokens on both sides) across the calibration prompts: [draws]."""
    from pipeline.replay.dynamic import replay_dynamic
    from pipeline.timing.paired import acceptance_draws

    if len(static_prompt_seconds) != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollouts but EntMTP*'s seconds on {len(static_prompt_seconds)} prompts")
    dyn = [replay_dynamic([r], [sc], policy, rank_cap).time_s if len(r["rank_paths"]) > 1 else 0.0
           for r, sc in zip(rollouts, scores)]
    return acceptance_draws([list(static_prompt_seconds)], [dyn])[:, 0]


def build_dynamic(rollouts: list[dict], scores: dict[str, Any], cost_model: Any, context: float,
                  oracle_tok_per_s: float | None, rank_cap: int | None = None, calibrate: bool = True,
                  stop_below: Sequence[float] = (0.0,), price: Callable[..., DynamicCell] | None = None,
                  static_tok_per_s: float | None = None,
                  static_prompt_seconds: Sequence[float] | None = None) -> dict[str, Any] | None:
    """The bank's `dynamic` entry: `fit_dynamic` over the scored candidates (`pipeline.rollout.
    load_scores`) that the cost model covers and the early-stop thresholds `stop_below`, with the
    replayed share of the bank's oracle and of the super-tree's hindsight ceiling ("ceiling");
    None when no candidate is left.

    With `price` (`price(policy, replay_ratio, acceptance)`: the fitted `DynamicPolicy` timed against
    EntMTP*, `pipeline.timing.paired.measure_dynamic`) and EntMTP*'s replayed tok/s, dyn is priced as it runs:
    the cost per step the model leaves out (its scheduling, its scored drafting; measured paired
    against EntMTP*) is added to every step cost and the fit is run again, so its replayed figures,
    its subset sizes and its early-stop threshold pay for it; the refitted policy is timed again and
    the entry records that measurement under "paired" (`offered`: its interval against EntMTP*
    lies above 1 + the paired settings' `min_gain`). With `static_prompt_seconds` (EntMTP*'s replayed
    seconds on each calibration prompt) that interval also resamples the prompts behind dyn's
    replayed speed-up (`prompt_speedup_draws`)."""
    from pipeline.bank.policies import fit_dynamic
    from pipeline.replay.dynamic import dynamic_ceiling
    from runtime.dynamic import MAX_SUPER_NODES, DynamicPolicy
    from runtime.tree import Tree

    limit = min(cost_rows_limit(cost_model), MAX_SUPER_NODES)
    keep = [s for s, paths in enumerate(scores["super_trees"]) if len(paths) + 1 <= limit]
    if not keep:
        return None
    def fit(overhead_ms: float) -> dict[str, Any]:
        return fit_dynamic(rollouts, [Tree(scores["super_trees"][s]) for s in keep], [scores["scores"][s] for s in keep],
                           lambda t: [c + overhead_ms for c in dynamic_step_ms(cost_model, t, context)],
                           rank_cap=rank_cap, calibrate=calibrate, draft_ms_for=lambda t: dynamic_draft_ms(cost_model, t),
                           stop_below=stop_below)

    def policy_of(f: dict[str, Any]) -> DynamicPolicy:
        return DynamicPolicy(Tree(f["super_tree"]), f["step_ms"], f["calibration"], draft_ms=f["draft_ms"],
                             stop_below=f["stop_below"])

    fitted = fit(0.0)
    paired = None

    def draws(f: dict[str, Any]) -> Any:
        if static_prompt_seconds is None:
            return None
        s = next(s for s in keep if Tree(scores["super_trees"][s]) == Tree(f["super_tree"]))
        return prompt_speedup_draws(rollouts, scores["scores"][s], policy_of(f), static_prompt_seconds, rank_cap)

    if price is not None and static_tok_per_s:
        first = price(policy_of(fitted), fitted["replay"]["tokens_per_second"] / static_tok_per_s, draws(fitted))
        # a negative excess (dyn's steps cheaper than modeled, relative to EntMTP*'s) is model error,
        # not a cost of running dyn: nothing is taken off
        added = max(0.0, first.overhead())
        fitted = fit(added)
        ratio = fitted["replay"]["tokens_per_second"] / static_tok_per_s
        # "overhead_ms" of the record: what the priced policy still leaves unpriced (near 0 when priced right)
        paired = {**price(policy_of(fitted), ratio, draws(fitted)).record(ratio),
                  "measured_overhead_ms": first.overhead(), "priced_overhead_ms": added}
    tps = fitted["replay"]["tokens_per_second"]
    fitted["replay"]["share_of_oracle"] = tps / oracle_tok_per_s if oracle_tok_per_s and tps else None
    # what the fitted super-tree allows at best (`pipeline.replay.dynamic_ceiling`): the bound on
    # any per-step signal, beside the bank's oracle
    policy = DynamicPolicy(Tree(fitted["super_tree"]), fitted["step_ms"], draft_ms=fitted["draft_ms"])
    fitted["ceiling"] = dynamic_ceiling(rollouts, policy, rank_cap)
    fitted["replay"]["share_of_ceiling"] = tps / fitted["ceiling"]["tokens_per_second"] if tps else None
    fitted["context"] = float(context)
    if paired is not None:
        fitted["paired"] = paired
    return fitted
