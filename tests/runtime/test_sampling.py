"""Seeded sampling keyed on the output position (runtime/sampling.py): exact samples, and tree
decoding that emits exactly the seeded-AR tokens for any tree, any per-step tree choice and both
kinds of heads.

The statistical tests use fixed seeds, so they are deterministic: they either always pass or
always fail. Their significance level (ALPHA) is what a correct sampler had to clear once; the
deliberate bugs must land far below it.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.decoder import TreeDecoder, TypicalAcceptance
from runtime.ar import ar_generate
from runtime.model.llama import Transformer
from runtime.policy import LadderPolicy, Scheduler
from runtime.sampling import (RowPositions, Sampler, SamplingConfig, gumbel_noise, keyed_argmax,
                              process_logits)
from runtime.tree import Tree, TreeBuffers
from tests.helpers import DECODER_TREES as TREES
from tests.helpers import tiny_heads, tiny_model, torch_threads
from tests.helpers import trees as valid_trees

ALPHA = 1e-3          # significance of the goodness-of-fit tests
BUG_ALPHA = 1e-9      # a deliberate bug must be rejected at least this strongly
PROMPT = [3, 17, 8, 25, 11]
# processing that exercises every stage: tempered, top-k, top-p
STAT_CONFIG = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


# --- the noise --------------------------------------------------------------------------------


def _reference_noise(seed: int, position: int, token: int) -> float:
    """The documented hash in plain Python integers (no torch): pins the definition, so the
    tensor version cannot drift, and shows the bits are device-free integer arithmetic."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x &= mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    key = mix(mix(seed + 0x9E3779B97F4A7C15) + (position + 1) * 0xD6E8FEB86659FD93)
    bits = mix(key + (token + 1) * 0x9E3779B97F4A7C15)
    u = ((bits >> 11) + 0.5) * 2.0 ** -53
    return -math.log(-math.log(u))


def test_noise_matches_the_integer_reference() -> None:
    for seed in (0, 1, 2**63 + 5, 2**64 - 1):
        positions = torch.tensor([0, 1, 7, 1000])
        noise = gumbel_noise(seed, positions, 300)
        for i, pos in enumerate(positions.tolist()):
            for tok in (0, 1, 150, 299):
                assert noise[i, tok].item() == pytest.approx(_reference_noise(seed, pos, tok), rel=1e-14, abs=1e-14)


def test_noise_depends_only_on_seed_position_and_token() -> None:
    rows = gumbel_noise(5, torch.tensor([4, 9, 4]), 64)
    assert torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[1])
    # the vocabulary size only truncates; a row alone equals the row in a batch
    assert torch.equal(gumbel_noise(5, torch.tensor([9]), 20)[0], rows[1, :20])
    # a tensor of seeds broadcasts against positions
    many = gumbel_noise(torch.tensor([[5], [6]]), torch.tensor([4, 9]), 64)
    assert torch.equal(many[0], rows[:2]) and torch.equal(many[1, 0], gumbel_noise(6, torch.tensor([4]), 64)[0])
    assert not torch.equal(many[1], many[0])


def test_noise_is_standard_gumbel() -> None:
    g = gumbel_noise(11, torch.arange(64), 16_384).flatten()  # 1M values
    assert torch.isfinite(g).all()
    euler_gamma = 0.5772156649015329
    assert g.mean().item() == pytest.approx(euler_gamma, abs=0.005)
    assert g.var().item() == pytest.approx(math.pi ** 2 / 6, abs=0.01)
    # the CDF exp(-exp(-x)) at a few points
    for x in (-1.0, 0.0, 1.0, 3.0):
        assert (g <= x).double().mean().item() == pytest.approx(math.exp(-math.exp(-x)), abs=0.002)


# --- the config and the processed support -----------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"), ({"seed": 1.0}, "seed"), ({"seed": 2**64}, "seed"),
])
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_config_round_trips_and_rejects_unknown_keys() -> None:
    cfg = SamplingConfig(temperature=0.7, top_k=50, top_p=0.95, seed=3)
    assert SamplingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown sampling settings"):
        SamplingConfig.from_dict({"temperature": 0.7, "topk": 5})


