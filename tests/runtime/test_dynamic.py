"""EntMTP-dyn (runtime/dynamic.py): a subset of a super-tree chosen per step from the heads' path
values. The subset's buffers equal the compiled sub-tree's, the selection is the top-n by value
with n set by the cost array, and decoding stays exactly AR's (greedy and seeded sampling, alone
and in a batch, in the row-invariant arithmetics)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.decoder import TreeDecoder, TypicalAcceptance
from runtime.dynamic import DYNAMIC_TREE, Calibration, DynamicPolicy
from runtime.ar import ar_generate
from runtime.model.llama import Transformer
from runtime.policy import ExpectedThroughputPolicy, BatchScheduler, Scheduler
from runtime.sampling import Sampler, SamplingConfig
from runtime.tree import Tree, TreeBuffers, TreeError
from tests.helpers import (ARITHMETICS, DECODER_TREES, DRAFTS, GENTLE, SUPER, ar_greedy, invariant_model,
                           random_prompts, tiny_heads, tiny_model, torch_threads)
from tests.helpers import trees as valid_trees


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _decoder(model: Transformer, kind: str, seed: int = 0) -> TreeDecoder:
    return TreeDecoder(model, tiny_heads(model, kind, seed=seed), [TreeBuffers.compile(t) for t in DECODER_TREES])


# --- subset buffers ----------------------------------------------------------------------------


def _closed_subsets(tree: Tree, g: torch.Generator, count: int) -> list[list[int]]:
    """Random ancestor-closed subsets (node indices, increasing) with no sibling-rank gap: the
    top-n of random values made monotone along paths, as the policy's selection is."""
    paths = [(), *tree.paths]
    out = []
    for _ in range(count):
        v = torch.rand(len(paths), generator=g).tolist()
        val = [1.0] * len(paths)
        for i, p in enumerate(paths[1:], start=1):
            parent = tree.node_index(p[:-1])
            sibling = tree.node_index(p[:-1] + (p[-1] - 1,)) if p[-1] > 0 else parent
            val[i] = min(val[parent], val[sibling], v[i])
        order = sorted(range(len(paths)), key=lambda i: (-val[i], i))
        n = int(torch.randint(1, len(paths) + 1, (1,), generator=g))
        out.append(sorted(order[:n]))
    return out


def _assert_same_buffers(got: TreeBuffers, want: TreeBuffers) -> None:
    for key in ("attn_mask", "depths", "parents", "ranks", "retrieve_indices", "parent_index", "node_paths",
                "draft_heads"):
        a, b = getattr(got, key), getattr(want, key)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert got.depth_slices == want.depth_slices and got.topk == want.topk
    assert got.ancestor_lists == want.ancestor_lists
    for key in ("parent_slots", "unique_parents", "parent_inverse"):
        assert len(getattr(got, key)) == len(getattr(want, key))
        assert all(torch.equal(a, b) for a, b in zip(getattr(got, key), getattr(want, key))), key


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=valid_trees(max_depth=5, max_nodes=30), seed=st.integers(0, 2**31 - 1))
def test_subset_buffers_equal_the_compiled_subtree(tree: Tree, seed: int) -> None:
    full = TreeBuffers.compile(tree)
    paths = [(), *tree.paths]
    for keep in _closed_subsets(tree, torch.Generator().manual_seed(seed), 4):
        sub = full.subset(torch.tensor(keep))
        want = TreeBuffers.compile(Tree([paths[i] for i in keep[1:]]))
        _assert_same_buffers(sub, want)
        sub.validate()


def test_subset_refuses_what_is_not_a_subtree() -> None:
    full = TreeBuffers.compile(SUPER)
    with pytest.raises(TreeError, match="closed under ancestors"):
        full.subset(torch.tensor([0, 4]))            # (0, 0) without (0,)
    with pytest.raises(TreeError, match="increasing from the root"):
        full.subset(torch.tensor([0, 2, 1]))
    with pytest.raises(TreeError, match="increasing from the root"):
        full.subset(torch.tensor([1, 2]))


