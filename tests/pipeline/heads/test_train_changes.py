"""The heads' training changes under trial (sampled continuations, a top-k ranking term, a
training-time-test pass) on a tiny random base model, and that they stay out of the heads key
while off."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline.heads.recipe import train_key
from pipeline.heads.distill import generate_batch
from pipeline.heads.train import _chain_drafts, distill_loss, sequence_batch, train_loop
from pipeline.config.schema import TrainSettings
from tests.helpers.training import checkpoint_prompts, make_heads, selfdistill, write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def seqs(tiny_dir: Path, tmp_path_factory) -> list[dict]:
    return selfdistill(tiny_dir, tmp_path_factory.mktemp("sd"), n=8)


def test_new_settings_enter_the_key_only_when_changed() -> None:
    default = TrainSettings()
    old_fields = {f.name for f in dataclasses.fields(default)} - {
        "dtype", "sampled_continuations", "sample_temperature", "rank_loss_weight", "rank_loss_topk", "ttt_weight",
        "ttt_steps", "ttt_decay", "reference_prompts", "batch_tokens", "eval_every"}
    assert set(train_key(default)) == old_fields  # the shipped heads' key is unchanged
    assert train_key(TrainSettings(rank_loss_weight=0.5))["rank_loss_weight"] == 0.5
    assert train_key(TrainSettings(ttt_weight=1.0)) != train_key(default)
    assert train_key(TrainSettings(ttt_steps=4))["ttt_steps"] == 4
    with pytest.raises(ValueError, match="sample_temperature"):
        TrainSettings(sampled_continuations=1, sample_temperature=0.0)


def test_sampled_continuations_are_seeded_and_keep_the_base_teacher(tiny_dir: Path) -> None:  # noqa: F811
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ps = checkpoint_prompts(4, seed=5)
    greedy = generate_batch(hf, ps, 12, {2}, 5)
    a = generate_batch(hf, ps, 12, {2}, 5, temperature=1.0, seeds=[11, 12, 13, 14])
    b = generate_batch(hf, ps, 12, {2}, 5, temperature=1.0, seeds=[11, 12, 13, 14])
    c = generate_batch(hf, ps, 12, {2}, 5, temperature=1.0, seeds=[21, 22, 23, 24])
    cold = generate_batch(hf, ps, 12, {2}, 5, temperature=1e-4, seeds=[11, 12, 13, 14])
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))          # seeded
    assert any(not torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))      # the seed matters
    assert any(not torch.equal(x["tokens"], g["tokens"]) for x, g in zip(a, greedy))  # not greedy at T=1
    assert all(torch.equal(x["tokens"], g["tokens"]) for x, g in zip(cold, greedy))   # T -> 0 is greedy
    # the teacher stays the base distribution along the sampled path: its top-1 is the argmax,
    # which a sampled token often is not
    assert sum(int((x["topk_ids"][:, 0] != x["tokens"]).sum()) for x in a) > 0
    for p, x in zip(ps, a):
        seq = torch.tensor([p + x["tokens"].tolist()[:-1]])
        with torch.no_grad():
            base = hf(seq).logits[0, len(p) - 1:]
        assert torch.equal(base.argmax(-1), x["topk_ids"][:, 0].long())
        assert x["hidden"].shape[0] == seq.shape[1]


def test_rank_term_is_the_listwise_cross_entropy_over_the_teacher_top_k(tiny_dir: Path, seqs: list[dict]) -> None:  # noqa: F811
    heads = make_heads(tiny_dir, kind="hydra").eval()
    batch = sequence_batch(heads, seqs[:2])
    k, w = 3, 0.7
    with torch.no_grad():
        plain, plain_heads = distill_loss(heads, batch)
        ranked, ranked_heads = distill_loss(heads, batch, rank_weight=w, rank_topk=k)
        logits = heads.output_logits(heads.head_states(batch["h"], batch["tokens"])).float()
    top = logits.gather(-1, batch["ids"][..., :k])
    pk = batch["p"][..., :k] / batch["p"][..., :k].sum(-1, keepdim=True).clamp_min(1e-9)
    listwise = torch.logsumexp(top, -1) - (pk * top).sum(-1)
    valid = batch["valid"].float()
    expected = ((listwise * valid).sum(0) / valid.sum(0)).mean()
    assert torch.allclose(plain_heads, ranked_heads)  # the reported per-head figure stays the distillation loss
    assert torch.allclose(ranked - plain, w * expected, atol=1e-5)
    assert float(expected) > 0


@pytest.mark.parametrize("output", ["shared", "own"])
def test_chain_drafts_are_each_heads_argmax_given_the_drafts_before(tiny_dir: Path, seqs: list[dict],  # noqa: F811
                                                                    output: str) -> None:
    heads = make_heads(tiny_dir, kind="hydra", output=output)
    if output == "own":
        with torch.no_grad():
            for h in heads.heads:
                h.out.weight.add_(torch.randn_like(h.out.weight))
    batch = sequence_batch(heads, seqs[:2])
    heads.train()
    drafted = _chain_drafts(heads, batch["h"], batch["tokens"], None)
    assert heads.training  # left as found
    assert torch.equal(drafted[:, 0], batch["tokens"][:, 0])  # the root is the base model's token
    with torch.no_grad():
        logits = heads.eval().teacher_forced_logits(batch["h"], drafted)  # [M, D, V]
    D = heads.config.num_heads
    assert torch.equal(logits[:, :D - 1].argmax(-1), drafted[:, 1:])
    assert not torch.equal(drafted, batch["tokens"])  # random heads draft wrongly, so the pass differs
    # over candidates, the drafts are the argmax among them
    cand = torch.tensor(sorted(set(batch["tokens"][:, 0].tolist()) | {3, 7, 19}))
    over = _chain_drafts(heads, batch["h"], batch["tokens"], cand)
    assert set(over[:, 1:].flatten().tolist()) <= set(cand.tolist())


def test_every_change_trains_and_reduces_the_loss(tiny_dir: Path, tmp_path: Path, seqs: list[dict]) -> None:  # noqa: F811
    s = TrainSettings(max_steps=20, batch_sequences=3, lr=3e-3, warmup_frac=0.1, checkpoint_every=100,
                      rank_loss_weight=0.5, rank_loss_topk=4, ttt_weight=0.5)
    heads = make_heads(tiny_dir, kind="hydra")
    batch = sequence_batch(heads, seqs)
    with torch.no_grad():
        before = float(distill_loss(heads.eval(), batch)[0])
    fit = train_loop(heads, seqs, s, tmp_path / "work", run_key="k")
    with torch.no_grad():
        after = float(distill_loss(heads.eval(), batch)[0])
    assert fit["steps"] == 20 and after < 0.95 * before, (before, after)
