"""EAGLE-2's dynamic tree (runtime/eagle2.py): the verified tree is EAGLE-2's selection (expand the
top-k frontier by cumulative log-probability, rerank every drafted node, keep the best), checked
against a brute force over the drafter's scores of the full k-ary tree; drafting costs one drafter
pass per depth over at most k rows; and decoding with it is AR's output token for token (greedy and
seeded sampling, alone and in a batch) with random Hydra / Medusa heads and random and trained
EAGLE-3 drafters. Through the public API: `policy="eagle2"`."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime.ar import ar_generate
from runtime.decoder import TreeDecoder
from runtime.dynamic import DYNAMIC_TREE
from runtime.eagle2 import EAGLE2, Eagle2Policy, Eagle2Settings, draft_eagle2, tree_of_codes
from runtime.eagle3 import target_forward
from runtime.sampling import Sampler, SamplingConfig
from runtime.tree import Tree, TreeBuffers
from tests.helpers import TinyBundle, invariant_model, random_prompts, tiny_heads
from tests.helpers.drafters import EAGLE3_AUX, eagle3_from, eagle3_target, random_eagle3, trained_eagle3_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 72   # new tokens: past KEY_CHUNK = 64, where the row-invariant attention starts a second key chunk
KINDS = ["hydra", "medusa", "eagle3", "eagle3-trained"]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    from tests.helpers import torch_threads

    with torch_threads(1):
        return trained_eagle3_weights()


def _decoder(kind: str, weights: dict, arithmetic: str = "padded") -> TreeDecoder:
    """A TreeDecoder with the drafter `kind` over its tiny target; its one bank tree (a chain) is
    never used by an Eagle2Policy."""
    if kind.startswith("eagle3"):
        model = eagle3_target(arithmetic)
        drafter = eagle3_from(weights, model) if kind == "eagle3-trained" else random_eagle3(model, seed=1)
    else:
        model = invariant_model(arithmetic)
        drafter = tiny_heads(model, kind, seed=2)
    return TreeDecoder(model, drafter, [TreeBuffers.compile(Tree.chain(2))])


# --- settings ------------------------------------------------------------------------------------


def test_settings_default_to_sglangs_and_check_what_they_draft() -> None:
    s = Eagle2Settings()
    assert (s.depth, s.topk, s.total_tokens) == (5, 4, 8)   # SGLang's speculative_num_steps / eagle_topk / draft tokens
    assert s.drafted_nodes == 4 + 4 * 16
    assert Eagle2Settings(3, 2, 1 + 2 + 4 + 4).total_tokens == 11          # every drafted node, and the root
    with pytest.raises(ValueError, match="exceeds the root plus the 10 nodes"):
        Eagle2Settings(3, 2, 12)
    for bad in ({"depth": 0}, {"topk": True}, {"total_tokens": 2.0}):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            Eagle2Settings(**bad)
    assert s.capped(4) == Eagle2Settings(4, 4, 8) and s.capped(9) == s
    assert Eagle2Settings(3, 2, 11).capped(1) == Eagle2Settings(1, 2, 3)    # only the root's 2 children remain
    assert Eagle2Settings(1, 1, 2).drafted_nodes == 1


def test_codes_name_tree_paths_in_node_order() -> None:
    s = Eagle2Settings(3, 3, 5)
    # depth * 27 + rank_1 * 9 + rank_2 * 3 + rank_3
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 1, 1)]
    assert [_code(q, s) for q in paths] == [27, 36, 54, 57, 63, 81, 84, 85]
    assert tree_of_codes([_code(q, s) for q in paths], s) == Tree(paths)
    assert tree_of_codes([], s) == Tree([])
    assert tree_of_codes([1, 2], Eagle2Settings(2, 1, 3)) == Tree.chain(2)   # topk 1: a chain


def _code(path: tuple[int, ...], s: Eagle2Settings) -> int:
    return len(path) * s.topk ** s.depth + sum(r * s.topk ** (s.depth - i) for i, r in enumerate(path, start=1))


# --- the tree is EAGLE-2's -------------------------------------------------------------------------


def _context(dec: TreeDecoder, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The drafter's context after `prompt` and the root (the target's greedy next token), the
    drafter's state left as a decode leaves it after its prefill."""
    model, drafter = dec.model, dec.heads
    model.reset_cache()
    drafter.reset()
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt))
    with torch.inference_mode():
        if drafter.aux_layer_ids:
            logits, hidden, features = target_forward(model, ids, pos, EAGLE3_AUX)
            root = int(logits[0, -1].argmax())
            h = drafter.observe(hidden, pos, torch.tensor(prompt[1:] + [root]), features)
        else:
            logits, hidden = model(ids, pos)
            root = int(logits[0, -1].argmax())
            h = drafter.observe(hidden, pos)
    return h, root


