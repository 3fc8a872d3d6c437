"""Training: head d at step i (the position whose base argmax is y_{i+1}) reads the context vector
there (Hydra: plus the true tokens y_{i+1..i+d}) and learns the base distribution of y_{i+1+d}
(Hydra++'s distillation loss), by default as a softmax over the step's candidate ids (the batch's
teacher top-k ids plus uniform negatives) rather than the whole vocabulary, whose output layer
dominates a step's cost. AdamW, linear warm-up then cosine decay. Checkpoints (safetensors:
weights, optimiser moments, RNG state; JSON metadata inside) are written atomically every
`checkpoint_every` steps; a restarted run continues from the last one with the same result as an
uninterrupted run."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes
from pipeline.config.schema import TrainSettings
from runtime.heads import DraftHeads

log = logging.getLogger(__name__)


def heads_device(heads: DraftHeads) -> torch.device:
    """Where the heads' parameters live (training data is moved there batch by batch)."""
    return next(heads.parameters()).device


def sequence_batch(heads: DraftHeads, seqs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Training rows of continuation steps: context vectors h [M, dim], true tokens [M, D], and for
    each head the teacher's top-k of its target [M, D, k] with a validity mask [M, D], on the
    heads' device (the continuations stay on the host until their batch is built)."""
    D = heads.config.num_heads
    dev = heads_device(heads)
    hs, toks, ids, ps, valid = [], [], [], [], []
    for s in seqs:
        P, y = int(s["prompt_len"]), s["tokens"].to(dev)
        T = len(y)
        ctx = heads.context(s["hidden"].to(dev).float())[P - 1:P - 1 + T]   # [T, dim], step i at row i
        step = torch.arange(T, device=dev)[:, None]
        ahead = step + torch.arange(D, device=dev)[None, :]                 # y_{i+1+j}: index i+j
        toks.append(torch.where(ahead < T, y[ahead.clamp(max=T - 1)], 0))
        target_step = step + torch.arange(1, D + 1, device=dev)[None, :]    # head d learns step i+d's distribution
        ok = target_step < T
        tgt = target_step.clamp(max=T - 1)
        ids.append(s["topk_ids"].to(dev)[tgt].long())
        ps.append(s["topk_p"].to(dev)[tgt].float() * ok[..., None])
        valid.append(ok)
        hs.append(ctx)
    return {"h": torch.cat(hs), "tokens": torch.cat(toks), "ids": torch.cat(ids), "p": torch.cat(ps),
            "valid": torch.cat(valid)}


def distill_loss(heads: DraftHeads, batch: dict[str, torch.Tensor], negatives: int | None = None,
                 generator: torch.Generator | None = None, rank_weight: float = 0.0, rank_topk: int = 8,
                 ttt_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the training loss, per-head distillation losses [D] detached).

    The loss is the mean over heads of each head's mean cross-entropy against the teacher.
    `negatives=None`: softmax over the whole output vocabulary; an int n: over the batch's
    candidates only (every teacher top-k id plus n uniform draws from `generator`, on the heads'
    device; None: the default generator of that device).
    `rank_weight` adds a listwise term (HASS): the cross-entropy of the teacher's top-`rank_topk`
    renormalised against the heads' softmax over those same ids, which scores their order only.
    `ttt_weight` adds a training-time-test pass (EAGLE-3; Hydra only): heads 2..D read the heads'
    own top-1 chain drafts (drawn from the same candidates, no gradient) as path tokens after the
    root, against the same targets."""
    dev = heads_device(heads)
    ids, p = batch["ids"], batch["p"]
    v_out = heads.config.draft_vocab_size or heads.config.vocab_size
    if heads.draft_ids is not None:  # targets outside the draft vocabulary carry no learnable mass
        inv = torch.full((heads.config.vocab_size,), -1, dtype=torch.long, device=dev)
        inv[heads.draft_ids] = torch.arange(len(heads.draft_ids), device=dev)
        ids = inv[ids]
        p = torch.where(ids >= 0, p, 0.0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        ids = ids.clamp(min=0)
    cand = None
    if negatives is not None:
        draws = torch.randint(0, v_out, (negatives,), device=dev, generator=generator)
        cand = torch.unique(torch.cat([ids.flatten(), draws]))
        slot = torch.full((v_out,), -1, dtype=torch.long, device=dev)
        slot[cand] = torch.arange(len(cand), device=dev)
        ids = slot[ids]

    def logits_of(states: torch.Tensor) -> torch.Tensor:
        if cand is None:
            return heads.output_logits(states).float()                      # [M, D, V_out]
        return heads.candidate_logits(states, cand).float()                 # [M, D, C]

    valid = batch["valid"].float()

    def head_mean(x: torch.Tensor) -> torch.Tensor:                        # [M, D] -> [D]
        return (x * valid).sum(0) / valid.sum(0).clamp_min(1.0)

    def losses_of(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss with every term, each head's distillation cross-entropy [D])."""
        ce = head_mean(torch.logsumexp(logits, dim=-1) - (p * logits.gather(-1, ids)).sum(-1))
        loss = ce.mean()
        if rank_weight:
            k = min(rank_topk, ids.shape[-1])
            top = logits.gather(-1, ids[..., :k])
            pk = p[..., :k] / p[..., :k].sum(-1, keepdim=True).clamp_min(1e-9)
            loss = loss + rank_weight * head_mean(torch.logsumexp(top, dim=-1) - (pk * top).sum(-1)).mean()
        return loss, ce

    loss, per_head = losses_of(logits_of(heads.head_states(batch["h"], batch["tokens"])))
    if ttt_weight and heads.config.kind == "hydra" and heads.config.num_heads > 1:
        drafted = _chain_drafts(heads, batch["h"], batch["tokens"], cand)
        loss = loss + ttt_weight * losses_of(logits_of(heads.head_states(batch["h"], drafted)))[0]
    return loss, per_head.detach()


@torch.no_grad()
def _chain_drafts(heads: DraftHeads, h: torch.Tensor, tokens: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
    """Path tokens [M, D] with the true root and then the heads' own top-1 chain: column d is head
    d's argmax (over `cand`, or the whole output vocabulary) given the columns before it."""
    was_training = heads.training
    heads.eval()
    out = tokens.clone()
    for d in range(1, heads.config.num_heads):
        state = heads.head_states(h, out, heads=d)[:, -1:]                 # head d given columns < d
        if cand is None:
            best = heads.output_logits(state, first_head=d)[:, 0].argmax(-1)
        else:
            # own output layers are per head: candidate_logits reads head j's from column j
            states = state if heads.config.output == "shared" else state.expand(-1, d, -1)
            best = cand[heads.candidate_logits(states, cand)[:, -1].argmax(-1)]
        out[:, d] = best if heads.draft_ids is None else heads.draft_ids[best]
    heads.train(was_training)
    return out


def lr_at(step: int, total: int, s: TrainSettings) -> float:
    warm = max(1, int(round(s.warmup_frac * total)))
    if step < warm:
        return s.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return s.lr * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))


