"""The EAGLE-3 drafter (runtime/eagle3.py): its state is a function of the true prefix, its tree
drafting equals a naive per-path autoregressive reference written here from the weights, the d2t
mapping, the target's features from the very forward that verifies (`Transformer.capture_aux`, on
every forward path), its rank paths along a known continuation (the rollout's), its own file format
and the refusal of malformed files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from runtime.eagle3 import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Error,
    load_drafter,
    save_drafter,
    target_forward,
)
from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from runtime.tree import Tree, TreeBuffers
from tests.helpers import tiny_transformer
from tests.helpers import trees as valid_trees
from tests.helpers.drafters import random_eagle3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, DRAFT_VOCAB = 64, 40
AUX = (1, 2, 3)
TREES = [Tree.named("chain4"), Tree.named("mc_sim_7b_63"), Tree([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0)])]


def tiny_target(seed: int = 0, n_layers: int = 4) -> Transformer:
    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_position_embeddings=512)
    return tiny_transformer(args, seed, cache=128)


def random_drafter(model: Transformer, seed: int = 0, draft_vocab: int = DRAFT_VOCAB,
                   norm_before_residual: bool = False) -> Eagle3Drafter:
    return random_eagle3(model, seed, draft_vocab, AUX, norm_before_residual=norm_before_residual, rope_theta=5000.0)


def prompt_inputs(model: Transformer, n: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The target's features of a random prompt, the tokens paired with them (each position's next
    token, the last being the root) and the root."""
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))
    model.reset_cache()
    logits, _, features = target_forward(model, ids, torch.arange(n), AUX)
    root = int(logits[0, -1].argmax())
    return features, torch.cat([ids[0, 1:], torch.tensor([root])]), root


# ---------------------------------------------------------------------------- naive reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_rows(drafter: Eagle3Drafter, hidden: torch.Tensor, emb: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """The draft layer over a sequence of rows (inputs hidden [m, H], embeddings [m, H]), causal,
    from scratch, in float64, written from the published EAGLE-3 layer (separate q/k/v, gate/up)."""
    c, sd = drafter.config, {k: v.double() for k, v in drafter.state_dict().items() if v.is_floating_point()}
    h, kvh, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    m = hidden.shape[0]
    wq, wk, wv = sd["layer.attention.wqkv.weight"].split([h * hd, kvh * hd, kvh * hd])
    normed = _rms(hidden, sd["layer.hidden_norm.weight"], eps)
    x = torch.cat([_rms(emb, sd["layer.input_layernorm.weight"], eps), normed], dim=-1)
    q, k, v = (x @ wq.T).view(m, h, hd), (x @ wk.T).view(m, kvh, hd), (x @ wv.T).view(m, kvh, hd)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.tensor(positions, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rot(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], dim=-1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(m, m, dtype=torch.bool).tril(), -math.inf)
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(m, h * hd) @ sd["layer.attention.wo.weight"].T
    y = (normed if c.norm_before_residual else hidden) + att
    gate, up = (_rms(y, sd["layer.post_attention_layernorm.weight"], eps) @ sd["layer.feed_forward.w13.weight"].T
                ).split(c.intermediate_size, dim=-1)
    return y + (F.silu(gate) * up) @ sd["layer.feed_forward.w2.weight"].T


def naive_tree(drafter: Eagle3Drafter, model: Transformer, features: torch.Tensor, next_tokens: torch.Tensor,
               tree: Tree) -> dict[tuple[int, ...], tuple[int, float]]:
    """Each path's (target token, draft probability), drafted autoregressively along that path alone:
    the committed rows (fc(feature_t), x_{t+1}) at positions t, then one row per drafted token
    (the previous row's output, the token) at the next position, everything recomputed from scratch."""
    sd = {k: v.double() for k, v in drafter.state_dict().items() if v.is_floating_point()}
    emb = model.tok_embeddings.weight.double()
    d2t = drafter.d2t
    n = features.shape[0]
    base_h, base_e = features.double() @ sd["fc.weight"].T, emb[next_tokens]
    out = {}
    for path in tree.paths:
        hid, em, pos = base_h, base_e, list(range(n))
        g = naive_rows(drafter, hid, em, pos)[-1]
        for j, rank in enumerate(path, start=1):
            logits = _rms(g, sd["norm.weight"], drafter.config.rms_norm_eps) @ sd["lm_head.weight"].T
            draft = int(logits.topk(rank + 1).indices[rank])
            tok = draft + int(d2t[draft])
            if j == len(path):
                out[path] = (tok, float(logits.softmax(-1)[draft]))
                break
            hid, em, pos = torch.cat([hid, g[None]]), torch.cat([em, emb[tok][None]]), pos + [n - 1 + j]
            g = naive_rows(drafter, hid, em, pos)[-1]
    return out


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_propose_tree_equals_the_naive_per_path_reference(norm_before_residual: bool) -> None:
    model = tiny_target()
    drafter = random_drafter(model, norm_before_residual=norm_before_residual)
    features, next_tokens, root = prompt_inputs(model)
    h = drafter.extend(features, next_tokens)
    for tree in TREES:
        tokens, probs = drafter.propose_scored(h, root, TreeBuffers.compile(tree))
        ref = naive_tree(drafter, model, features, next_tokens, tree)
        assert int(tokens[0]) == root and float(probs[0]) == 1.0
        for i, path in enumerate(tree.paths, start=1):
            assert int(tokens[i]) == ref[path][0], f"node {path}"
            assert float(probs[i]) == pytest.approx(ref[path][1], rel=1e-4, abs=1e-6), f"node {path}"
        assert torch.equal(drafter.propose_tree(h, root, TreeBuffers.compile(tree)), tokens)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=valid_trees(max_depth=4, max_children=3, max_nodes=20))
