"""Heads stage: distil Hydra / Hydra++ / Medusa draft heads from the frozen base model.

What the heads are judged on is greedy acceptance along the base model's *own* continuations, so
they are trained on self-distillation text:

1. Self-distillation data (shared by every head kind, cached under
   `artifacts/cache/heads/<model>/selfdistill-<hash>/`, one shard file per generation batch so an
   interrupted run resumes): the training prompts (the `train` splits of every task, disjoint from
   every calib/eval split by construction of the prepare stage, plus HumanEval-style prompts cut
   from the Python functions in ShareGPT's train replies: HumanEval leaves only 24 train prompts,
   and code is where the heads were weakest) are continued greedily by the base model, batched
   with left padding, prompts sorted by length (a decode step costs ~12 ms a row at 32 rows, ~18 at
   16, ~29 at 8 on the 2-core CPU: transformers' KV-cache copies grow with the batch too).
   The same pass records each position's final-normed hidden state (float16) and the base
   distribution at every continuation step as its top-k ids and renormalised probabilities.
2. Training: head d at step i (the position whose base argmax is y_{i+1}) reads the context
   vector there (Hydra: plus the true tokens y_{i+1..i+d}) and is trained with cross-entropy
   against the base distribution of y_{i+1+d} (Hydra++'s distillation loss), by default a softmax
   over the step's candidate ids (all teacher top-k ids of the batch + uniform negatives) rather
   than the full vocabulary: the 49k-way output was ~85% of a step's cost, and the held-out
   accuracy is the same (numbers at `TrainSettings.loss`). AdamW, linear warm-up
   then cosine decay, dropout as in Hydra. Checkpoints (safetensors: weights, optimiser moments,
   RNG state; JSON metadata inside) are written atomically every `checkpoint_every` steps, and a
   restarted run continues from the last one with the same result as an uninterrupted run.
3. Report: each head's top-1 / top-5 accuracy against the base greedy token on held-out
   continuations, and the tokens per step that a chain tree and Medusa's mc_sim_7b_63 tree would
   reach there (replayed from rank paths).

Output `artifacts/heads/<model>/<name>/`: config.json (with `base_fingerprint`),
heads.safetensors, report.json and the stage manifest. Shipped in git when small enough.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, atomic_write_json, hash_obj, machine_info, run_stage
from pipeline.model import model_fingerprint
from runtime.heads import DraftHeads, HeadsConfig, save_heads
from runtime.model import load_model

TRAIN_VERSION = 1
DEFAULT_TASKS = ("humaneval", "gsm8k", "sharegpt")
LOSSES = ("sampled", "full")
FUNCTIONS = "functions"  # the source name of the cut-out function prompts
_HEAD_KEYS = {f.name for f in dataclasses.fields(HeadsConfig)} - {"hidden_size", "vocab_size", "base_fingerprint", "base_args"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainSettings:
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    max_prompts: int = 240            # training prompts in all (round-robin over the sources, seeded)
    # One more round-robin source: HumanEval-style prompts (imports + signature + docstring, in the
    # `functions_template` task's template) cut from the Python functions in the recorded replies of
    # the `functions_from` task's train pool. HumanEval's own train pool holds only 24 prompts.
    functions_from: str | None = None
    functions_template: str = "humaneval"
    holdout_prompts: int = 24         # of them, kept out of training for the accuracy report
    max_prompt_tokens: int = 512      # longer prompts are left out (their prefill dominates the cost)
    max_new_tokens: int = 128         # length of each self-distilled continuation
    gen_batch: int = 32               # sequences generated together
    teacher_topk: int = 32            # base distribution kept as its top-k, renormalised
    # "sampled": softmax over the step's candidates (every teacher top-k id of the batch, ~5k, plus
    # `negatives` uniform draws) instead of "full" (all 49,152 logits of every head and position).
    # Measured on the default model, 4 sequences a step, 30 steps each on the same data: 0.62 vs
    # 3.94 s/step, held-out mc_sim_7b_63 tokens/step 1.775 vs 1.762 (HumanEval calib 1.723 vs 1.724)
    loss: str = "sampled"
    negatives: int = 1024
    epochs: float = 3.0               # passes over the training continuations ...
    max_steps: int | None = None      # ... or an explicit number of optimiser steps
    batch_sequences: int = 2          # continuations per optimiser step (~2 x 127 positions)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    checkpoint_every: int = 25
    seed: int = 0
    save_dtype: str = "bfloat16"      # shipped weights (halves the folder; training runs in float32)

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_prompt_tokens", "max_new_tokens", "gen_batch", "teacher_topk",
                     "batch_sequences", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"heads.train.{name} must be a positive int, got {v!r}")
        if not 0 <= self.holdout_prompts < self.max_prompts:
            raise ValueError(f"heads.train.holdout_prompts must be in [0, max_prompts={self.max_prompts}), "
                             f"got {self.holdout_prompts}")
        if self.max_steps is None and not self.epochs > 0:
            raise ValueError(f"heads.train.epochs must be > 0 (or set max_steps), got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"heads.train.max_steps must be >= 1 or null, got {self.max_steps}")
        if self.loss not in LOSSES:
            raise ValueError(f"heads.train.loss must be one of {LOSSES}, got {self.loss!r}")
        if isinstance(self.negatives, bool) or not isinstance(self.negatives, int) or self.negatives < 0:
            raise ValueError(f"heads.train.negatives must be an int >= 0, got {self.negatives!r}")
        if self.save_dtype not in _DTYPES:
            raise ValueError(f"heads.train.save_dtype must be one of {sorted(_DTYPES)}, got {self.save_dtype!r}")
        if not self.lr > 0 or not 0 <= self.warmup_frac < 1:
            raise ValueError(f"heads.train needs lr > 0 and warmup_frac in [0, 1); got lr={self.lr}, "
                             f"warmup_frac={self.warmup_frac}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> TrainSettings:
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown heads.train keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def data_dict(self) -> dict[str, Any]:
        """The settings the self-distillation data depends on (its cache key)."""
        keys = ("tasks", "max_prompts", "holdout_prompts", "max_prompt_tokens", "max_new_tokens", "teacher_topk", "seed")
        return {k: getattr(self, k) for k in keys}


def heads_dir(artifacts_dir: str | Path, model_name: str, heads_name: str) -> Path:
    """Where trained heads live: artifacts/heads/<model>/<heads name>/."""
    return Path(artifacts_dir) / "heads" / model_name / heads_name


def heads_config_for(heads_cfg: dict[str, Any], model_args: Any, fingerprint: str | None) -> HeadsConfig:
    """The HeadsConfig of a `heads` config group (its name/dir/train entries are not head shapes)."""
    shape = {k: v for k, v in heads_cfg.items() if k not in ("name", "dir", "train")}
    unknown = sorted(set(shape) - _HEAD_KEYS)
    if unknown:
        raise ValueError(f"unknown heads config keys {unknown}; known: {sorted(_HEAD_KEYS | {'name', 'dir', 'train'})}")
    return HeadsConfig.for_model(model_args, base_fingerprint=fingerprint, **shape)


# ----------------------------------------------------------------------------------------------
# 1. self-distillation data


def select_prompts(rows_by_task: dict[str, list[dict]], s: TrainSettings) -> tuple[list[dict], list[dict]]:
    """(train, holdout) rows: round-robin over the sources after a seeded shuffle, prompts that fit
    only; the holdout takes every source's share of `holdout_prompts`, spread over its picks."""
    rng = random.Random(s.seed)
    queues = []
    for task in sorted(rows_by_task):
        rows = [r for r in rows_by_task[task] if 0 < len(r["input_ids"]) <= s.max_prompt_tokens]
        rng.shuffle(rows)
        queues.append(rows)
    picked: list[list[dict]] = [[] for _ in queues]
    n = 0
    while n < s.max_prompts and any(queues):
        for q, out in zip(queues, picked):
            if q and n < s.max_prompts:
                out.append(q.pop())
                n += 1
    if n <= s.holdout_prompts:
        raise ValueError(f"only {n} training prompts of <= {s.max_prompt_tokens} tokens were found; "
                         f"need more than holdout_prompts={s.holdout_prompts} (prepare the tasks' train splits)")
    # largest-remainder shares, so the report sees every source in proportion
    quota = [s.holdout_prompts * len(out) / n for out in picked]
    share = [int(x) for x in quota]
    for i in sorted(range(len(quota)), key=lambda i: share[i] - quota[i])[:s.holdout_prompts - sum(share)]:
        share[i] += 1
    train, hold = [], []
    for out, k in zip(picked, share):
        held = {int(j * len(out) / k) for j in range(k)} if k else set()
        hold += [r for j, r in enumerate(out) if j in held]
        train += [r for j, r in enumerate(out) if j not in held]
    return train, hold