def batch_schedule(n_seqs: int, total_steps: int, s: TrainSettings) -> list[list[int]]:
    """Sequence indices of every step: seeded reshuffles per epoch, fixed for the whole run."""
    rng = np.random.default_rng(s.seed)
    out: list[list[int]] = []
    perm: list[int] = []
    while len(out) < total_steps:
        if len(perm) < s.batch_sequences:
            perm += rng.permutation(n_seqs).tolist()
        out.append(perm[:s.batch_sequences])
        perm = perm[s.batch_sequences:]
    return out


def total_steps_for(n_seqs: int, s: TrainSettings) -> int:
    if s.max_steps is not None:
        return s.max_steps
    return max(1, math.ceil(s.epochs * n_seqs / s.batch_sequences))


def _save_checkpoint(path: Path, heads: DraftHeads, opt: torch.optim.Optimizer, step: int, meta: dict[str, Any],
                     generator: torch.Generator | None = None) -> None:
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in heads.state_dict().items()}
    names = [n for n, _ in heads.named_parameters()]
    for i, name in enumerate(names):
        st = opt.state.get(opt.param_groups[0]["params"][i], {})
        for k, v in st.items():
            tensors[f"optim.{name}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().clone().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    if generator is not None:
        tensors["rng.negatives"] = generator.get_state()
    info = {**meta, "step": step, "param_names": names}
    atomic_write_bytes(path, save(tensors, metadata={"checkpoint": json.dumps(info)}))


def _load_checkpoint(path: Path, heads: DraftHeads, opt: torch.optim.Optimizer,
                     generator: torch.Generator | None = None) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        info = json.loads(f.metadata()["checkpoint"])
    tensors = load_file(str(path), device=str(heads_device(heads)))
    # RNG states are host byte tensors whatever the device
    rng = {k: tensors.pop(k).cpu() for k in [k for k in tensors if k.startswith("rng.")]}
    heads.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    params = dict(heads.named_parameters())
    if info["param_names"] != list(params):
        raise ValueError(f"checkpoint {path} was written for other parameters; delete it to start over")
    for name, p in params.items():
        st = {k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
              and k[len(f"optim.{name}."):].count(".") == 0}
        if st:
            opt.state[p] = st
    torch.set_rng_state(rng["rng.torch"])
    if generator is not None:
        # checkpoints from before the negatives had their own generator drew them from the CPU
        # default generator, whose state is rng.torch
        generator.set_state(rng.get("rng.negatives", rng["rng.torch"]))
    return info


def train_loop(heads: DraftHeads, seqs: list[dict[str, torch.Tensor]], s: TrainSettings, work_dir: Path,
               run_key: str, stop_after: int | None = None) -> dict[str, Any]:
    """Train `heads` (bound, float32 parameters, on their device) on `seqs` (host tensors);
    resumable from `work_dir/checkpoint.safetensors`. `s.dtype` other than float32 runs the
    forward under autocast to that dtype.

    `stop_after` ends the call after that many steps of this run (a test's simulated interruption)."""
    total = total_steps_for(len(seqs), s)
    schedule = batch_schedule(len(seqs), total, s)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    ckpt = work_dir / "checkpoint.safetensors"
    start, history = 0, []
    dev = heads_device(heads)
    torch.manual_seed(s.seed)
    # the negatives' own generator on the training device: on the CPU the same stream as the
    # default generator after manual_seed(seed), so CPU training is unchanged by it
    negatives_rng = torch.Generator(device=dev)
    negatives_rng.manual_seed(s.seed)
    autocast = torch.autocast(dev.type, dtype=getattr(torch, s.dtype), enabled=s.dtype != "float32")
    if ckpt.is_file():
        info = _load_checkpoint(ckpt, heads, opt, negatives_rng)
        if info.get("run_key") != run_key:
            raise ValueError(f"checkpoint {ckpt} belongs to another configuration; delete it to start over")
        start, history = int(info["step"]), list(info.get("history", []))
        log.info("[heads] resuming from step %d/%d", start, total)
    heads.train()
    t0 = time.time()
    bar = tqdm(range(start, total), desc=f"train {heads.config.kind}{'++' if heads.config.prefix_layer else ''}",
               unit="step", initial=start, total=total)
    done = 0
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, s)
        batch = sequence_batch(heads, [seqs[i] for i in schedule[step]])
        with autocast:
            loss, per_head = distill_loss(heads, batch, s.negatives if s.loss == "sampled" else None, negatives_rng,
                                          s.rank_loss_weight, s.rank_loss_topk, s.ttt_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        history.append(round(loss.item(), 5))
        bar.set_postfix(loss=f"{history[-1]:.3f}", heads=" ".join(f"{x:.2f}" for x in per_head.tolist()), refresh=False)
        done += 1
        last = step + 1 == total
        if (step + 1) % s.checkpoint_every == 0 or last or (stop_after is not None and done >= stop_after):
            _save_checkpoint(ckpt, heads, opt, step + 1, {"run_key": run_key, "history": history, "total": total},
                             negatives_rng)
        if stop_after is not None and done >= stop_after and not last:
            break
    bar.close()
    heads.eval()
    return {"steps": total, "resumed_from": start, "seconds_this_run": round(time.time() - t0, 1),
            "loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
            "loss_history": history}


def draft_vocabulary(seqs: list[dict[str, torch.Tensor]], size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of the training continuations (EAGLE-3's recipe),
    completed with the teachers' top candidates when the continuations use fewer distinct tokens."""
    counts: dict[int, float] = {}
    for s in seqs:
        for t in s["tokens"].tolist():
            counts[t] = counts.get(t, 0) + 1.0
    for s in seqs:
        for t, p in zip(s["topk_ids"].flatten().tolist(), s["topk_p"].flatten().tolist()):
            counts[t] = counts.get(t, 0) + 1e-3 * p
    ranked = sorted(counts, key=lambda t: -counts[t])[:size]
    if len(ranked) < size:
        raise ValueError(f"draft_vocab_size={size} exceeds the {len(ranked)} distinct tokens seen in training")
    return torch.tensor(sorted(ranked), dtype=torch.long)
