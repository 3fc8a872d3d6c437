"""Batched decoding: several sequences verified in one forward, each with its own KV cache,
positions and tree, and each sequence's output exactly its own AR output (batch invariance by
construction of the row-invariant arithmetic)."""

from __future__ import annotations

import pytest
import torch

from runtime.decoder import TreeDecoder
from runtime.model.batch import BatchItem
from runtime.policy import HysteresisPolicy, Scheduler
from runtime.sampling import Sampler, SamplingConfig
from runtime.tree import Tree, TreeBuffers
from tests.helpers import ARITHMETICS, DECODER_TREES, ar_greedy, invariant_model, tiny_heads, tiny_model


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (int(length),), generator=g).tolist() for length in torch.randint(3, 30, (n,), generator=g)]


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_forward_batch_rows_equal_each_sequence_alone(arithmetic: str) -> None:
    model = invariant_model(arithmetic)
    buf = TreeBuffers.compile(Tree.named("mc_sim_7b_63"))  # 64 rows a sequence: wider than one kernel call
    prompts = _prompts(3)
    caches, alone = [], []
    with torch.inference_mode():
        for k, p in enumerate(prompts):
            tokens = torch.randint(0, 40, (buf.num_nodes,), generator=torch.Generator().manual_seed(k))
            cache = model.new_cache(len(p) + buf.num_nodes)   # just what it needs: a cache's size changes no result
            model.use_cache(cache)
            model(torch.tensor([p]), torch.arange(len(p)))
            twin = model.new_cache()
            twin.kv[:, :, :, :len(p)] = cache.kv[:, :, :, :len(p)]
            twin.length = cache.length
            model.use_cache(twin)
            logits, hidden = model(tokens[None], cache.length + buf.depths, buf.attn_mask, check_mask=False,
                                   ancestors=buf.ancestor_lists)
            caches.append((cache, tokens))
            alone.append((logits[0], hidden[0], twin))
        out = model.forward_batch([BatchItem(c, t, c.length + buf.depths, buf.ancestor_lists) for c, t in caches])
    for (logits, hidden, twin), (b_logits, b_hidden), (cache, _) in zip(alone, out, caches):
        assert torch.equal(logits, b_logits) and torch.equal(hidden, b_hidden)
        assert cache.length == twin.length
        assert torch.equal(cache.kv[:, :, :, :cache.length], twin.kv[:, :, :, :twin.length])


def test_a_sequence_cache_holds_what_it_was_sized_for() -> None:
    model = invariant_model("padded")
    with pytest.raises(ValueError, match="1 to max_seq_len"):
        model.new_cache(model.max_seq_len + 1)
    cache = model.new_cache(5)
    assert cache.capacity == 5
    buf = TreeBuffers.compile(Tree([(0,), (0, 0)]))
    with torch.inference_mode():
        model.forward_batch([BatchItem(cache, torch.tensor([1, 2, 3]), buf.depths, buf.ancestor_lists)])
        with pytest.raises(ValueError, match="holds 5 positions; 3 are used and 3"):
            model.forward_batch([BatchItem(cache, torch.tensor([1, 2, 3]), 3 + buf.depths, buf.ancestor_lists)])


def test_forward_batch_needs_the_row_invariant_arithmetic() -> None:
    model = tiny_model()
    buf = TreeBuffers.compile(Tree([(0,)]))
    item = BatchItem(model.new_cache(), torch.tensor([1, 2]), buf.depths, buf.ancestor_lists)
    with pytest.raises(RuntimeError, match="set_row_invariance"):
        model.forward_batch([item])


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("kind,prefix", [("hydra", False), ("medusa", False), ("hydra", True)])
def test_generate_batch_is_each_prompts_own_ar_output(arithmetic: str, kind: str, prefix: bool) -> None:
    model = invariant_model(arithmetic)
    heads = tiny_heads(model, kind, prefix=prefix)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in DECODER_TREES])
    prompts = _prompts(6, seed=1)                # ragged lengths
    limits = [32, 5, 32, 13, 32, 32]             # sequences leave the batch at different steps
    chooses = [0, 1, 2, 3, 1, 0]                 # a different tree per sequence
    results = dec.generate_batch(prompts, limits, choose=chooses)
    accepted = 0
    for p, n, k, res in zip(prompts, limits, chooses, results):
        assert res.tokens == ar_greedy(model, p, n), f"tree {k}"
        assert res.tokens == dec.generate(p, n, choose=k).tokens
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0, "no draft was ever accepted: the test exercised nothing but the root"


