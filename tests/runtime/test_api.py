"""The public API (`runtime.api.EntMTP`) used from outside, on a tiny but real model + heads + bank.

What a user relies on: the bank folder alone is enough to load; generation is lossless (the same
tokens as plain greedy decoding) for every stored policy and every tree; the stats say what
happened; streaming pieces add up to the final text; mistakes give errors that say what to do.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from runtime.bank import BankError, BankFingerprintWarning, TopologyBank
from runtime.decoder import GenerationResult, StepRecord
from tests.helpers import BANK_TREES, TinyBundle, copy_bundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Write a haiku about trees."
NEW_TOKENS = 12  # few tokens: the CPU is shared; enough for several tree steps


@pytest.fixture(scope="module")
def engine(bundle: TinyBundle):
    from runtime.api import EntMTP

    return EntMTP.load(bundle.bank_dir)


@pytest.fixture(scope="module")
def ar_ref(engine):
    """Plain greedy decoding of PROMPT (chat template applied): the reference for losslessness."""
    return engine.generate_ar(PROMPT, NEW_TOKENS)


def test_load_and_generate_in_three_lines(bundle: TinyBundle) -> None:
    from runtime import EntMTP

    engine = EntMTP.load(bundle.bank_dir)
    out = engine.generate("Hello!", max_new_tokens=4)

    assert 1 <= len(out.tokens) <= 4
    assert out.text == engine.tokenizer.decode(out.tokens)
    # the bank's provenance found the weights and fixed the dtype its figures were measured in
    assert engine.model.dtype == torch.float32
    assert engine.heads.is_bound
    assert [t.num_nodes for t in engine.bank.trees] == [t.num_nodes for t in BANK_TREES]


def test_text_generation_is_lossless_for_every_policy(engine, ar_ref) -> None:
    policies = [*sorted(engine.bank.policies), str(len(engine.bank.trees) - 1)]
    assert {"static", "hysteresis", "ladder"} <= set(policies)
    accepted = 0
    for policy in policies:
        out = engine.generate(PROMPT, NEW_TOKENS, policy=policy)
        assert out.tokens == ar_ref.tokens, f"policy {policy}: tree decoding differs from greedy AR decoding"
        assert out.text == ar_ref.text
        accepted += sum(s.accepted for s in out.result.steps)
        if policy == "hysteresis":
            # the fixture is tuned so that the hysteresis really switches trees mid-generation
            assert len(out.stats["trees_used"]) == 2, (
                f"hysteresis used only {out.stats['trees_used']}: the tiny fixture no longer exercises tree "
                "switching; retune tests.helpers.tiny_policies")
    # at least one step accepted drafts, so KV-cache compaction after a tree verify was exercised
    assert accepted > 0, "no draft was ever accepted: the tiny heads no longer exercise acceptance"


def test_token_ids_generation_is_lossless(engine) -> None:
    ids = engine.tokenizer.encode("def reverse(s):\n    return", add_special_tokens=False).ids
    ar = engine.generate_ar(ids, NEW_TOKENS)
    assert ar.text == engine.tokenizer.decode(ar.tokens)
    for policy in (None, "0"):  # the bank's default policy, and a fixed tree (the smallest)
        out = engine.generate(ids, NEW_TOKENS, policy=policy)
        assert out.tokens == ar.tokens, f"policy {policy}: ids generation differs from greedy AR decoding"
    # text with chat=False is the same as its raw ids
    raw = engine.generate("def reverse(s):\n    return", NEW_TOKENS, policy="1", chat=False)
    assert raw.tokens == ar.tokens


def test_chat_template_is_applied(engine) -> None:
    with_chat = engine.encode(PROMPT, chat=True)
    without = engine.encode(PROMPT, chat=False)
    assert without == engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert len(with_chat) > len(without)
    rendered = engine.tokenizer.decode(with_chat, skip_special_tokens=False)
    assert PROMPT in rendered and "<|im_start|>user" in rendered and rendered.rstrip().endswith("assistant")


def test_stats(engine) -> None:
    out = engine.generate(PROMPT, NEW_TOKENS, policy="hysteresis")
    s = out.stats
    for key in ("steps", "tokens_per_step", "trees_used", "tok_per_s", "new_tokens"):
        assert key in s, f"stats lack {key!r}: {s}"
    assert s["new_tokens"] == len(out.tokens)
    assert s["steps"] == len(out.result.steps) >= 1
    assert sum(s["trees_used"].values()) == s["steps"]
    # trees_used is keyed by tree size (nodes), and only sizes of this bank appear
    assert set(s["trees_used"]) <= {t.num_nodes for t in engine.bank.trees}
    assert s["tokens_per_step"] == pytest.approx((len(out.tokens) - 1) / s["steps"], abs=1e-3)
    assert 1.0 <= s["tokens_per_step"] <= 1 + max(t.depth for t in engine.bank.trees)
    assert s["tok_per_s"] > 0
    ar = engine.generate_ar(PROMPT, 4)
    assert ar.stats["tokens_per_step"] == 1.0 and ar.stats["tok_per_s"] > 0


def test_streaming_pieces_concatenate_to_the_text(engine) -> None:
    pieces: list[str] = []
    out = engine.generate(PROMPT, NEW_TOKENS, stream=pieces.append)
    assert pieces and all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == out.text


def test_streaming_holds_back_split_characters(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A character split over byte-level tokens (an emoji, CJK) must be streamed once complete,
    and the pieces must still add up to the final text, whatever the steps' boundaries."""
    tok = engine.tokenizer
    text = "naïve 🙂 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids))), "no split character in the test text"
    for chunk in (1, 2, 3):
        steps = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]

        def fake_generate(input_ids, max_new_tokens, choose=0, eos_ids=None, stream=None, sampler=None, _steps=steps):
            for s in _steps:
                if stream:
                    stream(list(s))
            flat = [t for s in _steps for t in s]
            return GenerationResult(tokens=flat, steps=[StepRecord(0, len(s) - 1, 0.0, 0.0) for s in _steps[1:]],
                                    prefill_seconds=1e-3, decode_seconds=1e-3)

        monkeypatch.setattr(engine.decoder, "generate", fake_generate)
        pieces: list[str] = []
        out = engine.generate([1, 2, 3], 64, stream=pieces.append)
        assert out.text == text
        assert "".join(pieces) == text, f"chunks of {chunk}: streamed {pieces!r}"
        assert not any("\ufffd" in p for p in pieces), f"a half character was streamed: {pieces!r}"
        monkeypatch.undo()