# --- scoring -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_propose_scored_is_propose_with_each_heads_probability(kind: str) -> None:
    model = tiny_model(1)
    heads = tiny_heads(model, kind, seed=1)
    buf = TreeBuffers.compile(SUPER)
    h = torch.randn(1, model.args.dim, generator=torch.Generator().manual_seed(0))
    root = 7
    tokens, prob = heads.propose_scored(h, root, buf)
    assert torch.equal(tokens, heads.propose(h, root, buf))
    assert prob[0] == 1.0 and prob.dtype == torch.float32
    # reference: run the node's head on its path's tokens, softmax over its whole output
    with torch.no_grad():
        for i, path in enumerate(SUPER.paths, start=1):
            d = len(path)
            chain = [root] + [int(tokens[SUPER.node_index(path[:j])]) for j in range(1, d)]
            states = heads.head_states(h, torch.tensor([chain + [0] * (d - len(chain))]), heads=d)[:, -1:]
            logits = heads.output_logits(states, first_head=d)[0, 0].float()
            want = torch.softmax(logits, -1)[int(tokens[i])]
            assert float(prob[i]) == pytest.approx(float(want), rel=1e-5, abs=1e-7), (kind, path)
            # and the token is the path's rank-th candidate
            assert int(tokens[i]) == int(logits.topk(path[-1] + 1).indices[-1])


def _python_values(tree: Tree, prob: list[float], cal: Calibration) -> list[float]:
    """Path products, the calibration (numpy's interp per depth), then the minimum along the path."""
    paths = [(), *tree.paths]
    raw = [1.0] * len(paths)
    for i, p in enumerate(paths[1:], start=1):
        raw[i] = raw[tree.node_index(p[:-1])] * prob[i]
    cal_v = [1.0] * len(paths)
    for i, p in enumerate(paths[1:], start=1):
        if cal.is_identity:
            cal_v[i] = raw[i]
        else:
            row = min(len(p), len(cal.xs)) - 1
            cal_v[i] = float(np.interp(raw[i], cal.xs[row], cal.ys[row]))
    out = [1.0] * len(paths)
    for i, p in enumerate(paths[1:], start=1):
        out[i] = min(out[tree.node_index(p[:-1])], cal_v[i])
    return out


CALIBRATIONS = [
    Calibration(),
    # depth 1 shrunk, deeper depths inflated: raw order across depths is not kept, the path minimum restores it
    Calibration(xs=[[0.0, 1.0], [0.0, 0.1, 1.0], [0.0, 0.05, 1.0]],
                ys=[[0.0, 0.5], [0.0, 0.8, 0.9], [0.2, 0.9, 1.0]]),
]