def test_a_sequence_that_stops_on_eos_leaves_the_others_alone() -> None:
    model = invariant_model("padded")
    heads = tiny_heads(model, "hydra")
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in DECODER_TREES])
    prompts = _prompts(6, seed=3)
    free = [dec.generate(p, 40, choose=0, eos_ids=[]).tokens for p in prompts]
    stop = free[0][5]  # a token the first sequence emits early: the stop token of this run

    def until_stop(tokens: list[int]) -> list[int]:
        return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens

    expected = [until_stop(t) for t in free]
    assert len(expected[0]) <= 6 and any(len(e) == 40 for e in expected), "the stop token must end some, not all"
    results = dec.generate_batch(prompts, 40, choose=[0, 1, 2, 3, 2, 1], eos_ids=[stop])
    assert [r.tokens for r in results] == expected


def test_per_sequence_policies_and_seeded_sampling() -> None:
    model = invariant_model("padded", seed=2)
    heads = tiny_heads(model, "hydra", seed=2)
    trees = [TreeBuffers.compile(t) for t in (Tree([]), Tree([(0,)]), Tree.named("chain4"))]
    dec = TreeDecoder(model, heads, trees)
    prompts = _prompts(3, seed=4)
    sampler = Sampler(SamplingConfig(temperature=0.8, seed=5))

    def scheduler() -> Scheduler:
        return Scheduler(HysteresisPolicy(tau_on=0.5, tau_off=0.3, small=0, large=2, signal="p0"))

    batch = dec.generate_batch(prompts, 20, choose=[scheduler() for _ in prompts], sampler=sampler)
    for p, res in zip(prompts, batch):
        assert res.tokens == dec.generate(p, 20, choose=scheduler(), sampler=sampler).tokens
    with pytest.raises(ValueError, match="its own"):
        shared = scheduler()
        dec.generate_batch(prompts, 20, choose=[shared] * len(prompts))


def _count_prefills(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The prompt lengths of the model's prefill forwards (position 0 first), as they run."""
    seen: list[int] = []
    forward = model.forward

    def counted(tokens, positions, *args, **kwargs):  # noqa: ANN001, ANN202
        if int(positions.reshape(-1)[0]) == 0:
            seen.append(int(tokens.shape[-1]))
        return forward(tokens, positions, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return seen


def test_copies_of_one_prompt_share_its_prefill_and_decode_as_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.ar import ar_generate, ar_generate_batch

    model = invariant_model("padded", seed=2)
    heads = tiny_heads(model, "hydra", prefix=True, seed=2)   # a drafter with per-sequence state
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in DECODER_TREES])
    a, b = _prompts(2, seed=8)
    prompts = [a, a, a, b, a]                 # copies share the previous prefill; b and the a after it do not
    sampler = Sampler(SamplingConfig(temperature=0.8, seed=5))
    alone = [dec.generate(p, 72, choose=2, sampler=sampler).tokens for p in prompts]   # past the first key chunk
    seen = _count_prefills(model, monkeypatch)
    batch = dec.generate_batch(prompts, 72, choose=2, sampler=sampler)
    assert seen == [len(a), len(b), len(a)]
    assert [r.tokens for r in batch] == alone
    seen.clear()
    assert ar_generate_batch(model, prompts, 16, sampler=sampler) == [ar_generate(model, p, 16, sampler=sampler)
                                                                      for p in prompts]
    assert seen[:3] == [len(a), len(b), len(a)]   # then the five alone
    with pytest.raises(ValueError, match="cannot copy 9 positions"):
        model.new_cache(8).copy_prefix(model.new_cache(16), 9)


def test_bad_batches_say_what_is_wrong() -> None:
    model = invariant_model("padded")
    dec = TreeDecoder(model, tiny_heads(model, "hydra"), [TreeBuffers.compile(Tree([(0,)]))])
    with pytest.raises(ValueError, match="no prompts"):
        dec.generate_batch([], 8)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate_batch([[1, 2], []], 8)
    with pytest.raises(ValueError, match="2 prompts but 3 token limits"):
        dec.generate_batch([[1], [2]], [4, 4, 4])
    # a failed batch leaves the decoder usable for single sequences
    assert dec.generate([1, 2, 3], 6).tokens == ar_greedy(model, [1, 2, 3], 6)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_batched_ar_is_each_prompts_own_ar(arithmetic: str) -> None:
    from runtime.ar import ar_generate, ar_generate_batch

    model = invariant_model(arithmetic)
    prompts = _prompts(5, seed=6)
    limits = [20, 1, 9, 20, 0]
    assert ar_generate_batch(model, prompts, limits) == [ar_generate(model, p, n) for p, n in zip(prompts, limits)]
    sampler = Sampler(SamplingConfig(temperature=0.9, seed=3))
    assert ar_generate_batch(model, prompts, 12, sampler=sampler) == [ar_generate(model, p, 12, sampler=sampler)
                                                                      for p in prompts]


