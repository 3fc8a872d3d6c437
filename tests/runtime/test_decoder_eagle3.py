"""The tree decoder driving an EAGLE-3 drafter (runtime.decoder's `Drafter` protocol): token for token
AR's output (greedy and seeded sampling) over fixed, random and switching trees, in batches and under
EntMTP-dyn, in the row-invariant arithmetics and in bfloat16; the drafter's state is a function of the
true prefix, built from the verify forwards' own features; and the loaders recognise a drafter folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.ar import ar_generate
from runtime.decoder import TreeDecoder
from runtime.dynamic import DYNAMIC_TREE, DynamicPolicy
from runtime.eagle3 import Eagle3Drafter, save_drafter, target_forward
from runtime.policy import HysteresisPolicy, LadderPolicy, Scheduler
from runtime.sampling import Sampler, SamplingConfig
from runtime.tree import Tree, TreeBuffers
from tests.helpers import ARITHMETICS, DRAFTS, GENTLE, SUPER, random_prompts
from tests.helpers import trees as valid_trees
from tests.helpers.drafters import EAGLE3_AUX, eagle3_from, eagle3_target, random_eagle3, trained_eagle3_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# a 6-deep chain, Medusa's default tree, a small branching tree and the root alone
TREES = [Tree.chain(6), Tree.named("mc_sim_7b_63"), Tree([(0,), (1,), (0, 0), (0, 1), (1, 0)]), Tree([])]
N = 72   # new tokens: past KEY_CHUNK = 64, where the row-invariant attention starts a second key chunk


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    from tests.helpers import torch_threads

    with torch_threads(1):
        return trained_eagle3_weights()


def decoder(arithmetic: str | None, weights: dict, trees: list[Tree] = TREES,
            dtype: torch.dtype = torch.float32) -> tuple[TreeDecoder, Eagle3Drafter]:
    model = eagle3_target(arithmetic, dtype=dtype)
    drafter = eagle3_from(weights, model)
    return TreeDecoder(model, drafter, [TreeBuffers.compile(t) for t in trees]), drafter


def ar(dec: TreeDecoder, prompt: list[int], n: int = N, sampler: Sampler | None = None) -> list[int]:
    return ar_generate(dec.model, prompt, n, eos_ids=(), sampler=sampler)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_fixed_trees_are_ar(arithmetic: str, weights: dict) -> None:
    dec, drafter = decoder(arithmetic, weights)
    deep = 0
    for prompt in random_prompts(2, seed=5):
        ref = ar(dec, prompt)
        for k, tree in enumerate(TREES):
            res = dec.generate(prompt, N, choose=k, eos_ids=())
            assert res.tokens == ref, f"{arithmetic} tree {tree.num_nodes} nodes"
            deep = max([deep] + [s.accepted for s in res.steps])
            assert drafter.length == dec.model.cache_len   # one committed row per committed position
    assert deep >= 3, "no step accepted 3 drafts: the test never fed the drafter a long accepted path"


def test_bfloat16_on_the_torch_path_is_ar(weights: dict) -> None:
    dec, drafter = decoder("padded", weights, dtype=torch.bfloat16)
    assert drafter.dtype == torch.bfloat16 and dec.model.dtype == torch.bfloat16
    accepted = 0
    for prompt in random_prompts(2, seed=6):
        ref = ar(dec, prompt)
        for k in (0, 1, 2):
            res = dec.generate(prompt, N, choose=k, eos_ids=())
            assert res.tokens == ref, f"tree {k}"
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0
    # copies of one prompt share its prefill in a batch: each still AR, past the first key chunk
    prompt = random_prompts(1, seed=7)[0]
    ref = ar(dec, prompt)
    assert all(res.tokens == ref for res in dec.generate_batch([prompt] * 3, N, choose=[1, 2, 0], eos_ids=()))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(trees=st.lists(valid_trees(max_depth=5, max_nodes=24), min_size=2, max_size=4), seed=st.integers(0, 10_000))
def test_random_trees_switching_every_step_are_ar(trees: list[Tree], seed: int, weights: dict) -> None:
    dec, _ = decoder("padded", weights, trees)
    prompt = random_prompts(1, seed=seed)[0]
    ref = ar(dec, prompt)
    rng = torch.Generator().manual_seed(seed)
    thresholds = sorted(torch.rand(len(trees) - 1, generator=rng).tolist())
    thresholds = [t + i * 1e-6 for i, t in enumerate(thresholds)]
    # p0 from the base logits, then the drafter's own greedy chain (a signal that reads the drafter)
    for policy in (LadderPolicy(thresholds, signal="p0"),
                   HysteresisPolicy(tau_on=0.3, tau_off=0.1, small=0, large=len(trees) - 1, signal="greedy_path")):
        res = dec.generate(prompt, N, choose=Scheduler(policy, len(trees)), eos_ids=())
        assert res.tokens == ref


def test_the_greedy_path_signal_reads_the_drafters_chain(weights: dict) -> None:
    dec, drafter = decoder("padded", weights)
    model, prompt = dec.model, random_prompts(1, seed=7)[0]
    model.reset_cache()
    drafter.reset()
    logits, hidden, features = target_forward(model, torch.tensor([prompt]), torch.arange(len(prompt)), EAGLE3_AUX)
    root = int(logits[0, -1].argmax())
    h = drafter.observe(hidden, torch.arange(len(prompt)), torch.tensor(prompt[1:] + [root]), features)
    chain = Tree.chain(drafter.max_depth)
    tokens, probs = drafter.propose_scored(h, root, TreeBuffers.compile(chain))
    assert drafter.greedy_top1(h, root) == probs[1:].tolist() and len(probs) == drafter.max_depth + 1
    # p_d is the top-1 probability at the chain's node d-1: its child is the argmax
    logits_1 = drafter.logits(h)[0]
    assert int(tokens[1]) == int(drafter.target_ids()[logits_1.argmax()])
    assert probs[1] == pytest.approx(float(torch.softmax(logits_1, -1).max()), rel=1e-5)


def test_a_decode_that_fills_the_cache_and_typical_acceptance(weights: dict) -> None:
    """A decode as long as the target's cache holds, its trees small and the signal the drafter's
    8-deep greedy chain (the drafter keeps room past the target's cache for those scratch rows);
    typical acceptance runs and repeats itself."""
    model = eagle3_target("padded", cache=64)
    drafter = eagle3_from(weights, model)
    trees = [Tree.chain(1), Tree.chain(3)]
    dec = TreeDecoder(model, drafter, [TreeBuffers.compile(t) for t in trees])
    prompt = random_prompts(1, seed=14, lengths=(10, 11))[0]
    policy = HysteresisPolicy(tau_on=0.3, tau_off=0.1, small=0, large=1, signal="greedy_path")
    n = model.max_seq_len - len(prompt) - trees[1].num_nodes
    res = dec.generate(prompt, n, choose=Scheduler(policy, 2), eos_ids=())
    assert res.tokens == ar(dec, prompt, n) and len(res.tokens) == n
    model = eagle3_target("padded")
    typical = TreeDecoder(model, eagle3_from(weights, model), [TreeBuffers.compile(t) for t in TREES[:3]],
                          acceptance="typical")
    first = typical.generate(prompt, 40, choose=1, eos_ids=())
    assert typical.generate(prompt, 40, choose=1, eos_ids=()).tokens == first.tokens
    assert sum(s.accepted for s in first.steps) > 0


def test_seeded_sampling_is_seeded_ar(weights: dict) -> None:
    dec, _ = decoder("padded", weights)
    accepted = 0
    for seed, prompt in enumerate(random_prompts(2, seed=8)):
        cfg = SamplingConfig(temperature=0.7, seed=seed)
        ref = ar(dec, prompt, sampler=Sampler(cfg))
        assert ref != ar(dec, prompt), "the sample equals the greedy output: the test would not see a greedy decoder"
        for k in (0, 1, 2):
            res = dec.generate(prompt, N, choose=k, eos_ids=(), sampler=Sampler(cfg))
            assert res.tokens == ref, f"seed {seed} tree {k}"
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_generate_batch_gives_each_sequence_its_own_ar_output(arithmetic: str, weights: dict) -> None:
    dec, drafter = decoder(arithmetic, weights)
    prompts = random_prompts(3, seed=9)
    limits = [N, 23, N]                       # the second sequence leaves the batch early
    chooses = [1, 1, 0]                       # two sequences draft one tree together (propose_batch)
    own = drafter.save_state()
    results = dec.generate_batch(prompts, limits, choose=chooses, eos_ids=())
    assert drafter.save_state() is own        # the decoder's own state is back in place
    accepted = 0
    for prompt, n, res in zip(prompts, limits, results):
        assert res.tokens == ar(dec, prompt, n)
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0
    # seeded sampling, every sequence on Medusa's tree
    cfg = SamplingConfig(temperature=0.7, seed=3)
    results = dec.generate_batch(prompts, N, choose=1, eos_ids=(), sampler=Sampler(cfg))
    for prompt, res in zip(prompts, results):
        assert res.tokens == ar(dec, prompt, sampler=Sampler(cfg))
    # copies of one prompt share its prefill; each still observes it through its own drafter cache
    copies = dec.generate_batch([prompts[0]] * 3, N, choose=[1, 2, 1], eos_ids=(), sampler=Sampler(cfg))
    assert all(res.tokens == ar(dec, prompts[0], sampler=Sampler(cfg)) for res in copies)


def test_propose_batch_drafts_each_sequence_over_its_own_cache(weights: dict) -> None:
    model = eagle3_target("padded")
    drafter = eagle3_from(weights, model)
    buf = TreeBuffers.compile(TREES[1])
    states, hs, roots, alone = [], [], [], []
    for prompt in random_prompts(3, seed=10):
        drafter.load_state(drafter.new_state())
        model.reset_cache()
        logits, hidden, features = target_forward(model, torch.tensor([prompt]), torch.arange(len(prompt)), EAGLE3_AUX)
        root = int(logits[0, -1].argmax())
        h = drafter.observe(hidden, torch.arange(len(prompt)), torch.tensor(prompt[1:] + [root]), features)
        states.append(drafter.save_state())
        hs.append(h)
        roots.append(root)
        alone.append(drafter.propose(h, root, buf))
    last = drafter.save_state()
    batch = drafter.propose_batch(torch.cat(hs), roots, buf, states)
    assert all(torch.equal(b, a) for b, a in zip(batch, alone))
    assert drafter.save_state() is last
    with pytest.raises(ValueError, match="each sequence's state"):
        drafter.propose_batch(torch.cat(hs), roots, buf)


@pytest.mark.parametrize("stop", [0.0, 0.1], ids=["whole", "early-stop"])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_entmtp_dyn_is_ar(arithmetic: str, stop: float, weights: dict) -> None:
    dec, _ = decoder(arithmetic, weights)
    policy = DynamicPolicy(SUPER, GENTLE, draft_ms=DRAFTS, stop_below=stop)
    sizes, accepted = set(), 0
    prompts = random_prompts(2, seed=11)
    for prompt in prompts:
        res = dec.generate(prompt, N, choose=policy, eos_ids=())
        assert res.tokens == ar(dec, prompt)
        assert all(s.tree == DYNAMIC_TREE for s in res.steps)
        sizes |= {s.nodes for s in res.steps}
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0 and len(sizes) >= 2, f"the policy verified only {sizes}-node trees"
    results = dec.generate_batch(prompts + prompts[:1], [N, N, 30], choose=[policy, policy, 2], eos_ids=())
    for prompt, n, res in zip(prompts + prompts[:1], [N, N, 30], results):
        assert res.tokens == ar(dec, prompt, n)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_the_drafter_state_is_a_function_of_the_true_prefix(arithmetic: str, weights: dict) -> None:
    """After a decode the drafter holds one row per committed position, built from exactly AR's
    features (bit for bit: they come from row-invariant verify forwards) paired with the true next
    tokens, and its cache is what one `extend` over the whole text builds."""
    dec, drafter = decoder(arithmetic, weights)
    model = dec.model
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    observe = drafter.observe

    def spy(hidden, positions, next_tokens=None, features=None):  # noqa: ANN001, ANN202 - the protocol's call
        seen.append((positions.clone(), next_tokens.clone(), features.clone()))
        return observe(hidden, positions, next_tokens, features)

    drafter.observe = spy
    prompt = random_prompts(1, seed=12)[0]
    res = dec.generate(prompt, N, choose=1, eos_ids=())
    assert max(s.accepted for s in res.steps) >= 2
    length = drafter.length
    assert length == model.cache_len and len(seen) == len(res.steps) + 1
    positions = torch.cat([p for p, _, _ in seen])
    next_tokens = torch.cat([t for _, t, _ in seen])
    features = torch.cat([f for _, _, f in seen])
    assert torch.equal(positions, torch.arange(length))
    text = prompt + ar(dec, prompt, N + 8)   # the last step may accept past the token budget
    assert next_tokens.tolist() == text[1:length + 1]

    # AR's features, one forward per token after the prompt's: the verify rows' are the same bits
    model.reset_cache()
    model.capture_aux(EAGLE3_AUX)
    try:
        with torch.inference_mode():
            model(torch.tensor([prompt]), torch.arange(len(prompt)), last_only=True)
            rows = [model.aux_features]
            for pos in range(len(prompt), length):
                model(torch.tensor([[text[pos]]]), torch.tensor([pos]))
                rows.append(model.aux_features)
    finally:
        model.capture_aux(None)
    assert torch.equal(features, torch.cat(rows))

    # the cache equals one extend over the whole accepted text, from the features of one forward over it
    model.reset_cache()
    with torch.inference_mode():
        _, _, whole = target_forward(model, torch.tensor([text[:length]]), torch.arange(length), EAGLE3_AUX)
    fresh = eagle3_from(weights, model)
    fresh.extend(whole, torch.tensor(text[1:length + 1]))
    torch.testing.assert_close(drafter.state.kv[:, :, :length], fresh.state.kv[:, :, :length], rtol=1e-4, atol=1e-4)


def test_load_heads_and_entmtp_load_recognise_a_drafter_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from runtime.api import EntMTP
    from runtime.heads import load_heads
    from runtime.model.checkpoint import load_model
    from tests.helpers import make_tiny_bank, random_hf_causal_lm

    vocab = 64
    hf = random_hf_causal_lm("llama", dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=256, tie_word_embeddings=False))
    model_dir, drafter_dir = tmp_path / "model", tmp_path / "drafter"
    hf.save_pretrained(model_dir)
    words = models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    Tokenizer(words).save(str(model_dir / "tokenizer.json"))
    model = load_model(model_dir, max_seq_len=128)
    save_drafter(random_eagle3(model, draft_vocab=48), drafter_dir)

    loaded = load_heads(drafter_dir, model)
    assert isinstance(loaded, Eagle3Drafter) and loaded.is_bound and loaded.aux_layer_ids == EAGLE3_AUX

    bank_dir = make_tiny_bank(tmp_path / "bank", model_dir, drafter_dir)
    engine = EntMTP.load(bank_dir, max_seq_len=128)
    torch.set_num_threads(1)   # load_model takes every core once per process; the fixture restores the count
    assert isinstance(engine.heads, Eagle3Drafter)
    prompt = random_prompts(1, seed=13, vocab=vocab)[0]
    for policy in (None, 2, "static"):
        out = engine.generate(prompt, 40, policy=policy)
        assert out.tokens == engine.generate_ar(prompt, 40).tokens
    assert engine.generate(prompt, 30, temperature=0.7, seed=1).tokens == \
        engine.generate_ar(prompt, 30, temperature=0.7, seed=1).tokens