def test_processed_support() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    probs = lambda cfg: torch.softmax(process_logits(logits, cfg), -1)[0]  # noqa: E731
    # temperature only: everything stays, sharper or flatter
    assert (probs(SamplingConfig(temperature=0.5)) > 0).all()
    # top-k keeps the tie at the boundary
    assert probs(SamplingConfig(temperature=1.0, top_k=2)).gt(0).tolist() == [True, True, True, False, False]
    # top-p: p = [.53, .20, .20, .07, .03]; 0.6 needs the first two (mass before the second: .53 < .6)
    assert probs(SamplingConfig(temperature=1.0, top_p=0.6)).gt(0).tolist() == [True, True, False, False, False]
    # the most probable token always stays
    assert probs(SamplingConfig(temperature=1.0, top_p=1e-9)).gt(0).tolist() == [True, False, False, False, False]
    # top-k then top-p, on the top-k renormalised distribution
    kept = probs(SamplingConfig(temperature=1.0, top_k=2, top_p=0.7)).gt(0).tolist()
    assert kept == [True, True, False, False, False]  # .58 before the 2nd of [.58, .21, .21]
    with pytest.raises(ValueError, match="temperature 0"):
        process_logits(logits, SamplingConfig())


def test_greedy_is_argmax_and_needs_no_positions() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler().next_tokens(logits, torch.zeros(6, dtype=torch.long)), logits.argmax(-1))
    # top-k 1 at any temperature is greedy too
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=1, seed=9))
    assert torch.equal(sampler.next_tokens(logits, torch.arange(6)), logits.argmax(-1))


def test_row_positions_equal_explicit_positions() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 40, generator=gen)
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3])
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=4))
    for first in (0, 2, 3, 10, 3):  # forward, overlapping, a jump, and back (a new decode)
        got = sampler.next_tokens(logits, RowPositions(first, depths, 4))
        assert torch.equal(got, Sampler(sampler.config).next_tokens(logits, first + depths))
    with pytest.raises(ValueError, match="one output position per logits row"):
        sampler.next_tokens(logits, torch.arange(3))