_CODE_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
_DEF_NAME = re.compile(r"\bdef\s+(\w+)\s*\(")


def function_texts(reply: str, max_chars: int = 2000) -> list[tuple[str, str]]:
    """(name, prompt text) of every top-level Python function in the fenced code blocks of `reply`:
    the block's imports, then the function's decorators, signature and docstring, as a HumanEval
    prompt reads. Blocks that do not parse as Python are skipped."""
    out = []
    for block in _CODE_FENCE.findall(reply):
        try:
            tree = ast.parse(block)
        except (SyntaxError, ValueError):
            continue
        lines = block.splitlines()
        imports = [ast.get_source_segment(block, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        head = "\n".join(i for i in imports if i) + "\n\n\n" if imports else ""
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            first = node.body[0]
            # keep the docstring (the task's specification); cut before the first real statement
            end = first.end_lineno if ast.get_docstring(node) is not None else first.lineno - 1
            if end < node.lineno or (ast.get_docstring(node) is not None and len(node.body) < 2):
                continue  # a one-line def, or nothing left to complete after the docstring
            text = head + "\n".join(lines[start - 1:end]) + "\n"
            if len(text) <= max_chars:
                out.append((node.name, text))
    return out


def function_prompts(rows: list[dict[str, Any]], tokenizer: Any, template: str, system: str | None,
                     max_prompt_tokens: int, held_prompts: list[str]) -> list[dict[str, Any]]:
    """Rendered HumanEval-style prompts cut from the functions in `rows`' recorded replies.

    `held_prompts` are the calib/eval prompts of every task: a function whose name any of them
    defines, or whose rendered prompt equals one, is left out, so the mix cannot train on an
    evaluated problem. Duplicate functions (equal up to whitespace and case) are kept once."""
    from pipeline.prepare import render_prompt

    names = {n for p in held_prompts for n in _DEF_NAME.findall(p)}
    held = set(held_prompts)
    out, seen = [], set()
    for row in sorted(rows, key=lambda r: r["id"]):
        for name, text in function_texts(row.get("reference") or ""):
            key = " ".join(text.split()).casefold()
            if name in names or key in seen:
                continue
            seen.add(key)
            rendered = render_prompt(tokenizer, text, template, system, max_prompt_tokens, "skip")
            if rendered is not None and rendered[0] not in held:
                out.append({"id": f"{FUNCTIONS}/{row['id']}/{name}", "prompt": rendered[0], "input_ids": rendered[1]})
    return out


@torch.inference_mode()
def generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], topk: int
                   ) -> list[dict[str, torch.Tensor]]:
    """Greedy continuations of a left-padded batch with a transformers Llama model.

    Per sequence: tokens y [T] (EOS included), hidden [P+T-1, dim] float16 (final-normed states of
    the prompt and y_1..y_{T-1}: the positions whose next token is known), and the base
    distribution at each of the T steps as topk_ids [T, k] int32 / topk_p [T, k] float16."""
    from transformers import DynamicCache

    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
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
        nxt = probs.argmax(-1)
        for b in range(B):
            if not done[b]:
                ys[b].append(int(nxt[b]))
                tk_ids[b].append(top.indices[b].int())
                tk_p[b].append((top.values[b] / top.values[b].sum()).half())
                done[b] = int(nxt[b]) in eos_ids
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        out = model.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                          use_cache=True, **cache).last_hidden_state
        last = out[:, 0]
        next_pos = next_pos + 1
        for b in range(B):
            if not done[b]:  # the state of y_t's position, context of the next step
                hidden[b].append(last[b:b + 1].half())
    return [{"tokens": torch.tensor(ys[b], dtype=torch.long), "hidden": torch.cat(hidden[b]),
             "topk_ids": torch.stack(tk_ids[b]), "topk_p": torch.stack(tk_p[b]),
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


def build_selfdistill(model_dir: Path, rows: list[dict], s: TrainSettings, out_dir: Path,
                      log: Callable[[str], None] = print) -> list[dict[str, torch.Tensor]]:
    """Generate (or resume / reuse) the self-distillation data of `rows`; one shard per batch."""
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
                model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
                cfg_eos = model.config.eos_token_id
                eos = set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]) - {None}
            seqs = generate_batch(model, [rows[i]["input_ids"] for i in batch], s.max_new_tokens, eos, s.teacher_topk)
            atomic_write_bytes(shard, save(_flatten(seqs), metadata={"rows": json.dumps([rows[i]["id"] for i in batch])}))
        for i, seq in zip(batch, seqs):
            by_row[i] = seq
    if model is not None:
        log(f"[heads] self-distillation: {len(rows)} prompts in {time.time() - t0:.0f} s")
    return [by_row[i] for i in range(len(rows))]


