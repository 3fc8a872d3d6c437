"""Long runs (issue 7): many steps with a tree switch at every step keep memory flat (the KV caches
are preallocated, nothing accumulates per step) and stay lossless.

One greedy decode (EOS ignored) with a schedule that changes the tree at *every* step, cycling
through a bank of three trees (a chain, a small branching tree and a larger one): the decoder's
real per-step path (p0 and entropy of the base logits, drafting, verify, KV compaction; with
`reads_heads` also the heads' greedy chain that head-reading signals need) runs each step. Every
`sample_every` steps `long_run` records the process RSS (/proc/self/statm), the live torch tensors
(count and bytes, found through the garbage collector) and, on a GPU, torch's allocated bytes; then
it checks the tokens against AR greedy decoding (or one teacher-forced pass). The KV cache is
preallocated (`setup_cache` / `load_model(max_seq_len=...)`), so memory must not grow with the
number of steps.

Fast versions on a tiny random model; the slow test is the real thing: SmolLM2-135M with its
shipped heads, 2,000 tokens. (This check was `pipeline/benchmarks/long_run.py`; its verdict lives
here, and `format_report` prints the figures with `pytest -s`.)"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtime.decoder import TreeDecoder
from runtime.device import clock
from runtime.heads import DraftHeads, HeadsConfig
from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from runtime.policy import LadderPolicy, Scheduler, Signal, greedy_path_value
from runtime.tree import Tree, TreeBuffers

PAGE = os.sysconf("SC_PAGE_SIZE")
SIX_NODES = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
BANK = (Tree.chain(2), SIX_NODES, Tree.named("mc_sim_7b_63"))
# without the 63-node tree (a fp32 verify of 64 nodes costs ~3 small ones on this CPU): for runs
# that must fit a short time slot (the slow test)
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
    prefill instead of len(tokens) sequential AR steps. In the ordinary arithmetic a batched pass
    rounds differently from step-by-step decoding, so a mismatch at a near-tie (top-2 logit gap
    ~1e-5) is a floating-point tie, not a decoding error: the gaps are reported. Under row
    invariance (`Transformer.set_row_invariance`) the pass's logits are AR's, and the check is exact."""
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
    from runtime.ar import ar_generate

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
        "tokens": res.tokens,
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


def heads_for(model: Transformer, model_dir: Path, seed: int = 0,
              names: Sequence[str] = ("hydra_pp", "hydra")) -> tuple[DraftHeads, str]:
    """The model's first shipped heads of `names` (under artifacts/heads/<model>/) when present, else
    freshly initialised Hydra++ heads: they accept little, which does not matter for memory or
    losslessness, and their prefix layer has its own KV cache that must stay flat too."""
    from pipeline.paths import Layout
    from runtime.heads import load_heads

    for d in (Layout.for_model("artifacts", model_dir.name).heads_dir(n) for n in names):
        if (d / "config.json").is_file():
            return load_heads(d, model=model), f"shipped heads from {d}"
    torch.manual_seed(seed)
    heads = DraftHeads(HeadsConfig.for_model(model.args, kind="hydra", prefix_layer=True)).to(model.dtype)
    heads.bind(model)
    return heads.eval().requires_grad_(False), "freshly initialised Hydra++ heads (no shipped heads found)"


