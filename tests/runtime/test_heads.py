"""Draft heads: drafting matches a per-node brute force, context caching, save/load, validation."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.heads import DraftHeads, HeadsConfig, check_base_fingerprint, load_heads, save_heads
from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from runtime.tree import Tree, TreeBuffers
from tests.helpers import tiny_transformer

ARGS = ModelArgs(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                 tie_embeddings=True, max_position_embeddings=256)
VARIANTS = [
    (kind, prefix, output)
    for kind in ("hydra", "medusa")
    for prefix in (False, True)
    for output in ("shared", "own", "draft")
]


def tiny_model(seed: int = 0) -> Transformer:
    return tiny_transformer(ARGS, seed, cache=128)


def random_heads(model: Transformer, kind: str, prefix: bool, output: str, seed: int = 1, **kw) -> DraftHeads:
    cfg = HeadsConfig.for_model(model.args, kind=kind, prefix_layer=prefix, output=output,
                                draft_vocab_size=40 if output == "draft" else None, **kw)
    heads = DraftHeads(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():  # fresh heads are too symmetric (zero W) to test drafting
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if output == "draft":
            heads.set_draft_vocab(torch.randperm(ARGS.vocab_size, generator=g)[:40])
    heads.bind(model)
    return heads.eval()


def prefill(model: Transformer, heads: DraftHeads, n: int = 9, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    model.reset_cache()
    heads.reset()
    ids = torch.randint(0, ARGS.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    _, hidden = model(ids, torch.arange(n))
    return hidden, heads.observe(hidden, torch.arange(n))


def brute_force_tree(heads: DraftHeads, h: torch.Tensor, root: int, tree: Tree) -> list[int]:
    """Each node's token from teacher-forced logits along its own path (one call per node)."""
    D = heads.config.num_heads
    tokens = {(): root}
    for path in tree.paths:
        prefix_tokens = [tokens[path[:i]] for i in range(len(path))]  # root .. parent
        nxt = torch.tensor([prefix_tokens + [0] * (D - len(prefix_tokens))])
        logits = heads.teacher_forced_logits(h, nxt)[0, len(path) - 1]
        tokens[path] = int(logits.argsort(descending=True)[path[-1]])
    return [tokens[()]] + [tokens[p] for p in tree.paths]


TREES = [
    Tree.named("mc_sim_7b_63"),
    Tree.chain(4),
    Tree.chain(2),  # shallower than the heads
    Tree([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (2, 0, 0), (2, 0, 1)]),  # parents without children in between
    Tree([]),  # root only
]


@pytest.mark.parametrize(("kind", "prefix", "output"), VARIANTS)
def test_propose_matches_per_node_brute_force(kind: str, prefix: bool, output: str) -> None:
    model = tiny_model()
    heads = random_heads(model, kind, prefix, output)
    _, h = prefill(model, heads)
    for tree in TREES:
        got = heads.propose(h, 7, TreeBuffers.compile(tree)).tolist()
        assert got == brute_force_tree(heads, h, 7, tree), f"tree {tree}"


@pytest.mark.parametrize(("kind", "output"), [("hydra", "shared"), ("hydra", "draft"), ("medusa", "own")])
def test_propose_batch_drafts_each_sequence_as_propose_does(kind: str, output: str) -> None:
    model = tiny_model()
    heads = random_heads(model, kind, False, output)
    contexts = [prefill(model, heads, n=5 + i, seed=10 + i)[1] for i in range(3)]
    h, roots = torch.cat(contexts), [7, 31, 2]
    for tree in TREES:
        buf = TreeBuffers.compile(tree)
        together = heads.propose_batch(h, roots, buf)
        assert together.shape == (3, tree.num_nodes)
        alone = [heads.propose(c, r, buf).tolist() for c, r in zip(contexts, roots)]
        assert together.tolist() == alone, f"tree {tree}"
    drafted = heads.propose_batch(h, roots, TreeBuffers.compile(TREES[0]))[:, 1:].tolist()
    assert len({tuple(r) for r in drafted}) > 1  # the sequences' drafts differ: no row was copied
    with pytest.raises(ValueError, match="root tokens"):
        heads.propose_batch(h, [1, 2], TreeBuffers.compile(Tree.chain(2)))