# --- the engine and the command line -----------------------------------------------------------


def test_engine_batch_keeps_going_past_a_bad_prompt(bundle) -> None:  # noqa: ANN001 - the tiny bundle fixture
    from runtime.api import EntMTP

    engine = EntMTP.load(bundle.bank_dir)
    too_long = "word " * (engine.model.max_seq_len + 10)
    prompts = ["def add(a, b):", "", too_long, "Write a haiku.", [3, 4, 5]]
    outs = engine.generate_batch(prompts, max_new_tokens=10, batch_size=2)
    assert [o.error is not None for o in outs] == [False, True, True, False, False]
    assert "empty prompt" in outs[1].error and "exceeds the KV cache capacity" in outs[2].error
    ars = engine.generate_batch(prompts, max_new_tokens=10, batch_size=3, ar=True)
    for k in (0, 3, 4):
        assert outs[k].tokens == ars[k].tokens == engine.generate_ar(prompts[k], 10).tokens
        assert outs[k].stats["batch_tok_per_s"] > 0
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        engine.generate_batch(prompts, batch_size=0)
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate_batch([])


def test_prompts_files_lines_or_json_lines(tmp_path) -> None:  # noqa: ANN001
    from runtime.cli import read_prompts

    plain = tmp_path / "plain.txt"
    plain.write_text("first prompt\n\nsecond {not json}\n")
    assert read_prompts(plain) == ["first prompt", "second {not json}"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"a string"\n{"prompt": "an object"}\n{"text": "a record"}\n')
    assert read_prompts(jsonl) == ["a string", "an object", "a record"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(tmp_path / "empty.txt")


def test_cli_batch_reports_each_sequence_and_both_speeds(bundle, tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    from runtime.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nWrite a haiku.\nCount to five.\n")
    assert main(["generate", "--bank", str(bundle.bank_dir), "--prompts-file", str(prompts), "--batch", "2",
                 "--max-new-tokens", "8", "--compare-ar"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["prompt"] for line in lines] == [0, 1, 2] and all(line["identical_to_ar"] for line in lines)
    assert "3/3 outputs identical" in err and "batched AR" in err
    # the tiny bank was timed at batch size 1 only: a batch of 2 lies above it (AR), the last prompt uses B = 1's tree
    assert "batch of 2: above the bank's largest measured batch size (1), where it does not speculate: AR" in err
    assert "batch of 1: bank's choice for B=1: tree 1 (" in err
    assert main(["generate", "--bank", str(bundle.bank_dir), "--prompts-file", str(prompts), "--batch", "0"]) == 2
    assert "--batch must be at least 1" in capsys.readouterr().err
    assert main(["generate", "--bank", str(bundle.bank_dir), "--prompt", "x", "--batch", "2"]) == 2
    assert "--batch needs --prompts-file" in capsys.readouterr().err


def test_the_batch_scheduler_decodes_losslessly() -> None:
    from runtime.policy import BatchScheduler, ExpectedThroughputPolicy

    model = invariant_model("padded", seed=3)
    heads = tiny_heads(model, "hydra", seed=3)
    trees = [Tree([]), Tree([(0,)]), Tree.named("chain4")]
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees])
    table = [[1.0, 1.5, 1.55], [1.0, 1.6, 2.8]]  # an unsure sequence gains from the small tree, a sure one from both

    def policy() -> ExpectedThroughputPolicy:
        return ExpectedThroughputPolicy([0.055], table, [0.01, 0.011, 0.013], signal="p0")  # the tiny model: p0 ~ 0.05

    batch = BatchScheduler(policy(), {2: [10.0, 11.0, 13.0], 4: [12.0, 13.0, 15.0]})
    prompts = _prompts(4, seed=8)
    results = dec.generate_batch(prompts, 24, choose=[Scheduler(policy()) for _ in prompts], batch_policy=batch)
    assert [r.tokens for r in results] == [ar_greedy(model, p, 24) for p in prompts]
    assert len({s.tree for r in results for s in r.steps}) > 1, "the scheduler never mixed trees: nothing tested"
