"""Banks in memory: a bank shaped like the pipeline's (`make_bank`), the batch-size record of a bank
timed at batch size 1 (`batch_one_record`) or choosing a given tree per batch size
(`batch_choices_record`), its seals after a deliberate edit (`reseal`), and the
trees, fake figures and policies of the tiny bundle's bank."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.bank import TopologyBank
from runtime.policy import HysteresisPolicy, LadderPolicy, StaticPolicy
from runtime.tree import Tree

# Ordered by size, as a bank must be: a chain, a small branching tree, Medusa/Hydra's default.
SIX_NODE_TREE = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
BANK_TREES = (Tree.chain(2), SIX_NODE_TREE, Tree.named("mc_sim_7b_63"))
BEST_STATIC = 1

# A bank shaped like the pipeline's, in memory (tests/runtime/test_bank.py, tests/test_reliability.py)
MODEL_FP, HEADS_FP = "model-fp-0123456789", "heads-fp-abcdef"


def batch_one_record(trees: list[Tree], figures: list[dict], best_static: int,
                     ar_step_ms: float | None = None) -> dict[str, dict]:
    """bank.json's "batch_sizes" record (`runtime.export.schedule`) of a bank timed at batch size 1
    only: its best static tree; as best chain the longest all-top-1 path (0,), (0, 0), ... inside
    that tree when the bank holds that chain, with its figures; the bank's figures as the cost row."""
    best = trees[best_static]
    depth = 0
    while (0,) * (depth + 1) in best:
        depth += 1
    chain = None
    if depth and Tree.chain(depth) in trees:
        fig = figures[trees.index(Tree.chain(depth))]
        chain = {"depth": depth, **{key: fig[key] for key in ("tokens_per_step", "step_ms", "tok_per_s")}}
    return {"1": {"best_static": best_static if len(best) else None, "best_chain": chain, "ar_step_ms": ar_step_ms,
                  "step_ms": [f.get("step_ms") for f in figures], "tok_per_s": [f.get("tok_per_s") for f in figures]}}


def batch_choices_record(trees: list[Tree], choices: dict[int, int | None]) -> dict[str, dict]:
    """bank.json's "batch_sizes" record of a bank that chose tree `choices[B]` at batch size B (None:
    AR there): AR at 50 tok/s per sequence, the chosen tree measured at 1.2x AR, every other tree at
    0.9x; no best chain."""
    out = {}
    for b, k in choices.items():
        ar = 50.0 * b
        out[str(b)] = {"best_static": k, "best_chain": None, "ar_step_ms": 20.0, "ar_tok_per_s": ar,
                       "step_ms": [20.0 + 0.5 * t.num_nodes for t in trees],
                       "tok_per_s": [ar * (1.2 if j == k else 0.9) for j in range(len(trees))]}
    return out


def make_bank(trees: list[Tree] | None = None) -> TopologyBank:
    """A bank shaped like the pipeline's: trees ascending by size, figures, three policies, provenance,
    and a batch-size record at batch size 1 (`batch_one_record`)."""
    trees = trees or [Tree.chain(1), Tree.chain(2), Tree.chain(4), Tree.named("mc_sim_7b_63")]
    figures = [
        {"nodes": t.num_nodes, "depth": t.depth, "tokens_per_step": 1.4 + 0.3 * k, "step_ms": 20.0 + 2.5 * k,
         "tok_per_s": 70.0 + k, "real_tokens_per_step": 1.4 + 0.3 * k if k % 2 else None, "step_agreement": 1.0}
        for k, t in enumerate(trees)
    ]
    last = len(trees) - 1
    policies = {
        "static": {"kind": "static", "index": last, "signal": "p0"},
        "hysteresis": {"kind": "hysteresis", "signal": "p0", "small": 0, "large": last, "tau_on": 0.8, "tau_off": 0.4},
        "ladder": {"kind": "ladder", "signal": "p0", "thresholds": [0.3, 0.6, 0.9][: last], "trees": list(range(last + 1))},
    }
    return TopologyBank(
        trees=trees, figures=figures, best_static=last, policies=policies, default_policy="hysteresis",
        oracle={"tokens_per_s": 99.5, "tokens_per_step": 2.9}, batch_schedule=batch_one_record(trees, figures, last),
        provenance={"task": "humaneval", "model_name": "tiny", "heads_name": "hydra", "model_fingerprint": MODEL_FP,
                    "heads_fingerprint": HEADS_FP, "dtype": "float32", "machine": {"cpu": "test"}},
    )


def reseal(folder: Path) -> None:
    """Recompute bank.json's seals after a deliberate edit (what a buggy writer would produce)."""
    from runtime import bank as bank_mod
    from runtime.bank import BANK_JSON, BUFFERS

    doc = json.loads((folder / BANK_JSON).read_text())
    if (folder / BUFFERS).exists():
        blob = (folder / BUFFERS).read_bytes()
        doc["buffers_sha256"], doc["buffers_bytes"] = bank_mod._sha256(blob), len(blob)
    doc["doc_sha256"] = bank_mod._doc_checksum(doc)
    (folder / BANK_JSON).write_text(json.dumps(doc, indent=1))


def fake_figures(tree: Tree, k: int) -> dict[str, float | int]:
    """Plausible measured figures (bigger trees accept more but cost more per step)."""
    tokens_per_step = 1.0 + 0.4 * tree.depth + 0.01 * len(tree)
    step_ms = 5.0 + 0.2 * tree.num_nodes
    return {"nodes": tree.num_nodes, "depth": tree.depth, "tokens_per_step": round(tokens_per_step, 4),
            "step_ms": step_ms, "tok_per_s": round(1000.0 * tokens_per_step / step_ms, 3),
            "real_tokens_per_step": round(tokens_per_step - 0.01 * k, 4), "step_agreement": 1.0}


def tiny_policies() -> dict[str, dict]:
    """A static policy, a hysteresis between the smallest and the largest tree on the EMA of
    accepted tokens, and a ladder on the heads' greedy-path value (which makes the decoder run
    the heads' greedy chain every step)."""
    n = len(BANK_TREES)
    return {
        "static": StaticPolicy(BEST_STATIC).to_dict(),
        # init 2.0: start on the large tree and drop to the small one after a few rejected steps
        "hysteresis": HysteresisPolicy(tau_on=1.5, tau_off=1.2, small=0, large=n - 1, signal="accept_ema",
                                       signal_params={"alpha": 0.5, "init": 2.0}).to_dict(),
        # random heads over a 49152-token vocabulary give greedy-path values around 1e-17
        "ladder": LadderPolicy(thresholds=[2e-17, 6e-17], trees=[0, 1, 2], signal="greedy_path").to_dict(),
    }