def test_low_precision_logits_sample_in_float32() -> None:
    """bfloat16 logits give the tokens their float32 values give (the noise is never rounded to
    the model's dtype)."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for seed in range(20):
        cfg = SamplingConfig(temperature=0.7, top_p=0.9, seed=seed)
        assert torch.equal(Sampler(cfg).next_tokens(logits, torch.arange(3)),
                           Sampler(cfg).next_tokens(logits.float(), torch.arange(3)))


# --- tree decoding emits the seeded-AR tokens ---------------------------------------------------

CONFIGS = [SamplingConfig(temperature=0.7, seed=1), SamplingConfig(temperature=1.0, seed=2),
           SamplingConfig(temperature=1.0, top_k=8, top_p=0.9, seed=3), SamplingConfig(temperature=0.7, top_p=0.8, seed=4)]


def _ar(model: Transformer, ids: list[int], n: int, cfg: SamplingConfig) -> list[int]:
    return ar_generate(model, ids, n, sampler=Sampler(cfg))


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_seeded_tree_sampling_equals_seeded_ar(kind: str) -> None:
    model = tiny_model(3)
    heads = tiny_heads(model, kind, seed=3)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    accepted = 0
    for cfg in CONFIGS:
        ref = _ar(model, PROMPT, 30, cfg)
        for k in range(len(TREES)):
            res = dec.generate(PROMPT, 30, choose=k, sampler=Sampler(cfg))
            assert res.tokens == ref, (kind, cfg, k)
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0, "no draft was ever accepted: the test would not see a wrong acceptance rule"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees=st.lists(valid_trees(max_depth=4, max_nodes=20), min_size=1, max_size=4),
       seed=st.integers(0, 2**64 - 1), kind=st.sampled_from(["hydra", "medusa"]),
       temperature=st.sampled_from([0.7, 1.0]), top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.85]))
def test_random_trees_random_switching_equal_seeded_ar(trees: list[Tree], seed: int, kind: str, temperature: float,
                                                       top_k: int, top_p: float) -> None:
    with torch_threads(1):
        model = tiny_model(seed % 3)
        heads = tiny_heads(model, kind, seed=seed % 5)
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ref = _ar(model, PROMPT, 20, cfg)
        bufs = [TreeBuffers.compile(t) for t in trees]
        # a ladder over p0 with random thresholds: the tree changes from step to step
        rng = torch.Generator().manual_seed(seed % 2**63)
        thresholds = [t + i * 1e-6 for i, t in enumerate(sorted(torch.rand(len(bufs) - 1, generator=rng).tolist()))]
        choose = Scheduler(LadderPolicy(thresholds, signal="p0"), len(bufs)) if thresholds else 0
        assert TreeDecoder(model, heads, bufs).generate(PROMPT, 20, choose=choose, sampler=Sampler(cfg)).tokens == ref


def test_per_step_switching_uses_several_trees_and_stays_exact() -> None:
    model = tiny_model(1)
    heads = tiny_heads(model, "hydra", seed=1)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    cfg = SamplingConfig(temperature=0.7, seed=8)
    ref = _ar(model, PROMPT, 48, cfg)
    # thresholds at the quartiles of the signal this decode sees, so that the ladder climbs and falls
    probe = dec.generate(PROMPT, 48, choose=Scheduler(LadderPolicy([2.0, 3.0, 4.0], signal="p0"), len(TREES)),
                         sampler=Sampler(cfg))
    assert probe.tokens == ref
    quartiles = torch.tensor([s.signal for s in probe.steps]).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()
    thresholds = [q + i * 1e-6 for i, q in enumerate(quartiles)]
    res = dec.generate(PROMPT, 48, choose=Scheduler(LadderPolicy(thresholds, signal="p0"), len(TREES)),
                       sampler=Sampler(cfg))
    assert res.tokens == ref
    assert len({s.tree for s in res.steps}) >= 2, "the ladder never switched: the test would not exercise switching"


def test_seeds_give_different_outputs_and_temperature_zero_is_greedy() -> None:
    model = tiny_model(0)
    heads = tiny_heads(model, "hydra")
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(Tree.named("mc_sim_7b_63"))])
    outputs = {tuple(dec.generate(PROMPT, 16, sampler=Sampler(SamplingConfig(1.0, seed=s))).tokens) for s in range(6)}
    assert len(outputs) == 6
    greedy = ar_generate(model, PROMPT, 16)
    assert dec.generate(PROMPT, 16, sampler=Sampler(SamplingConfig(0.0, seed=123))).tokens == greedy
    assert _ar(model, PROMPT, 16, SamplingConfig(0.0, seed=5)) == greedy
    typical = TreeDecoder(model, heads, [TreeBuffers.compile(Tree.named("chain4"))], acceptance=TypicalAcceptance())
    with pytest.raises(ValueError, match="typical acceptance"):
        typical.generate(PROMPT, 4, sampler=Sampler(SamplingConfig(0.7)))


# --- distribution ---------------------------------------------------------------------------------


def g_test_p_value(observed: Counter, expected: dict, n: int) -> float:
    """p-value of the G-test of `observed` counts against `expected` probabilities. Cells
    expected fewer than 5 times are pooled into one, so that the chi-square law applies."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, p in expected.items():
        if p * n >= 5:
            cells.append((observed.get(key, 0), p * n))
        else:
            pooled_obs, pooled_exp = pooled_obs + observed.get(key, 0), pooled_exp + p * n
    outside = n - sum(observed.get(key, 0) for key in expected)
    if outside:
        return 0.0  # a draw outside the support
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    g = 2 * sum(o * math.log(o / e) for o, e in cells if o > 0)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(g / 2)))


@torch.inference_mode()
def _next_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    model.reset_cache()
    logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)))
    return logits[0, -1]


def _two_token_law(model: Transformer, cfg: SamplingConfig) -> tuple[torch.Tensor, dict, dict]:
    """The processed law of the first two tokens: (logits at position 1 per first token [V, V],
    P(t0), P(t0, t1) = P(t0) P(t1 | t0)), from the model's own conditionals."""
    l0 = _next_logits(model, PROMPT)
    p0 = torch.softmax(process_logits(l0, cfg), -1)
    vocab = l0.shape[-1]
    l1 = torch.zeros(vocab, vocab)
    joint = {}
    for t0 in torch.nonzero(p0).flatten().tolist():
        l1[t0] = _next_logits(model, PROMPT + [t0])
        p1 = torch.softmax(process_logits(l1[t0], cfg), -1)
        joint.update({(t0, t1): p0[t0].item() * p1[t1].item() for t1 in torch.nonzero(p1).flatten().tolist()})
    return l1, {t: p for t, p in enumerate(p0.tolist()) if p > 0}, joint


