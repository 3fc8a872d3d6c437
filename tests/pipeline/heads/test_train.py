"""Heads stage on a tiny random base model: self-distillation data, training, resume, the stage."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from pipeline.heads import TrainSettings, select_prompts, train_heads
from pipeline.heads.distill import generate_batch
from pipeline.heads.report import evaluate_heads
from pipeline.heads.train import distill_loss, sequence_batch, train_loop
from runtime.ar import ar_generate
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model
from tests.helpers.training import CHECKPOINT_VOCAB, checkpoint_prompts, make_heads, selfdistill, write_tiny_checkpoint

V = CHECKPOINT_VOCAB


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"))


def test_batched_generation_equals_runtime_greedy(tiny_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    rt = load_model(tiny_dir, max_seq_len=64)
    ps = checkpoint_prompts(4)
    out = generate_batch(hf, ps, 10, {2}, 5)  # left-padded batch of different lengths
    for p, o in zip(ps, out):
        assert o["tokens"].tolist() == ar_generate(rt, p, 10, eos_ids=[2])
        rt.reset_cache()
        seq = torch.tensor([p + o["tokens"].tolist()[:-1]])
        logits, hidden = rt(seq, torch.arange(seq.shape[1]))
        assert o["hidden"].shape == hidden[0].shape
        assert torch.allclose(o["hidden"].float(), hidden[0], atol=2e-2, rtol=1e-2)
        assert o["topk_ids"][:, 0].tolist() == o["tokens"].tolist()
        probs = torch.softmax(logits[0, len(p) - 1:], -1).topk(5).values
        assert torch.allclose(o["topk_p"].float(), probs / probs.sum(-1, keepdim=True), atol=2e-3)


def test_select_prompts_is_disjoint_and_covers_every_task() -> None:
    rows = {t: [{"id": f"{t}/{i}", "input_ids": [1] * (i % 7 + 1)} for i in range(30)] for t in ("a", "b", "c")}
    rows["a"].append({"id": "a/long", "input_ids": [1] * 50})
    s = TrainSettings(tasks=["a", "b", "c"], max_prompts=30, holdout_prompts=6, max_prompt_tokens=10)
    train, hold = select_prompts(rows, s)
    ids_t, ids_h = {r["id"] for r in train}, {r["id"] for r in hold}
    assert len(train) == 24 and len(hold) == 6 and not ids_t & ids_h and "a/long" not in ids_t | ids_h
    assert {i.split("/")[0] for i in ids_h} == {"a", "b", "c"}
    assert select_prompts(rows, s) == (train, hold)  # seeded


@pytest.fixture(scope="module")
def seqs10(tiny_dir: Path, tmp_path_factory) -> list[dict]:
    return selfdistill(tiny_dir, tmp_path_factory.mktemp("sd10"))


def test_selfdistill_shards_are_reused(tiny_dir: Path, tmp_path: Path) -> None:
    first = selfdistill(tiny_dir, tmp_path)
    shards = sorted((tmp_path / "sd").glob("shard-*.safetensors"))
    assert len(shards) == 3
    stamp = [p.stat().st_mtime_ns for p in shards]
    shards[1].unlink()  # an interrupted run: only the missing shard is generated again
    again = selfdistill(tiny_dir, tmp_path)
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "sd").glob("shard-*.safetensors"))][::2] == stamp[::2]
    for a, b in zip(first, again):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("kind", "prefix", "output"), [("hydra", False, "shared"), ("hydra", True, "shared"),
                                                        ("medusa", False, "own"), ("hydra", False, "draft")])
def test_a_few_steps_reduce_the_loss(tiny_dir: Path, tmp_path: Path, seqs10: list[dict], kind: str, prefix: bool,
                                     output: str) -> None:
    seqs = seqs10
    heads = make_heads(tiny_dir, kind=kind, prefix_layer=prefix, output=output,
                       draft_vocab_size=40 if output == "draft" else None)
    if output == "draft":
        from pipeline.heads.train import draft_vocabulary

        heads.set_draft_vocab(draft_vocabulary(seqs, 40))
    batch = sequence_batch(heads, seqs)
    with torch.no_grad():
        before = float(distill_loss(heads.eval(), batch)[0])
    s = TrainSettings(max_steps=25, batch_sequences=3, lr=3e-3, warmup_frac=0.1, checkpoint_every=100)
    fit = train_loop(heads, seqs, s, tmp_path / "work", run_key="k")
    batch = sequence_batch(heads, seqs)
    with torch.no_grad():
        after = float(distill_loss(heads.eval(), batch)[0])
    assert fit["steps"] == 25 and after < 0.95 * before, (before, after)
    rep = evaluate_heads(heads, seqs)
    assert len(rep["top1"]) == 4 and all(0 <= a <= b <= 1 for a, b in zip(rep["top1"], rep["top5"]))
    assert rep["tokens_per_step"]["chain1"] >= 1.0


@pytest.mark.parametrize("output", ["shared", "own", "draft"])
def test_candidate_logits_are_the_full_logits_at_those_ids(tiny_dir: Path, output: str) -> None:
    heads = make_heads(tiny_dir, kind="hydra", output=output, draft_vocab_size=40 if output == "draft" else None).eval()
    if output != "shared":  # move the own layers off the base copy, so a mix-up of heads would show
        with torch.no_grad():
            for h in heads.heads:
                h.out.weight.add_(torch.randn_like(h.out.weight))
    states = torch.randn(7, 4, 32)
    cand = torch.tensor([0, 5, 17, 39])
    full = heads.output_logits(states)
    assert torch.allclose(heads.candidate_logits(states, cand), full[..., cand], atol=1e-5)


def test_sampled_loss_is_the_full_loss_when_the_candidates_cover_the_vocabulary(tiny_dir: Path, seqs10: list[dict]
                                                                               ) -> None:
    heads = make_heads(tiny_dir, kind="hydra").eval()
    batch = sequence_batch(heads, seqs10[:3])
    with torch.no_grad():
        full_all, _ = distill_loss(heads, batch)
        torch.manual_seed(0)
        covered, _ = distill_loss(heads, batch, negatives=20 * V)  # every id drawn: P(miss) ~ e^-20 per id
        row = {k: v[:1] for k, v in batch.items()}  # one position: its 4 x 8 teacher ids cannot cover V
        few, few_heads = distill_loss(heads, row, negatives=0)  # teacher top-k ids only
        full, full_heads = distill_loss(heads, row)
    assert torch.allclose(covered, full_all, atol=1e-5)
    # a partial softmax never sees more mass than the full one: its loss is a lower bound
    assert bool((few_heads <= full_heads + 1e-5).all()) and float(few) < float(full)


def test_resume_gives_the_same_heads_as_an_uninterrupted_run(tiny_dir: Path, tmp_path: Path) -> None:
    seqs = selfdistill(tiny_dir, tmp_path, n=6)
    s = TrainSettings(max_steps=8, batch_sequences=2, lr=2e-3, checkpoint_every=3)
    cfg = {"kind": "hydra", "prefix_layer": True, "dropout": 0.2}  # dropout: the RNG state must resume too

    whole = make_heads(tiny_dir, **cfg)
    train_loop(whole, seqs, s, tmp_path / "a", run_key="k")

    part = make_heads(tiny_dir, **cfg)
    train_loop(part, seqs, s, tmp_path / "b", run_key="k", stop_after=5)  # "killed" after 5 steps
    torch.manual_seed(123)  # whatever happened in between must not matter
    resumed = make_heads(tiny_dir, **cfg)
    fit = train_loop(resumed, seqs, s, tmp_path / "b", run_key="k")
    assert fit["resumed_from"] == 5
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    with pytest.raises(ValueError, match="another configuration"):
        train_loop(make_heads(tiny_dir, **cfg), seqs, s, tmp_path / "b", run_key="other")


def write_task(data_dir: Path, task: str, rows: list[list[int]]) -> None:
    (data_dir / task).mkdir(parents=True)
    with open(data_dir / task / "train.jsonl", "w") as f:
        for i, ids in enumerate(rows):
            f.write(json.dumps({"id": f"{task}/{i}", "prompt": "", "input_ids": ids, "reference": None}) + "\n")


def test_stage_writes_loadable_heads_and_is_skipped_when_up_to_date(tiny_dir: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    write_task(data, "t1", checkpoint_prompts(6, seed=1))
    write_task(data, "t2", checkpoint_prompts(6, seed=2))
    cfg = {"name": "hydra", "kind": "hydra", "num_heads": 3, "num_layers": 1, "prefix_layer": False,
           "output": "shared", "dropout": 0.1, "dir": None,
           "train": {"tasks": ["t1", "t2"], "functions_from": None, "max_prompts": 10, "holdout_prompts": 2, "max_new_tokens": 12,
                     "gen_batch": 4, "teacher_topk": 8, "max_steps": 6, "batch_sequences": 2, "checkpoint_every": 4}}
    out = train_heads(cfg, tiny_dir, data, tmp_path / "artifacts")
    assert out == tmp_path / "artifacts" / "heads" / tiny_dir.name / "hydra"
    assert {"config.json", "heads.safetensors", "report.json", "manifest.json"} <= {p.name for p in out.iterdir()}
    report = json.loads((out / "report.json").read_text())
    assert report["sequences"] == 2 and len(report["top1"]) == 3 and report["steps"] == 6
    from pipeline.model.provision import model_fingerprint

    fp = model_fingerprint(tiny_dir)
    model = load_model(tiny_dir, max_seq_len=64)
    heads = load_heads(out, model, base_fingerprint=fp)
    assert heads.config.num_heads == 3 and heads.config.base_fingerprint == fp
    with pytest.raises(ValueError, match="trained on base model"):
        load_heads(out, model, base_fingerprint="0000000000000000")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        assert train_heads(cfg, tiny_dir, data, tmp_path / "artifacts") == out
    assert any("up to date" in r.getMessage() for r in caplog.records)
    # an eval split is not training data: adding one leaves the heads up to date
    (data / "t1" / "eval.jsonl").write_text(json.dumps({"id": "t1/e", "prompt": "", "input_ids": [1, 2], "reference": None}) + "\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        assert train_heads(cfg, tiny_dir, data, tmp_path / "artifacts") == out
    assert any("up to date" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    with pytest.raises(ValueError, match="unknown heads config keys"):
        train_heads({**cfg, "heads": 4}, tiny_dir, data, tmp_path / "artifacts")
    with pytest.raises(ValueError, match="unknown heads.train keys"):
        train_heads({**cfg, "train": {"step": 3}}, tiny_dir, data, tmp_path / "artifacts")


@pytest.mark.parametrize(("kind", "prefix", "output"), [("hydra", True, "shared"), ("medusa", False, "draft")])
def test_a_training_step_stays_on_the_models_device(tiny_dir: Path, tmp_path: Path, seqs10: list[dict], kind: str,
                                                    prefix: bool, output: str) -> None:
    """Batching, the sampled loss, its backward pass and the held-out report make no tensor off the
    heads' device (`DeviceCheck` flags every factory called without a device, so a CPU-only run
    finds what would break on a GPU); then one whole step of `train_loop` with an autocast dtype."""
    from pipeline.heads.train import draft_vocabulary
    from tests.helpers.device_check import DeviceCheck

    heads = make_heads(tiny_dir, kind=kind, prefix_layer=prefix, output=output,
                       draft_vocab_size=40 if output == "draft" else None)
    if output == "draft":
        heads.set_draft_vocab(draft_vocabulary(seqs10, 40))
    device = next(heads.parameters()).device
    negatives = torch.Generator(device=device)
    negatives.manual_seed(0)
    with DeviceCheck(device) as check:
        batch = sequence_batch(heads.train(), seqs10[:3])
        loss, per_head = distill_loss(heads, batch, negatives=16, generator=negatives)
        loss.backward()
        report = evaluate_heads(heads, seqs10[:2])
    check.raise_if_violations()
    assert per_head.shape == (4,) and all(p.grad is not None for p in heads.parameters() if p.requires_grad)
    assert len(report["top1"]) == 4
    # AdamW keeps its step counter as a 0-dim host tensor by design: the loop runs outside the check
    s = TrainSettings(max_steps=1, batch_sequences=2, checkpoint_every=1, dtype="bfloat16")
    fit = train_loop(heads, seqs10, s, tmp_path / "work", run_key="k")
    assert fit["steps"] == 1 and math.isfinite(fit["loss_last"])