# ------------------------------------------------------------------------------------- errors


def test_unknown_policy(engine) -> None:
    with pytest.raises(ValueError, match="unknown policy 'greedy'.*hysteresis"):
        engine.generate(PROMPT, 2, policy="greedy")


def test_empty_prompt(engine) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate("", 2)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([], 2)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate_ar([], 2)


def test_tree_index_out_of_range(engine) -> None:
    n = len(engine.bank.trees)
    with pytest.raises(ValueError, match=f"tree index {n} out of range.*{n} trees"):
        engine.generate(PROMPT, 2, policy=str(n))
    with pytest.raises(ValueError, match=f"tree index {n} out of range"):
        engine.generate(PROMPT, 2, policy=n)
    with pytest.raises(ValueError, match="tree index -1 out of range"):
        engine.generate(PROMPT, 2, policy=-1)
    with pytest.raises(ValueError, match="policy must be a policy name, a tree index or None"):
        engine.generate(PROMPT, 2, policy=True)


def test_integer_tree_index_is_that_tree(engine) -> None:
    """policy=0 is the smallest tree, not "no policy given" (the default policy)."""
    assert engine.bank.default_policy != "0"
    for k in (0, len(engine.bank.trees) - 1):
        out = engine.generate([7, 8, 9], 4, policy=k)
        assert out.result.steps, "the generation stopped before any tree step"
        assert {s.tree for s in out.result.steps} == {k}
        assert out.stats["trees_used"] == {engine.bank.trees[k].num_nodes: len(out.result.steps)}


def test_bad_dtype(bundle: TinyBundle) -> None:
    from runtime.api import EntMTP

    with pytest.raises(ValueError, match="dtype must be one of"):
        EntMTP.load(bundle.bank_dir, dtype="float64")


def _bank_for_other_weights(bundle: TinyBundle, dst: Path, which: str) -> Path:
    """The bundle's bank, re-sealed with the fingerprint of other `which` ("model"/"heads") weights."""
    bank = TopologyBank.load(bundle.bank_dir)
    bank.provenance[f"{which}_fingerprint"] = "0123456789abcdef"
    return bank.save(dst)


@pytest.mark.parametrize("which", ["model", "heads"])
def test_bank_for_other_weights_is_refused_unless_forced(bundle: TinyBundle, tmp_path: Path, which: str) -> None:
    from runtime.api import EntMTP

    other = _bank_for_other_weights(bundle, tmp_path / "bank", which)
    # the bank moved away from the weights: its relative paths no longer resolve
    with pytest.raises(BankError, match="does not exist; pass"):
        EntMTP.load(other)
    with pytest.raises(BankError, match=f"built for {which} weights with fingerprint '0123456789abcdef'.*force=True"):
        EntMTP.load(other, model_dir=bundle.model_dir, heads_dir=bundle.heads_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = EntMTP.load(other, model_dir=bundle.model_dir, heads_dir=bundle.heads_dir, force=True)
    assert any(issubclass(w.category, BankFingerprintWarning) for w in caught)
    # forced: still lossless
    ids = [1, 2, 3, 4]
    assert engine.generate(ids, 6, policy="2").tokens == engine.generate_ar(ids, 6).tokens


def test_moved_bundle_still_loads(bundle: TinyBundle, tmp_path: Path) -> None:
    """The bank records its model and heads folders relative to itself: moving the whole tree works."""
    from runtime.api import EntMTP

    moved = copy_bundle(bundle, tmp_path / "elsewhere")
    engine = EntMTP.load(moved.bank_dir)
    assert engine.model_dir.resolve() == moved.model_dir.resolve()
    assert 1 <= len(engine.generate([5, 6, 7], 3).tokens) <= 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lossless_modes_select_the_arithmetic(bundle: TinyBundle, dtype: str) -> None:
    """lossless="exact" (the default for a bank that records no mode) makes every decode forward
    row-invariant, "numerical" keeps the ordinary one; exact generation equals AR in bf16 too."""
    from runtime.api import EntMTP

    from runtime.model import small_rows

    # float32 on a CPU with the small-row kernel needs no padding: every product is row-invariant
    unpadded = dtype == "float32" and small_rows.available()
    exact = EntMTP.load(bundle.bank_dir, dtype=dtype)
    assert exact.model.invariant_rows == (1 if unpadded else 8)
    three = EntMTP.load(bundle.bank_dir, dtype=dtype, lossless="exact", invariant_rows=3)
    assert three.model.invariant_rows == (1 if unpadded else 3)
    assert EntMTP.load(bundle.bank_dir, dtype=dtype, lossless="numerical").model.invariant_rows is None
    with pytest.raises(ValueError, match="lossless must be one of"):
        EntMTP.load(bundle.bank_dir, lossless="fast")
    ar = exact.generate_ar(PROMPT, NEW_TOKENS)
    for policy in [*exact.bank.policies, *range(len(exact.bank.trees))]:
        assert exact.generate(PROMPT, NEW_TOKENS, policy=policy).tokens == ar.tokens, policy