def _batched_draws(l0: torch.Tensor, l1: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
                   position_of: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """First two tokens for every seed at once, the noise for output position t taken at
    position_of[t] (the identity for the real sampler; a bug maps several positions to one)."""
    vocab = l0.shape[-1]
    t0 = keyed_argmax(l0.expand(len(seeds), vocab), gumbel_noise(seeds, torch.tensor(position_of[0]), vocab), cfg)
    t1 = keyed_argmax(l1[t0], gumbel_noise(seeds, torch.tensor(position_of[1]), vocab), cfg)
    return t0, t1


def test_twenty_thousand_draws_follow_the_processed_law_and_reused_noise_is_caught() -> None:
    """20,000 seeds through the sampler on the model's own logits: the first token follows the
    processed distribution and the first two tokens follow P(t0) P(t1 | t0). Noise reused across
    positions still gives each token the right marginal, but couples consecutive tokens: the
    joint test rejects it."""
    model = tiny_model(4)
    l1, law0, joint = _two_token_law(model, STAT_CONFIG)
    l0 = _next_logits(model, PROMPT)
    n = 20_000
    seeds = torch.arange(n)
    t0, t1 = _batched_draws(l0, l1, STAT_CONFIG, seeds, {0: 0, 1: 1})
    assert g_test_p_value(Counter(t0.tolist()), law0, n) > ALPHA
    assert g_test_p_value(Counter(zip(t0.tolist(), t1.tolist())), joint, n) > ALPHA

    b0, b1 = _batched_draws(l0, l1, STAT_CONFIG, seeds, {0: 0, 1: 0})  # the bug: position 1 reuses position 0's noise
    assert g_test_p_value(Counter(b0.tolist()), law0, n) > ALPHA  # marginal still right ...
    assert g_test_p_value(Counter(zip(b0.tolist(), b1.tolist())), joint, n) < BUG_ALPHA  # ... the joint is not


class ReusedNoiseSampler(Sampler):
    """Deliberate bug: every row uses the noise of output position 0."""

    def next_tokens(self, logits: torch.Tensor, positions: torch.Tensor | RowPositions) -> torch.Tensor:
        return super().next_tokens(logits, torch.zeros(logits.shape[0], dtype=torch.long))


class NodeKeyedSampler(Sampler):
    """Deliberate bug: noise keyed on the tree node (the logits row) instead of the output position."""

    def next_tokens(self, logits: torch.Tensor, positions: torch.Tensor | RowPositions) -> torch.Tensor:
        return super().next_tokens(logits, torch.arange(logits.shape[0]))


@pytest.mark.parametrize("sampler_cls,correct", [(Sampler, True), (NodeKeyedSampler, False), (ReusedNoiseSampler, False)])
def test_real_tree_decoding_follows_the_law_and_bugs_are_caught(sampler_cls: type[Sampler], correct: bool) -> None:
    """Real tree decoding, one seed per decode: the first two tokens (the second from a tree
    step, accepted draft or bonus) follow P(t0) P(t1 | t0) only with position-keyed noise."""
    model = tiny_model(4)
    heads = tiny_heads(model, "hydra", seed=4)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(Tree([(0,), (1,), (0, 0)]))])
    _, _, joint = _two_token_law(model, STAT_CONFIG)
    n = 600  # enough: the bugs land many orders of magnitude below BUG_ALPHA at this size
    pairs = Counter()
    for seed in range(n):
        cfg = SamplingConfig(STAT_CONFIG.temperature, STAT_CONFIG.top_k, STAT_CONFIG.top_p, seed=seed)
        pairs[tuple(dec.generate(PROMPT, 2, eos_ids=(), sampler=sampler_cls(cfg)).tokens)] += 1
    p = g_test_p_value(pairs, joint, n)
    assert (p > ALPHA) if correct else (p < BUG_ALPHA), p


# --- the public API and the command line ------------------------------------------------------

API_PROMPT = "Write a haiku about trees."