def test_random_trees_equal_the_reference(tree: Tree) -> None:
    model = tiny_target(seed=1)
    drafter = random_drafter(model, seed=1)
    features, next_tokens, root = prompt_inputs(model, n=6, seed=1)
    h = drafter.extend(features, next_tokens)
    tokens = drafter.propose_tree(h, root, TreeBuffers.compile(tree))
    ref = naive_tree(drafter, model, features, next_tokens, tree)
    assert [int(t) for t in tokens[1:]] == [ref[p][0] for p in tree.paths]


def test_state_is_a_function_of_the_true_prefix() -> None:
    """Extending in one call or in several gives the same cache and proposals; drafting leaves the
    committed cache alone, and so does committing rows that are then truncated away."""
    model = tiny_target()
    features, next_tokens, root = prompt_inputs(model, n=10)
    one = random_drafter(model)
    h_one = one.extend(features, next_tokens)
    kv_one = one.state.kv[:, :, :10].clone()
    bufs = [TreeBuffers.compile(t) for t in TREES]
    drafts = [one.propose_scored(h_one, root, b) for b in bufs]
    assert torch.equal(one.state.kv[:, :, :10], kv_one) and one.length == 10  # drafting committed nothing
    assert all(torch.equal(one.propose_tree(h_one, root, b), t) for b, (t, _) in zip(bufs, drafts))

    several = random_drafter(model)
    for a, b in ((0, 3), (3, 4), (4, 8), (8, 10)):
        h = several.extend(features[a:b], next_tokens[a:b])
    assert several.length == 10
    torch.testing.assert_close(several.state.kv[:, :, :10], kv_one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_one, rtol=1e-5, atol=1e-5)
    for b, (tokens, probs) in zip(bufs, drafts):
        t2, p2 = several.propose_scored(h, root, b)
        assert torch.equal(t2, tokens)
        torch.testing.assert_close(p2, probs, rtol=1e-4, atol=1e-6)

    # rows of guessed tokens committed and truncated away leave no trace
    several.extend(torch.randn(3, features.shape[1]), torch.tensor([1, 2, 3]))
    several.truncate(10)
    for b, (tokens, _) in zip(bufs, drafts):
        assert torch.equal(several.propose_tree(h, root, b), tokens)


