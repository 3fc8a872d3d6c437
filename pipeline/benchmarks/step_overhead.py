"""What a decoding step costs besides drafting and verifying, per tree size.

    python -m pipeline.benchmarks.step_overhead [--sizes 1 2 5 9 17 33] [--rounds 6] [--new-tokens 32]

A tree-decoding step is: draft (the heads propose the tree's tokens), verify (one base-model
forward over the tree's nodes), and the rest (accept the longest agreeing path, compact the KV
cache, feed the accepted positions to the heads, hand the tokens to the caller, Python). The rest
buys nothing, so it should be a small share of a one-token forward. For every tree size this
prints medians over the steps of real greedy decodes with that tree of: the whole step (time
between consecutive streamed steps), its draft (its `heads.propose` call), its verify (its
base-model forward) and rest = step - draft - verify of the same step; and the rest as a
percentage of a one-token forward (median of separate one-token forwards at the context length
the decodes reach halfway).

Trees of n nodes are the first n-1 paths of Medusa's `mc_sim_7b_63` list (ordered by its authors
by expected gain, so every prefix is a valid tree). Rounds interleave all trees, so that the load
of a shared machine hits them alike. `--clock cpu` reads this thread's CPU time instead of the
wall clock: with `--threads 1` that counts only this process's work, so the figures hold on a
machine other processes keep busy. With the wall clock on a GPU, the timing wrappers synchronise
around draft and verify (the decoder itself does not). Writes
artifacts/reports/benchmarks/step_overhead.{csv,json}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import atomic_write_json, machine_info
from pipeline.paths import Layout, default_model_name
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, median, write_csv
from pipeline.prepare.render import task_prompts
from pipeline.timing.step_cost import StepParts
from runtime.decoder import TreeDecoder
from runtime.device import clock
from runtime.ar import ar_generate
from runtime.heads import DraftHeads, load_heads
from runtime.model.llama import Transformer
from runtime.model.checkpoint import load_model
from runtime.tree import TREES_DIR, Tree, TreeBuffers

DEFAULT_HEADS_DIR = Layout.for_model("artifacts", default_model_name()).heads_dir("hydra")
WARMUP_STEPS = 2


def prefix_tree(num_nodes: int) -> Tree:
    """The first num_nodes-1 paths of mc_sim_7b_63 (its file order is its authors' greedy order)."""
    paths = json.loads((TREES_DIR / "mc_sim_7b_63.json").read_text())
    if not 1 <= num_nodes <= len(paths) + 1:
        raise ValueError(f"tree sizes must lie in [1, {len(paths) + 1}], got {num_nodes}")
    return Tree(paths[: num_nodes - 1])


@torch.inference_mode()
def _one_token_forward(model: Transformer, context: list[int], reps: int, now: Callable[[], float]) -> list[float]:
    """Seconds of `reps` one-token forwards after `context` (the cost of one AR token)."""
    dev = model.device
    model.reset_cache()
    pos = torch.arange(len(context), device=dev)
    logits, _ = model(torch.tensor([context], device=dev), pos, last_only=True)
    start = model.cache_len
    token = logits[0, -1].argmax().reshape(1, 1)
    one_pos = torch.tensor([start], device=dev)
    times = []
    for _ in range(reps + 1):  # the first call warms up
        t0 = now()
        model(token, one_pos)
        times.append(now() - t0)
        model.truncate_cache(start)
    model.reset_cache()
    return times[1:]


def measure(model: Transformer, heads: DraftHeads, prompt: list[int], sizes: list[int], rounds: int,
            new_tokens: int, reps: int, cpu_clock: bool = False) -> list[dict[str, Any]]:
    """One row per tree size with the medians (ms) described in the module docstring."""
    dev = model.device
    now = time.thread_time if cpu_clock else (lambda: clock(dev))
    decoders = {n: TreeDecoder(model, heads, [TreeBuffers.compile(prefix_tree(n))]) for n in sizes}
    reference = ar_generate(model, prompt, new_tokens, eos_ids=())
    context = prompt + reference[: new_tokens // 2]
    parts: dict[int, list[tuple[float, float, float]]] = {n: [] for n in sizes}
    one_token: list[float] = []
    for n in sizes:  # warm-up
        decoders[n].generate(prompt, 8, choose=0, eos_ids=())
    for _ in range(rounds):
        for n in sizes:
            timer = StepParts(model, heads, now)
            try:
                decoders[n].generate(prompt, new_tokens, choose=0, eos_ids=(), stream=timer.mark)
            finally:
                timer.close()
            parts[n].extend(timer.steps()[WARMUP_STEPS:])
        one_token.extend(_one_token_forward(model, context, reps, now))
    one = 1e3 * median(one_token)
    rows = []
    for n in sizes:
        step, draft, verify = (1e3 * median([p[i] for p in parts[n]]) for i in range(3))
        rest = 1e3 * median([p[0] - p[1] - p[2] for p in parts[n]])
        rows.append({"nodes": n, "step_ms": round(step, 3), "draft_ms": round(draft, 3), "verify_ms": round(verify, 3),
                     "rest_ms": round(rest, 3), "one_token_forward_ms": round(one, 3),
                     "rest_pct_of_forward": round(100 * rest / one, 2), "steps_timed": len(parts[n])})
    model.reset_cache()
    heads.reset()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--heads", default=str(DEFAULT_HEADS_DIR))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 5, 9, 17, 33])
    p.add_argument("--rounds", type=int, default=6, help="decodes per tree (interleaved)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per timed decode")
    p.add_argument("--reps", type=int, default=5, help="one-token forwards per round")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="wall clock or this thread's CPU time")
    p.add_argument("--task", default="humaneval", help="task whose first prompt is decoded")
    p.add_argument("--out", default=str(REPORT_DIR))
    a = p.parse_args(argv)
    model = load_model(a.model, dtype=getattr(torch, a.dtype), max_seq_len=2048, device=a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    heads = load_heads(a.heads, model=model)
    prompt = task_prompts(a.model, [a.task], 1)[0][1]
    rows = measure(model, heads, prompt, sorted(set(a.sizes)), a.rounds, a.new_tokens, a.reps, a.clock == "cpu")
    cols = list(rows[0])
    print(f"step overhead, {a.dtype} on {a.device}, {torch.get_num_threads()} threads, {a.clock} clock, prompt {len(prompt)} tokens")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    out = Path(a.out)
    write_csv(out / "step_overhead.csv", rows)
    atomic_write_json(out / "step_overhead.json", {"machine": machine_info(), "settings": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
