"""EntMTP-dyn in the offline pipeline: the rollout's head scores are the decoder's, the replay of
a DynamicPolicy equals real decodes step by step, the calibration fit is monotone, the bank stores
and reloads the policy, and the evaluation has its row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.bank.dynamic import build_dynamic, dynamic_step_ms, super_tree_candidates
from pipeline.bank.policies import calibration_samples, fit_calibration, fit_dynamic
from pipeline.replay.dynamic import compare_dynamic_steps, dynamic_ceiling, replay_dynamic
from pipeline.rollout.scores import SCORES_META, load_scores, save_scores, score_prompt
from runtime.bank import BankError, TopologyBank
from runtime.decoder import TreeDecoder
from runtime.dynamic import DYNAMIC_TREE, Calibration, DynamicPolicy
from runtime.tree import Tree, TreeBuffers
from tests.helpers.step_cost import LinearCosts
from tests.helpers import make_bank, scored_rollouts, tiny_heads, torch_threads
from tests.helpers import ARITHMETICS, DRAFTS, GENTLE, SUPER, invariant_model, random_prompts

K = 10        # rank cap of the tiny rollouts
NEW = 30      # new tokens per prompt


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _real_decodes(model, heads, prompts: list[list[int]], policy: DynamicPolicy) -> list:
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(Tree([]))])
    return [dec.generate(ids, NEW, choose=policy) for ids in prompts]


# --- the rollout's scores -------------------------------------------------------------------------


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_scores_are_the_probabilities_a_decode_sees(arithmetic: str, kind: str) -> None:
    """Every step of a real dynamic decode drafts its super-tree with exactly the probabilities
    that `score_prompt` stored for that step index (bit for bit)."""
    model = invariant_model(arithmetic)
    heads = tiny_heads(model, kind)
    seen: list[torch.Tensor] = []
    scored = heads.propose_scored

    def spy(h, root, buf, stop_after=None):  # noqa: ANN001, ANN202
        tokens, prob = scored(h, root, buf, stop_after)
        seen.append(prob.clone())
        return tokens, prob

    steps = 0
    for ids in random_prompts(4):
        seen.clear()
        heads.propose_scored = spy
        res = _real_decodes(model, heads, [ids], DynamicPolicy(SUPER, GENTLE))[0]
        heads.propose_scored = scored
        (sc,) = score_prompt(model, heads, ids, res.tokens, [TreeBuffers.compile(SUPER)])
        assert sc.dtype == np.float32 and sc.shape == (len(res.tokens), SUPER.num_nodes - 1)
        i = 0
        for step, prob in zip(res.steps, seen):
            assert np.array_equal(prob[1:].numpy(), sc[i]), (kind, i)
            i += step.accepted + 1
            steps += 1
    assert steps > 20


def test_scores_round_trip_and_refuse_another_rollout(tmp_path: Path) -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    small = Tree([(0,), (1,), (0, 0)])
    rolls, scores = scored_rollouts(model, heads, random_prompts(3), [SUPER, small])
    save_scores(tmp_path, [r["id"] for r in rolls], [list(SUPER.paths), list(small.paths)],
                [[scores[0][n], scores[1][n]] for n in range(len(rolls))], "digest")
    got = load_scores(tmp_path, rolls)
    assert got["super_trees"] == [list(SUPER.paths), list(small.paths)] and got["rollout"] == "digest"
    for s in range(2):
        for a, b in zip(got["scores"][s], scores[s]):
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="belong to another rollout"):
        load_scores(tmp_path, rolls[:2])
    meta = json.loads((tmp_path / SCORES_META).read_text())
    (tmp_path / SCORES_META).write_text(json.dumps({**meta, "format": 0}))
    with pytest.raises(ValueError, match="format 0, this code reads 1"):
        load_scores(tmp_path)
    with pytest.raises(FileNotFoundError, match="no head scores"):
        load_scores(tmp_path / "missing")


# --- replay == real decodes -------------------------------------------------------------------------


CALS = {"identity": Calibration(),
        "per-depth": Calibration(xs=[[0.0, 0.5, 1.0], [0.0, 0.2, 1.0]], ys=[[0.0, 0.1, 0.6], [0.0, 0.02, 0.3]])}
STOPS = {"identity": 0.1, "per-depth": 0.03}


@pytest.mark.parametrize("stop", [False, True], ids=["whole", "early-stop"])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("cal", list(CALS))
def test_replay_equals_real_decodes_step_by_step(arithmetic: str, cal: str, stop: bool) -> None:
    """Recalibrate's check for EntMTP-dyn: on every step of real decodes, the replay from the rank
    paths and head scores visits the same step index, drafts to the same depth, picks a subset of
    the same size and accepts the same length; tokens per step and modeled time agree in total."""
    model = invariant_model(arithmetic)
    heads = tiny_heads(model, "hydra")
    prompts = random_prompts(5, seed=1)
    rolls, (scores,) = scored_rollouts(model, heads, prompts, [SUPER])
    # thresholds that make these tiny heads stop at different depths under each calibration
    policy = DynamicPolicy(SUPER, GENTLE, CALS[cal], draft_ms=DRAFTS, stop_below=STOPS[cal] if stop else 0.0)
    replay = replay_dynamic(rolls, scores, policy)
    real = _real_decodes(model, heads, prompts, policy)
    compared = 0
    sizes = set()
    for n, (ro, res) in enumerate(zip(rolls, real)):
        assert res.tokens == ro["tokens"].tolist()
        assert all(s.tree == DYNAMIC_TREE for s in res.steps)
        cmp = compare_dynamic_steps(replay, n, [s.accepted for s in res.steps], [s.nodes for s in res.steps],
                                    len(ro["tokens"]))
        assert cmp["disagreements"] == [] and cmp["steps_agree"] == cmp["steps_compared"] == len(res.steps)
        compared += cmp["steps_compared"]
        sizes.update(s.nodes for s in res.steps)
    assert replay.steps == sum(len(r.steps) for r in real) == compared
    assert replay.tokens_per_step == pytest.approx(sum(len(r.tokens) - 1 for r in real) / compared)
    assert len(sizes) >= 2, f"every step verified {sizes} nodes: the test exercised little"
    # modeled time: one cost per step, by its size and the depth it drafted to
    want = sum(policy.step_costs(s.depth)[s.nodes - 1] for r in real for s in r.steps) / 1000
    assert replay.time_s == pytest.approx(want)
    depths = np.bincount([s.depth for r in real for s in r.steps], minlength=SUPER.depth + 1)
    assert replay.depth_steps.tolist() == depths.tolist()
    if stop:
        assert np.count_nonzero(depths) >= 2, f"every step drafted to the same depth {depths}: the test exercised little"


def test_replay_refuses_scores_of_another_shape() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(1), [SUPER])
    with pytest.raises(ValueError, match="float32"):
        replay_dynamic(rolls, [scores[0][:, :3]], DynamicPolicy(SUPER, GENTLE))
    with pytest.raises(ValueError, match="head scores for 2 prompts"):
        replay_dynamic(rolls, scores * 2, DynamicPolicy(SUPER, GENTLE))


# --- the calibration fit -----------------------------------------------------------------------------


def test_fit_calibration_is_monotone_and_follows_the_observed_rates() -> None:
    g = np.random.default_rng(0)
    values = g.random(20000)
    depths = g.integers(1, 4, size=values.size)
    # acceptance rate: depth 1 well calibrated, depth 2 over-confident (half the value), depth 3 noisy
    rate = np.where(depths == 1, values, np.where(depths == 2, values / 2, np.clip(values + 0.3 * g.standard_normal(values.size), 0, 1)))
    accepted = g.random(values.size) < rate
    fit = fit_calibration(values, depths, accepted, max_depth=4, bins=10)
    cal = Calibration.from_dict(fit)  # the runtime's own checks: knots increasing in [0, 1], values non-decreasing
    assert len(cal.xs) == 4
    assert cal.xs[3] == [0.0, 1.0] and cal.ys[3] == [0.0, 1.0]   # no samples at depth 4: the identity
    for d in range(3):
        assert all(b >= a for a, b in zip(cal.ys[d], cal.ys[d][1:]))
    x = torch.tensor([0.2, 0.8])
    at = lambda d: cal(x, torch.full((2,), d), 4).tolist()  # noqa: E731
    assert at(1) == pytest.approx([0.2, 0.8], abs=0.06)
    assert at(2) == pytest.approx([0.1, 0.4], abs=0.06)


def test_calibration_samples_count_every_node_at_every_step() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(3, seed=2), [SUPER])
    v, d, a = calibration_samples(rolls, scores, SUPER)
    steps = sum(len(r["tokens"]) - 1 for r in rolls)
    assert v.shape == d.shape == a.shape == (steps * (SUPER.num_nodes - 1),)
    assert ((v >= 0) & (v <= 1)).all() and set(d.tolist()) <= {1, 2, 3, 4}
    # an accepted node's value counts; accepted depth-1 nodes = steps whose rank path starts in the tree
    first = {p[0] for p in SUPER.paths if len(p) == 1}
    want = sum(int(r["rank_paths"][i, 0]) in first for r in rolls for i in range(len(r["tokens"]) - 1))
    assert int(a[d == 1].sum()) == want
    fit = fit_calibration(v, d, a, SUPER.depth, min_samples=10)
    Calibration.from_dict(fit)


def test_fit_dynamic_keeps_the_fastest_candidate() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    small = Tree([(0,), (1,), (0, 0)])
    rolls, scores = scored_rollouts(model, heads, random_prompts(4, seed=3), [small, SUPER])
    cost = lambda t: [1.0 + 0.02 * k for k in range(t.num_nodes)]  # noqa: E731
    fit = fit_dynamic(rolls, [small, SUPER], scores, cost, draft_ms_for=lambda t: [0.01 * d for d in range(t.depth + 1)],
                      stop_below=[0.3])
    assert len(fit["candidates"]) == 8   # two trees, identity and fitted calibration, drafting all or stopping
    assert {c["stop_below"] for c in fit["candidates"]} == {0.0, 0.3}
    best = max(c["tokens_per_second"] for c in fit["candidates"])
    assert fit["replay"]["tokens_per_second"] == pytest.approx(best)
    pol = DynamicPolicy(Tree(fit["super_tree"]), fit["step_ms"], fit["calibration"], draft_ms=fit["draft_ms"],
                        stop_below=fit["stop_below"])
    s = [Tree(fit["super_tree"])] == [small]
    again = replay_dynamic(rolls, scores[0 if s else 1], pol)
    assert again.tokens_per_second == pytest.approx(best)


def test_the_ceiling_bounds_every_dynamic_policy_and_is_reached_by_hindsight() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(4, seed=5), [SUPER])
    ceiling = dynamic_ceiling(rolls, DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS))
    assert ceiling["tokens"] == sum(len(r["rank_paths"]) - 1 for r in rolls)
    for cal in CALS.values():
        for stop in (0.0, 0.03, 0.1):
            pol = DynamicPolicy(SUPER, GENTLE, cal, draft_ms=DRAFTS, stop_below=stop)
            assert replay_dynamic(rolls, scores, pol).tokens_per_second <= ceiling["tokens_per_second"] * (1 + 1e-9)
    # a greedy walk that verifies each step's accepted chain (drafted just that deep) is one of the
    # schedules the ceiling's dynamic program weighs, so the ceiling is at least as fast
    index = {(): 0, **{tuple(p): SUPER.node_index(p) for p in SUPER.paths}}
    pol = DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS)
    tokens, ms = 0, 0.0
    for r in rolls:
        R, i = r["rank_paths"], 0
        while i < len(R) - 1:
            k = max(d for d in range(SUPER.depth + 1) if tuple(int(x) for x in R[i, :d]) in index)
            ms += pol.step_costs(max(k, 1))[k]
            i = min(i + k + 1, len(R) - 1)
        tokens += len(R) - 1
    assert 1000 * tokens / ms <= ceiling["tokens_per_second"] * (1 + 1e-9)
    assert 1000 * tokens / ms >= 0.9 * ceiling["tokens_per_second"]


# --- the bank -------------------------------------------------------------------------------------


def test_step_ms_and_candidates() -> None:
    ms = dynamic_step_ms(LinearCosts(), SUPER, 100.0)
    assert len(ms) == SUPER.num_nodes and all(b > a for a, b in zip(ms, ms[1:]))
    assert ms[0] == pytest.approx(0.4 + 10.0 + 0.5 + 0.1 + 0.3 + 0.01)
    frontier = {"frontier": {"2": [{"paths": [[0]]}, {"paths": [[0], [1]]}],
                             "3": [{"paths": [[0]]}, {"paths": [[0], [0, 0]]}, {"paths": [[0], [0, 0], [0, 0, 0]]}]}}
    got = super_tree_candidates(frontier, [1, 2, 8], num_heads=4)
    assert [t.num_nodes for t in got] == [2, 3, 4]
    assert [t.num_nodes for t in super_tree_candidates(frontier, [2], num_heads=2)] == [3]
    with pytest.raises(ValueError, match="no tree the heads"):
        super_tree_candidates(frontier, [2], num_heads=1)


def test_bank_round_trip_with_the_dynamic_policy(tmp_path: Path) -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(3), [SUPER])
    dyn = build_dynamic(rolls, {"super_trees": [list(SUPER.paths)], "scores": [scores]}, LinearCosts(), 100.0,
                        oracle_tok_per_s=200.0)
    assert dyn is not None and dyn["replay"]["share_of_oracle"] == pytest.approx(dyn["replay"]["tokens_per_second"] / 200)
    bank = make_bank()
    bank.dynamic = dyn
    bank.save(tmp_path / "bank")
    back = TopologyBank.load(tmp_path / "bank", max_depth=4)
    assert back.dynamic == json.loads(json.dumps(dyn))
    pol = back.dynamic_policy()
    assert pol.super_tree.to_tree() == SUPER and pol.step_ms == pytest.approx(dyn["step_ms"])
    assert "EntMTP-dyn: super-tree 16 nodes" in back.summary()
    # the reloaded policy replays as the fitted one
    assert replay_dynamic(rolls, scores, pol).tokens_per_second == pytest.approx(dyn["replay"]["tokens_per_second"])
    with pytest.raises(BankError, match="depth 4 but the heads draft only 2"):
        TopologyBank.load(tmp_path / "bank", max_depth=2)
    # a damaged entry is refused on save (and so never written)
    bank.dynamic = {**dyn, "step_ms": dyn["step_ms"][:-1]}
    with pytest.raises(BankError, match="dynamic policy is not usable"):
        bank.save(tmp_path / "bad")
    bank.dynamic = None
    bank.save(tmp_path / "none")
    with pytest.raises(BankError, match="no EntMTP-dyn policy"):
        TopologyBank.load(tmp_path / "none").dynamic_policy()
    # a super-tree the cost model never measured that large leaves no candidate
    small = LinearCosts()
    small.verify_rows = [1, 8]
    assert build_dynamic(rolls, {"super_trees": [list(SUPER.paths)], "scores": [scores]}, small, 100.0, None) is None


# --- the evaluation --------------------------------------------------------------------------------


def test_evaluation_has_the_dynamic_row_and_checks_its_replay() -> None:
    """compare_methods decodes EntMTP-dyn for real (identical to AR), replays it on the eval
    rollouts beside the oracle (its share of it), and its replay agrees with every real step."""
    from pipeline.evaluate.run import DYNAMIC_LABEL, compare_methods
    from tests.helpers import BANK_TREES, BEST_STATIC, fake_figures, tiny_policies

    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(3, seed=4), [SUPER])
    dyn = build_dynamic(rolls, {"super_trees": [list(SUPER.paths)], "scores": [scores]}, LinearCosts(), 50.0, None)
    bank = TopologyBank(trees=list(BANK_TREES), figures=[fake_figures(t, k) for k, t in enumerate(BANK_TREES)],
                        best_static=BEST_STATIC, policies=tiny_policies(), default_policy="hysteresis", dynamic=dyn)
    rows = [{"id": f"e{n}", "input_ids": p} for n, p in enumerate(random_prompts(3, seed=5))]
    df, recs = compare_methods(model, heads, bank, rows, 24, rank_cap=K)
    by = df.set_index("method")
    assert by.loc[DYNAMIC_LABEL, "identical_to_ar"] == 1.0
    assert 0 < by.loc[DYNAMIC_LABEL, "replayed_share_of_oracle"] and np.isfinite(by.loc[DYNAMIC_LABEL, "replayed_tok_per_s"])
    assert all(t == DYNAMIC_TREE for r in recs[DYNAMIC_LABEL] for t in r["trees"])
    assert all(1 <= n <= SUPER.num_nodes for r in recs[DYNAMIC_LABEL] for n in r["nodes"])
    check = df.attrs["dynamic_check"]
    assert check["prompts_compared"] == 3 and check["steps_compared"] == sum(r["steps"] for r in recs[DYNAMIC_LABEL])
    assert check["steps_agree"] == check["steps_compared"] and check["disagreements"] == []
    assert check["replayed_tok_per_s"] == pytest.approx(by.loc[DYNAMIC_LABEL, "replayed_tok_per_s"])
    assert check["replayed_tok_per_s"] <= check["ceiling_tok_per_s"] * (1 + 1e-9)
    assert check["share_of_ceiling"] == pytest.approx(check["replayed_tok_per_s"] / check["ceiling_tok_per_s"])


def test_the_step_check_reports_what_differs() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    prompts = random_prompts(1, seed=6)
    rolls, (scores,) = scored_rollouts(model, heads, prompts, [SUPER])
    policy = DynamicPolicy(SUPER, GENTLE)
    replay = replay_dynamic(rolls, scores, policy)
    (res,) = _real_decodes(model, heads, prompts, policy)
    acc, nodes, T = [s.accepted for s in res.steps], [s.nodes for s in res.steps], len(rolls[0]["tokens"])
    nodes[0] += 1
    cmp = compare_dynamic_steps(replay, 0, acc, nodes, T)
    assert cmp["steps_agree"] == cmp["steps_compared"] - 1 and cmp["disagreements"][0]["step"] == 0
    acc[0] += 1   # the real decode then visits other step indices: compared up to there
    cmp = compare_dynamic_steps(replay, 0, acc, [s.nodes for s in res.steps], T)
    assert cmp["steps_compared"] == 1 and cmp["disagreements"][-1]["what"].startswith("the replay visits")


def test_a_policy_per_step_replays_each_prompt_with_its_policy() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    rolls, (scores,) = scored_rollouts(model, heads, random_prompts(4, seed=6), [SUPER])
    # prompts 0-1 under one policy, 2-3 under another: the pooled replay of the two halves
    first, second = (DynamicPolicy(SUPER, GENTLE, CALS[cal], draft_ms=DRAFTS, stop_below=stop)
                     for cal, stop in (("identity", 0.0), ("per-depth", 0.03)))
    mixed = replay_dynamic(rolls, scores, first, policy_at=lambda n, i: first if n < 2 else second)
    halves = [replay_dynamic(rolls[:2], scores[:2], first), replay_dynamic(rolls[2:], scores[2:], second)]
    assert mixed.steps == sum(h.steps for h in halves)
    assert mixed.time_s == pytest.approx(sum(h.time_s for h in halves))
    assert [len(v) for v in mixed.visited] == [len(v) for h in halves for v in h.visited]