def test_one_state_per_sequence() -> None:
    """Two sequences interleaved through save_state / load_state draft as each does alone."""
    model = tiny_target()
    fa, ta, ra = prompt_inputs(model, n=8, seed=2)
    fb, tb, rb = prompt_inputs(model, n=5, seed=3)
    buf = TreeBuffers.compile(TREES[1])
    alone = random_drafter(model)
    ha = alone.extend(fa, ta)
    want_a = alone.propose_tree(ha, ra, buf)
    alone.reset()
    hb = alone.extend(fb, tb)
    want_b = alone.propose_tree(hb, rb, buf)

    drafter = random_drafter(model)
    state_a, state_b = drafter.new_state(), drafter.new_state()
    drafter.load_state(state_a)
    drafter.extend(fa[:4], ta[:4])
    drafter.load_state(state_b)
    hb2 = drafter.extend(fb, tb)
    drafter.load_state(state_a)
    ha2 = drafter.extend(fa[4:], ta[4:])
    assert torch.equal(drafter.propose_tree(ha2, ra, buf), want_a)
    drafter.load_state(state_b)
    assert drafter.save_state() is state_b and state_b.length == 5
    assert torch.equal(drafter.propose_tree(hb2, rb, buf), want_b)


def test_d2t_maps_draft_ids_to_target_ids() -> None:
    model = tiny_target()
    drafter = random_drafter(model)
    features, next_tokens, root = prompt_inputs(model)
    h = drafter.extend(features, next_tokens)
    in_vocab = drafter.target_ids()
    assert torch.equal(in_vocab, drafter.t2d.nonzero().flatten())  # listed in increasing target id
    tokens = drafter.propose_tree(h, root, TreeBuffers.compile(TREES[1]))
    assert bool(drafter.t2d[tokens[1:]].all())
    logits = drafter.logits(h)[0]
    top = logits.topk(10).indices
    depth1 = TreeBuffers.compile(Tree([(r,) for r in range(10)]))
    assert torch.equal(drafter.propose_tree(h, root, depth1)[1:], top + drafter.d2t[top])
    full = drafter.to_target_logits(logits)
    assert torch.equal(full[in_vocab], logits) and bool(torch.isinf(full[~drafter.t2d]).all())
    assert int(full.argmax()) == int(top[0] + drafter.d2t[top[0]])
    with pytest.raises(Eagle3Error, match="distinct"):
        drafter.set_draft_vocab(torch.zeros(DRAFT_VOCAB, dtype=torch.long))
    with pytest.raises(Eagle3Error, match="40"):
        drafter.set_draft_vocab(torch.arange(5))


def test_trees_given_as_paths_and_stop_after() -> None:
    model = tiny_target()
    drafter = random_drafter(model)
    features, next_tokens, root = prompt_inputs(model)
    h = drafter.extend(features, next_tokens)
    tree = TREES[2]
    tokens = drafter.propose_tree(h, root, TreeBuffers.compile(tree))
    assert torch.equal(drafter.propose_tree(h, root, tree), tokens)
    assert torch.equal(drafter.propose(h, root, [list(p) for p in tree.paths]), tokens)
    buf = TreeBuffers.compile(tree)
    full_tokens, full_probs = drafter.propose_scored(h, root, buf)
    cut_tokens, cut_probs = drafter.propose_scored(h, root, buf, stop_after=lambda d, p: d == 1)
    end1 = buf.depth_slices[0][1]
    assert torch.equal(cut_tokens[:end1], full_tokens[:end1]) and torch.equal(cut_probs[:end1], full_probs[:end1])
    assert bool((cut_probs[end1:] == 0).all())