@pytest.mark.parametrize("cal", CALIBRATIONS, ids=["identity", "per-depth"])
def test_select_is_the_top_n_by_value_and_n_follows_the_cost(cal: Calibration) -> None:
    paths = [(), *SUPER.paths]
    n_nodes = SUPER.num_nodes
    g = torch.Generator().manual_seed(3)
    costs = {"flat": [1.0] * n_nodes, "steep": [10.0 ** k for k in range(n_nodes)],
             "gentle": GENTLE, "convex": [1.0 + 0.002 * k * k for k in range(n_nodes)]}
    seen_n = set()
    for trial in range(30):
        # sorted per sibling group like a head's top-k, with ties now and then
        prob = torch.rand(n_nodes, generator=g)
        prob = torch.where(torch.rand(n_nodes, generator=g) < 0.2, prob.round(decimals=1), prob)
        for i, p in enumerate(paths[1:], start=1):
            if p[-1] > 0:
                prob[i] = min(prob[i], prob[SUPER.node_index(p[:-1] + (p[-1] - 1,))])
        prob[0] = 1.0
        want_vals = _python_values(SUPER, prob.tolist(), cal)
        ranked = sorted(range(n_nodes), key=lambda i: (-want_vals[i], i))
        for name, cost in costs.items():
            policy = DynamicPolicy(SUPER, cost, cal)
            keep, n, vals = policy.select(prob)
            assert vals.tolist() == pytest.approx(want_vals, rel=1e-5, abs=1e-7)
            got_vals = vals.tolist()
            # expected tokens / cost per size, in float64 here (float32 there): sizes within rounding
            # of the best rate all count as right; the smallest such is the intended tie-break
            rates = [sum(sorted(got_vals, reverse=True)[:k]) / cost[k - 1] for k in range(1, n_nodes + 1)]
            near = [k + 1 for k, r in enumerate(rates) if r >= max(rates) * (1 - 1e-6)]
            assert int(n) in near, (name, trial, near)
            order = sorted(range(n_nodes), key=lambda i: (-got_vals[i], i))
            assert sorted(keep.nonzero().flatten().tolist()) == sorted(order[:int(n)])
            # the kept nodes form a valid tree (ancestors closed, sibling ranks without gaps)
            Tree([paths[i] for i in sorted(order[:int(n)])[1:]])
            if name == "flat":
                assert int(n) == n_nodes or min(want_vals) == 0.0
            if name == "steep":
                assert int(n) == 1 and keep.tolist() == [True] + [False] * (n_nodes - 1)
            seen_n.add(int(n))
        assert ranked[0] == 0
    assert len(seen_n) >= 4, f"the cost arrays picked only sizes {sorted(seen_n)}: the test exercised little"


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_draft_verifies_the_selected_subset_and_caches_it(kind: str) -> None:
    model = tiny_model(4)
    heads = tiny_heads(model, kind, seed=4)
    policy = DynamicPolicy(SUPER, GENTLE)
    full = policy.super_tree
    g = torch.Generator().manual_seed(5)
    for step in range(12):
        h = torch.randn(1, model.args.dim, generator=g) * (0.5 + step)
        buf, tokens, drafted = policy.draft(heads, h, 3)
        assert drafted == SUPER.depth
        all_tokens, prob = heads.propose_scored(h, 3, full)
        keep, n, _ = policy.select(prob)
        idx = keep.nonzero().flatten()
        assert buf.num_nodes == int(n) and torch.equal(tokens, all_tokens[idx])
        _assert_same_buffers(buf, full.subset(idx))
        assert policy.subset(keep) is policy._cache[int((policy._bits * keep).sum())]
    assert policy.hits + policy.misses == 24 and policy.misses == len(policy._cache)


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_early_stop_drafts_to_the_depth_a_replay_computes(kind: str) -> None:
    """With stop_below, a decode drafts S depth by depth and stops after the first depth with no
    node worth the threshold: the depth, subset and tokens are those the replay's view (every
    depth's probabilities) gives, Hydra's deeper heads never run, and the step is priced by the
    depths drafted."""
    model = tiny_model(4)
    heads = tiny_heads(model, kind, seed=4)
    policy = DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS, stop_below=0.5)
    full = policy.super_tree
    calls: list[int] = []
    blocks = heads._blocks
    heads._blocks = lambda d, x: (calls.append(d), blocks(d, x))[1]  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(5)
    depths = []
    for step in range(12):
        h = torch.randn(1, model.args.dim, generator=g) * (0.5 + step)
        calls.clear()
        buf, tokens, drafted = policy.draft(heads, h, 3)
        ran = list(calls)
        all_tokens, prob = heads.propose_scored(h, 3, full)
        d = policy.drafted_depth(prob)
        depths.append(d)
        assert drafted == d
        keep, n, _ = policy.select(prob, d)
        idx = keep.nonzero().flatten()
        assert buf.num_nodes == int(n) and torch.equal(tokens, all_tokens[idx])
        assert int(full.depths[idx].max()) <= d
        if kind == "hydra":
            assert ran == list(range(1, d + 1)), f"drafted to depth {d} but ran the heads of depths {ran}"
    assert len(set(depths)) >= 3, f"every step drafted to depths {set(depths)}: the test exercised little"
    assert policy.step_costs(1) == pytest.approx([c - 0.3 for c in GENTLE])
    assert policy.step_costs(4) == GENTLE
    assert "stop below 0.5" in repr(policy)