@pytest.mark.parametrize("output", ["draft"])
def test_draft_vocab_proposals_are_base_ids_of_the_draft_vocab(output: str) -> None:
    model = tiny_model()
    heads = random_heads(model, "hydra", False, output)
    _, h = prefill(model, heads)
    toks = heads.propose(h, 3, TreeBuffers.compile(Tree.named("mc_sim_7b_63")))
    assert set(toks[1:].tolist()) <= set(heads.draft_ids.tolist())
    full = heads.teacher_forced_logits(h, torch.zeros(1, 4, dtype=torch.long))
    outside = torch.ones(ARGS.vocab_size, dtype=torch.bool)
    outside[heads.draft_ids] = False
    assert torch.isinf(full[..., outside]).all() and torch.isfinite(full[..., ~outside]).all()


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_observe_in_pieces_equals_context_of_whole_sequence(kind: str) -> None:
    model = tiny_model()
    heads = random_heads(model, kind, True, "shared")
    ids = torch.randint(0, ARGS.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    model.reset_cache()
    _, hidden = model(ids, torch.arange(12))
    full = heads.context(hidden)
    heads.reset()
    outs = []
    for a, b in [(0, 5), (5, 6), (6, 9), (9, 12)]:
        outs.append(heads.observe(hidden[:, a:b], torch.arange(a, b)))
        assert torch.allclose(outs[-1][0], full[b - 1], atol=1e-5)
    # context() is stateless: the decoding cache still holds exactly 12 positions
    assert heads.prefix.cache_len == 12
    heads.reset()
    again = heads.observe(hidden[:, :5], torch.arange(5))
    assert torch.allclose(again, outs[0], atol=1e-6)


def test_prefix_layer_is_causal_and_without_prefix_context_is_identity() -> None:
    model = tiny_model()
    heads = random_heads(model, "hydra", True, "shared")
    hidden = torch.randn(1, 10, ARGS.dim)
    a = heads.context(hidden)
    hidden2 = hidden.clone()
    hidden2[0, 7:] += 1.0
    b = heads.context(hidden2)
    assert torch.allclose(a[:7], b[:7], atol=1e-6) and not torch.allclose(a[7:], b[7:])
    plain = random_heads(model, "hydra", False, "shared")
    assert torch.equal(plain.context(hidden), hidden[0])
    assert torch.equal(plain.observe(hidden, torch.arange(10)), hidden[:, -1])


def test_hydra_head_d_reads_only_its_first_d_tokens_and_medusa_none() -> None:
    model = tiny_model()
    h = torch.randn(6, ARGS.dim)
    toks = torch.randint(0, ARGS.vocab_size, (6, 4), generator=torch.Generator().manual_seed(3))
    for kind in ("hydra", "medusa"):
        heads = random_heads(model, kind, False, "shared")
        base = heads.teacher_forced_logits(h, toks)
        for j in range(4):
            changed = toks.clone()
            changed[:, j] = (changed[:, j] + 1) % ARGS.vocab_size
            out = heads.teacher_forced_logits(h, changed)
            for d in range(1, 5):
                same = torch.equal(out[:, d - 1], base[:, d - 1])
                assert same == (kind == "medusa" or j >= d), (kind, j, d)


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
@pytest.mark.parametrize("output", ["shared", "own"])
def test_fresh_heads_start_as_the_base_lm_head(kind: str, output: str) -> None:
    model = tiny_model()
    heads = DraftHeads(HeadsConfig.for_model(model.args, kind=kind, output=output))
    heads.bind(model)
    heads.init_output_from_base()
    h = torch.randn(5, ARGS.dim)
    logits = heads.teacher_forced_logits(h, torch.zeros(5, 4, dtype=torch.long))
    expected = model.output(h)
    for d in range(4):
        assert torch.allclose(logits[:, d], expected, atol=1e-5)


@pytest.mark.parametrize(("kind", "prefix", "output"), [("hydra", True, "shared"), ("medusa", False, "own"),
                                                        ("hydra", False, "draft")])
def test_save_load_round_trip(tmp_path, kind: str, prefix: bool, output: str) -> None:
    model = tiny_model()
    heads = random_heads(model, kind, prefix, output, base_fingerprint="abc123")
    save_heads(heads, tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["config.json", "heads.safetensors"]
    loaded = load_heads(tmp_path / "h", model, base_fingerprint="abc123")
    assert loaded.config == heads.config
    for k, v in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    heads.eval().add_fast_paths()  # what load_heads does after reading the weights
    _, h = prefill(model, heads)
    _, h2 = prefill(model, loaded)
    assert torch.equal(h, h2)
    buf = TreeBuffers.compile(Tree.named("mc_sim_7b_63"))
    assert torch.equal(heads.propose(h, 4, buf), loaded.propose(h2, 4, buf))


def test_saved_heads_never_hold_the_shared_lm_head_and_bf16_halves_the_file(tmp_path) -> None:
    model = tiny_model()
    heads = random_heads(model, "hydra", False, "shared")
    save_heads(heads, tmp_path / "f32")
    save_heads(heads, tmp_path / "bf16", dtype=torch.bfloat16)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "f32" / "heads.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    assert shapes and not any("embed" in k or "lm_head" in k for k in shapes)
    assert not any(ARGS.vocab_size in s for s in shapes.values()), "a V x dim matrix was saved"
    s32 = (tmp_path / "f32" / "heads.safetensors").stat().st_size
    s16 = (tmp_path / "bf16" / "heads.safetensors").stat().st_size
    assert s16 < 0.6 * s32
    loaded = load_heads(tmp_path / "bf16", dtype=torch.float32)
    assert loaded.dtype == torch.float32 and json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_fingerprint_mismatch_is_refused(tmp_path) -> None:
    model = tiny_model()
    heads = random_heads(model, "medusa", False, "shared", base_fingerprint="aaaa")
    save_heads(heads, tmp_path)
    with pytest.raises(ValueError, match="trained on base model aaaa"):
        load_heads(tmp_path, model, base_fingerprint="bbbb")
    with pytest.raises(ValueError, match="no base_fingerprint"):
        check_base_fingerprint(HeadsConfig(hidden_size=8, vocab_size=10), "bbbb")
    check_base_fingerprint(heads.config, None)  # None skips


def test_load_validation_names_the_problem(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = tiny_model()
    heads = random_heads(model, "hydra", False, "shared")
    save_heads(heads, tmp_path)
    cfg_path, w_path = tmp_path / "config.json", tmp_path / "heads.safetensors"
    cfg = json.loads(cfg_path.read_text())

    cfg_path.write_text(json.dumps({**cfg, "hydra_num_heads": 4}))
    with pytest.raises(ValueError, match="hydra_num_heads"):
        load_heads(tmp_path)
    cfg_path.write_text(json.dumps({**cfg, "num_heads": 3}))  # weights hold 4 heads
    with pytest.raises(ValueError, match=r"unexpected keys \['heads\.3\."):
        load_heads(tmp_path)
    cfg_path.write_text(json.dumps({**cfg, "kind": "eagle"}))
    with pytest.raises(ValueError, match="kind"):
        load_heads(tmp_path)
    cfg_path.write_text(json.dumps(cfg))
    state = load_file(str(w_path))
    state["heads.0.blocks.0.linear.weight"] = torch.zeros(5, 5)
    save_file(state, str(w_path))
    with pytest.raises(ValueError, match=r"heads\.0\.blocks\.0\.linear\.weight: shape \(5, 5\)"):
        load_heads(tmp_path)
    state = {k: v.to(torch.float16) for k, v in load_file(str(w_path)).items()}
    save_file(state, str(w_path))
    with pytest.raises(ValueError, match="not float32"):
        load_heads(tmp_path)
    w_path.unlink()
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        load_heads(tmp_path)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        HeadsConfig(hidden_size=8, vocab_size=10, kind="eagle")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        HeadsConfig(hidden_size=8, vocab_size=10, output="draft")
    with pytest.raises(ValueError, match="base_args"):
        HeadsConfig(hidden_size=8, vocab_size=10, prefix_layer=True)
    with pytest.raises(ValueError, match="num_heads"):
        HeadsConfig(hidden_size=8, vocab_size=10, num_heads=0)
    with pytest.raises(ValueError, match="unknown heads config keys"):
        HeadsConfig.from_dict({"hidden_size": 8, "vocab_size": 10, "heads": 4})
    assert HeadsConfig(hidden_size=8, vocab_size=10, output="own").output_bias is True
    assert HeadsConfig(hidden_size=8, vocab_size=10, kind="medusa", output="own").output_bias is False


def test_bind_and_propose_errors() -> None:
    model = tiny_model()
    other = DraftHeads(HeadsConfig(hidden_size=16, vocab_size=97))
    with pytest.raises(ValueError, match="another model"):
        other.bind(model)
    unbound = DraftHeads(HeadsConfig.for_model(model.args))
    with pytest.raises(RuntimeError, match="bind"):
        unbound.propose(torch.zeros(1, ARGS.dim), 0, TreeBuffers.compile(Tree.chain(2)))
    heads = random_heads(model, "hydra", False, "shared", num_heads=2)
    with pytest.raises(ValueError, match="depth 4"):
        heads.propose(torch.zeros(1, ARGS.dim), 0, TreeBuffers.compile(Tree.chain(4)))
    with pytest.raises(ValueError, match="input_pos"):
        heads.observe(torch.zeros(1, 3, ARGS.dim), torch.arange(2))


def test_prefix_cache_follows_a_cast_after_bind() -> None:
    model = tiny_model()
    heads = random_heads(model, "hydra", True, "shared")
    hidden = torch.randn(1, 6, ARGS.dim)
    ref = heads.observe(hidden, torch.arange(6))
    heads.reset()
    heads.to(torch.bfloat16)  # e.g. a bf16 runtime: the prefix cache must follow
    out = heads.observe(hidden, torch.arange(6))
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, atol=0.1, rtol=0.05)
    toks = heads.propose(out, 3, TreeBuffers.compile(Tree.chain(4)))
    assert toks.shape == (5,)
