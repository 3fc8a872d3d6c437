"""One shard of the calibration rollout: per prompt, the AR continuation (greedy or seeded sampling),
one teacher-forced pass over prompt + continuation, and the rank paths and signals recorded from it
(`rollout_prompt`, `run_rollout`); saving and loading a rollout folder.

Heads (Medusa, Hydra) give their teacher-forced logits along the true path from the pass's hidden
states; an EAGLE-3 drafter reads the target's features from the same pass and gives its rank paths
and top-1 probabilities along the continuation itself (`runtime.eagle3.Eagle3Drafter.rollout_arrays`:
its committed rows built causally, then one draft-layer pass per depth over every position), with
D = the drafter's `max_depth` columns (the trees a bank may use go to `heads.num_heads`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from tqdm.auto import tqdm

from runtime.ar import ar_generate
from runtime.decoder import Drafter
from runtime.eagle3 import target_forward
from runtime.model.llama import Transformer
from runtime.sampling import Sampler

ARRAYS = ("tokens", "rank_paths", "p0", "entropy", "head_top1", "greedy_top1", "tf_mismatch")


@torch.inference_mode()
def rollout_prompt(
    model: Transformer, heads: Drafter, input_ids: list[int], max_new_tokens: int, rank_cap: int,
    sampler: Sampler | None = None,
) -> dict[str, np.ndarray]:
    """Arrays over step indices i = 0..T-1 for one prompt (see the rank-path convention).

    rank_paths [T, D] int16: rank of y_{i+1+d} in head d at i, K where >= K or beyond T.
    p0 [T], entropy [T]: base top-1 probability and entropy (nats) of the distribution giving y_{i+1}.
    head_top1 [T, D]: head d's top-1 probability at i when fed the true tokens y (rank-path view).
    greedy_top1 [T, D]: head d's top-1 probability along the heads' *own* greedy chain, which is
      what a decoder sees before verifying (the inputs of the greedy-path signal g_d).
    tf_mismatch [T] bool: the teacher-forced choice differs from the AR token (a float tie).

    With a sampling `sampler` (seeded, noise keyed on the output position) y is the seeded AR
    sample, and the rank paths replay tree decoding with the same sampler exactly: a node is
    accepted iff its token equals its parent's keyed sample, i.e. the next token of y.
    """
    sampler = sampler if sampler is not None else Sampler()
    y = ar_generate(model, list(input_ids), max_new_tokens, sampler=sampler)
    P, T, D = len(input_ids), len(y), heads.max_depth
    dev = model.device  # every tensor is made where the model computes
    seq = torch.tensor([list(input_ids) + y[:-1]], dtype=torch.long, device=dev)  # y_T needs no successor
    seq_pos = torch.arange(seq.shape[1], device=dev)
    model.reset_cache()
    heads.reset()
    if heads.aux_layer_ids:  # an EAGLE-3 drafter: the target's features from this same forward
        logits, hidden, features = target_forward(model, seq, seq_pos, heads.aux_layer_ids)
    else:
        logits, hidden = model(seq, seq_pos)
    base = logits[0, P - 1:].float()                                     # [T, V] gives y_1..y_T
    y_t = torch.tensor(y, dtype=torch.long, device=dev)
    logp = torch.log_softmax(base, -1)
    p0 = logp.max(-1).values.exp()
    entropy = -(logp.exp() * logp).sum(-1)
    tf_mismatch = sampler.next_tokens(base, torch.arange(T, device=dev)) != y_t
    if heads.aux_layer_ids:
        # x_{s+1} for every position s of seq: its own next token, then y_T
        ranks, head_top1, greedy_top1 = heads.rollout_arrays(features, torch.cat([seq[0, 1:], y_t[-1:]]), P - 1, D,
                                                             rank_cap)
        return _arrays(y, ranks, p0, entropy, head_top1, greedy_top1, tf_mismatch)
    ctx = heads.context(hidden, seq_pos)[P - 1:]                         # [T, dim]

    # next_true[i, d] = y_{i+1+d} (d = 0..D): the root and the targets of heads 1..D; -1 past T
    padded = torch.cat([y_t, torch.full((D,), -1, dtype=torch.long, device=dev)])
    idx = torch.arange(T, device=dev)[:, None] + torch.arange(D + 1, device=dev)[None, :]
    next_true = padded[idx]                                              # [T, D+1]
    head_logits = heads.teacher_forced_logits(ctx, next_true[:, :D].clamp(min=0))  # [T, D, V]
    target = next_true[:, 1:]                                            # [T, D]
    tgt_logit = head_logits.gather(-1, target.clamp(min=0)[..., None])
    ranks = (head_logits > tgt_logit).sum(-1)
    ranks = torch.where(target < 0, rank_cap, ranks.clamp(max=rank_cap))
    head_top1 = torch.softmax(head_logits, -1).max(-1).values

    # the heads' own greedy chain: head d fed the root and heads 1..d-1's top-1 tokens
    chain = next_true[:, :D].clamp(min=0).clone()
    for d in range(1, D):
        lg = heads.teacher_forced_logits(ctx, chain)
        chain[:, d] = lg[:, d - 1].argmax(-1)
    greedy_top1 = torch.softmax(heads.teacher_forced_logits(ctx, chain), -1).max(-1).values
    return _arrays(y, ranks, p0, entropy, head_top1, greedy_top1, tf_mismatch)


def _arrays(y: list[int], ranks: torch.Tensor, p0: torch.Tensor, entropy: torch.Tensor, head_top1: torch.Tensor,
            greedy_top1: torch.Tensor, tf_mismatch: torch.Tensor) -> dict[str, np.ndarray]:
    return {
        "tokens": np.asarray(y, dtype=np.int64),
        "rank_paths": ranks.to(torch.int16).cpu().numpy(),
        "p0": p0.float().cpu().numpy(),
        "entropy": entropy.float().cpu().numpy(),
        "head_top1": head_top1.float().cpu().numpy(),
        "greedy_top1": greedy_top1.float().cpu().numpy(),
        "tf_mismatch": tf_mismatch.cpu().numpy(),
    }


def shard_rows(rows: list[dict], shard: int, num_shards: int) -> list[dict]:
    if not 0 <= shard < num_shards:
        raise ValueError(f"rollout.shard must be in [0, {num_shards}), got {shard}")
    return rows[shard::num_shards]


def run_rollout(
    model: Transformer, heads: Drafter, rows: list[dict], max_new_tokens: int, rank_cap: int,
    out_dir: Path, desc: str = "rollout", sampler: Sampler | None = None,
) -> dict[str, Any]:
    """Roll out `rows` (dicts with `id` and `input_ids`) and save them under `out_dir`."""
    per_prompt = []
    for row in tqdm(rows, desc=desc, unit="prompt"):
        per_prompt.append(rollout_prompt(model, heads, row["input_ids"], max_new_tokens, rank_cap, sampler))
    save_rollout(out_dir, [r["id"] for r in rows], per_prompt, rank_cap)
    tokens = sum(len(r["tokens"]) for r in per_prompt)
    return {"prompts": len(rows), "tokens": tokens, "tf_mismatches": int(sum(r["tf_mismatch"].sum() for r in per_prompt))}


def save_rollout(out_dir: Path, ids: list[str], per_prompt: list[dict[str, np.ndarray]], rank_cap: int) -> None:
    """Concatenate per-prompt arrays with an offsets vector (safetensors + JSON; no pickle)."""
    lengths = [len(r["tokens"]) for r in per_prompt]
    flat = {k: np.concatenate([r[k] for r in per_prompt]) if per_prompt else np.zeros(0) for k in ARRAYS}
    flat["tf_mismatch"] = flat["tf_mismatch"].astype(np.uint8)
    flat["offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    save_file(flat, str(out_dir / "rollout.safetensors"))
    (out_dir / "prompts.json").write_text(json.dumps({"ids": ids, "rank_cap": int(rank_cap)}))


def load_rollout(folder: str | Path) -> list[dict[str, Any]]:
    """Per-prompt dicts of arrays (the replay engine's input), each with its prompt `id`."""
    folder = Path(folder)
    f = folder / "rollout.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"no rollout in {folder}: run `python -m pipeline stage=rollout` first")
    flat = load_file(str(f))
    meta = json.loads((folder / "prompts.json").read_text())
    ids, rank_cap = meta["ids"], int(meta["rank_cap"])
    off = flat["offsets"]
    if len(off) != len(ids) + 1:
        raise ValueError(f"rollout in {folder} is inconsistent: {len(ids)} prompt ids but {len(off) - 1} offsets")
    out = []
    for j, pid in enumerate(ids):
        a, b = int(off[j]), int(off[j + 1])
        r: dict[str, Any] = {k: flat[k][a:b] for k in ARRAYS}
        r["tf_mismatch"] = r["tf_mismatch"].astype(bool)
        r["id"] = pid
        r["rank_cap"] = rank_cap
        out.append(r)
    return out