def _brute_force(dec: TreeDecoder, h: torch.Tensor, root: int, s: Eagle2Settings) -> tuple[Tree, dict]:
    """EAGLE-2's tree, computed from the drafter's own scores of the FULL k-ary tree of depth D
    (`propose_scored`, which drafts every node): the frontier, the candidates and the rerank in
    plain Python. Returns the tree and every full-tree path's token."""
    k, depth = s.topk, s.depth
    full = Tree(p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d))
    with torch.inference_mode():
        tokens, prob = dec.heads.propose_scored(h, root, TreeBuffers.compile(full))
    paths = [(), *full.paths]
    token = {p: int(t) for p, t in zip(paths, tokens.tolist())}
    logp = {p: math.log(q) for p, q in zip(paths, prob.tolist())}
    cum = {(): 0.0}
    for p in full.paths:
        cum[p] = cum[p[:-1]] + logp[p]
    drafted = [(r,) for r in range(k)]                  # the root's children, in rank order
    frontier = list(drafted)
    for _ in range(depth - 1):
        children = [f + (r,) for f in frontier for r in range(k)]
        drafted += children
        # the k best, ties to the first drafted (Python's sort is stable)
        frontier = sorted(children, key=lambda p: -cum[p])[:k]
    kept = sorted(drafted, key=lambda p: -cum[p])[: s.total_tokens - 1]
    return Tree(kept), token


@pytest.mark.parametrize("kind", ["hydra", "medusa", "eagle3"])
def test_the_verified_tree_is_eagle2s_selection(kind: str, weights: dict) -> None:
    dec = _decoder(kind, weights)
    varied = False
    for settings in (Eagle2Settings(3, 3, 10), Eagle2Settings(4, 2, 7), Eagle2Settings(2, 4, 12)):
        policy = Eagle2Policy(settings)
        shapes = set()
        for prompt in random_prompts(12, seed=11):
            h, root = _context(dec, prompt)
            want, token = _brute_force(dec, h, root, settings)
            with torch.inference_mode():
                buf, tokens, drafted = policy.draft(dec.heads, h, root)
            got = buf.to_tree()
            assert got == want, f"{kind} {settings}: EAGLE-2's tree differs from the brute force"
            assert buf.num_nodes == settings.total_tokens and drafted == settings.depth
            assert tokens.tolist() == [root] + [token[p] for p in got.paths]
            shapes.add(got)
        varied |= len(shapes) > 1
    assert varied, "every prompt gave one shape: the test never saw the tree change"


def test_drafting_runs_one_pass_per_depth_over_the_frontier(weights: dict) -> None:
    """EAGLE-3: depth - 1 draft-layer forwards of topk rows (the frontier), never the full tree;
    Hydra: head d on one row (d = 1) or the topk frontier rows; Medusa: each head once."""
    s = Eagle2Settings(4, 3, 12)
    rows: list[int] = []

    def count(_module, args, _out) -> None:  # noqa: ANN001 - a forward hook
        rows.append(int(args[0].shape[0]))

    dec = _decoder("eagle3", weights)
    h, root = _context(dec, [3, 1, 4, 1, 5])
    hook = dec.heads.layer.register_forward_hook(count)
    with torch.inference_mode():
        tokens, cum, code = draft_eagle2(dec.heads, h, root, s)
    hook.remove()
    assert rows == [3, 3, 3] and tokens.numel() == cum.numel() == code.numel() == s.drafted_nodes
    assert dec.heads.length == len([3, 1, 4, 1, 5])   # drafting commits nothing
    for kind, want in (("hydra", [1, 3, 3, 3]), ("medusa", [1, 1, 1, 1])):
        dec = _decoder(kind, weights)
        h, root = _context(dec, [3, 1, 4, 1, 5])
        rows.clear()
        hooks = [head.blocks[0].register_forward_hook(count) for head in dec.heads.heads]
        with torch.inference_mode():
            draft_eagle2(dec.heads, h, root, s)
        for hook in hooks:
            hook.remove()
        assert rows == want, kind


