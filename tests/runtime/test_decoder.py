"""Lossless tree speculative decoding: the decoder emits exactly the greedy AR tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.decoder import TreeDecoder, TypicalAcceptance
from runtime.heads import DraftHeads, HeadsConfig
from runtime.policy import HysteresisPolicy, LadderPolicy, Scheduler
from runtime.tree import Tree, TreeBuffers
from tests.helpers import DECODER_TREES as TREES
from tests.helpers import ar_greedy, tiny_heads, tiny_model
from tests.helpers import trees as valid_trees


@pytest.mark.parametrize("kind,prefix", [("hydra", False), ("medusa", False), ("hydra", True)])
def test_lossless_fixed_trees(kind: str, prefix: bool) -> None:
    model = tiny_model()
    heads = tiny_heads(model, kind, prefix=prefix)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    accepted_any = 0
    for seed in range(2):
        ids = torch.randint(0, 40, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = ar_greedy(model, ids, 32)
        for k in range(len(TREES)):
            res = dec.generate(ids, 32, choose=k)
            assert res.tokens == ref, f"{kind} tree {k} prompt {seed}"
            accepted_any += sum(s.accepted for s in res.steps)
            # every step but the last emits accepted + 1 tokens (the last may be cut at the budget/EOS)
            assert sum(s.accepted + 1 for s in res.steps[:-1]) < len(res.tokens) <= 1 + sum(s.accepted + 1 for s in res.steps)
    assert accepted_any > 0, "the test never exercised an accepted draft; make the heads luckier"


def test_switching_every_step_is_lossless() -> None:
    model = tiny_model(1)
    heads = tiny_heads(model, "hydra", seed=1)
    trees = [TreeBuffers.compile(t) for t in TREES]
    dec = TreeDecoder(model, heads, trees)
    ids = list(range(3, 12))
    ref = ar_greedy(model, ids, 60)
    for policy in (HysteresisPolicy(tau_on=0.3, tau_off=0.2, small=0, large=1, signal="p0"),
                   LadderPolicy([0.2, 0.4, 0.6], signal="entropy_ema"),
                   HysteresisPolicy(tau_on=0.05, tau_off=0.01, small=2, large=3, signal="greedy_path")):
        res = dec.generate(ids, 60, choose=Scheduler(policy, len(trees)))
        assert res.tokens == ref
    used = {s.tree for s in res.steps}
    assert len(used) >= 1


def test_signals_computed_only_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """p0/entropy (an exp pass over the vocabulary) run only for signals that read them, and the
    heads' greedy chain only for greedy_path (the paper's signal equals p0 exactly): same
    tokens, same tree choices, less work."""
    import runtime.decoder as decoder_mod

    model = tiny_model(2)
    heads = tiny_heads(model, "hydra", seed=2)
    trees = [TreeBuffers.compile(t) for t in TREES]
    dec = TreeDecoder(model, heads, trees)
    ids = list(range(5, 14))
    calls = {"logits": 0, "chain": 0}
    real_stats, real_chain = decoder_mod._top1_and_entropy, decoder_mod.greedy_chain_top1

    def counting_stats(x):  # noqa: ANN001, ANN202
        calls["logits"] += 1
        return real_stats(x)

    def counting_chain(*a):  # noqa: ANN002, ANN202
        calls["chain"] += 1
        return real_chain(*a)

    monkeypatch.setattr(decoder_mod, "_top1_and_entropy", counting_stats)
    monkeypatch.setattr(decoder_mod, "greedy_chain_top1", counting_chain)
    ref = ar_greedy(model, ids, 30)
    expect = {"accept_ema": (False, False), "p0": (True, False), "paper": (True, False), "greedy_path": (True, True)}
    choices = {}
    for signal, (logits, chain) in expect.items():
        calls.update(logits=0, chain=0)
        res = dec.generate(ids, 30, choose=Scheduler(LadderPolicy([0.3, 0.5, 0.7], signal=signal), len(trees)))
        assert res.tokens == ref, signal
        assert (calls["logits"] > 0, calls["chain"] > 0) == (logits, chain), (signal, calls)
        choices[signal] = [s.tree for s in res.steps]
    assert choices["paper"] == choices["p0"]  # the paper's signal is p0, chain or not


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees=st.lists(valid_trees(max_depth=4, max_nodes=20), min_size=1, max_size=4),
       seed=st.integers(0, 10_000), kind=st.sampled_from(["hydra", "medusa"]))
def test_random_trees_random_switching_lossless(trees: list[Tree], seed: int, kind: str) -> None:
    model = tiny_model(seed % 3)
    heads = tiny_heads(model, kind, seed=seed % 5)
    bufs = [TreeBuffers.compile(t) for t in trees]
    ids = torch.randint(0, 40, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = ar_greedy(model, ids, 24)

    # a ladder with random thresholds over p0: the tree changes from step to step
    rng = torch.Generator().manual_seed(seed)
    thresholds = sorted(torch.rand(len(bufs) - 1, generator=rng).tolist()) if len(bufs) > 1 else []
    thresholds = [t + i * 1e-6 for i, t in enumerate(thresholds)]
    choose = Scheduler(LadderPolicy(thresholds, signal="p0"), len(bufs)) if thresholds else 0
    dec = TreeDecoder(model, heads, bufs)
    assert dec.generate(ids, 24, choose=choose).tokens == ref


def test_typical_acceptance_runs_and_is_reproducible() -> None:
    model = tiny_model(2)
    heads = tiny_heads(model, "hydra", seed=2)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(Tree.named("mc_sim_7b_63"))],
                      acceptance=TypicalAcceptance(temperature=0.7, seed=3))
    a = dec.generate([1, 2, 3], 30).tokens
    b = dec.generate([1, 2, 3], 30).tokens
    assert a == b and 1 <= len(a) <= 30


def test_errors() -> None:
    model = tiny_model()
    heads = tiny_heads(model, "hydra")
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(Tree.named("chain4"))])
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([], 4)
    with pytest.raises(ValueError, match="KV cache capacity"):
        dec.generate([1] * 200, 100)
    with pytest.raises(ValueError, match="out of range"):
        dec.generate([1, 2], 4, choose=3)
    shallow = DraftHeads(HeadsConfig.for_model(model.args, kind="hydra", num_heads=2))
    with pytest.raises(ValueError, match="depth 4"):
        TreeDecoder(model, shallow, [TreeBuffers.compile(Tree.named("chain4"))])
