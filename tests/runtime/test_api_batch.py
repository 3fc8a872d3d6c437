"""`EntMTP.generate_batch` with no policy named follows the bank's choice per batch size: the tree
the bank chose for the batch's size (the smallest measured batch size >= it), the runtime's real
batched AR where the bank chose AR or above its largest measured batch size, the batch scheduler
only where the bank measured it faster; a named policy overrides the bank."""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime.ar
from runtime.api import EntMTP, batch_choice
from tests.helpers import TinyBundle, make_bank
from tests.helpers.banks import batch_choices_record
from tests.helpers.bundle import bank_choosing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# tree 0 (a 2-chain) at B = 1, tree 2 (Medusa's 63-node default) at B = 2, AR at B = 4
CHOICES = {1: 0, 2: 2, 4: None}
PROMPTS = ["def add(a, b):", "Hello there", "What is 2 + 3?", "Write a haiku about rain."]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engine(bundle: TinyBundle, tmp_path_factory: pytest.TempPathFactory) -> EntMTP:
    return EntMTP.load(bank_choosing(bundle, tmp_path_factory.mktemp("batch") / "bundle", CHOICES))


@pytest.fixture(scope="module")
def ar_tokens(engine: EntMTP) -> list[list[int]]:
    return [engine.generate_ar(p, NEW_TOKENS).tokens for p in PROMPTS]


def test_batch_choice_follows_the_banks_table(engine: EntMTP) -> None:
    nodes = [t.num_nodes for t in engine.bank.trees]
    one, two, three, four, five = (engine.batch_choice(n) for n in (1, 2, 3, 4, 5))
    assert (one.tree, one.measured, one.text) == (0, 1, f"bank's choice for B=1: tree 0 ({nodes[0]} nodes)")
    assert (two.tree, two.measured, two.text) == (2, 2, f"bank's choice for B=2: tree 2 ({nodes[2]} nodes)")
    # a load between measured sizes takes the next larger one's choice: AR at B = 4
    assert three.ar and three.measured == 4 and three.text == "bank's choice for B=4: AR"
    assert four.ar and four.text == "bank's choice for B=4: AR"
    assert five.ar and five.measured is None and "largest measured batch size (4)" in five.text


@pytest.mark.parametrize("size,tree", [(1, 0), (2, 2)])
def test_default_batches_decode_with_the_tree_chosen_for_their_size(engine: EntMTP, ar_tokens: list[list[int]],
                                                                    size: int, tree: int) -> None:
    outs = engine.generate_batch(PROMPTS, NEW_TOKENS, batch_size=size)
    nodes = engine.bank.trees[tree].num_nodes
    for out, ar in zip(outs, ar_tokens):
        assert out.tokens == ar  # lossless per sequence
        assert set(out.stats["trees_used"]) == {nodes}, out.stats
        assert out.stats["choice"] == f"bank's choice for B={size}: tree {tree} ({nodes} nodes)"


def test_a_batch_the_bank_gives_to_ar_runs_the_runtimes_batched_ar(engine: EntMTP, ar_tokens: list[list[int]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = runtime.ar.ar_generate_batch

    def spy(model, prompts, *args, **kwargs):  # noqa: ANN001, ANN202 - the wrapped function's signature
        calls.append(len(prompts))
        return real(model, prompts, *args, **kwargs)

    def no_tree_decode(*_args, **_kwargs):  # noqa: ANN202
        raise AssertionError("AR was chosen, but the tree decoder ran")

    monkeypatch.setattr(runtime.ar, "ar_generate_batch", spy)
    monkeypatch.setattr(engine.decoder, "generate_batch", no_tree_decode)
    outs = engine.generate_batch(PROMPTS[:3], NEW_TOKENS)  # a load of 3: the choice measured at B = 4
    assert calls == [3]
    assert [o.tokens for o in outs] == ar_tokens[:3]
    assert all(o.stats["choice"] == "bank's choice for B=4: AR" and not o.result.steps for o in outs)


def test_a_named_policy_overrides_the_bank(engine: EntMTP, ar_tokens: list[list[int]]) -> None:
    outs = engine.generate_batch(PROMPTS, NEW_TOKENS, batch_size=4, policy="static")
    static_nodes = engine.bank.trees[engine.bank.best_static].num_nodes
    for out, ar in zip(outs, ar_tokens):
        assert out.tokens == ar
        assert out.result.steps and set(out.stats["trees_used"]) == {static_nodes}
        assert out.stats["choice"] == "policy 'static' (named)"


def test_the_batch_scheduler_only_where_the_bank_measured_it_faster() -> None:
    bank = make_bank()
    bank.batch_schedule = batch_choices_record(bank.trees, {1: 3, 4: None})
    entry = bank.batch_schedule["4"]  # AR at 200 tok/s there
    entry["scheduler_tok_per_s"] = 260.0
    assert batch_choice(bank, 4).ar  # no expected_throughput policy to run the scheduler on
    bank.policies["expected_throughput"] = {"kind": "expected_throughput"}
    choice = batch_choice(bank, 3)
    assert choice.scheduler and not choice.ar and choice.measured == 4
    assert choice.text == "bank's choice for B=4: the batch scheduler (measured 260.0 tok/s vs 200.0 for AR)"
    entry["scheduler_tok_per_s"] = 150.0  # measured slower than AR: AR stays
    assert batch_choice(bank, 4).ar
    assert batch_choice(bank, 1).tree == 3  # no scheduler record at B = 1: the tree