# ----------------------------------------------------------------------------------------------
# 2. training


def sequence_batch(heads: DraftHeads, seqs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Training rows of continuation steps: context vectors h [M, dim], true tokens [M, D], and for
    each head the teacher's top-k of its target [M, D, k] with a validity mask [M, D]."""
    D = heads.config.num_heads
    hs, toks, ids, ps, valid = [], [], [], [], []
    for s in seqs:
        P, y = int(s["prompt_len"]), s["tokens"]
        T = len(y)
        ctx = heads.context(s["hidden"].float())[P - 1:P - 1 + T]           # [T, dim], step i at row i
        step = torch.arange(T)[:, None]
        ahead = step + torch.arange(D)[None, :]                             # y_{i+1+j}: index i+j
        toks.append(torch.where(ahead < T, y[ahead.clamp(max=T - 1)], 0))
        target_step = step + torch.arange(1, D + 1)[None, :]                # head d learns step i+d's distribution
        ok = target_step < T
        tgt = target_step.clamp(max=T - 1)
        ids.append(s["topk_ids"][tgt].long())
        ps.append(s["topk_p"][tgt].float() * ok[..., None])
        valid.append(ok)
        hs.append(ctx)
    return {"h": torch.cat(hs), "tokens": torch.cat(toks), "ids": torch.cat(ids), "p": torch.cat(ps),
            "valid": torch.cat(valid)}


def distill_loss(heads: DraftHeads, batch: dict[str, torch.Tensor], negatives: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over heads of each head's mean cross-entropy against the teacher, per-head losses [D]
    detached). `negatives=None`: softmax over the whole output vocabulary; an int n: over the
    batch's candidates only (every teacher top-k id plus n uniform draws from the global RNG)."""
    states = heads.head_states(batch["h"], batch["tokens"])                 # [M, D, dim]
    ids, p = batch["ids"], batch["p"]
    v_out = heads.config.draft_vocab_size or heads.config.vocab_size
    if heads.draft_ids is not None:  # targets outside the draft vocabulary carry no learnable mass
        inv = torch.full((heads.config.vocab_size,), -1, dtype=torch.long)
        inv[heads.draft_ids] = torch.arange(len(heads.draft_ids))
        ids = inv[ids]
        p = torch.where(ids >= 0, p, 0.0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        ids = ids.clamp(min=0)
    if negatives is None:
        logits = heads.output_logits(states).float()                        # [M, D, V_out]
    else:
        cand = torch.unique(torch.cat([ids.flatten(), torch.randint(0, v_out, (negatives,))]))
        slot = torch.full((v_out,), -1, dtype=torch.long)
        slot[cand] = torch.arange(len(cand))
        logits = heads.candidate_logits(states, cand).float()               # [M, D, C]
        ids = slot[ids]
    ce = torch.logsumexp(logits, dim=-1) - (p * logits.gather(-1, ids)).sum(-1)   # [M, D]
    valid = batch["valid"].float()
    per_head = (ce * valid).sum(0) / valid.sum(0).clamp_min(1.0)
    return per_head.mean(), per_head.detach()


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


def _save_checkpoint(path: Path, heads: DraftHeads, opt: torch.optim.Optimizer, step: int, meta: dict[str, Any]) -> None:
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in heads.state_dict().items()}
    names = [n for n, _ in heads.named_parameters()]
    for i, name in enumerate(names):
        st = opt.state.get(opt.param_groups[0]["params"][i], {})
        for k, v in st.items():
            tensors[f"optim.{name}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().clone().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    info = {**meta, "step": step, "param_names": names}
    atomic_write_bytes(path, save(tensors, metadata={"checkpoint": json.dumps(info)}))


def _load_checkpoint(path: Path, heads: DraftHeads, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        info = json.loads(f.metadata()["checkpoint"])
    tensors = load_file(str(path))
    heads.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    params = dict(heads.named_parameters())
    if info["param_names"] != list(params):
        raise ValueError(f"checkpoint {path} was written for other parameters; delete it to start over")
    for name, p in params.items():
        st = {k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
              and k[len(f"optim.{name}."):].count(".") == 0}
        if st:
            opt.state[p] = st
    torch.set_rng_state(tensors["rng.torch"])
    return info


def train_loop(heads: DraftHeads, seqs: list[dict[str, torch.Tensor]], s: TrainSettings, work_dir: Path,
               run_key: str, stop_after: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train `heads` (bound, float32) on `seqs`; resumable from `work_dir/checkpoint.safetensors`.

    `stop_after` ends the call after that many steps of this run (a test's simulated interruption)."""
    total = total_steps_for(len(seqs), s)
    schedule = batch_schedule(len(seqs), total, s)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    ckpt = work_dir / "checkpoint.safetensors"
    start, history = 0, []
    torch.manual_seed(s.seed)
    if ckpt.is_file():
        info = _load_checkpoint(ckpt, heads, opt)
        if info.get("run_key") != run_key:
            raise ValueError(f"checkpoint {ckpt} belongs to another configuration; delete it to start over")
        start, history = int(info["step"]), list(info.get("history", []))
        log(f"[heads] resuming from step {start}/{total}")
    heads.train()
    t0 = time.time()
    bar = tqdm(range(start, total), desc=f"train {heads.config.kind}{'++' if heads.config.prefix_layer else ''}",
               unit="step", initial=start, total=total)
    done = 0
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, s)
        batch = sequence_batch(heads, [seqs[i] for i in schedule[step]])
        loss, per_head = distill_loss(heads, batch, s.negatives if s.loss == "sampled" else None)
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
            _save_checkpoint(ckpt, heads, opt, step + 1, {"run_key": run_key, "history": history, "total": total})
        if stop_after is not None and done >= stop_after and not last:
            break
    bar.close()
    heads.eval()
    return {"steps": total, "resumed_from": start, "seconds_this_run": round(time.time() - t0, 1),
            "loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
            "loss_history": history}


# ----------------------------------------------------------------------------------------------
# 3. report


@torch.no_grad()
def evaluate_heads(heads: DraftHeads, seqs: list[dict[str, torch.Tensor]], rank_cap: int = 10) -> dict[str, Any]:
    """Top-1 / top-5 accuracy of each head against the base greedy token, and replayed tokens per
    step of a few trees, on held-out continuations (rank-path convention, see DESIGN.md §4)."""
    from pipeline.replay import replay_tokens_per_step
    from runtime.tree import Tree

    heads.eval()
    D = heads.config.num_heads
    hits1, hits5, counts = np.zeros(D), np.zeros(D), np.zeros(D)
    rollouts = []
    for s in seqs:
        P, y = int(s["prompt_len"]), s["tokens"]
        T = len(y)
        if T < 2:
            continue
        ctx = heads.context(s["hidden"].float())[P - 1:P - 1 + T]
        step = torch.arange(T)[:, None]
        ahead = step + torch.arange(D + 1)[None, :]
        nxt = torch.where(ahead < T, y[ahead.clamp(max=T - 1)], -1)         # [T, D+1]: y_{i+1..i+1+D}
        logits = heads.teacher_forced_logits(ctx, nxt[:, :D].clamp(min=0))  # [T, D, V]
        target = nxt[:, 1:]
        tl = logits.gather(-1, target.clamp(min=0)[..., None])
        ranks = (logits > tl).sum(-1)
        ok = target >= 0
        hits1 += ((ranks == 0) & ok).sum(0).numpy()
        hits5 += ((ranks < 5) & ok).sum(0).numpy()
        counts += ok.sum(0).numpy()
        rp = torch.where(ok, ranks.clamp(max=rank_cap), rank_cap)
        rollouts.append({"rank_paths": rp.numpy().astype(np.int64)})
    report: dict[str, Any] = {
        "sequences": len(rollouts),
        "positions": int(counts[0]),
        "top1": [round(float(x), 4) for x in hits1 / np.maximum(counts, 1)],
        "top5": [round(float(x), 4) for x in hits5 / np.maximum(counts, 1)],
    }
    if rollouts:
        trees = {f"chain{d}": Tree.chain(d) for d in range(1, D + 1)}
        mc = Tree.named("mc_sim_7b_63")
        if mc.depth <= D:
            trees["mc_sim_7b_63"] = mc
        report["tokens_per_step"] = {name: round(float(replay_tokens_per_step(rollouts, t, rank_cap)), 4)
                                     for name, t in trees.items()}
    return report


def format_report(name: str, r: dict[str, Any]) -> str:
    lines = [f"heads {name}: held-out {r['sequences']} continuations, {r['positions']} positions"]
    for d, (a1, a5) in enumerate(zip(r["top1"], r["top5"]), start=1):
        lines.append(f"  head {d}: top-1 {a1:.3f}  top-5 {a5:.3f}")
    if "tokens_per_step" in r:
        lines.append("  tokens/step (replayed): " + ", ".join(f"{k} {v:.3f}" for k, v in r["tokens_per_step"].items()))
    for src, sr in r.get("by_source", {}).items():
        tps = sr.get("tokens_per_step", {})
        lines.append(f"  {src} ({sr['sequences']} continuations): top-1 " + " ".join(f"{a:.3f}" for a in sr["top1"])
                     + "".join(f", {k} {tps[k]:.3f}" for k in ("chain4", "mc_sim_7b_63") if k in tps))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the stage


def _read_train_rows(data_dir: Path, model_dir: Path, s: TrainSettings) -> dict[str, list[dict[str, Any]]]:
    """The training sources: each task's train pool, plus the cut-out function prompts if asked for."""
    from pipeline.prepare import load_chat_tokenizer, load_task_config, read_split

    rows = {t: read_split(data_dir, t, "train") for t in s.tasks}
    if s.functions_from:
        style = load_task_config(s.functions_template)
        tasks = sorted(set(s.tasks) | {s.functions_from, s.functions_template})
        held = [r["prompt"] for t in tasks for split in ("calib", "eval") for r in read_split(data_dir, t, split)]
        rows[FUNCTIONS] = function_prompts(read_split(data_dir, s.functions_from, "train"), load_chat_tokenizer(model_dir),
                                           style["template"], style.get("system"), s.max_prompt_tokens, held)
    return rows


def train_heads(heads_cfg: dict[str, Any], model_dir: Path, data_dir: Path, artifacts_dir: Path, force: bool = False,
                log: Callable[[str], None] = print) -> Path:
    """Train the heads of config group `heads_cfg` for the model in `model_dir` (skipped when an
    up-to-date folder exists, e.g. shipped in git) and return their folder."""
    model_dir, data_dir, artifacts_dir = Path(model_dir), Path(data_dir), Path(artifacts_dir)
    name = heads_cfg.get("name") or heads_cfg.get("kind", "hydra")
    s = TrainSettings.from_dict(heads_cfg.get("train"))
    fingerprint = model_fingerprint(model_dir)
    from runtime.model import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    config = heads_config_for(heads_cfg, args, fingerprint)  # validates before any long work
    rows_by_task = _read_train_rows(data_dir, model_dir, s)
    train_rows, hold_rows = select_prompts(rows_by_task, s)
    data_hash = hash_obj([[r["id"], r["input_ids"]] for r in train_rows + hold_rows])
    key = {"version": TRAIN_VERSION, "heads": config.to_dict(), "train": dataclasses.asdict(s), "data": data_hash,
           "model": fingerprint}
    out = heads_dir(artifacts_dir, model_dir.name, name)
    cache = artifacts_dir / "cache" / "heads" / model_dir.name

    def build(tmp: Path) -> dict[str, Any]:
        t0, c0 = time.time(), time.process_time()
        threads = torch.get_num_threads()  # load_model may reset it; keep the caller's choice
        sd_dir = cache / f"selfdistill-{hash_obj([s.data_dict(), data_hash, fingerprint])}"
        train_seqs = build_selfdistill(model_dir, train_rows, s, sd_dir / "train", log)
        hold_seqs = build_selfdistill(model_dir, hold_rows, s, sd_dir / "holdout", log)
        t_data, c_data = time.time() - t0, time.process_time() - c0
        model = load_model(model_dir, dtype=torch.float32, max_seq_len=min(args.max_position_embeddings, 2048))
        torch.set_num_threads(threads)
        torch.manual_seed(s.seed)
        heads = DraftHeads(config)
        heads.bind(model)
        heads.init_output_from_base()
        if config.output == "draft":
            heads.set_draft_vocab(draft_vocabulary(train_seqs, config.draft_vocab_size))
        work = cache / f"train-{name}-{hash_obj(key)}"
        work.mkdir(parents=True, exist_ok=True)
        fit = train_loop(heads, train_seqs, s, work, run_key=hash_obj(key), log=log)
        report = evaluate_heads(heads, hold_seqs)
        sources = [r["id"].split("/")[0] for r in hold_rows]
        report["by_source"] = {src: {k: v for k, v in evaluate_heads(
            heads, [q for q, r in zip(hold_seqs, sources) if r == src]).items() if k != "top5"}
            for src in sorted(set(sources))}
        report.update({
            "name": name, "kind": config.kind, "prefix_layer": config.prefix_layer, "output": config.output,
            "train_sequences": len(train_seqs), "train_positions": int(sum(len(x["tokens"]) for x in train_seqs)),
            "steps": fit["steps"], "loss_first": fit["loss_first"], "loss_last": fit["loss_last"],
            # wall time depends on what else the machine runs; CPU time (this process) is the
            # better figure to extrapolate from on a shared machine
            "wall_s": {"data": round(t_data, 1), "train_this_run": fit["seconds_this_run"],
                       "total_this_run": round(time.time() - t0, 1)},
            "cpu_s": {"data": round(c_data, 1), "total_this_run": round(time.process_time() - c0, 1)},
            "machine": machine_info(), "base_fingerprint": fingerprint,
        })
        save_heads(heads, tmp, dtype=_DTYPES[s.save_dtype])
        atomic_write_json(tmp / "report.json", report)
        atomic_write_json(work / "loss_history.json", fit["loss_history"])
        log(format_report(name, report))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        return {"top1": report["top1"], "top5": report["top5"], "tokens_per_step": report.get("tokens_per_step"),
                "bytes": size, "base_fingerprint": fingerprint}

    return run_stage("heads", out, key, build, force=force, log=log)


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


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.train_heads hydra medusa`: the heads stage without hydra-core."""
    import yaml  # hydra-core depends on PyYAML

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("heads", nargs="+", help="names of conf/heads/<name>.yaml")
    p.add_argument("--model-dir", default="artifacts/models/smollm2-135m-instruct")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--artifacts-dir", default="artifacts")
    p.add_argument("--force", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--set", action="append", default=[], metavar="train.KEY=VALUE",
                   help="override a train setting, e.g. --set train.max_steps=200")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    conf = Path(__file__).resolve().parent.parent / "conf" / "heads"
    for name in a.heads:
        cfg = yaml.safe_load((conf / f"{name}.yaml").read_text())
        for item in a.set:
            k, v = item.split("=", 1)
            node = cfg
            *parents, leaf = k.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = yaml.safe_load(v)
        out = train_heads(cfg, Path(a.model_dir), Path(a.data_dir), Path(a.artifacts_dir), force=a.force)
        print(out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