@pytest.fixture(scope="module")
def engine(bundle):  # noqa: ANN001 - tests.helpers.TinyBundle
    from runtime.api import EntMTP

    return EntMTP.load(bundle.bank_dir)


def test_api_sampling_equals_sampled_ar_for_every_policy(engine) -> None:  # noqa: ANN001
    args = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "seed": 12}
    ar = engine.generate_ar(API_PROMPT, 12, **args)
    assert ar.stats["sampling"] == {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "seed": 12}
    # the default policy switches trees mid-decode on this bank; "2" is its largest tree
    for policy in ("hysteresis", "2"):
        out = engine.generate(API_PROMPT, 12, policy=policy, **args)
        assert out.tokens == ar.tokens and out.text == ar.text, policy
        assert out.stats["sampling"] == ar.stats["sampling"]
    other = engine.generate(API_PROMPT, 12, **{**args, "seed": 13})
    assert other.tokens == engine.generate_ar(API_PROMPT, 12, **{**args, "seed": 13}).tokens
    assert other.tokens != ar.tokens
    # the defaults are greedy
    assert engine.generate(API_PROMPT, 12).tokens == engine.generate_ar(API_PROMPT, 12, temperature=0.0).tokens
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(API_PROMPT, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate_ar(API_PROMPT, 4, temperature=0.7, top_p=0.0)


def test_cli_sampling_flags(bundle, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    from runtime.api import EntMTP
    from runtime.cli import main

    argv = ["generate", "--bank", str(bundle.bank_dir), "--prompt", "Say hello.", "--max-new-tokens", "8",
            "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--compare-ar"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "output identical" in captured.err, captured.err
    expected = EntMTP.load(bundle.bank_dir).generate("Say hello.", 8, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    assert captured.out == expected.text + "\n"
    assert main([*argv[:-1], "--top-p", "0"]) == 2
    assert capsys.readouterr().err.startswith("entmtp: error: top_p must be")


# --- the default model (slow) -------------------------------------------------------------------

REAL_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Give me three tips for staying focused while working from home.",
)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_default_model_seeded_tree_sampling_equals_seeded_ar(smollm2_dir, kind: str) -> None:  # noqa: ANN001
    """The default model and its shipped heads: seeded tree sampling with Medusa/Hydra's 64-node
    tree and a 6-node tree emits the seeded-AR tokens at T = 0.7 and 1.0 on real prompts. Prints
    tokens/step per tree at T = 0, 0.7 and 1.0 (run with -s to see them)."""
    from runtime.api import render_chat
    from runtime.heads import load_heads
    from runtime.model.checkpoint import load_model, load_tokenizer

    heads_dir = smollm2_dir.parent.parent / "heads" / smollm2_dir.name / kind
    if not (heads_dir / "config.json").is_file():
        pytest.skip(f"shipped heads not found at {heads_dir}")
    new_tokens = 32
    with torch_threads(2):
        model = load_model(smollm2_dir, dtype=torch.float32, max_seq_len=1024)
        heads = load_heads(heads_dir, model=model)
        tokenizer = load_tokenizer(smollm2_dir)
        trees = {"mc_sim_7b_63": Tree.named("mc_sim_7b_63"), "6-node": Tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])}
        dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees.values()])
        steps: dict[tuple[str, float], list[int]] = {}
        for i, prompt in enumerate(REAL_PROMPTS):
            ids = tokenizer.encode(render_chat(smollm2_dir, prompt), add_special_tokens=False).ids
            for temperature in (0.0, 0.7, 1.0):
                cfg = SamplingConfig(temperature=temperature, seed=100 + i)
                ref = ar_generate(model, ids, new_tokens, sampler=Sampler(cfg))
                for k, name in enumerate(trees):
                    res = dec.generate(ids, new_tokens, choose=k, sampler=Sampler(cfg))
                    assert res.tokens == ref, (kind, name, temperature, prompt)
                    tally = steps.setdefault((name, temperature), [0, 0])
                    tally[0] += len(res.tokens) - 1
                    tally[1] += len(res.steps)
    for (name, temperature), (tokens, n_steps) in steps.items():
        print(f"[{kind} {name} T={temperature}] tokens/step {tokens / n_steps:.2f} ({tokens} tokens, {n_steps} steps)")