def test_calibration_interpolates_per_depth_and_checks_its_knots() -> None:
    cal = CALIBRATIONS[1]
    v = torch.tensor([0.0, 0.03, 0.05, 0.5, 1.0, 0.3, 0.07])
    d = torch.tensor([1, 2, 3, 3, 2, 4, 1])
    got = cal(v, d, 4).tolist()
    want = [float(np.interp(x, cal.xs[min(k, 3) - 1], cal.ys[min(k, 3) - 1])) for x, k in zip(v.tolist(), d.tolist())]
    assert got == pytest.approx(want, abs=1e-6)
    assert Calibration.from_dict(cal.to_dict()).to_dict() == cal.to_dict()
    assert Calibration.from_dict(None).is_identity
    with pytest.raises(ValueError, match="must not decrease"):
        Calibration(xs=[[0.0, 1.0]], ys=[[0.5, 0.4]])
    with pytest.raises(ValueError, match="increase strictly"):
        Calibration(xs=[[0.0, 0.0, 1.0]], ys=[[0.0, 0.1, 0.2]])
    with pytest.raises(ValueError, match="unknown keys"):
        Calibration.from_dict({"knots": [0, 1]})


def test_policy_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="one positive, finite cost per tree size 1..16"):
        DynamicPolicy(SUPER, [1.0] * 15)
    with pytest.raises(ValueError, match="one positive"):
        DynamicPolicy(SUPER, [1.0] * 15 + [0.0])
    with pytest.raises(TreeError, match="at most 63"):
        DynamicPolicy(Tree([(k,) for k in range(63)]), [1.0] * 64)
    with pytest.raises(ValueError, match="needs draft_ms"):
        DynamicPolicy(SUPER, GENTLE, stop_below=0.5)
    with pytest.raises(ValueError, match="per drafted depth 0..4"):
        DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS[:4], stop_below=0.5)
    with pytest.raises(ValueError, match="must not decrease"):
        DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS[::-1], stop_below=0.5)
    with pytest.raises(ValueError, match=r"stop_below must lie in \[0, 1\]"):
        DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS, stop_below=1.5)
    model = tiny_model()
    dec = TreeDecoder(model, tiny_heads(model, "hydra", num_heads=2), [TreeBuffers.compile(Tree.chain(2))])
    with pytest.raises(ValueError, match="depth 4 but the heads draft only 2"):
        dec.generate([1, 2, 3], 4, choose=DynamicPolicy(SUPER, GENTLE))


