"""EAGLE-3 training here: the training-time test computes what the runtime drafts, data from one
teacher-forced pass equals the runtime target's features, and a short training run learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.heads.eagle3_train import (
    chain_tokens_per_step,
    length_batches,
    pad_batch,
    teacher_batch,
    train_drafter,
    ttt_forward,
    ttt_loss,
)
from runtime.eagle3 import Eagle3Config, Eagle3Drafter, load_drafter, save_drafter, target_forward
from tests.helpers.drafters import EAGLE3_AUX, eagle3_target, random_eagle3
from tests.helpers.models import random_prompts


def _teacher_items(model, seqs: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """What `teacher_pass` stores, from the runtime target itself (float32, no rounding to fp16)."""
    items = []
    for s in seqs:
        ids = torch.tensor(s)
        model.setup_cache(256)
        with torch.no_grad():
            _, hidden, feats = target_forward(model, ids[None], torch.arange(len(s)), EAGLE3_AUX)
            items.append({"tokens": ids, "features": feats.reshape(len(s), -1),
                          "final": hidden.reshape(len(s), -1)})
    return items


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_each_unrolled_step_ranks_the_true_token_as_the_drafter_does_at_that_depth(norm_before_residual: bool) -> None:
    model = eagle3_target()
    drafter = random_eagle3(model, norm_before_residual=norm_before_residual)
    seqs = random_prompts(3, seed=4, lengths=(12, 30))
    items = _teacher_items(model, seqs)
    batch = pad_batch(items, "cpu")
    steps = 4
    with torch.no_grad():
        out = ttt_forward(drafter, batch["features"], batch["tokens"], batch["lengths"], steps)
    for b, x in enumerate(items):
        n = len(x["tokens"])
        ranks, _ = drafter.rank_paths(x["features"][:-1], x["tokens"][1:], depth=steps)
        for j, (g, valid) in enumerate(out):
            logits = drafter.logits(g[b, :n - 1])
            for t in range(n - 1):
                if t + j + 2 > n - 1:   # the token this row predicts lies past the sequence
                    assert int(ranks[t, j]) == -1
                    continue
                assert bool(valid[b, t])
                true = int(x["tokens"][t + j + 2])
                in_vocab = bool(drafter.t2d[true])
                draft_id = int((drafter.target_ids() == true).nonzero()[0]) if in_vocab else None
                want = (int((logits[t] > logits[t, draft_id]).sum()) if in_vocab
                        else drafter.config.draft_vocab_size)
                assert int(ranks[t, j]) == want, (b, j, t)
            assert not bool(valid[b, n - 1 - j:].any())


def test_teacher_batch_gives_the_runtime_targets_features_and_final_states(tmp_path: Path) -> None:
    from tests.helpers.models import random_hf_causal_lm

    cfg = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf = random_hf_causal_lm("llama", cfg, seed=3).eval()
    hf.save_pretrained(tmp_path)
    from runtime.model.checkpoint import load_model

    model = load_model(tmp_path, dtype=torch.float32, max_seq_len=256)
    seqs = random_prompts(3, seed=1, lengths=(5, 40))
    got = teacher_batch(hf, seqs, EAGLE3_AUX)
    want = _teacher_items(model, seqs)
    for g, w in zip(got, want):
        assert torch.equal(g["tokens"], w["tokens"])
        torch.testing.assert_close(g["features"].float(), w["features"], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(g["final"].float(), w["final"], atol=2e-3, rtol=2e-3)


def test_a_short_run_learns_the_target_and_ships_without_its_output_rows(tmp_path: Path) -> None:
    from runtime.ar import ar_generate  # noqa: F401  (the target's own continuations are what it learns)

    model = eagle3_target()
    torch.manual_seed(0)
    cfg = Eagle3Config.for_model(model.args, draft_vocab_size=40, aux_layer_ids=EAGLE3_AUX, output="shared")
    drafter = Eagle3Drafter(cfg)
    drafter.bind(model)
    drafter.set_draft_vocab(torch.arange(40))
    prompts = random_prompts(12, seed=2, lengths=(4, 10))
    seqs = []
    for p in prompts:   # the target's greedy continuations: a learnable teacher
        ids = list(p)
        for _ in range(40):
            model.setup_cache(256)
            with torch.no_grad():
                logits, _ = model(torch.tensor(ids)[None], torch.arange(len(ids)))
            ids.append(int(logits.reshape(len(ids), -1)[-1].argmax()))
        seqs.append(ids)
    items = _teacher_items(model, seqs)
    batch = pad_batch(items[:4], "cpu")
    loss0, _, _ = ttt_loss(drafter, batch, drafter.lm_head.weight.detach(), 3, 0.8, negatives=None)
    fit = train_drafter(drafter, items[:10], items[10:], steps=3, decay=0.8, epochs=30, batch_tokens=256, lr=3e-3,
                        warmup_frac=0.05, grad_clip=1.0, seed=0, eval_every=20, eval_depth=4)
    loss1, _, _ = ttt_loss(drafter, batch, drafter.lm_head.weight.detach(), 3, 0.8, negatives=None)
    assert float(loss1) < 0.5 * float(loss0)
    curve = fit["curve"]
    assert curve[0]["train_tokens"] == 0 and curve[-1]["train_tokens"] == fit["train_tokens"] > 0
    assert curve[-1]["tokens_per_step"] > curve[0]["tokens_per_step"] + 0.15
    assert chain_tokens_per_step(drafter, items[10:], 4) == {k: curve[-1][k] for k in ("tokens_per_step", "top1")}
    # the shared output layer is the target's rows of the draft ids: not stored, restored on load
    save_drafter(drafter, tmp_path / "d", dtype=torch.bfloat16)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "drafter.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    again = load_drafter(tmp_path / "d", model)
    assert torch.equal(again.lm_head.weight, model.output.weight[again.target_ids()])
    assert torch.equal(again.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())
    unbound = load_drafter(tmp_path / "d")
    with pytest.raises(RuntimeError, match="bind"):
        unbound.logits(torch.zeros(1, 32))


def test_length_batches_group_similar_lengths_within_the_padded_budget() -> None:
    assert length_batches([5, 1, 3, 9], 9) == [[1, 2], [0], [3]]
    assert length_batches([20], 8) == [[0]]          # a longer sequence goes alone
    assert sorted(i for b in length_batches([4, 4, 2, 7, 1], 8) for i in b) == [0, 1, 2, 3, 4]
