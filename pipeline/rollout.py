"""Rollout stage: greedy continuations of the calibration prompts and their rank paths.

Greedy acceptance is a rank path (see `pipeline.replay`): the decoded text does not depend on the tree,
so one AR greedy continuation y per prompt, one teacher-forced pass of the base model over
prompt + y, and the heads run along y give, for every step index i, the rank path
R[i, d-1] = rank of y_{i+1+d} in head d's distribution (capped at K). Every tree, policy and
oracle is then replayed from these arrays without running the model again.

Shardable by prompt (`shard`, `num_shards`): shard k takes prompts k, k+n, k+2n, ...; `merge`
restores prompt order, so a merged sharded rollout equals a single-process one.

Head scores for EntMTP-dyn (`runtime.dynamic`): a DynamicPolicy chooses each step's tree from the
heads' probabilities of a super-tree S's nodes, drafted from the step's context vector. The
smallest exact record of that is, per step index i, the [N-1] float32 probabilities of S's
non-root nodes as `DraftHeads.propose_scored` gives them for S itself (a Hydra node's probability
depends on the tokens of its path, and the heads' products round by their row count, so the
scores of a larger tree are not S's). `score_prompt` computes them from the context vectors a
decoder sees (`decode_contexts`: the prefill, then the continuation in one causal-masked forward,
which a row-invariant model computes as bit-identically as any decode forward). They are kept
beside the rollout in a versioned file (`save_scores` / `load_scores`, SCORES_FORMAT), one array
per candidate super-tree, checked against the rollout they belong to on load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from tqdm.auto import tqdm

from pipeline.bank.dynamic import SCORES_FORMAT  # head scores of super-trees (`save_scores`)
from runtime.generate import ar_generate
from runtime.sampling import Sampler
from runtime.heads import DraftHeads
from runtime.model import Transformer
from runtime.tree import TreeBuffers

ARRAYS = ("tokens", "rank_paths", "p0", "entropy", "head_top1", "greedy_top1", "tf_mismatch")
SCORES_FILE, SCORES_META = "scores.safetensors", "scores.json"


@torch.inference_mode()
def rollout_prompt(
    model: Transformer, heads: DraftHeads, input_ids: list[int], max_new_tokens: int, rank_cap: int,
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
    P, T, D = len(input_ids), len(y), heads.config.num_heads
    dev = model.device  # every tensor is made where the model computes
    seq = torch.tensor([list(input_ids) + y[:-1]], dtype=torch.long, device=dev)  # y_T needs no successor
    seq_pos = torch.arange(seq.shape[1], device=dev)
    model.reset_cache()
    heads.reset()
    logits, hidden = model(seq, seq_pos)
    ctx = heads.context(hidden, seq_pos)[P - 1:]                         # [T, dim]
    base = logits[0, P - 1:].float()                                     # [T, V] gives y_1..y_T
    y_t = torch.tensor(y, dtype=torch.long, device=dev)
    logp = torch.log_softmax(base, -1)
    p0 = logp.max(-1).values.exp()
    entropy = -(logp.exp() * logp).sum(-1)
    tf_mismatch = sampler.next_tokens(base, torch.arange(T, device=dev)) != y_t

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
    model: Transformer, heads: DraftHeads, rows: list[dict], max_new_tokens: int, rank_cap: int,
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


def merge_rollouts(shard_dirs: list[Path], order: list[str], out_dir: Path) -> dict[str, Any]:
    """Merge shard folders back into prompt order `order` (the ids of the unsharded split)."""
    by_id: dict[str, dict] = {}
    caps = set()
    for d in shard_dirs:
        for r in load_rollout(d):
            by_id[r["id"]] = r
            caps.add(r["rank_cap"])
    if len(caps) > 1:
        raise ValueError(f"cannot merge shards rolled out with different rank caps {sorted(caps)}; rerun them with one profile")
    missing = [i for i in order if i not in by_id]
    if missing:
        raise ValueError(f"cannot merge: {len(missing)} prompts have no shard output (first: {missing[0]}); rerun the missing shards")
    per_prompt = [{k: by_id[i][k] for k in ARRAYS} for i in order]
    save_rollout(out_dir, order, per_prompt, caps.pop() if caps else 0)
    return {"prompts": len(order), "shards": len(shard_dirs), "tokens": int(sum(len(r["tokens"]) for r in per_prompt))}


# ----------------------------------------------------------------------------- head scores (EntMTP-dyn)


@torch.inference_mode()
def decode_contexts(model: Transformer, heads: DraftHeads, input_ids: list[int], tokens: list[int] | np.ndarray) -> torch.Tensor:
    """The context vectors [T, dim] from which a decoder drafts at step indices i = 0..T-1 of the
    continuation `tokens` (y_1..y_T): row i follows y_{i+1}'s predecessor, as `TreeDecoder` holds it
    before drafting the step whose root is y_{i+1}.

    Computed as a decoder computes them: the same prefill, then y_1..y_{T-1} in one forward with an
    explicit causal mask, which a row-invariant model (`lossless: exact`) runs through its
    row-invariant path, giving every position the bits any decode forward gives it. A prefix layer
    (Hydra++) observes the prompt, then one position at a time; a decode observes each step's
    accepted positions together, which may round its context differently in the last bits."""
    y = [int(t) for t in tokens]
    P, T, dev = len(input_ids), len(y), model.device
    model.reset_cache()
    heads.reset()
    _, hidden = model(torch.tensor([list(input_ids)], dtype=torch.long, device=dev), torch.arange(P, device=dev),
                      last_only=True)
    parts = [hidden[0, -1:]]
    if T > 1:
        n = T - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
        _, rest = model(torch.tensor([y[:-1]], dtype=torch.long, device=dev), torch.arange(P, P + n, device=dev),
                        mask=causal)
        parts.append(rest[0])
    if heads.prefix is None:
        return torch.cat(parts)
    # Hydra++: the prefix layer's cache is fed as a decode feeds it, the prompt then position by position
    out = [heads.observe(hidden, torch.arange(P, device=dev))]
    if T > 1:
        out += [heads.observe(rest[:, j:j + 1], torch.arange(P + j, P + j + 1, device=dev)) for j in range(T - 1)]
    return torch.cat(out)


@torch.inference_mode()
def score_prompt(model: Transformer, heads: DraftHeads, input_ids: list[int], tokens: list[int] | np.ndarray,
                 super_trees: list[TreeBuffers], contexts: torch.Tensor | None = None) -> list[np.ndarray]:
    """Per super-tree S, float32 [T, N-1]: row i holds the head probabilities of S's non-root nodes
    (node order) at step index i, exactly as `propose_scored(h_i, y_{i+1}, S)` gives them in a
    decode (`contexts`: `decode_contexts`, computed here when not given)."""
    y = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=model.device)
    ctx = decode_contexts(model, heads, input_ids, y.tolist()) if contexts is None else contexts
    out = []
    for buf in super_trees:
        buf = buf.to(model.device)
        rows = torch.empty(len(y), buf.num_nodes - 1, dtype=torch.float32, device=model.device)
        for i in range(len(y)):
            rows[i] = heads.propose_scored(ctx[i], y[i], buf)[1][1:]
        out.append(rows.cpu().numpy())
    return out


def save_scores(out_dir: Path, ids: list[str], super_trees: list[list[tuple[int, ...]]],
                per_prompt: list[list[np.ndarray]], rollout_digest: str | None = None) -> None:
    """Write the head scores of `super_trees` (their paths) for prompts `ids`: per prompt, one
    [T, N_s - 1] array per super-tree (`score_prompt`'s list), concatenated over prompts."""
    lengths = [int(p[0].shape[0]) if p else 0 for p in per_prompt]
    flat: dict[str, np.ndarray] = {"offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    for s, paths in enumerate(super_trees):
        arrays = [p[s] for p in per_prompt]
        flat[f"s{s}"] = (np.concatenate(arrays) if arrays else np.zeros((0, len(paths)))).astype(np.float32)
    save_file(flat, str(out_dir / SCORES_FILE))
    meta = {"format": SCORES_FORMAT, "ids": list(ids), "rollout": rollout_digest,
            "super_trees": [[list(p) for p in paths] for paths in super_trees]}
    (out_dir / SCORES_META).write_text(json.dumps(meta))


def load_scores(folder: str | Path, rollouts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """{"super_trees": [paths per super-tree], "scores": [per super-tree: [per prompt [T, N-1]]],
    "ids", "rollout"}, checked: the format, one column per non-root node, probabilities in [0, 1],
    and, given the `rollouts` they were scored on, the same prompts in the same order and lengths."""
    folder = Path(folder)
    meta_file, data_file = folder / SCORES_META, folder / SCORES_FILE
    if not meta_file.is_file() or not data_file.is_file():
        raise FileNotFoundError(f"no head scores in {folder}: EntMTP-dyn needs them; rebuild the bank "
                                "(`python -m pipeline stage=bank ...` scores the calibration rollout)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != SCORES_FORMAT:
        raise ValueError(f"head scores in {folder} have format {meta.get('format')!r}, this code reads {SCORES_FORMAT}: "
                         "rebuild them (`python -m pipeline stage=bank ...` rescoring is part of the bank stage)")
    flat = load_file(str(data_file))
    ids, trees = list(meta["ids"]), [[tuple(int(r) for r in p) for p in paths] for paths in meta["super_trees"]]
    off = flat["offsets"]
    if len(off) != len(ids) + 1:
        raise ValueError(f"head scores in {folder} are inconsistent: {len(ids)} prompt ids but {len(off) - 1} offsets")
    if rollouts is not None:
        got = [r["id"] for r in rollouts]
        lengths = [len(r["tokens"]) for r in rollouts]
        if got != ids or lengths != np.diff(off).tolist():
            raise ValueError(f"head scores in {folder} belong to another rollout (prompts or lengths differ); "
                             "rebuild the bank stage to rescore the current rollout")
    scores = []
    for s, paths in enumerate(trees):
        a = flat.get(f"s{s}")
        if a is None or a.ndim != 2 or a.shape != (int(off[-1]), len(paths)):
            raise ValueError(f"head scores in {folder}: super-tree {s} needs [{int(off[-1])}, {len(paths)}] scores, "
                             f"got {None if a is None else a.shape}; rebuild them")
        if a.size and not (np.isfinite(a).all() and a.min() >= 0.0 and a.max() <= 1.0):
            raise ValueError(f"head scores in {folder}: super-tree {s} holds values outside [0, 1]; rebuild them")
        scores.append([a[int(off[j]):int(off[j + 1])] for j in range(len(ids))])
    return {"super_trees": trees, "scores": scores, "ids": ids, "rollout": meta.get("rollout")}