def test_features_are_the_inputs_of_the_named_layers(tmp_path: Path) -> None:
    """target_forward's feature id i is Hugging Face's output_hidden_states[i] (our convention)."""
    from runtime.model.checkpoint import load_model
    from tests.helpers import random_hf_causal_lm

    hf = random_hf_causal_lm("llama", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=128, tie_word_embeddings=False))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, max_seq_len=32, fast_paths=False)
    _, _, features = target_forward(model, ids, torch.arange(7), (0, 2, 3))
    want = torch.cat([states[0][0], states[2][0], states[3][0]], dim=-1)
    torch.testing.assert_close(features, want, rtol=1e-4, atol=1e-4)


def _hook_features(model: Transformer, ids: torch.Tensor, aux: tuple[int, ...]) -> torch.Tensor:
    """The inputs of layers `aux` in the plain forward over `ids` from an empty cache, caught by
    forward pre-hooks on the layers (the reference the capture must match)."""
    captured: dict[int, torch.Tensor] = {}
    handles = [model.layers[i].register_forward_pre_hook(
        lambda _m, inputs, i=i: captured.__setitem__(i, inputs[0])) for i in aux]
    try:
        model.reset_cache()
        model(ids, torch.arange(ids.shape[1]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([captured[i] for i in aux], dim=-1)


@pytest.mark.parametrize("arithmetic", ["plain", "padded", "kernel"])
def test_the_forward_that_verifies_hands_over_the_features(arithmetic: str) -> None:
    """`Transformer.capture_aux`: every forward path (plain, row-invariant with pad rows, small-row
    kernel, forward_batch) leaves the inputs of the named layers for its real rows, in input order,
    in the order the ids are given; a tree verify's row has AR's features for the same token bit for
    bit in a row-invariant arithmetic; capture off keeps nothing."""
    from runtime.model.batch import BatchItem
    from runtime.model import small_rows

    if arithmetic == "kernel" and not small_rows.available():
        pytest.skip("the small-row kernels are not built here")
    model = tiny_target()
    if arithmetic == "kernel":
        model.add_fast_paths()
    aux = (3, 0, 2)   # any distinct layers, concatenated in the order given
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    tree = TREES[2]   # 7 nodes: padded to 8 rows in blocks of 4
    buf = TreeBuffers.compile(tree)
    nodes = torch.randint(0, VOCAB, (buf.num_nodes,), generator=torch.Generator().manual_seed(5))
    # the reference: each node's features from a plain forward over the prompt and its path
    want = torch.stack([_hook_features(model, torch.cat([ids[0], nodes[buf.node_paths[i, :d + 1]]])[None], aux)[-1]
                        for i, d in enumerate(buf.depths.tolist())])
    prompt_want = _hook_features(model, ids, aux)
    if arithmetic != "plain":
        model.set_row_invariance(4)

    model.capture_aux(aux)
    model.reset_cache()
    model(ids, torch.arange(9), last_only=True)
    torch.testing.assert_close(model.aux_features, prompt_want, rtol=0, atol=0)   # the prefill: one path for all
    model(nodes[None], 9 + buf.depths, buf.attn_mask, ancestors=buf.ancestor_lists)
    verify = model.aux_features
    assert verify.shape == (buf.num_nodes, 3 * 32)
    torch.testing.assert_close(verify, want, rtol=1e-5, atol=1e-5)
    if arithmetic != "plain":
        # row invariance: AR's one-token forwards along each node's path give the same bits
        for i, d in enumerate(buf.depths.tolist()):
            model.truncate_cache(9)
            for j, node in enumerate(buf.node_paths[i, :d + 1].tolist()):   # the root, then the path
                model(nodes[node].view(1, 1), torch.tensor([9 + j]))
            assert torch.equal(model.aux_features[0], verify[i]), f"node {i}"
        # forward_batch: each item's rows, item after item, as each alone
        caches = [model.new_cache(), model.new_cache()]
        for cache, n in zip(caches, (9, 5)):
            model.use_cache(cache)
            model(ids[:, :n], torch.arange(n))
        chain = TreeBuffers.compile(TREES[0])
        items = [BatchItem(caches[0], nodes, 9 + buf.depths, buf.ancestor_lists),
                 BatchItem(caches[1], nodes[:chain.num_nodes], 5 + chain.depths, chain.ancestor_lists)]
        model.forward_batch(items)
        batch = model.aux_features
        assert batch.shape == (buf.num_nodes + chain.num_nodes, 3 * 32)
        assert torch.equal(batch[:buf.num_nodes], verify)
        model.use_cache(caches[1])
        model.truncate_cache(5)
        model(nodes[None, :chain.num_nodes], 5 + chain.depths, chain.attn_mask, ancestors=chain.ancestor_lists)
        assert torch.equal(batch[buf.num_nodes:], model.aux_features)
    # target_forward reads the same capture, and restores the model's own setting
    model.capture_aux(None)
    model.reset_cache()
    _, _, features = target_forward(model, ids, torch.arange(9), (0, 2, 3))
    torch.testing.assert_close(features, _hook_features(model, ids, (0, 2, 3)), rtol=0, atol=0)
    assert model.aux_layer_ids == () and model.aux_features is None
    model(ids[:, :1], torch.tensor([9]))
    assert model.aux_features is None   # capture off keeps nothing
    with pytest.raises(ValueError, match="distinct ids"):
        model.capture_aux((1, 1))
    with pytest.raises(ValueError, match="layers 0..3"):
        model.capture_aux((4,))


def _true_path_tree(ranks: list[int]) -> tuple[Tree, list[tuple[int, ...]]]:
    """A tree holding, at each depth, every rank up to the true token's below the true path (the
    path by those ranks), and that path's nodes."""
    paths, path, on_path = [], (), []
    for r in ranks:
        paths += [path + (k,) for k in range(r + 1)]
        path = path + (r,)
        on_path.append(path)
    return Tree(paths), on_path


def test_rank_paths_rank_the_true_tokens_as_propose_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """rank_paths[t, d-1] is the index of the true token x_{t+1+d} among the depth-d children that
    `propose_scored` drafts below the true path from position t (the tree wide enough to hold it),
    top1 the probability of the rank-0 child there; the greedy variant follows `propose`'s chain."""
    from runtime import eagle3

    model = tiny_target()
    drafter = random_drafter(model)
    drafter.bind(model, capacity=512)
    n, depth = 14, 4
    x = torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(6))
    model.reset_cache()
    _, _, features = target_forward(model, x[None, :n], torch.arange(n), AUX)
    nxt = x[1:]
    ranks, top1 = drafter.rank_paths(features, nxt, depth=depth)
    greedy_ranks, greedy_top1 = drafter.rank_paths(features, nxt, depth=depth, greedy=True)
    assert ranks.shape == top1.shape == (n, depth) and drafter.length == 0   # its own cache left alone
    t, d = torch.meshgrid(torch.arange(n), torch.arange(1, depth + 1), indexing="ij")
    assert torch.equal(ranks < 0, t + 1 + d > n) and torch.equal(greedy_ranks < 0, t + 1 + d > n)
    assert torch.equal(greedy_top1[:, 0], top1[:, 0])
    checked = 0
    for pos in range(n - 1):
        drafter.reset()
        h = drafter.extend(features[:pos + 1], nxt[:pos + 1])
        root = int(nxt[pos])   # x_{pos+1}
        along = []
        for dd in range(depth):
            r = int(ranks[pos, dd])
            if r < 0:
                break
            if r == DRAFT_VOCAB:   # not in the draft vocabulary: never drafted, deeper nodes unreachable
                assert not bool(drafter.t2d[nxt[pos + dd + 1]])
                break
            along.append(r)
        tree, on_path = _true_path_tree(along)
        tokens, probs = drafter.propose_scored(h, root, TreeBuffers.compile(tree))
        order = {p: i for i, p in enumerate(tree.paths, start=1)}
        for dd, node in enumerate(on_path, start=1):
            assert int(tokens[order[node]]) == int(nxt[pos + dd]), f"position {pos} depth {dd}"
            first = order[node[:-1] + (0,)]
            assert float(probs[first]) == pytest.approx(float(top1[pos, dd - 1]), rel=1e-4, abs=1e-6)
            checked += 1
        _, chain_probs = drafter.propose_scored(h, root, TreeBuffers.compile(Tree.chain(depth)))
        live = min(depth, n - 1 - pos)
        torch.testing.assert_close(chain_probs[1:live + 1], greedy_top1[pos, :live], rtol=1e-4, atol=1e-6)
    assert checked >= 20, "too few depths checked: the random drafter's true tokens fell off its vocabulary"

    # from `first` on, in chunks of query rows, and the rollout's view (capped, with the greedy chain)
    monkeypatch.setattr(eagle3, "RANK_CHUNK", 4)
    r5, p5 = drafter.rank_paths(features, nxt, depth=depth, first=5)
    assert torch.equal(r5, ranks[5:])
    torch.testing.assert_close(p5, top1[5:], rtol=1e-5, atol=1e-6)
    capped, head_top1, chain_top1 = drafter.rollout_arrays(features, nxt, 5, depth, 8)
    assert torch.equal(capped, torch.where(ranks[5:] < 0, 8, ranks[5:].clamp(max=8)))
    torch.testing.assert_close(head_top1, top1[5:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chain_top1, greedy_top1[5:], rtol=1e-5, atol=1e-6)


def test_inputs_and_targets_are_checked() -> None:
    model = tiny_target()
    drafter = random_drafter(model)
    features, next_tokens, root = prompt_inputs(model)
    with pytest.raises(Eagle3Error, match="extend"):
        drafter.propose_tree(torch.zeros(1, 32), root, TreeBuffers.compile(TREES[0]))
    with pytest.raises(Eagle3Error, match=r"features must be \[n >= 1, 3 x 32 = 96\]"):
        drafter.extend(features[:, :64], next_tokens)
    with pytest.raises(Eagle3Error, match="tokens must be"):
        drafter.extend(features, next_tokens[:-1])
    drafter.setup_cache(8)
    with pytest.raises(Eagle3Error, match="holds 8 rows"):
        drafter.extend(features, next_tokens)
    h = drafter.extend(features[:7], next_tokens[:7])
    with pytest.raises(Eagle3Error, match="scratch rows"):
        drafter.propose_tree(h, root, TreeBuffers.compile(TREES[1]))
    with pytest.raises(Eagle3Error, match="hidden size 32 but the target's is 48"):
        drafter.bind(tiny_transformer(ModelArgs(vocab_size=VOCAB, dim=48, n_layers=4, n_heads=4, n_kv_heads=2,
                                                head_dim=12, intermediate_size=64), cache=16))
    with pytest.raises(Eagle3Error, match="only 3 layers"):
        drafter.bind(tiny_target(n_layers=3))
    with pytest.raises(Eagle3Error, match="strictly increasing"):
        Eagle3Config.for_model(model.args, aux_layer_ids=(2, 1, 3))


# ---------------------------------------------------------------------------- our file format


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_save_load_round_trip(tmp_path: Path, dtype: torch.dtype | None) -> None:
    model = tiny_target()
    drafter = random_drafter(model, norm_before_residual=True)
    save_drafter(drafter, tmp_path, dtype=dtype)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["format"] == "entmtp-eagle3" and meta["aux_layer_ids"] == list(AUX)
    back = load_drafter(tmp_path, model, dtype=torch.float32)
    assert back.config == drafter.config and back.is_bound
    for k, v in drafter.state_dict().items():
        want = v if dtype is None or not v.is_floating_point() else v.to(dtype).float()
        assert torch.equal(back.state_dict()[k], want), k
    if dtype is None:
        features, next_tokens, root = prompt_inputs(model)
        h, h2 = drafter.extend(features, next_tokens), back.extend(features, next_tokens)
        buf = TreeBuffers.compile(TREES[1])
        assert torch.equal(back.propose_tree(h2, root, buf), drafter.propose_tree(h, root, buf))
    alone = load_drafter(tmp_path)  # without a target: not bound, in the stored dtype
    assert not alone.is_bound and alone.dtype == (dtype or torch.float32)
    with pytest.raises(Eagle3Error, match="target vocabulary 64 but the target model has 80"):
        load_drafter(tmp_path, tiny_transformer(ModelArgs(vocab_size=80, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                                          head_dim=8, intermediate_size=64), cache=16))


def _corrupt_tensors(folder: Path, edit) -> None:  # noqa: ANN001 - a callable on the state dict
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / WEIGHTS_FILE))
    edit(state)
    save_file(state, str(folder / WEIGHTS_FILE))


