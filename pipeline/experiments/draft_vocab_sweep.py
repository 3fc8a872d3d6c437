"""Draft vocabulary size and drafting arithmetic: what they cost and what they lose, side by side.

    python -m pipeline.experiments.draft_vocab_sweep [--sizes 2048 4096 8192 16384 49152]
        [--kinds hydra medusa] [--arithmetics float32 bfloat16 int8] [--calib-prompts 4]

For every heads kind, draft vocabulary size V_d (the frequency ranking of `pipeline.heads.draft_vocab`,
built from train prompts only) and drafting arithmetic:

* quality, per task, on the model's own greedy continuations of a few *calib* prompts (used here
  to measure, never to build the vocabulary): coverage (share of the continuation tokens inside
  the draft vocabulary), each head's top-1 accuracy against the true next tokens, replayed
  tokens/step of fixed trees from the rank paths (the rollout stage's convention), and the share
  of positions where each head's top-1 equals the float32 arithmetic's;
* cost: `heads.propose` on a chain of depth 1..4 and a one-token base forward at a fixed context,
  all interleaved in one loop (medians; the spread is the inter-quartile range);
  `--clock cpu` (with `--threads 1`) times the process's CPU time instead of wall time: on a
  machine shared with other jobs, waiting for a core then does not count, which wall time cannot
  separate from the work itself;
* end to end: real greedy decodes of a few calib prompts with small fixed trees, interleaved with
  AR, each output checked token-identical to AR.

Writes artifacts/reports/<model>/draft_vocab/{quality,timing,e2e}.csv, sweep.json (machine,
settings) and sweep.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.paths import REPO_ROOT, Layout, default_model_name
from pipeline.artifacts import atomic_write_json, machine_info, save_figure
from pipeline.benchmarks import median, write_csv
from pipeline.config.schema import TRAIN_TASKS
from pipeline.heads.draft_vocab import FrequencySettings, draft_vocab_heads, read_frequencies, token_frequencies
from pipeline.prepare import read_split
from pipeline.replay.accept import replay_tokens_per_step
from runtime.decoder import TreeDecoder
from runtime.ar import ar_generate
from runtime.heads import DraftHeads, HeadsConfig, draft_arithmetics, load_heads
from runtime.model.llama import Transformer
from runtime.model.checkpoint import load_model
from runtime.tree import Tree, TreeBuffers

RANK_CAP = 10
# a 4-chain, a 9-node tree of depth 4 (the shape small banks keep) and Medusa's / Hydra's default
REPLAY_TREES = {
    "chain4": Tree.chain(4),
    "tree9": Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]),
    "mc_sim_7b_63": Tree.named("mc_sim_7b_63"),
}
E2E_TREES = {"chain2": Tree.chain(2), "chain3": Tree.chain(3)}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def heads_variant(full: DraftHeads, ranking: np.ndarray, size: int, arithmetic: str) -> DraftHeads:
    """`full` itself (V_d = V, float32: the shipped heads), or its draft-vocabulary / arithmetic variant."""
    if size == full.config.vocab_size:
        if arithmetic == "float32" and full.dtype == torch.float32:
            return full
        heads = DraftHeads(HeadsConfig.from_dict({**full.config.to_dict(), "draft_dtype": arithmetic})).to(full.dtype)
        heads.load_state_dict(full.state_dict(), strict=True)
        return heads.eval().requires_grad_(False)
    return draft_vocab_heads(full, ranking, size, arithmetic)


@torch.inference_mode()
def own_continuations(model: Transformer, prompts: list[list[int]], new_tokens: int) -> list[dict[str, torch.Tensor]]:
    """The model's greedy continuation y of each prompt and its hidden states [1, P+T-1, dim]."""
    out = []
    for ids in prompts:
        y = ar_generate(model, ids, new_tokens)
        seq = torch.tensor([ids + y[:-1]], dtype=torch.long)
        model.reset_cache()
        _, hidden = model(seq, torch.arange(seq.shape[1]))
        out.append({"tokens": torch.tensor(y), "hidden": hidden, "prompt_len": len(ids)})
    return out