# ---------------------------------------------------------------------------------------------- tests
NEW_TOKENS = 600


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads; on a busy shared CPU two spinning OpenMP threads
    made tiny-model decoding 15-50x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_setup(prompt_len: int, new_tokens: int, kind: str = "hydra", prefix: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    vocab = 48
    args = ModelArgs(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=64, eos_token_ids=(vocab - 1,), max_position_embeddings=4096)
    model = Transformer(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.setup_cache(prompt_len + new_tokens + 100)
    heads = DraftHeads(HeadsConfig.for_model(args, kind=kind, num_heads=4, prefix_layer=prefix))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    heads.bind(model)
    return model.eval(), heads.eval()


def test_switching_scheduler_changes_tree_every_step() -> None:
    s = switching_scheduler(3)
    picks = [s.choose(0.5, [0.5] * 4, 1.0) for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert s.signal.name == "p0" and switching_scheduler(3, reads_heads=True).signal.name == "greedy_path"


# seeds whose random heads get drafts accepted now and then (so the KV compaction really runs)
@pytest.mark.parametrize("kind,prefix,seed,reads_heads", [("hydra", True, 2, True), ("medusa", False, 0, False)])
def test_long_run_is_lossless_with_flat_memory(kind: str, prefix: bool, seed: int, reads_heads: bool) -> None:
    prompt = list(range(3, 12))
    model, heads = tiny_setup(len(prompt), NEW_TOKENS, kind, prefix, seed)
    r = long_run(model, heads, prompt, NEW_TOKENS, sample_every=100, reads_heads=reads_heads)
    assert r["signal"] == ("greedy_path" if reads_heads else "p0")
    print(format_report(r))
    assert r["new_tokens"] == NEW_TOKENS and r["lossless"], r["first_mismatch"]
    assert r["switches"] == r["steps"] - 1, "the schedule must change tree at every step"
    assert set(r["trees_used"]) == {t.num_nodes for t in BANK}
    assert r["steps"] < NEW_TOKENS - 50, "hardly any draft was accepted: the test would not exercise cache compaction"
    assert r["kv_cache_same_buffer"], "the KV cache was reallocated during decoding"
    # nothing accumulates per step: no extra live tensors, and RSS within allocator noise
    assert r["tensors_end"] <= r["tensors_start"] + 2, (r["tensors_start"], r["tensors_end"])
    assert abs(r["tensor_mb_end"] - r["tensor_mb_start"]) < 0.5
    growth_mb = r["rss_end_mb"] - r["samples"][1]["rss_mb"]  # after the first 100 steps (warm-up)
    assert growth_mb < 4.0, format_report(r)


def test_teacher_forced_check_accepts_greedy_and_flags_a_wrong_token() -> None:
    from tests.helpers import ar_greedy

    prompt = list(range(3, 12))
    model, _ = tiny_setup(len(prompt), 80)
    ref = ar_greedy(model, prompt, 80)
    assert teacher_forced_check(model, prompt, ref, chunk=16) == {"checked": len(ref), "mismatches": []}
    bad = list(ref)
    bad[30] = (bad[30] + 1) % 48
    mm = teacher_forced_check(model, prompt, bad, chunk=7)["mismatches"]
    assert mm and mm[0]["token"] == 30 and mm[0]["gap"] > 0


# ~2 min on the 2-core bench machine (one thread); the 63-node bank, full-vocabulary heads and a
# sequential AR reference over all 2,000 tokens took 5 min
@pytest.mark.slow
def test_smollm2_2000_tokens_switching_every_step(smollm2_dir: Path) -> None:
    """The real thing: SmolLM2-135M with its shipped heads (the draft-vocabulary ones its banks
    use), 2,000 tokens, a tree switch at every step, in the shipped arithmetic (`lossless: exact`,
    every forward row-invariant with 8 rows). Memory stays flat, and the output is AR's: every
    token is the base argmax given its prefix in one teacher-forced pass (exact here: under row
    invariance a position's logits do not depend on the forward, so they are AR's bit for bit), and
    the first 200 tokens are also compared with sequential AR decoding, the definition."""
    from runtime.api import render_chat
    from runtime.ar import ar_generate
    from runtime.model.checkpoint import load_model, load_tokenizer

    # one thread (the autouse fixture): on the shared 2-core machine, 2 threads ran SmolLM2 3-4x slower
    tok = load_tokenizer(smollm2_dir)
    prompt = tok.encode(render_chat(smollm2_dir, "Tell me a very long story about the sea."), add_special_tokens=False).ids
    model = load_model(smollm2_dir, max_seq_len=len(prompt) + 2000 + 100)
    torch.set_num_threads(1)  # load_model sets all cores the first time it runs in a process
    model.set_row_invariance(8)
    heads, _ = heads_for(model, smollm2_dir, seed=0, names=("hydra-draft8192", "hydra"))
    # the small bank (3, 6, 12 nodes): cheaper steps than the 63-node tree's, the same per-step path
    r = long_run(model, heads, prompt, 2000, trees=SMALL_BANK, compare_ar="teacher_forced", count_tensors=False)
    print(format_report(r))
    assert r["new_tokens"] == 2000 and r["switches"] == r["steps"] - 1 and r["kv_cache_same_buffer"]
    assert set(r["trees_used"]) == {t.num_nodes for t in SMALL_BANK}
    assert r["lossless"], f"tokens that are not the base argmax: {r['tf_mismatches'][:5]}"
    assert r["rss_end_mb"] - r["samples"][1]["rss_mb"] < 32.0, format_report(r)  # after the first 100 steps
    assert r["tokens"][:200] == ar_generate(model, prompt, 200, eos_ids=[])