def _corrupt_config(folder: Path, edit) -> None:  # noqa: ANN001 - a callable on the config dict
    meta = json.loads((folder / CONFIG_FILE).read_text())
    edit(meta)
    (folder / CONFIG_FILE).write_text(json.dumps(meta))


def _swap_d2t(s: dict) -> None:
    s["d2t"] = s["d2t"].clone()
    s["d2t"][0] = s["d2t"][1] + 1  # draft ids 0 and 1 now map to one target id


MALFORMED = {
    "missing key": (lambda f: _corrupt_tensors(f, lambda s: s.pop("layer.hidden_norm.weight")),
                    r"missing keys \['layer.hidden_norm.weight'\]"),
    "unexpected key": (lambda f: _corrupt_tensors(f, lambda s: s.update(extra=torch.zeros(2))),
                       r"unexpected keys \['extra'\]"),
    "wrong shape": (lambda f: _corrupt_tensors(f, lambda s: s.update({"fc.weight": torch.zeros(32, 64)})),
                    r"fc.weight: shape \(32, 64\), expected \(32, 96\)"),
    "d2t not integer": (lambda f: _corrupt_tensors(f, lambda s: s.update(d2t=s["d2t"].float())), "d2t: dtype"),
    "d2t collision": (lambda f: _corrupt_tensors(f, _swap_d2t), "two draft ids to one target id"),
    "t2d inconsistent": (lambda f: _corrupt_tensors(f, lambda s: s.update(t2d=~s["t2d"])), "t2d"),
    "dtype mismatch": (lambda f: _corrupt_tensors(f, lambda s: s.update({"norm.weight": s["norm.weight"].double()})),
                       "not float32 as config.json says"),
    "not safetensors": (lambda f: (f / WEIGHTS_FILE).write_bytes(b"\x00" * 64), "not a readable safetensors file"),
    "foreign config": (lambda f: _corrupt_config(f, lambda m: m.update(format="entmtp-heads")),
                       "not an EntMTP EAGLE-3"),
    "format version": (lambda f: _corrupt_config(f, lambda m: m.update(format_version=9)), "format_version 9"),
    "unknown config key": (lambda f: _corrupt_config(f, lambda m: m.update(num_layers=2)),
                           r"unknown .* \['num_layers'\]"),
    "config lacks a key": (lambda f: _corrupt_config(f, lambda m: m.pop("draft_vocab_size")), "lacks required keys"),
    "vocab in config": (lambda f: _corrupt_config(f, lambda m: m.update(draft_vocab_size=30)),
                        r"lm_head.weight: shape"),
    "unsorted layers": (lambda f: _corrupt_config(f, lambda m: m.update(aux_layer_ids=[3, 1, 2])),
                        "strictly increasing"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_refused(tmp_path: Path, case: str) -> None:
    model = tiny_target()
    save_drafter(random_drafter(model), tmp_path)
    corrupt, message = MALFORMED[case]
    corrupt(tmp_path)
    with pytest.raises(Eagle3Error, match=message):
        load_drafter(tmp_path, model)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_drafter(tmp_path)
    save_drafter(random_drafter(tiny_target()), tmp_path)
    (tmp_path / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="drafter.safetensors not found"):
        load_drafter(tmp_path)