def test_cumulative_log_probabilities_never_rise_along_a_path(weights: dict) -> None:
    """Every drafted node's parent is drafted, with a cumulative log-probability at least its own:
    what makes the best n nodes a tree."""
    s = Eagle2Settings(4, 3, 12)
    for kind in ("hydra", "eagle3"):
        dec = _decoder(kind, weights)
        h, root = _context(dec, [7, 2, 9])
        with torch.inference_mode():
            _, cum, code = draft_eagle2(dec.heads, h, root, s)
        paths = tree_of_codes(sorted(code.tolist()), Eagle2Settings(4, 3, s.drafted_nodes + 1)).paths
        by_code = dict(zip(code.tolist(), cum.tolist()))
        value = {p: by_code[_code(p, s)] for p in paths}
        assert len(value) == s.drafted_nodes and all(v <= 0 for v in value.values())
        assert all(value[p] <= value[p[:-1]] for p in paths if len(p) > 1), kind


# --- lossless decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_decoding_is_ar(kind: str, temperature: float, weights: dict) -> None:
    dec = _decoder(kind, weights)
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=3)) if temperature else None
    policy = Eagle2Policy(Eagle2Settings().capped(dec.heads.max_depth))
    deepest = 0
    for prompt in random_prompts(2, seed=5):
        ref = ar_generate(dec.model, prompt, N, eos_ids=(), sampler=sampler)
        res = dec.generate(prompt, N, choose=policy, eos_ids=(), sampler=sampler)
        assert res.tokens == ref, f"{kind} at T={temperature}"
        assert all(st.tree == DYNAMIC_TREE and st.nodes == policy.num_nodes for st in res.steps)
        deepest = max([deepest] + [st.accepted for st in res.steps])
        if kind.startswith("eagle3"):
            assert dec.heads.length == dec.model.cache_len   # one committed row per committed position
    assert policy.hits > 0 and policy.misses > 0
    if kind == "eagle3-trained" and temperature == 0:
        assert deepest >= 3, "no step accepted 3 drafts: the test never verified a deep EAGLE-2 path"


@pytest.mark.parametrize("kind", ["hydra", "eagle3-trained"])
def test_batch_decoding_is_ar(kind: str, weights: dict) -> None:
    dec = _decoder(kind, weights)
    policy = Eagle2Policy(Eagle2Settings(3, 3, 6))
    prompts = random_prompts(3, seed=8)
    sampler = Sampler(SamplingConfig(temperature=0.7, seed=5))
    got = dec.generate_batch(prompts, N, choose=policy, eos_ids=(), sampler=sampler)
    for prompt, res in zip(prompts, got):
        assert res.tokens == ar_generate(dec.model, prompt, N, eos_ids=(), sampler=sampler)
        assert all(st.nodes == 6 for st in res.steps)


def test_a_tree_deeper_than_the_drafter_is_refused(weights: dict) -> None:
    dec = _decoder("hydra", weights)    # 4 heads
    with pytest.raises(ValueError, match=r"depth 5 but the drafter drafts only 4 tokens.*capped\(4\)"):
        dec.generate([1, 2, 3], 8, choose=Eagle2Policy(Eagle2Settings(5, 2, 4)))
    with pytest.raises(TypeError, match="Eagle2Settings"):
        Eagle2Policy({"depth": 3})   # type: ignore[arg-type]


def test_one_token_is_a_root_only_step(weights: dict) -> None:
    dec = _decoder("hydra", weights)
    prompt = [4, 4, 2]
    res = dec.generate(prompt, 12, choose=Eagle2Policy(Eagle2Settings(2, 2, 1)), eos_ids=())
    assert res.tokens == ar_generate(dec.model, prompt, 12, eos_ids=())
    assert all(st.nodes == 1 and st.accepted == 0 for st in res.steps)


# --- the public API ------------------------------------------------------------------------------------


def test_the_engine_decodes_policy_eagle2_as_ar(bundle: TinyBundle) -> None:
    from runtime.api import EntMTP

    engine = EntMTP.load(bundle.bank_dir)
    choose = engine.scheduler(EAGLE2)
    assert isinstance(choose, Eagle2Policy) and choose.settings == Eagle2Settings().capped(engine.heads.max_depth)
    for temperature in (0.0, 0.7):
        out = engine.generate("Write a haiku about trees.", 20, policy=EAGLE2, temperature=temperature, seed=1)
        ar = engine.generate_ar("Write a haiku about trees.", 20, temperature=temperature, seed=1)
        assert out.tokens == ar.tokens and out.result is not None
        assert {st.nodes for st in out.result.steps} == {choose.num_nodes}
    with pytest.raises(ValueError, match="eagle2"):
        engine.scheduler("no-such-policy")
