"""The heads report: each head's top-1 / top-5 accuracy against the base greedy token on held-out
continuations, and the tokens per step a chain tree and Medusa's mc_sim_7b_63 tree would reach
there (replayed from rank paths)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runtime.heads import DraftHeads


def evaluate_heads(heads: DraftHeads, seqs: list[dict[str, torch.Tensor]], rank_cap: int = 10,
                   trees: dict[str, Any] | None = None) -> dict[str, Any]:
    """Top-1 / top-5 accuracy of each head against the base greedy token, and replayed tokens per
    step of a few trees (`trees`, name -> Tree; default: the chains and mc_sim_7b_63), on
    held-out continuations (rank paths as in `pipeline.replay`)."""
    from pipeline.replay.accept import replay_tokens_per_step
    from runtime.tree import Tree

    heads.eval()
    dev = next(heads.parameters()).device
    D = heads.config.num_heads
    hits1, hits5, counts = np.zeros(D), np.zeros(D), np.zeros(D)
    rollouts = []
    for s in seqs:
        P, y = int(s["prompt_len"]), s["tokens"].to(dev)
        T = len(y)
        if T < 2:
            continue
        ctx = heads.context(s["hidden"].to(dev).float())[P - 1:P - 1 + T]
        step = torch.arange(T, device=dev)[:, None]
        ahead = step + torch.arange(D + 1, device=dev)[None, :]
        nxt = torch.where(ahead < T, y[ahead.clamp(max=T - 1)], -1)         # [T, D+1]: y_{i+1..i+1+D}
        logits = heads.teacher_forced_logits(ctx, nxt[:, :D].clamp(min=0))  # [T, D, V]
        target = nxt[:, 1:]
        tl = logits.gather(-1, target.clamp(min=0)[..., None])
        ranks = (logits > tl).sum(-1)
        ok = target >= 0
        hits1 += ((ranks == 0) & ok).sum(0).cpu().numpy()
        hits5 += ((ranks < 5) & ok).sum(0).cpu().numpy()
        counts += ok.sum(0).cpu().numpy()
        rp = torch.where(ok, ranks.clamp(max=rank_cap), rank_cap)
        rollouts.append({"rank_paths": rp.cpu().numpy().astype(np.int64)})
    report: dict[str, Any] = {
        "sequences": len(rollouts),
        "positions": int(counts[0]),
        "top1": [round(float(x), 4) for x in hits1 / np.maximum(counts, 1)],
        "top5": [round(float(x), 4) for x in hits5 / np.maximum(counts, 1)],
    }
    if rollouts:
        if trees is None:
            trees = {f"chain{d}": Tree.chain(d) for d in range(1, D + 1)}
            trees["mc_sim_7b_63"] = Tree.named("mc_sim_7b_63")
        trees = {name: t for name, t in trees.items() if t.depth <= D}
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
