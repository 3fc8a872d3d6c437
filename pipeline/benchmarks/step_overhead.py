"""What a decoding step costs besides drafting and verifying, per tree size.

    python -m pipeline.benchmarks.step_overhead [--sizes 1 2 5 9 17 33] [--rounds 6] [--new-tokens 32]

A tree-decoding step is: draft (the heads propose the tree's tokens), verify (one base-model
forward over the tree's nodes), and the rest (accept the longest agreeing path, compact the KV
cache, feed the accepted positions to the heads, hand the tokens to the caller, Python). The rest
buys nothing, so it should be a small share of a one-token forward. For every tree size this
prints the medians of: the whole step (the time between consecutive streamed steps of real greedy
decodes with that tree),
one `heads.propose` call, one verify forward with the tree's mask, one one-token forward, and
rest = step - draft - verify, also as a percentage of the one-token forward.

Trees of n nodes are the first n-1 paths of Medusa's `mc_sim_7b_63` list (ordered by its authors
by expected gain, so every prefix is a valid tree). Draft and verify are timed at the context
length the decodes reach halfway. Rounds interleave all trees, so that the load of a shared
machine hits them alike. Writes artifacts/reports/benchmarks/step_overhead.{csv,json}.
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
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, median, task_prompts, write_csv
from runtime.decoder import TreeDecoder
from runtime.device import clock
from runtime.generate import ar_generate
from runtime.heads import DraftHeads, load_heads
from runtime.model import Transformer, load_model
from runtime.tree import TREES_DIR, Tree, TreeBuffers

DEFAULT_HEADS_DIR = Path("artifacts") / "heads" / "smollm2-135m-instruct" / "hydra"
WARMUP_STEPS = 2


def prefix_tree(num_nodes: int) -> Tree:
    """The first num_nodes-1 paths of mc_sim_7b_63 (its file order is its authors' greedy order)."""
    paths = json.loads((TREES_DIR / "mc_sim_7b_63.json").read_text())
    if not 1 <= num_nodes <= len(paths) + 1:
        raise ValueError(f"tree sizes must lie in [1, {len(paths) + 1}], got {num_nodes}")
    return Tree(paths[: num_nodes - 1])


@torch.inference_mode()
def _time_parts(model: Transformer, heads: DraftHeads, context: list[int], buf: TreeBuffers, reps: int,
                now: Callable[[], float]) -> tuple[list[float], list[float], list[float]]:
    """(draft, verify, one-token forward) seconds, `reps` of each, at the cache state after `context`."""
    dev = model.device
    model.reset_cache()
    heads.reset()
    pos = torch.arange(len(context), device=dev)
    logits, hidden = model(torch.tensor([context], device=dev), pos, last_only=True)
    h = heads.observe(hidden, pos)
    root = int(logits[0, -1].argmax())
    start = model.cache_len
    one_tok = torch.tensor([[root]], device=dev)
    one_pos = torch.tensor([start], device=dev)
    draft, verify, single = [], [], []
    for _ in range(reps + 1):  # the first round warms up
        t0 = now()
        tokens = heads.propose(h, root, buf)
        t1 = now()
        model(tokens[None], start + buf.depths, buf.attn_mask)
        t2 = now()
        model.truncate_cache(start)
        model(one_tok, one_pos)
        t3 = now()
        model.truncate_cache(start)
        draft.append(t1 - t0)
        verify.append(t2 - t1)
        single.append(t3 - t2)
    return draft[1:], verify[1:], single[1:]


def measure(model: Transformer, heads: DraftHeads, prompt: list[int], sizes: list[int], rounds: int,
            new_tokens: int, reps: int, cpu_clock: bool = False) -> list[dict[str, Any]]:
    """One row per tree size with the medians (ms) described in the module docstring."""
    dev = model.device
    now = time.thread_time if cpu_clock else (lambda: clock(dev))
    buffers = {n: TreeBuffers.compile(prefix_tree(n)) for n in sizes}
    decoders = {n: TreeDecoder(model, heads, [b]) for n, b in buffers.items()}
    reference = ar_generate(model, prompt, new_tokens, eos_ids=())
    context = prompt + reference[: new_tokens // 2]
    steps: dict[int, list[float]] = {n: [] for n in sizes}
    parts: dict[int, tuple[list[float], list[float], list[float]]] = {n: ([], [], []) for n in sizes}
    for n in sizes:  # warm-up
        decoders[n].generate(prompt, 8, choose=0, eos_ids=())
    for _ in range(rounds):
        for n in sizes:
            marks: list[float] = []  # after the prefill, then after every step
            decoders[n].generate(prompt, new_tokens, choose=0, eos_ids=(), stream=lambda _t: marks.append(now()))
            steps[n].extend(b - a for a, b in list(zip(marks, marks[1:]))[WARMUP_STEPS:])
            for acc, got in zip(parts[n], _time_parts(model, heads, context, buffers[n], reps, now)):
                acc.extend(got)
    rows = []
    for n in sizes:
        step, draft, verify, one = (1e3 * median(x) for x in (steps[n], *parts[n]))
        rest = step - draft - verify
        rows.append({"nodes": n, "step_ms": round(step, 3), "draft_ms": round(draft, 3), "verify_ms": round(verify, 3),
                     "rest_ms": round(rest, 3), "one_token_forward_ms": round(one, 3),
                     "rest_pct_of_forward": round(100 * rest / one, 2), "steps_timed": len(steps[n])})
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
    p.add_argument("--reps", type=int, default=5, help="draft/verify repeats per tree per round")
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
