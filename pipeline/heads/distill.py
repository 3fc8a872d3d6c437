"""Self-distillation data: the frozen base model continues every training prompt greedily, batched
with left padding (prompts sorted by length), recording each position's final-normed hidden state
(float16) and the base distribution at every continuation step as its renormalised top-k. One
shard file per generation batch, so an interrupted run resumes where it stopped."""

from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, hash_obj
from pipeline.config.schema import TrainSettings
from runtime.sampling import gumbel_noise

log = logging.getLogger(__name__)


@torch.inference_mode()
def generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], topk: int,
                   temperature: float = 0.0, seeds: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """Greedy continuations (or, at `temperature` > 0, samples keyed on (seeds[b], output position)
    as in runtime/sampling.py) of a left-padded batch with a transformers Llama model. The
    recorded teacher is the base distribution at every step either way.

    Per sequence: tokens y [T] (EOS included), hidden [P+T-1, dim] float16 (final-normed states of
    the prompt and y_1..y_{T-1}: the positions whose next token is known), and the base
    distribution at each of the T steps as topk_ids [T, k] int32 / topk_p [T, k] float16."""
    from transformers import DynamicCache

    B, P = len(prompts), max(len(p) for p in prompts)
    dev = model.device
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    mask = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, device=dev)
        mask[b, P - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    row_seeds = torch.tensor(seeds or [0] * B, dtype=torch.long)  # each below 2**63
    # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns until 5.40)
    cache_kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    cache = {cache_kw: DynamicCache(config=model.config)}
    hid = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **cache).last_hidden_state
    hidden: list[list[torch.Tensor]] = [[hid[b, P - len(p):].half()] for b, p in enumerate(prompts)]
    last = hid[:, -1]
    next_pos = pos[:, -1] + 1
    ys: list[list[int]] = [[] for _ in range(B)]
    tk_ids: list[list[torch.Tensor]] = [[] for _ in range(B)]
    tk_p: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        probs = torch.softmax(model.lm_head(last).float(), dim=-1)
        top = probs.topk(topk, dim=-1)
        if temperature > 0:  # Gumbel-max: an exact, seeded draw from softmax(logits / T)
            logits = torch.log(probs.clamp_min(1e-30)) / temperature
            nxt = (logits.double() + gumbel_noise(row_seeds, torch.full((B,), step), probs.shape[-1]).to(dev)).argmax(-1)
        else:
            nxt = probs.argmax(-1)
        for b in range(B):
            if not done[b]:
                ys[b].append(int(nxt[b]))
                tk_ids[b].append(top.indices[b].int())
                tk_p[b].append((top.values[b] / top.values[b].sum()).half())
                done[b] = int(nxt[b]) in eos_ids
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long, device=dev)], dim=1)
        out = model.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                          use_cache=True, **cache).last_hidden_state
        last = out[:, 0]
        next_pos = next_pos + 1
        for b in range(B):
            if not done[b]:  # the state of y_t's position, context of the next step
                hidden[b].append(last[b:b + 1].half())
    # host tensors: they are saved as shards and moved to the training device batch by batch
    return [{"tokens": torch.tensor(ys[b], dtype=torch.long), "hidden": torch.cat(hidden[b]).cpu(),
             "topk_ids": torch.stack(tk_ids[b]).cpu(), "topk_p": torch.stack(tk_p[b]).cpu(),
             "prompt_len": torch.tensor(len(prompts[b]))} for b in range(B)]


def _flatten(seqs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate per-sequence arrays with offsets (safetensors holds flat tensors only)."""
    out: dict[str, torch.Tensor] = {}
    for key in ("tokens", "hidden", "topk_ids", "topk_p"):
        out[key] = torch.cat([s[key] for s in seqs])
        out[f"{key}_offsets"] = torch.tensor(np.cumsum([0] + [len(s[key]) for s in seqs]), dtype=torch.long)
    out["prompt_len"] = torch.stack([s["prompt_len"] for s in seqs]).long()
    return out


def _unflatten(flat: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    n = len(flat["prompt_len"])
    seqs = []
    for i in range(n):
        s = {"prompt_len": flat["prompt_len"][i]}
        for key in ("tokens", "hidden", "topk_ids", "topk_p"):
            off = flat[f"{key}_offsets"]
            s[key] = flat[key][int(off[i]):int(off[i + 1])]
        seqs.append(s)
    return seqs


def build_selfdistill(model_dir: Path, rows: list[dict], s: TrainSettings, out_dir: Path, device: str = "cpu",
                      temperature: float = 0.0, sample_seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Generate (or resume / reuse) the self-distillation data of `rows` with the base model on
    `device` (float32); one shard per batch, host tensors. `temperature` > 0 samples the
    continuations instead, row r keyed on (sample_seed, r's id)."""
    from transformers import LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    # sort by prompt length so a batch wastes little on padding
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["input_ids"]), rows[i]["id"]))
    batches = [order[i:i + s.gen_batch] for i in range(0, len(order), s.gen_batch)]
    model = None
    eos = set()
    by_row: dict[int, dict[str, torch.Tensor]] = {}
    t0 = time.time()
    for bi, batch in enumerate(tqdm(batches, desc="self-distill", unit="batch")):
        shard = out_dir / f"shard-{bi:04d}.safetensors"
        if shard.is_file():
            seqs = _unflatten(load_file(str(shard)))
        else:
            if model is None:
                model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
                cfg_eos = model.config.eos_token_id
                eos = set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]) - {None}
            seeds = [int(hash_obj([sample_seed, rows[i]["id"]])[:15], 16) for i in batch]
            seqs = generate_batch(model, [rows[i]["input_ids"] for i in batch], s.max_new_tokens, eos, s.teacher_topk,
                                  temperature, seeds)
            atomic_write_bytes(shard, save(_flatten(seqs), metadata={"rows": json.dumps([rows[i]["id"] for i in batch])}))
        for i, seq in zip(batch, seqs):
            by_row[i] = seq
    if model is not None:
        log.info(f"[heads] self-distillation: {len(rows)} prompts in {time.time() - t0:.0f} s")
    return [by_row[i] for i in range(len(rows))]


# ----------------------------------------------------------------------------------------------
# 2. training
