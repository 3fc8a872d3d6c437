"""The row-invariant attention of `lossless: exact` (torch's products: bf16, fp16, CUDA) and the
probe that checks a whole forward for it (`pipeline.timing.invariance.invariance_probe`).

CUDA's flash attention sums a row's keys in a number of splits that it picks from batch x heads, so
the same position's logits rounded differently in a tree verify and in AR. The probe must see such
an attention; the runtime's own must pass it, on every route it takes (keys gathered per row or
read in place, one row per product or a block of rows)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.timing.invariance import PROBE_CONTEXTS, invariance_probe
from runtime.model import invariant
from runtime.model.invariant import KEY_CHUNK, RowPlan, row_plan
from runtime.model.llama import Attention, ModelArgs, Transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def row_keys(plan: RowPlan, row: int) -> torch.Tensor:
    """The cache slots `row` attends to, in logical order, read back from the plan's torch encoding
    (blocked or chunked)."""
    if plan.block_slots is not None:
        assert plan.block_masked is not None
        shared = torch.arange(plan.shared_blocks * invariant.KEY_BLOCK)
        return torch.cat([shared, plan.block_slots[row][~plan.block_masked[row]]])
    assert plan.masked is not None and plan.tail_slots is not None
    group, at = plan.group, row % plan.group
    head = plan.masked[row // group, :-1, 0, at, 0].reshape(-1)
    tail = plan.masked[row // group, -1, 0, at, 0]
    return torch.cat([torch.arange(head.numel(), device=head.device)[~head], plan.tail_slots[row][~tail]])


def reference_attention(attn: Attention, q: torch.Tensor, kv: torch.Tensor, plan: RowPlan, splits: int = 1,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each real row's softmax attention over its keys (`row_keys`) in `dtype`, the keys summed in
    `splits` consecutive parts merged by their log-sum-exp, as flash attention does."""
    h, kvh, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    out = torch.zeros_like(q)
    for r in range(plan.real):
        slots = row_keys(plan, r)
        k = kv[0][:, slots].to(dtype).repeat_interleave(h // kvh, 0)  # [h, keys, hd]
        v = kv[1][:, slots].to(dtype).repeat_interleave(h // kvh, 0)
        scores = torch.einsum("hd,hkd->hk", q[r].to(dtype), k) / math.sqrt(hd)
        parts = list(zip(scores.tensor_split(splits, dim=1), v.tensor_split(splits, dim=1)))
        tops = [s.amax(-1) for s, _ in parts]
        top = torch.stack(tops).amax(0)
        den = sum((s - t[:, None]).exp().sum(-1) * (t - top).exp() for (s, _), t in zip(parts, tops))
        num = sum(torch.einsum("hk,hkd->hd", (s - t[:, None]).exp(), vv) * (t - top).exp()[:, None]
                  for (s, vv), t in zip(parts, tops))
        out[r] = (num / den[:, None]).to(q.dtype)
    return out


def split_count_follows_rows(self: Attention, q: torch.Tensor, kv: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """A deliberately faulty attention: its key-split count follows the forward's row count, as CUDA's
    flash attention's did for Vicuna-7B (one row: 4 splits, up to 4 rows: 2, more: 1)."""
    splits = 4 if plan.real == 1 else 2 if plan.real <= 4 else 1
    return reference_attention(self, q, kv, plan, splits=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_sees_a_split_count_that_follows_the_row_count(dtype: torch.dtype) -> None:
    """At Vicuna-7B's and Llama-3-8B's attention shapes the probe reports rows that differ from AR
    when the attention's key splits follow the row count, and none with the runtime's attention."""
    faulty = invariance_probe("cpu", dtype, contexts=PROBE_CONTEXTS[:1], attend=split_count_follows_rows)
    assert not faulty["ok"]
    assert any(r["identical_rows"] < r["nodes"] for r in faulty["results"] if r["shape"] == "vicuna-7b")
    real = invariance_probe("cpu", dtype, contexts=PROBE_CONTEXTS[:1])
    assert real["ok"], [r for r in real["results"] if r["identical_rows"] < r["nodes"]]
    assert {r["shape"] for r in real["results"]} == {"vicuna-7b", "llama-3-8b"}
    assert {r["tree"] for r in real["results"]} == {"chain4", "branchy13"}


def test_probe_sees_the_fault_through_the_block_layout_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the layout other devices use (a block of rows shares each head product) the runtime's
    attention passes, and the faulty one is still caught."""
    monkeypatch.setitem(invariant.ATTENTION_ROWS, "cpu", 8)
    real = invariance_probe("cpu", torch.float32, contexts=PROBE_CONTEXTS[:1], rows=8)
    assert real["ok"] and real["rows_per_attention_product"] == 8
    assert not invariance_probe("cpu", torch.float32, contexts=PROBE_CONTEXTS[:1], rows=8,
                                attend=split_count_follows_rows)["ok"]


# the attention shapes of SmolLM2 (GQA, 3 query heads per KV head), Vicuna-7B, Llama-3-8B
SHAPES = [(9, 3, 64), (32, 32, 128), (32, 8, 128)]
CHAIN3_AND_SIBLINGS = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 1, 3, 5], [0, 1, 3, 6], [0, 1, 3, 5, 7],
                       [0, 1, 3, 5, 8], [0, 1, 3, 5, 7, 9]]


def attention_inputs(shape: tuple[int, int, int], start: int, rows: int, dtype: torch.dtype,
                     seed: int = 0) -> tuple[Attention, torch.Tensor, torch.Tensor]:
    h, kvh, hd = shape
    attn = Attention(ModelArgs(vocab_size=8, dim=16, n_layers=1, n_heads=h, n_kv_heads=kvh, head_dim=hd,
                               intermediate_size=16))
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, kvh, start + rows + 5, hd, generator=g).to(dtype)
    q = torch.randn(rows, h, hd, generator=g).to(dtype)
    return attn, q, kv


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("start", [5, 70, 187, 700])
def test_attention_is_softmax_attention(shape: tuple[int, int, int], start: int) -> None:
    """In float32 the chunked attention is softmax attention over each row's keys (a float64
    reference agrees to rounding), for rows whose keys fit the tail alone and rows with heads."""
    attn, q, kv = attention_inputs(shape, start, 16, torch.float32)
    plan = row_plan(start, CHAIN3_AND_SIBLINGS, torch.device("cpu"), 8)
    got = attn._attend(q, kv, plan)
    want = reference_attention(attn, q, kv, plan, dtype=torch.float64)
    torch.testing.assert_close(got[:plan.real], want[:plan.real], rtol=1e-5, atol=1e-5)
    assert not got[plan.real:].any()  # pad rows attend to nothing


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("start", [40, 187, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_route_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int, int], start: int,
                                         dtype: torch.dtype) -> None:
    """One row per product, the keys gathered per row (few rows) or the head read in place (more
    rows), and a one-token forward's tail read as a run of slots (or gathered, near position 0):
    the same arithmetic, bit for bit. So each tree row equals the one-token (AR) forward of the same
    token at its position."""
    attn, q, kv = attention_inputs(shape, start, 16, dtype)
    plan = lambda: row_plan(start, CHAIN3_AND_SIBLINGS, torch.device("cpu"), 8)  # noqa: E731 - fresh scratch
    monkeypatch.setattr(invariant, "GATHER_PIECES", 1000)
    gathered = attn._attend(q, kv, plan())
    monkeypatch.setattr(invariant, "GATHER_PIECES", 0)
    in_place = attn._attend(q, kv, plan())
    assert torch.equal(gathered, in_place)
    for i, anc in enumerate(CHAIN3_AND_SIBLINGS):
        kv_ar = kv.clone()  # AR's cache: the row's ancestors in order after the prefix
        kv_ar[:, :, start:start + len(anc)] = kv[:, :, [start + a for a in anc]]
        ar = attn._attend(q[i:i + 1].expand(8, -1, -1), kv_ar, row_plan(start + len(anc) - 1, [[0]], "cpu", 8))
        assert torch.equal(ar[0], gathered[i]), i


def test_block_layout_keeps_forward_batch_rows_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block layout pads the real rows that forward_batch passes (no padding of their own)."""
    monkeypatch.setitem(invariant.ATTENTION_ROWS, "cpu", 8)
    attn, q, kv = attention_inputs((9, 3, 64), 187, 10, torch.float32)
    plan = row_plan(187, CHAIN3_AND_SIBLINGS, torch.device("cpu"), 8)
    got = attn._attend(q, kv, plan)  # 10 rows: one block and part of a second
    assert got.shape == q.shape
    want = reference_attention(attn, q, kv, plan, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def tiny_model(dtype: torch.dtype = torch.bfloat16) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                                  intermediate_size=64, max_position_embeddings=256))
    model.to(dtype).setup_cache(256)
    return model.eval()


def test_an_attention_that_follows_the_row_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`set_row_invariance` probes the model's attention too and refuses one that AR and a tree
    verify would round apart, naming what to do."""
    monkeypatch.setattr(invariant, "_ATTENTION_MATCHES_AR", {})
    monkeypatch.setattr(Attention, "_attend", split_count_follows_rows)
    with pytest.raises(RuntimeError, match="attention.*lossless=numerical"):
        tiny_model(torch.float32).set_row_invariance(8)


def test_a_forward_deeper_than_a_key_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked attention: a row's new tokens must fit its last KEY_CHUNK keys, a deeper chain is
    refused, saying so (the blocked one has no such limit: `test_blocked_rows_equal_ar_past_a_block`)."""
    monkeypatch.setattr(invariant, "EXACT_ATTENTION", "chunked")
    model = tiny_model()
    model.set_row_invariance(8)
    model(torch.zeros(1, 10, dtype=torch.long), torch.arange(10))
    n = KEY_CHUNK + 1
    with pytest.raises(ValueError, match="KEY_CHUNK"):
        model(torch.zeros(1, n, dtype=torch.long), 10 + torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())


# ~20 s on the 2-core bench machine
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probe_at_three_contexts(dtype: torch.dtype) -> None:
    """The probe's full run on the CPU: Vicuna-7B's and Llama-3-8B's attention shapes, ~200, 700
    and 1500 positions, two layers: every tree row bit-identical to AR's."""
    result = invariance_probe("cpu", dtype, layers=2)
    assert result["ok"], [r for r in result["results"] if r["identical_rows"] < r["nodes"]]
    assert sorted({r["context"] for r in result["results"]}) == sorted(PROBE_CONTEXTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 8])
def test_blocked_rows_equal_ar_past_a_block(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, group: int) -> None:
    """The blocked attention takes a chain deeper than a key block (no depth limit), and each of its
    rows equals the one-token (AR) forward of the same token at its position, bit for bit, with one
    row or a block of rows per product, while reading the cache in place and in its own dtype."""
    monkeypatch.setitem(invariant.ATTENTION_ROWS, "cpu", group)
    n, start = invariant.KEY_BLOCK + 20, 100
    chain = [list(range(i + 1)) for i in range(n)]
    attn, q, kv = attention_inputs((9, 3, 64), start, n, dtype)
    plan = row_plan(start, chain, torch.device("cpu"), 8)
    assert plan.block_slots is not None and plan.shared_blocks == start // invariant.KEY_BLOCK
    got = attn._attend(q, kv, plan)
    for i in (0, 1, 27, 28, 29, n - 1):  # 28: the first row past a block boundary
        ar = attn._attend(q[i:i + 1].expand(8, -1, -1), kv, row_plan(start + i, [[0]], "cpu", 8))
        assert torch.equal(ar[0], got[i]), i
    if dtype == torch.float32:
        want = reference_attention(attn, q, kv, plan, dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_norm_probe_refuses_a_norm_that_follows_the_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """`set_row_invariance` probes RMSNorm too (it runs over a call's rows at once): a norm whose
    row result follows the call's row count is refused, naming what to do; the real one passes."""
    model = tiny_model(torch.float32)
    model.set_row_invariance(8)
    assert invariant._norm_rows_match(model.norm, torch.float32, torch.device("cpu"), 8)
    real_forward = type(model.norm).forward

    def by_count(self, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return real_forward(self, x) * (1 + 1e-3 * (x.shape[0] > 8))

    monkeypatch.setattr(invariant, "_NORM_MATCHES", {})
    monkeypatch.setattr(type(model.norm), "forward", by_count)
    with pytest.raises(RuntimeError, match="RMSNorm.*lossless=numerical"):
        model.set_row_invariance(8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_composition_does_not_change_a_sequence(dtype: torch.dtype) -> None:
    """The same sequence verified alone and beside others of other context lengths and row counts
    (`forward_batch`, kernel off) gets the same logits bit for bit, wherever it sits in the batch."""
    from runtime.model.batch import BatchItem

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                  intermediate_size=64, max_position_embeddings=512))
    model.to(dtype).setup_cache(512)
    model.eval().set_row_invariance(8)
    g = torch.Generator().manual_seed(1)
    chain = lambda n: [list(range(i + 1)) for i in range(n)]  # noqa: E731

    def item(context: int, n: int, seed: int) -> BatchItem:
        cache = model.new_cache()
        model.use_cache(cache)
        ids = torch.randint(0, 64, (context,), generator=torch.Generator().manual_seed(seed))
        model(ids[None], torch.arange(context))
        toks = torch.randint(0, 64, (n,), generator=g)
        return BatchItem(cache, toks, torch.arange(context, context + n), chain(n))

    def fresh(it: BatchItem) -> BatchItem:
        it.cache.length = int(it.positions[0])
        return it

    mine, others = item(130, 5, 0), [item(40, 3, 1), item(200, 11, 2), item(70, 1, 3)]
    alone = model.forward_batch([fresh(mine)])[0][0]
    for batch in ([mine] + others, others[:2] + [mine], others + [mine]):
        out = model.forward_batch([fresh(it) for it in batch])
        assert torch.equal(out[batch.index(mine)][0], alone)
