"""Heads training on a tiny transformers checkpoint: the checkpoint folder, prompts for it,
self-distillation data and fresh heads bound to it (the pipeline's heads tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.config.schema import TrainSettings
from runtime.heads import DraftHeads, HeadsConfig


CHECKPOINT_VOCAB = 61


def write_tiny_checkpoint(folder: Path, vocab: int = CHECKPOINT_VOCAB) -> Path:
    """A random Llama checkpoint folder (transformers' save_pretrained, no tokenizer), loud enough
    (std 0.25) to continue prompts non-trivially; EOS 2, BOS 1, PAD 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)
    model.save_pretrained(folder)
    return folder


def checkpoint_prompts(n: int, seed: int = 0, vocab: int = CHECKPOINT_VOCAB) -> list[list[int]]:
    """`n` seeded prompts of 2-8 tokens for `write_tiny_checkpoint`'s model (no special ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def selfdistill(tiny_dir: Path, tmp: Path, n: int = 10) -> list[dict]:
    """Self-distillation data of `n` seeded prompts, in `tmp`/sd (shards reused when present)."""
    from pipeline.heads.distill import build_selfdistill

    rows = [{"id": str(i), "input_ids": p} for i, p in enumerate(checkpoint_prompts(n, seed=3))]
    s = TrainSettings(max_new_tokens=16, gen_batch=4, teacher_topk=8, max_prompts=n + 1, holdout_prompts=1)
    return build_selfdistill(tiny_dir, rows, s, tmp / "sd")


def make_heads(tiny_dir: Path, **kw) -> DraftHeads:  # noqa: ANN003 - HeadsConfig.for_model's settings
    """Fresh heads (HeadsConfig.for_model(**kw)) bound to the checkpoint, outputs from the base."""
    from runtime.model.checkpoint import load_model

    model = load_model(tiny_dir, max_seq_len=64)
    torch.manual_seed(0)
    heads = DraftHeads(HeadsConfig.for_model(model.args, **kw))
    heads.bind(model)
    heads.init_output_from_base()
    return heads
