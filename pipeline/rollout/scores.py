"""The scores stage's library: head scores for EntMTP-dyn (`runtime.dynamic`). A DynamicPolicy chooses each step's tree from the
heads' probabilities of a super-tree S's nodes, drafted from the step's context vector. The
smallest exact record of that is, per step index i, the [N-1] float32 probabilities of S's
non-root nodes as `DraftHeads.propose_scored` gives them for S itself (a Hydra node's probability
depends on the tokens of its path, and the heads' products round by their row count, so the
scores of a larger tree are not S's). `score_prompt` computes them from the context vectors a
decoder sees (`decode_contexts`: the prefill, then the continuation in one causal-masked forward,
which a row-invariant model computes as bit-identically as any decode forward). They are kept
beside the rollout in a versioned file (`save_scores` / `load_scores`, SCORES_FORMAT), one array
per candidate super-tree, checked against the rollout they belong to on load.

An EAGLE-3 drafter (`runtime.eagle3`) drafts from its own cache of committed rows as well as its
context, so `score_prompt` builds what a decoder holds at each step index instead
(`drafter_scores`): the target's features of the prompt (the prefill's forward) and of the
continuation (causal-masked chunks, as for heads), all rows committed at once, then, step index by
step index from the last, the cache cut back to the step's committed rows and S drafted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from pipeline.bank.dynamic import (
    SCORES_FORMAT,  # head scores of super-trees (`save_scores`)
)
from runtime.decoder import Drafter
from runtime.eagle3 import Eagle3Drafter, target_forward
from runtime.heads import DraftHeads
from runtime.model.llama import Transformer
from runtime.tree import TreeBuffers

SCORES_FILE, SCORES_META = "scores.safetensors", "scores.json"


CONTEXT_CHUNK = 32  # continuation tokens per forward in `decode_contexts`


@torch.inference_mode()
def decode_contexts(model: Transformer, heads: DraftHeads, input_ids: list[int], tokens: list[int] | np.ndarray) -> torch.Tensor:
    """The context vectors [T, dim] from which a decoder drafts at step indices i = 0..T-1 of the
    continuation `tokens` (y_1..y_T): row i follows y_{i+1}'s predecessor, as `TreeDecoder` holds it
    before drafting the step whose root is y_{i+1}.

    Computed as a decoder computes them: the same prefill, then y_1..y_{T-1} in causal-masked
    forwards of CONTEXT_CHUNK tokens, which a row-invariant model (`lossless: exact`) runs through its
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
    # the continuation in causal pieces of CONTEXT_CHUNK tokens: the row-invariant attention holds a
    # forward's tokens at most KEY_CHUNK - 1 deep, and row invariance makes the pieces' bits those of
    # one forward
    for a in range(0, T - 1, CONTEXT_CHUNK):
        b = min(a + CONTEXT_CHUNK, T - 1)
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=dev).tril_()
        _, piece = model(torch.tensor([y[a:b]], dtype=torch.long, device=dev), torch.arange(P + a, P + b, device=dev),
                         mask=causal)
        parts.append(piece[0])
    if heads.prefix is None:
        return torch.cat(parts)
    # Hydra++: the prefix layer's cache is fed as a decode feeds it, the prompt then position by position
    out = [heads.observe(hidden, torch.arange(P, device=dev))]
    rest = torch.cat(parts[1:])[None] if T > 1 else None
    if rest is not None:
        out += [heads.observe(rest[:, j:j + 1], torch.arange(P + j, P + j + 1, device=dev)) for j in range(T - 1)]
    return torch.cat(out)


@torch.inference_mode()
def drafter_scores(model: Transformer, drafter: Eagle3Drafter, input_ids: list[int], tokens: list[int] | np.ndarray,
                   super_trees: list[TreeBuffers]) -> list[np.ndarray]:
    """`score_prompt` for an EAGLE-3 drafter: per super-tree S, float32 [T, N-1], row i the draft
    probabilities of S's non-root nodes as `propose_scored(g_i, y_{i+1}, S)` gives them in a decode
    whose drafter cache holds the committed rows of positions 0..P-1+i (P prompt tokens). The
    prompt's rows are committed as the decoder's prefill commits them (one call); the continuation's
    in one call too, where a decode commits each step's accepted rows together, which may round a
    row's state differently in the last bits (as for Hydra++'s prefix layer in `decode_contexts`)."""
    y = [int(t) for t in tokens]
    P, T, dev = len(input_ids), len(y), model.device
    aux = tuple(drafter.aux_layer_ids)
    model.reset_cache()
    drafter.reset()
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=dev)
    _, _, prompt_features = target_forward(model, ids, torch.arange(P, device=dev), aux, last_only=True)
    features = [prompt_features]
    for a in range(0, T - 1, CONTEXT_CHUNK):   # the continuation as `decode_contexts` runs it
        b = min(a + CONTEXT_CHUNK, T - 1)
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=dev).tril_()
        _, _, piece = target_forward(model, torch.tensor([y[a:b]], dtype=torch.long, device=dev),
                                     torch.arange(P + a, P + b, device=dev), aux, mask=causal)
        features.append(piece)
    # each position's next token: the prompt's after the first, then y_1..y_T
    nxt = torch.tensor(list(input_ids[1:]) + y, dtype=torch.long, device=dev)
    g = [drafter.extend(prompt_features, nxt[:P])]                         # g_0: drafts below y_1
    if T > 1:
        g.append(drafter.extend(torch.cat(features[1:]), nxt[P:], return_all=True))  # g_1..g_{T-1}
    ctx = torch.cat(g)
    bufs = [buf.to(dev) for buf in super_trees]
    rows = [torch.empty(T, buf.num_nodes - 1, dtype=torch.float32, device=dev) for buf in bufs]
    # from the last step index down: drafting writes scratch rows past the committed ones, which only
    # the later step indices (already scored) hold as committed
    for i in range(T - 1, -1, -1):
        drafter.truncate(P + i)
        for buf, out in zip(bufs, rows):
            out[i] = drafter.propose_scored(ctx[i], y[i], buf)[1][1:]
    drafter.reset()
    return [r.cpu().numpy() for r in rows]


@torch.inference_mode()
def score_prompt(model: Transformer, heads: Drafter, input_ids: list[int], tokens: list[int] | np.ndarray,
                 super_trees: list[TreeBuffers], contexts: torch.Tensor | None = None) -> list[np.ndarray]:
    """Per super-tree S, float32 [T, N-1]: row i holds the head probabilities of S's non-root nodes
    (node order) at step index i, exactly as `propose_scored(h_i, y_{i+1}, S)` gives them in a
    decode (`contexts`: `decode_contexts`, computed here when not given). An EAGLE-3 drafter:
    `drafter_scores` (`contexts` is not read)."""
    if heads.aux_layer_ids:
        return drafter_scores(model, heads, input_ids, tokens, super_trees)  # type: ignore[arg-type]
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

