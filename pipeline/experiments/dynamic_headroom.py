"""How far is EntMTP-dyn from what its super-tree allows, and would a richer acceptance signal help?

    python -m pipeline.experiments.dynamic_headroom [--tasks humaneval gsm8k sharegpt] [--heads hydra-draft8192]

Per task, on the bank's calibration rollout and at the bank's modeled step costs (no model runs):

* EntMTP-dyn as the bank fitted it (`pipeline.replay.replay_dynamic`);
* the oracle over the bank's static trees (the must-show's yardstick);
* the super-tree's hindsight ceiling (`pipeline.replay.dynamic_ceiling`): each step verifies just
  its accepted chain, so no per-step signal can do better with this super-tree and these costs;
* EntMTP-dyn whose node values come from a learned acceptance model instead of the calibrated path
  product: per depth, a logistic regression over every signal a decoder holds before it verifies
  (`NODE_FEATURES`: the path value, the head probability of the node and of each ancestor, the
  ranks on its path, the base model's top-1 probability and entropy, the heads' greedy-chain
  probabilities, and an exponential average of the decode's own past accepted lengths, the
  best single predictor in the EntMTP authors' feature study). Fitted and scored on the same
  prompts ("in-sample", optimistic: an upper estimate of what these signals add), and fitted on
  half the prompts and scored on the other half ("2-fold").

Writes artifacts/reports/benchmarks/dynamic_headroom.{csv,json}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import atomic_write_json
from pipeline.benchmarks import write_csv
from pipeline.experiments import bank_study_args, bank_layouts

STOP_GRID = (0.0, 0.1, 0.15, 0.2, 0.3, 0.4)
EMA_ALPHA = 0.3     # weight of the latest step in the average of past accepted lengths
RANK_BINS = 3       # a rank on the path enters as one of: 0, 1, 2 or more


def _log(x: Any) -> np.ndarray:
    return np.log(np.clip(np.asarray(x, dtype=np.float64), 1e-6, 1.0))


def node_features(rollout: dict, scores: np.ndarray, tree: Any) -> tuple[np.ndarray, list[str]]:
    """Signals of every non-root node of super-tree `tree` at every step index of one rollout, as
    [T, N-1, F] float32 (and the F names), all known before the step verifies; the average of past
    accepted lengths is left out (it depends on the schedule: `with_history`). Log-probabilities
    are clipped at 1e-6."""
    T, depth = len(rollout["rank_paths"]), tree.depth
    paths = tree.paths
    lp = _log(scores)                                                             # [T, N-1]
    node = {tuple(p): tree.node_index(p) - 1 for p in paths}                      # column of each path
    p0, ent = _log(rollout["p0"]), np.asarray(rollout["entropy"], dtype=np.float64)
    chains = np.concatenate([_log(rollout["head_top1"])[:, :depth], _log(rollout["greedy_top1"])[:, :depth]], 1)
    names = (["log path value", "log head prob", "log p0", "entropy", "log path value x log p0"]
             + [f"log head prob, ancestor at depth {d}" for d in range(1, depth + 1)]
             + [f"rank at depth {d} is {r}{'+' if r == RANK_BINS - 1 else ''}" for d in range(1, depth + 1)
                for r in range(RANK_BINS)]
             + [f"log head top-1, depth {d}" for d in range(1, depth + 1)]
             + [f"log greedy-chain top-1, depth {d}" for d in range(1, depth + 1)])
    out = np.zeros((T, len(paths), len(names)), dtype=np.float32)
    for p in paths:
        j = node[tuple(p)]
        anc = [node[tuple(p[:k])] for k in range(1, len(p) + 1)]
        f = out[:, j]
        f[:, 0] = lp[:, anc].sum(1)
        f[:, 1] = lp[:, j]
        f[:, 2], f[:, 3] = p0, ent
        f[:, 4] = f[:, 0] * p0
        f[:, 5: 5 + len(anc)] = lp[:, anc]
        for k, r in enumerate(p):
            f[:, 5 + depth + RANK_BINS * k + min(r, RANK_BINS - 1)] = 1.0
        f[:, 5 + depth * (1 + RANK_BINS):] = chains
    return out, names


def with_history(features: np.ndarray, history: np.ndarray) -> np.ndarray:
    """`features` [T, N-1, F] with two more columns: the average of past accepted lengths known at
    each step index [T], and its product with the log path value (column 0)."""
    h = np.broadcast_to(np.asarray(history, dtype=np.float32)[:, None], features.shape[:2])
    return np.concatenate([features, h[..., None], (h * features[..., 0])[..., None]], axis=2)


def history_along(T: int, visited: Sequence[int], accepted: Sequence[int], alpha: float = EMA_ALPHA) -> np.ndarray:
    """[T]: at each step index, the exponential average (weight `alpha` on the latest) of the
    accepted lengths of the steps a decode took before it (visited at `visited`, accepting
    `accepted`); 1.0 before the first step."""
    out = np.empty(T, dtype=np.float32)
    cur, done = 1.0, dict(zip((int(v) for v in visited), (int(a) for a in accepted)))
    for i in range(T):
        out[i] = cur
        if i in done:
            cur = alpha * done[i] + (1 - alpha) * cur
    return out


@dataclass
class AcceptanceModel:
    """Per depth, a logistic regression of "node accepted" on standardised node features."""

    depths: np.ndarray                                    # [N-1]: each column's depth
    per_depth: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, float]]   # d -> (mean, std, weights, bias)

    @classmethod
    def fit(cls, features: Sequence[np.ndarray], accepted: Sequence[np.ndarray], depths: np.ndarray,
            l2: float = 1e-3) -> AcceptanceModel:
        """Fit on per-prompt features [T, N-1, F] and labels [T, N-1] (the last step index left out:
        nothing follows it)."""
        import torch

        per_depth = {}
        for d in sorted({int(x) for x in depths}):
            cols = depths == d
            x = np.concatenate([f[:-1, cols].reshape(-1, f.shape[2]) for f in features]).astype(np.float64)
            y = np.concatenate([a[:-1, cols].reshape(-1) for a in accepted]).astype(np.float64)
            mean, std = x.mean(0), x.std(0) + 1e-6
            xt, yt = torch.tensor((x - mean) / std), torch.tensor(y)
            w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
            b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

            def loss() -> Any:
                opt.zero_grad()
                out = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt) + l2 * (w * w).sum()
                out.backward()
                return out

            opt.step(loss)
            per_depth[d] = (mean, std, w.detach().numpy(), float(b.item()))
        return cls(np.asarray(depths), per_depth)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """P(accepted) [..., N-1] of features [..., N-1, F]."""
        out = np.zeros(features.shape[:-1], dtype=np.float32)
        for d, (mean, std, w, b) in self.per_depth.items():
            cols = self.depths == d
            z = ((features[..., cols, :] - mean) / std) @ w + b
            out[..., cols] = 1.0 / (1.0 + np.exp(-z))
        return out


def accepted_labels(rollout: dict, tree: Any) -> np.ndarray:
    """[T, N-1] bool: whether a step at each index accepts each non-root node of `tree`."""
    R = np.asarray(rollout["rank_paths"])
    out = np.zeros((len(R), tree.num_nodes - 1), dtype=bool)
    for p in tree.paths:
        out[:, tree.node_index(p) - 1] = (R[:, : len(p)] == np.asarray(p)[None]).all(1)
    return out


def learned_replay(rollouts: Sequence[dict], features: Sequence[np.ndarray], model: AcceptanceModel, policy: Any,
                   stop_below: float, reveal: Sequence[np.ndarray] | None = None) -> Any:
    """Replay `policy`'s super-tree and costs with each step's node values from `model` (the
    average of past accepted lengths taken along this replay's own steps), early stop at
    `stop_below`; a `pipeline.replay.DynamicReplay`. `reveal` (per prompt, `accepted_labels`)
    hands the policy the truth about depth 1, knowledge no signal has: each depth-1 node is worth 1
    if accepted and 0 if not, and a deeper node the model's estimate over its depth-1 ancestor's
    (at most 1) under an accepted ancestor, else 0."""
    import torch

    from pipeline.replay.dynamic import replay_dynamic
    from runtime.dynamic import DynamicPolicy

    class GivenValues(DynamicPolicy):
        """Node values set from outside before each step (a root of 1, no node above its parent)."""

        given = torch.ones(policy.num_nodes)

        def values(self, node_prob: torch.Tensor) -> torch.Tensor:
            return torch.where(self._super.attn_mask, self.given, 1.0).amin(dim=1)

    pol = GivenValues(policy.super_tree, policy.step_ms, draft_ms=policy.draft_ms, stop_below=stop_below)
    tree = policy.super_tree.to_tree()
    # column of each node's depth-1 ancestor (the node itself at depth 1)
    first = np.asarray([tree.node_index(p[:1]) - 1 for p in sorted(tree.paths, key=tree.node_index)])
    state: dict[int, tuple[int, float]] = {}

    def at(n: int, i: int) -> Any:
        last, avg = state.get(n, (-1, 1.0))
        if last >= 0:
            avg = EMA_ALPHA * (i - last - 1) + (1 - EMA_ALPHA) * avg
        state[n] = (i, avg)
        f = with_history(features[n][i: i + 1], np.asarray([avg]))[0]
        est = model.predict(f)
        if reveal is not None:
            truth = reveal[n][i][first].astype(np.float32)
            est = np.where(first == np.arange(len(est)), truth, np.minimum(est / est[first].clip(1e-6), 1.0) * truth)
        pol.given = torch.cat([torch.ones(1), torch.from_numpy(est.astype(np.float32))])
        return pol

    scores = [np.zeros((len(r["rank_paths"]), policy.num_nodes - 1), dtype=np.float32) for r in rollouts]
    return replay_dynamic(rollouts, scores, pol, policy_at=at)


def learned_rows(rollouts: Sequence[dict], scores: Sequence[np.ndarray], policy: Any) -> dict[str, float]:
    """Tokens/s of EntMTP-dyn valued by an `AcceptanceModel`: fitted and scored on every prompt
    (best early stop of STOP_GRID), and 2-fold (fitted, early stop included, on the even prompts and
    scored on the odd ones, then the other way; pooled tokens over pooled time); and in-sample again
    with the depth-1 outcome revealed (`learned_replay`'s `reveal`), knowledge no signal has."""
    from pipeline.replay.dynamic import replay_dynamic

    tree = policy.super_tree.to_tree()
    feats = [node_features(r, np.asarray(sc), tree)[0] for r, sc in zip(rollouts, scores)]
    labels = [accepted_labels(r, tree) for r in rollouts]
    depths = np.asarray([len(p) for p in sorted(tree.paths, key=tree.node_index)])
    # the history the fit sees: along the bank's own policy's steps
    own = replay_dynamic(rollouts, scores, policy)
    hist = [with_history(f, history_along(len(f), v, a)) for f, v, a in zip(feats, own.visited, own.accepted)]

    def fitted(idx: Sequence[int]) -> tuple[AcceptanceModel, float, float]:
        """The model fitted on prompts `idx`, its best early stop there and its tokens/s with it."""
        model = AcceptanceModel.fit([hist[n] for n in idx], [labels[n] for n in idx], depths)
        rate, stop = max((learned_replay([rollouts[n] for n in idx], [feats[n] for n in idx], model, policy, s)
                          .tokens_per_second, s) for s in STOP_GRID)
        return model, stop, rate

    everyone = list(range(len(rollouts)))
    whole, _, rate = fitted(everyone)
    rows = {"in-sample": rate}
    tokens = seconds = 0.0
    for train, test in ((everyone[::2], everyone[1::2]), (everyone[1::2], everyone[::2])):
        model, stop, _ = fitted(train)
        rep = learned_replay([rollouts[n] for n in test], [feats[n] for n in test], model, policy, stop)
        tokens, seconds = tokens + rep.tokens, seconds + rep.time_s
    rows["2-fold"] = tokens / seconds
    rows["in-sample, told the depth-1 outcome"] = max(
        learned_replay(rollouts, feats, whole, policy, s, reveal=labels).tokens_per_second for s in STOP_GRID)
    return rows


def task_headroom(bank_dir: Path, work: Path) -> list[dict[str, Any]]:
    from pipeline.replay.dynamic import dynamic_ceiling, replay_dynamic
    from pipeline.rollout.record import load_rollout
    from pipeline.rollout.scores import load_scores
    from runtime.bank import TopologyBank
    from runtime.tree import Tree

    bank = TopologyBank.load(bank_dir)
    if not bank.dynamic:
        raise SystemExit(f"{bank_dir}: the bank has no EntMTP-dyn entry; rebuild it with dynamic.enabled=true")
    rollouts = load_rollout(work / "rollout")
    stored = load_scores(work / "scores", rollouts)
    tree = Tree(bank.dynamic["super_tree"])
    match = [s for s, paths in enumerate(stored["super_trees"]) if Tree(paths) == tree]
    if not match:
        raise SystemExit(f"{work / 'scores'} holds no scores of the bank's super-tree; run `make bank` again")
    scores = stored["scores"][match[0]]
    policy = bank.dynamic_policy()
    dyn = replay_dynamic(rollouts, scores, policy).tokens_per_second
    oracle = float(bank.oracle["tokens_per_second"])
    ceiling = dynamic_ceiling(rollouts, policy)["tokens_per_second"]
    rows = [("EntMTP-dyn (the bank's fit)", dyn), ("oracle over the bank", oracle),
            ("super-tree hindsight ceiling", ceiling)]
    for how, tps in learned_rows(rollouts, scores, policy).items():
        rows.append((f"EntMTP-dyn, learned acceptance model, {how}", tps))
    return [{"method": name, "tok_per_s": round(tps, 2), "share_of_oracle_pct": round(100 * tps / oracle, 1),
             "share_of_ceiling_pct": round(100 * tps / ceiling, 1)} for name, tps in rows]
def main(argv: list[str] | None = None) -> None:
    a = bank_study_args(__doc__, argv)
    results: dict[str, list[dict[str, Any]]] = {}
    for task, lay in bank_layouts(a, needs=("rollout", "scores")):
        results[task] = task_headroom(lay.bank_dir, lay.work)
        for r in results[task]:
            print(f"{task:10s} {r['method']:75s} {r['tok_per_s']:7.1f} tok/s  {r['share_of_oracle_pct']:5.1f}% of the "
                  f"oracle  {r['share_of_ceiling_pct']:5.1f}% of the ceiling")
    out = Path(a.out)
    write_csv(out / "dynamic_headroom.csv", [{"task": t, **r} for t, rows in results.items() for r in rows])
    atomic_write_json(out / "dynamic_headroom.json", results)


if __name__ == "__main__":
    main()