@torch.inference_mode()
def head_ranks(heads: DraftHeads, text: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank paths [T, D] capped at RANK_CAP, top-1 ids [T, D], valid [T, D]) of the heads along
    one continuation, as the rollout stage computes them (head d at step i targets y_{i+1+d})."""
    y, P, D = text["tokens"], int(text["prompt_len"]), heads.config.num_heads
    T = len(y)
    ctx = heads.context(text["hidden"], torch.arange(text["hidden"].shape[1]))[P - 1:P - 1 + T]
    padded = torch.cat([y, torch.full((D,), -1, dtype=torch.long)])
    nxt = padded[torch.arange(T)[:, None] + torch.arange(D + 1)[None, :]]
    logits = heads.teacher_forced_logits(ctx, nxt[:, :D].clamp(min=0))   # [T, D, V]
    target = nxt[:, 1:]
    ranks = (logits > logits.gather(-1, target.clamp(min=0)[..., None])).sum(-1)
    ranks = torch.where(target < 0, RANK_CAP, ranks.clamp(max=RANK_CAP))
    return ranks.numpy().astype(np.int64), logits.argmax(-1).numpy(), (target >= 0).numpy()


def quality_rows(model: Transformer, kind: str, full: DraftHeads, ranking: np.ndarray, sizes: list[int], arithmetics: list[str],
                 texts: dict[str, list[dict[str, torch.Tensor]]]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        reference: dict[str, list[np.ndarray]] = {}
        for arith in arithmetics:
            heads = heads_variant(full, ranking, size, arith)
            heads.bind(model)
            inside = np.zeros(full.config.vocab_size, dtype=bool)
            inside[ranking[:size]] = True
            for task, conts in texts.items():
                per = [head_ranks(heads, c) for c in conts]
                valid = np.concatenate([v for _, _, v in per])
                ranks = np.concatenate([r for r, _, _ in per])
                top1 = np.concatenate([t for _, t, _ in per])
                if arith == arithmetics[0]:
                    reference[task] = top1
                tokens = np.concatenate([c["tokens"].numpy() for c in conts])
                row = {"kind": kind, "task": task, "draft_vocab": size, "arithmetic": arith,
                       "coverage": round(float(inside[tokens].mean()), 4)}
                for d in range(ranks.shape[1]):
                    row[f"top1_h{d + 1}"] = round(float(((ranks[:, d] == 0) & valid[:, d]).sum() / valid[:, d].sum()), 4)
                for name, tree in REPLAY_TREES.items():
                    if tree.depth <= heads.config.num_heads:
                        rollouts = [{"rank_paths": r} for r, _, _ in per]
                        row[f"tps_{name}"] = round(float(replay_tokens_per_step(rollouts, tree, RANK_CAP)), 4)
                row["top1_agree_fp32"] = round(float((top1 == reference[task])[valid].mean()), 4)
                rows.append(row)
                print(f"[sweep] {kind} V_d={size} {arith} {task}: " + ", ".join(f"{k}={v}" for k, v in row.items()
                      if k.startswith(("coverage", "tps", "top1_h1", "top1_agree"))), flush=True)
    return rows


@torch.inference_mode()
def timing_rows(model: Transformer, variants: dict[tuple[str, int, str], DraftHeads], h: torch.Tensor,
                context: int, repeats: int) -> list[dict[str, Any]]:
    """Interleaved medians: heads.propose on chains of depth 1..D per variant, one-token forwards."""
    from pipeline.timing.step_cost import fill_cache

    chains = {d: TreeBuffers.compile(Tree.chain(d)) for d in range(1, 5)}
    samples: dict[Any, list[float]] = {}
    fill_cache(model, context, torch.Generator().manual_seed(context))
    token = torch.tensor([[17]])
    pos = torch.tensor([context])

    def forward() -> None:
        model(token, pos)
        model.truncate_cache(context)

    for rep in range(repeats + 2):  # two warm-up rounds (first calls build the draft products)
        t0 = clock()
        forward()
        if rep >= 2:
            samples.setdefault("forward", []).append(clock() - t0)
        for key, heads in variants.items():
            for d, buf in chains.items():
                if d > heads.config.num_heads:
                    continue
                t0 = clock()
                heads.propose(h, 17, buf)
                if rep >= 2:
                    samples.setdefault((*key, d), []).append(clock() - t0)
    fwd = median(samples["forward"]) * 1e3
    rows = [{"kind": "base", "draft_vocab": model.args.vocab_size, "arithmetic": str(model.dtype).removeprefix("torch."),
             "depth": 0, "median_ms": round(fwd, 3), "iqr_ms": round(_iqr(samples["forward"]) * 1e3, 3),
             "per_depth_ms": None, "per_depth_vs_forward": None}]
    for key, xs in samples.items():
        if key == "forward":
            continue
        kind, size, arith, d = key
        ms = median(xs) * 1e3
        rows.append({"kind": kind, "draft_vocab": size, "arithmetic": arith, "depth": d, "median_ms": round(ms, 3),
                     "iqr_ms": round(_iqr(xs) * 1e3, 3), "per_depth_ms": round(ms / d, 3),
                     "per_depth_vs_forward": round(ms / d / fwd, 4)})
    return rows


def _iqr(xs: list[float]) -> float:
    q = np.percentile(xs, [25, 75])
    return float(q[1] - q[0])


@torch.inference_mode()
def e2e_rows(model: Transformer, decoders: dict[tuple[str, int, str], TreeDecoder], prompts: dict[str, list[list[int]]],
             new_tokens: int) -> list[dict[str, Any]]:
    """Decode each prompt with AR and every decoder x tree, interleaved; tok/s vs AR per task."""
    rows = []
    for task, plist in prompts.items():
        acc: dict[Any, list[float]] = {}
        ar_generate(model, plist[0], 4)  # warm-up
        for ids in plist:
            t0 = clock()
            ref = ar_generate(model, ids, new_tokens)
            a = acc.setdefault("AR", [0, 0, 0.0, 0])
            a[0] += len(ref); a[1] += len(ref) - 1; a[2] += clock() - t0; a[3] += 1  # noqa: E702
            for key, dec in decoders.items():
                for k, name in enumerate(E2E_TREES):
                    t0 = clock()
                    res = dec.generate(ids, new_tokens, choose=k)
                    secs = clock() - t0
                    a = acc.setdefault((*key, name), [0, 0, 0.0, 0])
                    a[0] += len(res.tokens); a[1] += len(res.steps)  # noqa: E702
                    a[2] += secs; a[3] += int(res.tokens == ref)  # noqa: E702
        ar_tps = acc["AR"][0] / acc["AR"][2]
        for key, (toks, steps, secs, same) in acc.items():
            kind, size, arith, tree = ("AR", model.args.vocab_size, "-", "-") if key == "AR" else key
            rows.append({"task": task, "kind": kind, "draft_vocab": size, "arithmetic": arith, "tree": tree,
                         "tokens_per_step": round((toks - len(plist)) / max(steps, 1), 3), "tok_per_s": round(toks / secs, 2),
                         "vs_ar": round(toks / secs / ar_tps, 3), "identical_to_ar": same / len(plist)})
            print(f"[sweep] e2e {task} {kind} V_d={size} {arith} {tree}: {rows[-1]['tok_per_s']} tok/s "
                  f"({rows[-1]['vs_ar']}x AR), tokens/step {rows[-1]['tokens_per_step']}, "
                  f"identical {rows[-1]['identical_to_ar']}", flush=True)
    return rows


def plot(quality: list[dict], timing: list[dict], e2e: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for (kind, task), grp in _groups(quality, ("kind", "task"), arithmetic="float32").items():
        grp.sort(key=lambda r: r["draft_vocab"])
        ax.plot([r["draft_vocab"] for r in grp], [r["tps_chain4"] for r in grp], marker="o", label=f"{kind} {task} chain4")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocabulary V_d")
    ax.set_ylabel("replayed tokens/step (calib continuations)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for (kind, arith), grp in _groups([r for r in timing if r["depth"] == 4], ("kind", "arithmetic")).items():
        grp.sort(key=lambda r: r["draft_vocab"])
        ax.plot([r["draft_vocab"] for r in grp], [100 * r["per_depth_vs_forward"] for r in grp], marker="o",
                label=f"{kind} {arith}")
    ax.axhline(5, color="gray", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocabulary V_d")
    ax.set_ylabel("draft ms per depth (4-chain) / one-token forward, %")
    ax.legend(fontsize=7)
    ax = axes[2]
    for (kind, arith, tree), grp in _groups([r for r in e2e if r["kind"] != "AR"], ("kind", "arithmetic", "tree")).items():
        sizes = sorted({r["draft_vocab"] for r in grp})
        ax.plot(sizes, [np.mean([r["vs_ar"] for r in grp if r["draft_vocab"] == s]) for s in sizes], marker="o",
                label=f"{kind} {arith} {tree}")
    ax.axhline(1, color="gray", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocabulary V_d")
    ax.set_ylabel("end-to-end tok/s vs AR (mean over tasks)")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def _groups(rows: list[dict], keys: tuple[str, ...], **where: Any) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if all(r.get(k) == v for k, v in where.items()):
            out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO_ROOT / Layout.for_model("artifacts", default_model_name()).model_dir))
    ap.add_argument("--heads-root", default=None, help="default artifacts/heads/<model name>")
    ap.add_argument("--data", default=str(REPO_ROOT / "data"))
    ap.add_argument("--kinds", nargs="+", default=["hydra", "medusa"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 49152])
    ap.add_argument("--arithmetics", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--tasks", nargs="+", default=list(TRAIN_TASKS))
    ap.add_argument("--calib-prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--e2e-kinds", nargs="*", default=["hydra"])
    ap.add_argument("--e2e-sizes", nargs="*", type=int, default=None, help="default: --sizes")
    ap.add_argument("--e2e-arithmetics", nargs="*", default=["float32"])
    ap.add_argument("--e2e-prompts", type=int, default=1)
    ap.add_argument("--e2e-tokens", type=int, default=64)
    ap.add_argument("--freq-prompts-per-task", type=int, default=FrequencySettings.prompts_per_task)
    ap.add_argument("--freq-new-tokens", type=int, default=FrequencySettings.max_new_tokens)
    ap.add_argument("--freq", default=None, help="a `pipeline.heads.draft_vocab` frequencies folder (default: build/reuse it)")
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                    help="cpu: the process's CPU time (use with --threads 1 on a shared machine)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: load_model's choice)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["quality", "timing", "e2e"])
    ap.add_argument("--out", default=None, help="default artifacts/reports/<model>/draft_vocab")
    args = ap.parse_args(argv)

    model_dir = Path(args.model)
    heads_root = Path(args.heads_root or REPO_ROOT / Layout.for_model("artifacts", model_dir.name).heads_dir(""))
    out = Path(args.out or REPO_ROOT / Layout.for_model("artifacts", model_dir.name).model_reports / "draft_vocab")
    arithmetics = [a for a in args.arithmetics if a in draft_arithmetics(torch.device("cpu"))]
    global clock
    clock = CLOCKS[args.clock]
    model = load_model(model_dir, dtype=torch.float32, max_seq_len=2048)
    if args.threads:
        torch.set_num_threads(args.threads)
    mach = machine_info()
    print(f"[sweep] machine: {mach['cpu']}, {mach.get('cores')} cores, {mach['torch_threads']} threads, torch {mach['torch']}")
    calib = {t: [r["input_ids"] for r in read_split(Path(args.data), t, "calib", limit=args.calib_prompts)] for t in args.tasks}
    # the measuring text first: it does not depend on the vocabulary, which may still be building
    texts = {t: own_continuations(model, p, args.new_tokens) for t, p in calib.items()} if "quality" not in args.skip else {}
    settings = FrequencySettings(prompts_per_task=args.freq_prompts_per_task, max_new_tokens=args.freq_new_tokens)
    freq_dir = Path(args.freq) if args.freq else token_frequencies(model_dir, Path(args.data),
                                                                   REPO_ROOT / Layout.for_model("artifacts", model_dir.name).frequencies_root, settings)
    ranking = read_frequencies(freq_dir, model.args.vocab_size)["ranking"]
    fulls = {}
    for kind in args.kinds:
        fulls[kind] = load_heads(heads_root / kind, model=model)

    quality: list[dict] = []
    timing: list[dict] = []
    e2e: list[dict] = []
    if "quality" not in args.skip:
        for kind, full in fulls.items():
            quality += quality_rows(model, kind, full, ranking, args.sizes, arithmetics, texts)
        write_csv(out / "quality.csv", quality)
    if "timing" not in args.skip:
        variants = {}
        for kind, full in fulls.items():
            for size in args.sizes:
                for arith in arithmetics:
                    v = heads_variant(full, ranking, size, arith)
                    v.bind(model)
                    variants[(kind, size, arith)] = v
        h = torch.randn(1, model.args.dim, generator=torch.Generator().manual_seed(0))
        timing = timing_rows(model, variants, h, args.context, args.repeats)
        for r in timing:
            if r["depth"] in (0, 4):
                print(f"[sweep] timing {r}")
        write_csv(out / "timing.csv", timing)
        del variants
    if "e2e" not in args.skip:
        decoders = {}
        for kind in args.e2e_kinds:
            for size in args.e2e_sizes or args.sizes:
                for arith in args.e2e_arithmetics:
                    v = heads_variant(fulls[kind], ranking, size, arith)
                    decoders[(kind, size, arith)] = TreeDecoder(model, v, [TreeBuffers.compile(t) for t in E2E_TREES.values()])
        prompts = {t: p[:args.e2e_prompts] for t, p in calib.items()}
        e2e = e2e_rows(model, decoders, prompts, args.e2e_tokens)
        write_csv(out / "e2e.csv", e2e)
    atomic_write_json(out / "sweep.json", {"machine": mach, "settings": vars(args), "frequencies": str(freq_dir),
                                           "replay_trees": {k: [list(p) for p in t.paths] for k, t in REPLAY_TREES.items()}})
    if quality and timing and e2e:
        plot(quality, timing, e2e, out / "sweep.png", f"{model_dir.name}, {mach['cpu']}, float32 model, "
             f"{mach['torch_threads']} threads")
    print(f"[sweep] wrote {out}")


if __name__ == "__main__":
    main()
