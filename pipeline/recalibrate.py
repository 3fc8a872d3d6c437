"""The recalibrate stage's library: decode for real with each candidate tree and check the replay against it.

Under greedy verification the replay from rank paths is exact (see `pipeline.replay`): the real decoder
must emit the rollout's tokens, visit the same step indices and accept the same lengths. Any
disagreement is listed with its cause; the only legitimate one is a floating-point tie flipping
an argmax between the teacher-forced pass and the tree-shaped verify call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pipeline.replay.accept import accept_lengths
from runtime.sampling import Sampler
from runtime.decoder import TreeDecoder
from runtime.tree import Tree


def compare_step_by_step(rollout: dict[str, Any], tree: Tree, accepted_real: list[int], tokens_real: list[int],
                         rank_cap: int) -> dict[str, Any]:
    """Compare one real decode with the replay of the same tree on the same prompt."""
    acc = accept_lengths(rollout["rank_paths"], tree.paths, rank_cap=rank_cap)
    T = len(rollout["tokens"])
    same_tokens = tokens_real == rollout["tokens"].tolist()
    first_diff = None
    if not same_tokens:
        first_diff = next((j for j, (a, b) in enumerate(zip(tokens_real, rollout["tokens"].tolist())) if a != b),
                          min(len(tokens_real), T))
    i, agree, steps = 0, 0, 0
    disagreements = []
    for s, a_real in enumerate(accepted_real):
        if i >= T - 1 or (first_diff is not None and i + 1 >= first_diff):
            break  # past the end of the rollout, or the texts diverged: no replay to compare with
        a_rep = int(acc[i])
        # the decoder may accept drafts past the end of the rollout (past EOS or the token
        # budget) and then truncate them; the replay cannot see beyond, so compare what counts
        a_cmp = min(a_real, T - 1 - i)
        steps += 1
        if a_rep == a_cmp:
            agree += 1
        elif len(disagreements) < 20:
            disagreements.append({"step": s, "index": i, "replay": a_rep, "real": a_real,
                                  "rank_path": rollout["rank_paths"][i].tolist()})
        i += a_real + 1
    replay_steps = _replay_step_count(acc, T)
    return {
        "same_tokens": same_tokens,
        "first_token_diff": first_diff,
        "steps_compared": steps,
        "steps_agree": agree,
        "real_steps": len(accepted_real),
        "replay_steps": replay_steps,
        "disagreements": disagreements,
    }


def _replay_step_count(acc: np.ndarray, T: int) -> int:
    i, steps = 0, 0
    while i < T - 1:  # y_1 comes from the prefill; each step emits acc + 1 tokens
        i += int(acc[i]) + 1
        steps += 1
    return steps


def recalibrate(
    decoder: TreeDecoder, trees: list[Tree], rows: list[dict], rollouts: dict[str, dict], max_new_tokens: int,
    rank_cap: int, sampler: Sampler | None = None,
) -> list[dict[str, Any]]:
    """Decode every row with every tree (prompt-major, so machine drift hits all trees alike),
    with the rollout's sampler (greedy, or the same seeded sampling).

    Under typical acceptance (`decoder.acceptance`) the decoded text leaves the rollout's at the
    first draft that only typical acceptance takes, so there is no replay to agree with: the
    real figures are measured, and the replay-agreement fields are None."""
    exact = decoder.acceptance == "exact"
    per_tree: list[dict[str, Any]] = [
        {"tokens": 0, "steps": 0, "replay_steps": 0, "steps_compared": 0, "steps_agree": 0, "token_mismatch_prompts": 0,
         "disagreements": [], "seconds": 0.0, "step_seconds": []} for _ in trees]
    bar = tqdm(total=len(rows) * len(trees), desc="recalibrate", unit="decode")
    for row in rows:
        ro = rollouts[row["id"]]
        for k, tree in enumerate(trees):
            res = decoder.generate(row["input_ids"], max_new_tokens, choose=k, sampler=sampler)
            cmp = compare_step_by_step(ro, tree, [s.accepted for s in res.steps], res.tokens, rank_cap)
            f = per_tree[k]
            f["tokens"] += len(res.tokens) - 1
            f["steps"] += len(res.steps)
            f["replay_steps"] += cmp["replay_steps"]
            f["steps_compared"] += cmp["steps_compared"]
            f["steps_agree"] += cmp["steps_agree"]
            f["token_mismatch_prompts"] += int(not cmp["same_tokens"])
            f["seconds"] += res.prefill_seconds + res.decode_seconds
            f["step_seconds"].extend(s.seconds for s in res.steps)
            for d in cmp["disagreements"]:
                if len(f["disagreements"]) < 10:
                    f["disagreements"].append({"prompt": row["id"], **d})
            bar.update()
    bar.close()
    out = []
    for k, f in enumerate(per_tree):
        real_tps = f["tokens"] / max(f["steps"], 1)
        replay_tps = f["tokens"] / max(f["replay_steps"], 1)
        out.append({
            "tree": k,
            "real_tokens_per_step": real_tps,
            "replay_tokens_per_step": replay_tps,
            "tps_rel_diff": (abs(real_tps - replay_tps) / replay_tps if replay_tps else 0.0) if exact else None,
            "step_agreement": f["steps_agree"] / max(f["steps_compared"], 1) if exact else None,
            "steps_compared": f["steps_compared"] if exact else 0,
            "token_mismatch_prompts": f["token_mismatch_prompts"] if exact else None,
            "median_step_ms": 1000 * float(np.median(f["step_seconds"])) if f["step_seconds"] else float("nan"),
            "e2e_tok_per_s": (f["tokens"] + len(rows)) / f["seconds"] if f["seconds"] else float("nan"),
            "disagreements": f["disagreements"] if exact else [],
        })
    return out