# --- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [0.0, 0.1], ids=["whole", "early-stop"])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_dynamic_generate_is_ar(arithmetic: str, kind: str, stop: float) -> None:
    model = invariant_model(arithmetic)
    dec = _decoder(model, kind)
    policy = DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS, stop_below=stop)
    sizes, depths, accepted, steps = set(), set(), 0, 0
    for p in random_prompts(4, seed=1):
        res = dec.generate(p, 32, choose=policy)
        assert res.tokens == ar_greedy(model, p, 32)
        assert all(s.tree == DYNAMIC_TREE and 1 <= s.nodes <= SUPER.num_nodes for s in res.steps)
        sizes |= {s.nodes for s in res.steps}
        accepted += sum(s.accepted for s in res.steps)
        steps += len(res.steps)
        stats = res.stats()
        assert sum(stats["dynamic_nodes"].values()) == len(res.steps) and not stats["trees_used"]
        depths |= set(stats["dynamic_drafted_depths"])
    assert accepted > 0, "no draft was ever accepted: the test exercised nothing but the root"
    assert len(sizes) >= 2 or len(depths) >= 2, f"every step verified {sizes} nodes drafted to depth {depths}: the " \
                                                "policy never changed the tree"
    assert depths == {SUPER.depth} if not stop else min(depths) < SUPER.depth
    assert policy.hits + policy.misses == steps and policy.misses == policy.stats()["cached"]


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_dynamic_generate_batch_is_each_prompts_own_ar(arithmetic: str) -> None:
    model = invariant_model(arithmetic)
    dec = _decoder(model, "hydra")
    policy = DynamicPolicy(SUPER, GENTLE)           # stateless: one for every sequence
    prompts = random_prompts(5, seed=2)
    limits = [32, 6, 32, 17, 32]
    chooses = [policy, policy, 1, policy, 0]        # dynamic sequences next to bank trees
    results = dec.generate_batch(prompts, limits, choose=chooses)
    for p, n, c, res in zip(prompts, limits, chooses, results):
        assert res.tokens == ar_greedy(model, p, n)
        assert res.tokens == dec.generate(p, n, choose=c).tokens
        assert all((s.tree == DYNAMIC_TREE) == (c is policy) for s in res.steps)
    assert len({s.nodes for r, c in zip(results, chooses) if c is policy for s in r.steps}) >= 2


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_dynamic_seeded_sampling_is_seeded_ar(kind: str) -> None:
    model = invariant_model("padded", seed=3)
    dec = _decoder(model, kind, seed=3)
    policy = DynamicPolicy(SUPER, GENTLE)
    prompts = random_prompts(3, seed=4)
    accepted = 0
    for cfg in (SamplingConfig(temperature=0.7, seed=1), SamplingConfig(temperature=1.0, top_k=8, top_p=0.9, seed=2)):
        sampler = Sampler(cfg)
        refs = [ar_generate(model, p, 24, sampler=sampler) for p in prompts]
        for p, ref in zip(prompts, refs):
            res = dec.generate(p, 24, choose=policy, sampler=sampler)
            assert res.tokens == ref, (kind, cfg)
            accepted += sum(s.accepted for s in res.steps)
        assert [r.tokens for r in dec.generate_batch(prompts, 24, choose=policy, sampler=sampler)] == refs
    assert accepted > 0


def test_dynamic_with_a_calibration_and_typical_acceptance_runs() -> None:
    model = tiny_model(2)
    heads = tiny_heads(model, "hydra", seed=2)
    policy = DynamicPolicy(SUPER, GENTLE, CALIBRATIONS[1].to_dict())
    exact = TreeDecoder(model, heads, [TreeBuffers.compile(Tree.chain(1))])
    assert exact.generate([5, 6, 7], 24, choose=policy).tokens == ar_greedy(model, [5, 6, 7], 24)
    typical = TreeDecoder(model, heads, [TreeBuffers.compile(Tree.chain(1))], acceptance=TypicalAcceptance())
    res = typical.generate([5, 6, 7], 24, choose=policy)
    assert len(res.tokens) == 24 and all(s.tree == DYNAMIC_TREE for s in res.steps)


def test_a_super_tree_deeper_than_the_bank_and_batch_policies() -> None:
    model = invariant_model("padded")
    dec = TreeDecoder(model, tiny_heads(model, "hydra"), [TreeBuffers.compile(Tree([]))])  # the bank: the root only
    policy = DynamicPolicy(SUPER, [1.0] * SUPER.num_nodes)
    res = dec.generate([4, 5, 6], 30, choose=policy)
    assert res.tokens == ar_greedy(model, [4, 5, 6], 30)
    assert {s.nodes for s in res.steps} == {SUPER.num_nodes}
    too_long = model.max_seq_len - 30 - SUPER.num_nodes + 1
    with pytest.raises(ValueError, match=f"largest tree \\({SUPER.num_nodes} nodes\\)"):
        dec.generate([1] * too_long, 30, choose=policy)
    et = ExpectedThroughputPolicy([0.5], [[1.0], [1.0]], [1.0], signal="p0")
    with pytest.raises(ValueError, match="without batch_policy"):
        dec.generate_batch([[1, 2], [3, 4]], 8, choose=[policy, Scheduler(et)],
                           batch_policy=BatchScheduler(et, {1: [1.0], 2: [1.0]}))
