"""Long generations: memory stays flat and the output stays lossless while the tree switches every step.

    python -m pipeline.benchmarks.long_run [--new-tokens 2000] [--heads-dir DIR] [--threads 2]

One greedy decode of `--new-tokens` tokens (EOS ignored) with a schedule that changes the tree at
*every* step, cycling through a bank of three trees (a chain, a small branching tree and the
63-node Medusa/Hydra default): the decoder's real per-step path (p0 and entropy of the base
logits, drafting, verify, KV compaction; with --reads-heads also the heads' greedy chain that
head-reading signals need) runs each step.
Every 100 steps it records the process RSS (/proc/self/statm), the live torch tensors (count and
bytes, found through the garbage collector) and, on a GPU, torch's allocated bytes. It then
decodes the same prompt with plain AR greedy decoding and compares the tokens.

The KV cache is preallocated by `load_model(max_seq_len=...)` (prompt + new tokens + 100 here), so
memory must not grow with the number of steps: the report gives RSS at start, max, end, and the
growth per 1,000 steps (least-squares slope over the samples after the first).

Heads: the trained ones when `--heads-dir` (or artifacts/heads/<model>/hydra_pp, then hydra)
exists, else freshly initialised Hydra++ heads (`HeadsConfig.for_model(kind="hydra",
prefix_layer=True)`): they accept little, which does not matter for memory or losslessness, and
their prefix layer has its own KV cache that must stay flat too.
Writes artifacts/reports/benchmarks/long_run.json.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.decoder import TreeDecoder
from runtime.device import clock
from runtime.heads import DraftHeads
from runtime.model import Transformer
from runtime.policy import LadderPolicy, Scheduler, Signal, greedy_path_value
from runtime.tree import Tree, TreeBuffers

PAGE = os.sysconf("SC_PAGE_SIZE")
SIX_NODES = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
BANK = (Tree.chain(2), SIX_NODES, Tree.named("mc_sim_7b_63"))
# without the 63-node tree (a fp32 verify of 64 nodes costs ~3 small ones on this CPU): for runs
# that must fit a short time slot
SMALL_BANK = (Tree.chain(2), SIX_NODES,
              Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0), (1, 0, 0)]))


def rss_bytes() -> int:
    """Resident set size of this process (second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def live_tensors() -> tuple[int, int]:
    """(count, bytes) of the torch tensors the garbage collector can see (parameters and buffers
    included): a per-step leak of tensors shows up here even when RSS hides it in the allocator."""
    n, total = 0, 0
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): isinstance reads __class__, which some deprecated torch
            # module attributes answer with a warning
            if issubclass(type(obj), torch.Tensor):
                n += 1
                total += obj.element_size() * obj.nelement()
        except Exception:  # noqa: BLE001 - exotic objects may refuse isinstance/size queries
            continue
    return n, total


class CyclingSignal(Signal):
    """Computes a real signal (p0, or with reads_heads the greedy-path value, for which the decoder
    then runs the heads' greedy chain every step) and returns the step number modulo `n` instead,
    so that a ladder with thresholds 0.5, 1.5, ... picks a different tree at every step."""

    def __init__(self, n: int, reads_heads: bool = False) -> None:
        self.name = "greedy_path" if reads_heads else "p0"
        self.reads_heads = reads_heads  # the decoder then runs the heads' greedy chain every step
        self.n = n
        self.step = 0
        self.last = float("nan")

    def observe(self, p0: float, head_top1: Sequence[float], entropy: float) -> float:
        self.last = greedy_path_value(p0, head_top1) if self.reads_heads else p0
        v = float(self.step % self.n)
        self.step += 1
        return v

    def reset(self) -> None:
        self.step = 0


def switching_scheduler(n_trees: int, reads_heads: bool = False) -> Scheduler:
    """A scheduler that moves to the next tree of the bank (cyclically) at every step."""
    sched = Scheduler(LadderPolicy([j + 0.5 for j in range(n_trees - 1)], signal="p0"), n_trees)
    sched.signal = CyclingSignal(n_trees, reads_heads)
    return sched


@torch.inference_mode()
def teacher_forced_check(model: Transformer, prompt: list[int], tokens: list[int], chunk: int = 256) -> dict[str, Any]:
    """Check a greedy continuation in one causal pass over prompt + tokens (chunked prefill):
    each token must be the base argmax given the prompt and the tokens before it. Costs one long
    prefill instead of len(tokens) sequential AR steps. A batched pass rounds differently from
    step-by-step decoding, so a mismatch at a near-tie (top-2 logit gap ~1e-5) is a floating-point
    tie, not a decoding error: the gaps are reported."""
    seq = list(prompt) + list(tokens)
    P = len(prompt)
    model.reset_cache()
    mismatches = []
    for start in range(0, len(seq) - 1, chunk):
        piece = seq[start:min(start + chunk, len(seq) - 1)]
        logits, _ = model(torch.tensor([piece]), torch.arange(start, start + len(piece)))
        for j in range(len(piece)):
            pos = start + j                     # this row predicts seq[pos + 1]
            if pos < P - 1:
                continue
            row = logits[0, j]
            want = seq[pos + 1]
            got = int(row.argmax())
            if got != want:
                top2 = row.topk(2).values
                mismatches.append({"token": pos + 1 - P, "decoded": want, "argmax": got,
                                   "gap": float(row[got] - row[want]), "top2_gap": float(top2[0] - top2[1])})
    model.reset_cache()
    return {"checked": len(tokens), "mismatches": mismatches}


