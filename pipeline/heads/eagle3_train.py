"""Training an EAGLE-3 drafter here: teacher-forced target features, then a training-time test.

Data. A drafter learns from (target features of position t, true token x_{t+1}) -> the target's
distribution of x_{t+2}. A teacher-forced forward of the target over a whole sequence yields that
for EVERY position at once, so data costs one forward per sequence, not one per generated token.
The sequences: the heads stage's self-distilled continuations (prompt + the model's own greedy
reply, `pipeline.heads.distill`; what the drafter meets when decoding) and, to scale the tokens
cheaply, train-pool prompts with their reference replies (never an eval or calibration split; the
mix's holdout prompts are left out). `teacher_pass` runs the target once per sequence (Hugging
Face, float32) and keeps per position the concatenated residual streams entering the
`aux_layer_ids` layers (our convention, `runtime.eagle3`) and the final-normed state, float16;
the teacher's distribution over the draft vocabulary is recomputed from that state each step.

Training-time test (EAGLE-3's): K unrolled steps. Step 0 is the committed pass: row t reads
(fc(f_t), x_{t+1}) at position t with causal attention. Step j >= 1, row t, is the depth-(j+1)
node below the true path: it reads (the drafter's own step-(j-1) output of row t, x_{t+j+1}) at
position t + j and attends to the committed rows 0..t and to row t of steps 1..j (its ancestors
and itself), exactly as `Eagle3Drafter.propose_tree` runs a drafted node; its target is the
target's distribution of x_{t+j+2}. Loss: forward KL to the target's softmax restricted to the
draft vocabulary, step j weighted decay**j. Inputs are the true tokens (along the accepted path
every drafted token is the true one), so the training matches the rank-path replay.

The output layer is shared (`Eagle3Config.output = "shared"`): the target's own output rows of the
draft ids, frozen and not stored, as EAGLE-1 froze the target's head; the drafter learns to produce
target-like final states.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from torch import Tensor
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, save_figure
from runtime.eagle3 import Eagle3Drafter
from runtime.model.rope import apply_rope

log = logging.getLogger(__name__)

FEATURE_KEYS = ("tokens", "features", "final")


# ----------------------------------------------------------------------------------------------
# 1. teacher-forced data


@torch.inference_mode()
def teacher_batch(model: Any, seqs: Sequence[Sequence[int]], aux_layer_ids: Sequence[int]) -> list[dict[str, Tensor]]:
    """One target forward (a transformers Llama model) over right-padded sequences: per sequence
    tokens [T] int64, features [T, k*dim] float16 (the residual streams entering `aux_layer_ids`,
    i.e. `output_hidden_states[i]`, concatenated) and final [T, dim] float16 (final-normed states)."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long, device=model.device)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(list(s), device=model.device)
    # right padding: under causal attention a real position never sees the padding after it
    out = model.model(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    return [{"tokens": ids[b, :len(s)].cpu(), "features": feats[b, :len(s)].half().cpu(),
             "final": out.last_hidden_state[b, :len(s)].half().cpu()} for b, s in enumerate(seqs)]


def _flatten(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    lens = torch.tensor([len(x["tokens"]) for x in items])
    return {"offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            **{k: torch.cat([x[k] for x in items]) for k in FEATURE_KEYS}}


def _unflatten(flat: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    off = flat["offsets"].tolist()
    return [{k: flat[k][a:b] for k in FEATURE_KEYS} for a, b in zip(off, off[1:])]


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices of sequences in batches of similar length, shortest first: a batch grows while its
    padded size (count x its longest) stays within `batch_tokens` (a longer sequence goes alone)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def teacher_pass(model_dir: Path, seqs: Sequence[Sequence[int]], aux_layer_ids: Sequence[int], out_dir: Path,
                 batch_tokens: int = 4096, device: str = "cpu") -> list[dict[str, Tensor]]:
    """Teacher-forced features of every sequence (`teacher_batch`), in the order given; batches of
    about `batch_tokens` padded tokens, sorted by length; one shard per batch in `out_dir`, so an
    interrupted run resumes where it stopped."""
    from transformers import LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    batches = length_batches([len(s) for s in seqs], batch_tokens)
    model, result = None, {}
    for bi, batch in enumerate(tqdm(batches, desc="teacher features", unit="batch")):
        shard = out_dir / f"shard-{bi:04d}.safetensors"
        if shard.is_file():
            items = _unflatten(load_file(str(shard)))
        else:
            if model is None:
                model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
            items = teacher_batch(model, [seqs[i] for i in batch], aux_layer_ids)
            atomic_write_bytes(shard, save(_flatten(items)))
        result.update(zip(batch, items))
    return [result[i] for i in range(len(seqs))]


# ----------------------------------------------------------------------------------------------
# 2. the training-time test


def _attention_parts(drafter: Eagle3Drafter, emb: Tensor, hidden: Tensor, positions: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(residual, q [B, h, T, hd], k, v [B, h, T, hd]; k/v repeated to the query heads) of the
    draft layer's rows at `positions` [T] (RoPE applied), as `Eagle3Attention` computes them."""
    layer, att = drafter.layer, drafter.layer.attention
    h, kvh, hd = att.n_heads, att.n_kv_heads, att.head_dim
    B, T, _ = hidden.shape
    normed = layer.hidden_norm(hidden)
    residual = normed if layer.norm_before_residual else hidden
    x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
    qkv = att.wqkv(x).view(B, T, h + 2 * kvh, hd)
    cos, sin = drafter._rope(positions)
    qk = apply_rope(qkv[:, :, :h + kvh], cos, sin).to(x.dtype)
    q = qk[:, :, :h].transpose(1, 2)
    k = qk[:, :, h:].transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    v = qkv[:, :, h + kvh:].transpose(1, 2).repeat_interleave(h // kvh, dim=1)
    return residual, q, k, v


def _finish(drafter: Eagle3Drafter, residual: Tensor, att_out: Tensor) -> Tensor:
    """The layer's output g after attention (`Eagle3Layer.forward` from the attention on)."""
    layer = drafter.layer
    B, h, T, hd = att_out.shape
    x = residual + layer.attention.wo(att_out.transpose(1, 2).reshape(B, T, h * hd))
    return x + layer.feed_forward(layer.post_attention_layernorm(x))


def ttt_forward(drafter: Eagle3Drafter, features: Tensor, tokens: Tensor, lengths: Tensor, steps: int
                ) -> list[tuple[Tensor, Tensor]]:
    """The K = `steps` unrolled steps on a right-padded batch: features [B, T, k*dim], tokens
    [B, T] (x_0..x_{T-1}), lengths [B]. Returns per step j (draft states g_j [B, T, dim], valid
    [B, T] bool): row t of step j predicts x_{t+j+2}, valid where t + j + 1 < length."""
    B, T, _ = features.shape
    dev = features.device
    nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(B, 1)], dim=1)          # x_{t+1}
    idx = torch.arange(T, device=dev)
    causal = idx[None, :] <= idx[:, None]                                      # [T, T] key <= query
    scale = 1.0 / math.sqrt(drafter.layer.attention.head_dim)
    hidden = drafter.fc(features)
    residual, q, k0, v0 = _attention_parts(drafter, drafter.embed(nxt.flatten()).view(B, T, -1), hidden, idx)
    att = F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    g = _finish(drafter, residual, att)
    out = [(g, idx[None, :] + 1 < lengths[:, None])]
    diag_k: list[Tensor] = []
    diag_v: list[Tensor] = []
    for j in range(1, steps):
        tok = torch.cat([tokens[:, j + 1:], tokens.new_zeros(B, j + 1)], dim=1)  # x_{t+j+1}
        residual, q, k, v = _attention_parts(drafter, drafter.embed(tok.flatten()).view(B, T, -1), g, idx + j)
        diag_k.append(k)
        diag_v.append(v)
        s0 = (q @ k0.transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~causal, float("-inf"))
        sd = torch.stack([(q * kk).sum(-1) for kk in diag_k], dim=-1) * scale   # [B, h, T, j]
        p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
        att = p[..., :T] @ v0 + sum(p[..., T + i, None] * vv for i, vv in enumerate(diag_v))
        g = _finish(drafter, residual, att)
        out.append((g, idx[None, :] + j + 1 < lengths[:, None]))
    return out


def ttt_loss(drafter: Eagle3Drafter, batch: dict[str, Tensor], teacher_rows: Tensor, steps: int, decay: float,
             topk: int = 32, negatives: int | None = 1024, generator: torch.Generator | None = None
             ) -> tuple[Tensor, list[float], list[float]]:
    """(loss, per-step KL, per-step top-1 agreement with the teacher) of a padded batch.
    `teacher_rows` [V_d, dim]: the target's output rows of the draft ids (the teacher's logits over
    the draft vocabulary are final @ teacher_rows^T, computed once per batch: step j reads them
    shifted by j). The teacher is its top-`topk` over the draft vocabulary, renormalised; with
    `negatives` the drafter's softmax runs over the batch's candidates only (every teacher top-k
    id plus that many uniform draws; the output product over all V_d ids dominates a step), None:
    over the whole draft vocabulary."""
    B, T = batch["tokens"].shape
    dev = batch["tokens"].device
    with torch.no_grad():
        top = (batch["final"].reshape(B * T, -1) @ teacher_rows.t()).topk(topk, dim=-1)
        t_prob = torch.softmax(top.values, dim=-1).view(B, T, topk)
        t_ids = top.indices.view(B, T, topk)
        if negatives is None:
            cand = torch.arange(teacher_rows.shape[0], device=dev)
        else:
            draws = torch.randint(0, teacher_rows.shape[0], (negatives,), generator=generator).to(dev)
            cand = torch.cat([t_ids[..., :topk].flatten(), draws]).unique()
        where = torch.full((teacher_rows.shape[0],), -1, dtype=torch.long, device=dev)
        where[cand] = torch.arange(len(cand), device=dev)
        t_pos = where[t_ids]                                                    # [B, T, k] candidate index
    weight = drafter.lm_head.weight[cand]
    total = torch.zeros((), device=dev)
    kls, agree = [], []
    weight_sum = 0.0
    for j, (g, valid) in enumerate(ttt_forward(drafter, batch["features"], batch["tokens"], batch["lengths"], steps)):
        tgt = (torch.arange(T, device=dev) + j + 1).clamp(max=T - 1)            # the teacher's position
        rows = valid.flatten()
        p = t_prob[:, tgt].reshape(B * T, topk)[rows]
        pos = t_pos[:, tgt].reshape(B * T, topk)[rows]
        s_logp = torch.log_softmax((drafter.norm(g.reshape(B * T, -1)[rows]) @ weight.t()).float(), dim=-1)
        kl = (p * (torch.log(p.clamp_min(1e-30)) - s_logp.gather(1, pos))).sum(-1).mean()
        w = decay ** j
        total = total + w * kl
        weight_sum += w
        kls.append(float(kl.detach()))
        agree.append(float((s_logp.argmax(-1) == pos[:, 0]).float().mean()))
    return total / weight_sum, kls, agree


def pad_batch(items: Sequence[dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
    """Right-padded float32 tensors of a few sequences' teacher data."""
    T = max(len(x["tokens"]) for x in items)
    B = len(items)
    f = items[0]["features"].shape[1]
    d = items[0]["final"].shape[1]
    out = {"tokens": torch.zeros(B, T, dtype=torch.long), "features": torch.zeros(B, T, f),
           "final": torch.zeros(B, T, d), "lengths": torch.tensor([len(x["tokens"]) for x in items])}
    for b, x in enumerate(items):
        n = len(x["tokens"])
        out["tokens"][b, :n] = x["tokens"]
        out["features"][b, :n] = x["features"].float()
        out["final"][b, :n] = x["final"].float()
    return {k: v.to(device) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# 3. the loop, with a held-out curve


def chain_tokens_per_step(drafter: Eagle3Drafter, items: Sequence[dict[str, Tensor]], depth: int) -> dict[str, Any]:
    """Held-out figures of a drafter on teacher-forced sequences, by rank paths along the true
    continuation (`Eagle3Drafter.rank_paths`): tokens per step of a greedy chain of `depth` (one
    plus the accepted run of rank-0 drafts) and the top-1 rate per depth."""
    acc, top1, n = [], np.zeros(depth), np.zeros(depth)
    with torch.no_grad():
        for x in items:
            if len(x["tokens"]) < 3:
                continue
            ranks, _ = drafter.rank_paths(x["features"][:-1].float(), x["tokens"][1:], depth=depth)
            hit = ranks == 0
            run = torch.cumprod(hit.long(), dim=1).sum(1)
            acc.append(run.float())
            known = ranks >= 0
            top1 += (hit & known).sum(0).numpy()
            n += known.sum(0).numpy()
    runs = torch.cat(acc)
    return {"tokens_per_step": round(1 + float(runs.mean()), 4),
            "top1": [round(float(a / max(b, 1)), 4) for a, b in zip(top1, n)]}


def train_drafter(drafter: Eagle3Drafter, train: list[dict[str, Tensor]], holdout: list[dict[str, Tensor]], *,
                  steps: int, decay: float, epochs: float, batch_tokens: int, lr: float, warmup_frac: float,
                  grad_clip: float, seed: int, eval_every: int, eval_depth: int, dtype: str = "float32",
                  progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """AdamW on the drafter's own parameters (lm_head frozen when shared), linear warm-up then
    cosine decay, batches of about `batch_tokens` padded tokens of similar length, `epochs` passes;
    `dtype` bfloat16 / float16 autocasts the products (parameters and optimiser state stay float32).
    Returns the loss history and the held-out curve (tokens/step of a depth-`eval_depth` chain
    against the training tokens seen)."""
    dev = drafter.device
    gen = torch.Generator().manual_seed(seed)
    batches = length_batches([len(x["tokens"]) for x in train], batch_tokens)
    n_steps = max(1, round(epochs * len(batches)))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, int(warmup_frac * n_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, n_steps - warm))))
    teacher_rows = drafter.lm_head.weight.detach()
    history, curve = [], []
    seen, t0 = 0, time.time()

    def evaluate(step: int) -> None:
        drafter.eval()
        point = {"step": step, "train_tokens": seen, "seconds": round(time.time() - t0, 1),
                 **chain_tokens_per_step(drafter, holdout, eval_depth)}
        curve.append(point)
        drafter.train()
        log.info("[eagle3] step %d, %d tokens: held-out chain%d %.3f tokens/step, top-1 %s", step, seen, eval_depth,
                 point["tokens_per_step"], point["top1"])
        if progress:
            progress(point)

    drafter.train()
    evaluate(0)
    perm: list[int] = []
    bar = tqdm(range(n_steps), desc="train eagle3", unit="step")
    for step in bar:
        if not perm:
            perm = torch.randperm(len(batches), generator=gen).tolist()
        items = [train[i] for i in batches[perm.pop()]]
        batch = pad_batch(items, dev)
        with torch.autocast(dev.type, dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            loss, kls, agree = ttt_loss(drafter, batch, teacher_rows, steps, decay, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        sched.step()
        seen += int(batch["lengths"].sum())
        history.append({"step": step + 1, "loss": round(loss.item(), 5), "kl": [round(k, 4) for k in kls],
                        "top1_agree": [round(a, 4) for a in agree]})
        bar.set_postfix(loss=f"{loss.item():.3f}", agree0=f"{agree[0]:.2f}")
        if (step + 1) % eval_every == 0 or step + 1 == n_steps:
            evaluate(step + 1)
    drafter.eval()
    return {"history": history, "curve": curve, "steps": n_steps, "train_tokens": seen,
            "seconds": round(time.time() - t0, 1)}


def write_curve(curve: list[dict[str, Any]], out: Path, title: str) -> None:
    """The held-out chain tokens/step against training tokens, as JSON and a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    atomic_write_bytes(out.with_suffix(".json"), (json.dumps(curve, indent=1) + "\n").encode())
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p["train_tokens"] / 1e3 for p in curve], [p["tokens_per_step"] for p in curve], marker="o")
    ax.set_xlabel("training tokens seen (thousands)")
    ax.set_ylabel("held-out tokens/step (greedy chain)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"))


# ----------------------------------------------------------------------------------------------
# 4. the heads stage's build


def reference_sequences(data_dir: Path, model_dir: Path, tasks: Sequence[str], count: int, exclude: set[str],
                        max_prompt_tokens: int, max_reply_tokens: int, seed: int) -> tuple[list[str], list[list[int]]]:
    """(row ids, token ids) of up to `count` train-pool rows of `tasks`, round-robin over the tasks
    after a seeded shuffle: the prompt's ids, then its reference reply (at most `max_reply_tokens`)
    and the model's end-of-sequence token. Rows in `exclude` (the mix's holdout) are left out."""
    import random

    from pipeline.prepare import load_chat_tokenizer, read_split

    if count <= 0:
        return [], []
    tok = load_chat_tokenizer(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos_id = eos[0] if isinstance(eos, list) else eos
    rng = random.Random(seed)
    queues = []
    for t in sorted(tasks):
        rows = [r for r in read_split(data_dir, t, "train") if r.get("reference") and r["id"] not in exclude
                and 0 < len(r["input_ids"]) <= max_prompt_tokens]
        rng.shuffle(rows)
        queues.append(rows)
    ids, seqs = [], []
    while len(seqs) < count and any(queues):
        for q in queues:
            if q and len(seqs) < count:
                r = q.pop()
                reply = tok.encode(r["reference"], add_special_tokens=False)[:max_reply_tokens]
                ids.append(r["id"])
                seqs.append(list(r["input_ids"]) + list(reply) + ([eos_id] if eos_id is not None else []))
    return ids, seqs


def train_eagle3(heads_cfg: dict[str, Any], model_dir: Path, data_dir: Path, artifacts_dir: Path,
                 force: bool = False, model_name: str | None = None, device: str = "cpu") -> Path:
    """Train the EAGLE-3 drafter of config group `heads_cfg` (kind eagle3, no `dir`) for the model in
    `model_dir` and return its folder `artifacts/heads/<model>/<name>/` (config.json +
    drafter.safetensors + report.json + manifest); skipped when up to date (e.g. shipped in git).
    Its draft vocabulary is the `heads.draft_vocab.size` ids the model emits most often (the
    frequency ranking the Hydra draft vocabulary uses), its lm_head the target's rows of them."""
    from pipeline.artifacts import atomic_write_json, hash_obj, machine_info, run_stage
    from pipeline.heads.draft_vocab import FrequencySettings, read_frequencies, token_frequencies
    from pipeline.heads.recipe import train_key, training_rows
    from pipeline.model.provision import model_fingerprint
    from pipeline.paths import Layout
    from pipeline.config.schema import TrainSettings
    from runtime.config import ModelArgs
    from runtime.eagle3 import Eagle3Config

    model_dir, data_dir = Path(model_dir), Path(data_dir)
    lay = Layout.for_model(artifacts_dir, model_name or model_dir.name, data_dir)
    name = str(heads_cfg.get("name") or "eagle3")
    s = TrainSettings.from_dict(heads_cfg.get("train"))
    dv = dict(heads_cfg.get("draft_vocab") or {})
    fingerprint = model_fingerprint(model_dir)
    args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    size = int(dv.get("size") or args.vocab_size)
    config = Eagle3Config.for_model(args, draft_vocab_size=size, output="shared")
    data_hash, rows = training_rows(data_dir, model_dir, s, lay.heads_cache)
    freq = FrequencySettings(tasks=list(s.tasks), prompts_per_task=int(dv.get("prompts_per_task", 24)),
                             max_new_tokens=int(dv.get("max_new_tokens", 64)))
    freq_dir = token_frequencies(model_dir, data_dir, lay.frequencies_root, freq, memo_dir=lay.heads_cache,
                                 log=log.info) if size < args.vocab_size else None
    key = {"version": 1, "kind": "eagle3", "drafter": config.to_dict(), "train": train_key(s), "data": data_hash,
           "model": fingerprint, "vocab": None if freq_dir is None else freq_dir.name}

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.heads.distill import build_selfdistill
        from runtime.eagle3 import save_drafter
        from runtime.model.checkpoint import load_model

        train_rows, hold_rows = rows()
        t0, c0 = time.time(), time.process_time()
        threads = torch.get_num_threads()
        sd_dir = lay.heads_cache / f"selfdistill-{hash_obj([s.data_dict(), data_hash, fingerprint])}"
        hold_sd = build_selfdistill(model_dir, hold_rows, s, sd_dir / "holdout", device=device)
        train_sd = build_selfdistill(model_dir, train_rows, s, sd_dir / "train", device=device)
        own = [list(r["input_ids"]) + x["tokens"].tolist() for r, x in zip(train_rows, train_sd)]
        held = [list(r["input_ids"]) + x["tokens"].tolist() for r, x in zip(hold_rows, hold_sd)]
        ref_ids, refs = reference_sequences(data_dir, model_dir, s.tasks, s.reference_prompts,
                                            {r["id"] for r in hold_rows}, s.max_prompt_tokens, s.max_new_tokens * 2,
                                            s.seed)
        t_gen = time.time() - t0
        tf_dir = lay.heads_cache / f"eagle3-teacher-{hash_obj([key['data'], fingerprint, list(config.aux_layer_ids)])}"
        hold = teacher_pass(model_dir, held, config.aux_layer_ids, tf_dir / "holdout", device=device)
        train = teacher_pass(model_dir, own, config.aux_layer_ids, tf_dir / "selfdistill", device=device)
        if refs:
            train += teacher_pass(model_dir, refs, config.aux_layer_ids,
                                  tf_dir / f"references-{hash_obj(ref_ids)[:12]}", device=device)
        t_data = time.time() - t0
        model = load_model(model_dir, dtype=torch.float32, max_seq_len=min(args.max_position_embeddings, 2048),
                           device=device)
        torch.set_num_threads(threads)
        torch.manual_seed(s.seed)
        drafter = Eagle3Drafter(config).to(model.device)
        drafter.bind(model)
        if freq_dir is not None:
            ranking = read_frequencies(freq_dir, args.vocab_size)["ranking"][:size]
            drafter.set_draft_vocab(torch.from_numpy(np.sort(ranking)))
        with torch.no_grad():  # start from the target's final norm: g then reads as a target final state
            drafter.norm.weight.copy_(model.norm.weight)
        fit = train_drafter(drafter, train, hold, steps=s.ttt_steps, decay=s.ttt_decay, epochs=s.epochs,
                            batch_tokens=s.batch_tokens, lr=s.lr, warmup_frac=s.warmup_frac, grad_clip=s.grad_clip,
                            seed=s.seed, eval_every=s.eval_every, eval_depth=max(s.ttt_steps, 4), dtype=s.dtype)
        sources = [r["id"].split("/")[0] for r in hold_rows]
        depth = max(s.ttt_steps, 4)
        report = {
            "name": name, "kind": "eagle3", "output": config.output, "draft_vocab_size": size,
            "aux_layer_ids": list(config.aux_layer_ids), "ttt_steps": s.ttt_steps, "train_dtype": s.dtype,
            "holdout": chain_tokens_per_step(drafter, hold, depth),
            "by_source": {src: chain_tokens_per_step(drafter, [h for h, r in zip(hold, sources) if r == src], depth)
                          for src in sorted(set(sources))},
            "chain_depth": depth, "curve": fit["curve"],
            "train_sequences": {"selfdistill": len(own), "references": len(refs)},
            "train_positions": int(sum(len(x["tokens"]) for x in train)), "train_tokens_seen": fit["train_tokens"],
            "steps": fit["steps"], "loss_first": fit["history"][0]["loss"], "loss_last": fit["history"][-1]["loss"],
            "wall_s": {"generate": round(t_gen, 1), "teacher": round(t_data - t_gen, 1), "train": fit["seconds"],
                       "total": round(time.time() - t0, 1)},
            "cpu_s": round(time.process_time() - c0, 1),
            "machine": machine_info(), "base_fingerprint": fingerprint, "device": str(model.device),
        }
        save_drafter(drafter, tmp, dtype=getattr(torch, s.save_dtype))
        atomic_write_json(tmp / "report.json", report)
        reports = lay.heads_training_reports
        reports.mkdir(parents=True, exist_ok=True)
        write_curve(fit["curve"], reports / f"{name}_curve", f"EAGLE-3 drafter ({lay.model_name}): held-out chain{depth}")
        atomic_write_json(lay.heads_cache / f"{name}-loss-{hash_obj(key)[:12]}.json", fit["history"])
        log.info("[eagle3] held-out chain%d: %.3f tokens/step; top-1 by depth %s; %d positions, %.0f s",
                 depth, report["holdout"]["tokens_per_step"], report["holdout"]["top1"], report["train_positions"],
                 report["wall_s"]["total"])
        return {"tokens_per_step": report["holdout"]["tokens_per_step"], "top1": report["holdout"]["top1"],
                "bytes": sum(f.stat().st_size for f in tmp.iterdir()), "base_fingerprint": fingerprint}

    return run_stage("heads", lay.heads_dir(name), key, build, force=force)