def _slope_per_1000(steps: list[int], values: list[float]) -> float:
    if len(steps) < 3:
        return float("nan")
    x, y = np.asarray(steps[1:], dtype=float), np.asarray(values[1:], dtype=float)  # skip the warm-up sample
    return float(np.polyfit(x, y, 1)[0] * 1000.0)


def long_run(
    model: Transformer,
    heads: DraftHeads,
    prompt: list[int],
    new_tokens: int,
    trees: Sequence[Tree] = BANK,
    sample_every: int = 100,
    compare_ar: bool | str = True,
    count_tensors: bool = True,
    reads_heads: bool = False,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Decode `new_tokens` tokens (EOS ignored) switching tree every step; sample memory every
    `sample_every` steps; compare with AR greedy decoding (compare_ar=True), or check the tokens
    with one teacher-forced pass (compare_ar="teacher_forced", see `teacher_forced_check`), or
    not at all (False). reads_heads: also run the heads' greedy
    chain every step (what head-reading signals cost). `progress` gets each memory sample as it
    is taken. Returns the figures (JSON-able)."""
    from runtime.generate import ar_generate

    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees])
    sched = switching_scheduler(len(trees), reads_heads)
    kv_ptr, kv_bytes = model.kv_cache.data_ptr(), model.kv_cache.nbytes
    samples: list[dict[str, Any]] = []
    steps = [0]
    emitted = [0]

    def sample() -> None:
        gc.collect()
        row: dict[str, Any] = {"step": steps[0], "tokens": emitted[0], "rss_mb": rss_bytes() / 2**20}
        if count_tensors:
            row["tensors"], b = live_tensors()
            row["tensor_mb"] = b / 2**20
        if torch.cuda.is_available() and model.device.type == "cuda":
            row["cuda_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
        samples.append(row)
        if progress is not None:
            progress(row)

    def on_step(tokens: list[int]) -> None:
        emitted[0] += len(tokens)
        if emitted[0] == len(tokens):  # the prefill's token: not a step
            sample()
            return
        steps[0] += 1
        if steps[0] % sample_every == 0:
            sample()

    t0 = clock(model.device)
    res = dec.generate(prompt, new_tokens, choose=sched, eos_ids=[], stream=on_step)
    dt = clock(model.device) - t0
    sample()
    used = [s.tree for s in res.steps]
    switches = sum(a != b for a, b in zip(used, used[1:]))
    rss = [s["rss_mb"] for s in samples]
    out: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "new_tokens": len(res.tokens),
        "steps": len(res.steps),
        "switches": switches,
        "tokens_per_step": res.tokens_per_step,
        "decode_s": dt,
        "trees_used": {trees[k].num_nodes: used.count(k) for k in sorted(set(used))},
        "signal": sched.signal.name,
        "kv_cache_same_buffer": model.kv_cache.data_ptr() == kv_ptr and model.kv_cache.nbytes == kv_bytes,
        "kv_cache_mb": kv_bytes / 2**20,
        "rss_start_mb": rss[0],
        "rss_max_mb": max(rss),
        "rss_end_mb": rss[-1],
        "rss_growth_mb_per_1000_steps": _slope_per_1000([s["step"] for s in samples], rss),
        "samples": samples,
    }
    if count_tensors:
        out["tensors_start"], out["tensors_end"] = samples[0]["tensors"], samples[-1]["tensors"]
        out["tensor_mb_start"], out["tensor_mb_end"] = samples[0]["tensor_mb"], samples[-1]["tensor_mb"]
    if compare_ar == "teacher_forced":
        t1 = clock(model.device)
        tf = teacher_forced_check(model, prompt, res.tokens)
        out["check"] = "teacher_forced"
        out["check_s"] = clock(model.device) - t1
        out["tf_mismatches"] = tf["mismatches"]
        out["lossless"] = not tf["mismatches"]
        out["first_mismatch"] = tf["mismatches"][0]["token"] if tf["mismatches"] else None
    elif compare_ar:
        t1 = clock(model.device)
        ref = ar_generate(model, prompt, new_tokens, eos_ids=[])
        out["check"] = "ar"
        out["check_s"] = clock(model.device) - t1
        diff = next((i for i, (a, b) in enumerate(zip(res.tokens, ref)) if a != b), None)
        if diff is None and len(ref) != len(res.tokens):
            diff = min(len(ref), len(res.tokens))
        out["lossless"] = diff is None
        out["first_mismatch"] = diff
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['new_tokens']} new tokens after a {r['prompt_tokens']}-token prompt in {r['steps']} steps "
             f"({r['tokens_per_step']:.3f} tokens/step), {r['switches']} tree switches, {r['decode_s']:.1f} s"]
    lines.append(f"trees used (nodes: steps): {r['trees_used']}; signal computed each step: {r['signal']}")
    lines.append(f"KV cache {r['kv_cache_mb']:.1f} MB, same buffer throughout: {r['kv_cache_same_buffer']}")
    lines.append(f"RSS start {r['rss_start_mb']:.1f} MB, max {r['rss_max_mb']:.1f} MB, end {r['rss_end_mb']:.1f} MB, "
                 f"growth {r['rss_growth_mb_per_1000_steps']:+.2f} MB per 1,000 steps")
    if "tensors_start" in r:
        lines.append(f"live torch tensors {r['tensors_start']} -> {r['tensors_end']} "
                     f"({r['tensor_mb_start']:.1f} -> {r['tensor_mb_end']:.1f} MB; includes the last step's logits, "
                     "whose size depends on its tree)")
    lines.append("RSS curve (step: MB): " + ", ".join(f"{s['step']}: {s['rss_mb']:.1f}" for s in r["samples"]))
    if r.get("check") == "ar":
        lines.append(f"AR greedy comparison: {'identical tokens' if r['lossless'] else 'MISMATCH at token ' + str(r['first_mismatch'])}"
                     f" (AR took {r['check_s']:.1f} s)")
    elif r.get("check") == "teacher_forced":
        mm = r["tf_mismatches"]
        lines.append(f"teacher-forced check ({r['check_s']:.1f} s): every token is the base argmax given its prefix"
                     if not mm else f"teacher-forced check: {len(mm)} tokens differ from the batched argmax: "
                     + ", ".join(f"token {m['token']} (gap {m['gap']:.2e}, top-2 gap {m['top2_gap']:.2e})" for m in mm[:10]))
    return "\n".join(lines)


def _heads_for(model: Transformer, model_dir: Path, heads_dir: str | None, seed: int) -> tuple[DraftHeads, str]:
    from pipeline.paths import Layout
    from runtime.heads import HeadsConfig, load_heads

    cands = [Path(heads_dir)] if heads_dir else [Layout.for_model("artifacts", model_dir.name).heads_dir(n) for n in ("hydra_pp", "hydra")]
    for d in cands:
        if (d / "config.json").is_file():
            return load_heads(d, model=model), f"trained heads from {d}"
    if heads_dir:
        raise FileNotFoundError(f"--heads-dir {heads_dir} holds no heads (config.json + heads.safetensors)")
    torch.manual_seed(seed)
    heads = DraftHeads(HeadsConfig.for_model(model.args, kind="hydra", prefix_layer=True)).to(model.dtype)
    heads.bind(model)
    return heads.eval().requires_grad_(False), "freshly initialised Hydra++ heads (no trained heads found)"


def main(argv: list[str] | None = None) -> None:
    from pipeline.artifacts import atomic_write_json, machine_info
    from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR
    from runtime.api import render_chat
    from runtime.model import load_model, load_tokenizer

    p = argparse.ArgumentParser(description="Long-run memory and losslessness with per-step tree switching.")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--heads-dir", default=None)
    p.add_argument("--new-tokens", type=int, default=2000)
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the runtime's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--check", choices=("ar", "teacher_forced", "none"), default="ar",
                   help="how to check losslessness: sequential AR greedy decoding (the definition), one "
                        "teacher-forced pass over the output (much cheaper), or not at all")
    p.add_argument("--bank", choices=("default", "small"), default="default",
                   help="default: 3, 6 and 64 nodes (Medusa's tree); small: 3, 6 and 12 nodes (cheaper steps)")
    p.add_argument("--reads-heads", action="store_true",
                   help="compute the heads' greedy chain every step too (head-reading signals; much slower)")
    p.add_argument("--out", default=str(REPORT_DIR / "long_run.json"))
    a = p.parse_args(argv)

    model_dir = Path(a.model_dir)
    tok = load_tokenizer(model_dir)
    text = ("Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
            "Describe every day of the following month.")
    prompt = tok.encode(render_chat(model_dir, text), add_special_tokens=False).ids
    model = load_model(model_dir, dtype=getattr(torch, a.dtype), max_seq_len=len(prompt) + a.new_tokens + 100)
    if a.threads:
        torch.set_num_threads(a.threads)
    heads, heads_desc = _heads_for(model, model_dir, a.heads_dir, seed=0)
    print(f"model {model_dir} ({a.dtype}, {torch.get_num_threads()} threads); {heads_desc}")
    check = {"ar": True, "teacher_forced": "teacher_forced", "none": False}[a.check]
    trees = BANK if a.bank == "default" else SMALL_BANK
    r = long_run(model, heads, prompt, a.new_tokens, trees=trees, sample_every=a.sample_every, compare_ar=check,
                 reads_heads=a.reads_heads, progress=lambda row: print(f"  sample {row}", flush=True))
    r.update({"heads": heads_desc, "dtype": a.dtype, "threads": torch.get_num_threads(), "machine": machine_info()})
    print(format_report(r))
    atomic_write_json(a.out, r)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
