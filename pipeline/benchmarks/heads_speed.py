"""Tokens per step and tok/s of the trained heads with fixed trees, side by side with AR.

    python -m pipeline.benchmarks.heads_speed [--prompts 3] [--new-tokens 128] [--dtype float32]

For each task's eval prompts (written by the prepare stage), decodes with runtime AR, then Hydra
and Medusa heads with Medusa's default tree `mc_sim_7b_63` and with a 4-chain, interleaved per
prompt. Prints and writes a CSV under artifacts/reports/benchmarks/ with the machine recorded.
Greedy: every output is checked token-identical to AR.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, machine_info
from pipeline.paths import REPO_ROOT, Layout, default_model_name
from pipeline.prepare import read_split
from pipeline.config.schema import TRAIN_TASKS
from runtime.decoder import TreeDecoder
from runtime.device import clock
from runtime.ar import ar_generate
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model
from runtime.tree import Tree, TreeBuffers



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Layout.for_model(REPO_ROOT / "artifacts", default_model_name())
    ap.add_argument("--model", default=str(default.model_dir))
    ap.add_argument("--heads-root", default=str(default.heads_dir("")), help="the folder holding one folder per heads kind")
    ap.add_argument("--data", default=str(REPO_ROOT / "data"))
    ap.add_argument("--tasks", nargs="+", default=list(TRAIN_TASKS))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(REPO_ROOT / "artifacts/reports/benchmarks/heads_speed.csv"))
    args = ap.parse_args(argv)

    model = load_model(args.model, dtype=getattr(torch, args.dtype), max_seq_len=2048)
    trees = {"mc_sim_7b_63": Tree.named("mc_sim_7b_63"), "chain4": Tree.named("chain4")}
    decoders = {}
    for kind in ("hydra", "medusa"):
        folder = Path(args.heads_root) / kind
        if not folder.is_dir():
            print(f"[heads_speed] no {kind} heads in {folder}; skipping them (train with `make heads`)")
            continue
        heads = load_heads(folder, model=model)
        decoders[kind] = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees.values()])
    mach = machine_info()
    print(f"machine: {mach['cpu']}, {mach['torch_threads']} threads, torch {mach['torch']}, {args.dtype}")
    rows = []
    for task in args.tasks:
        prompts = read_split(Path(args.data), task, "eval", limit=args.prompts)
        acc: dict[str, list[float]] = {}
        ar_decode(model, prompts[0]["input_ids"], 8)  # warm-up
        for p in tqdm(prompts, desc=f"heads_speed {task}", unit="prompt"):
            ids = p["input_ids"]
            t0 = clock(model.device)
            ref = ar_generate(model, ids, args.new_tokens)
            acc.setdefault("AR", [0, 0, 0.0, 0])
            _add(acc["AR"], len(ref), len(ref) - 1, clock(model.device) - t0, 1)
            for kind, dec in decoders.items():
                for k, name in enumerate(trees):
                    res = dec.generate(ids, args.new_tokens, choose=k)
                    _add(acc.setdefault(f"{kind} + {name}", [0, 0, 0.0, 0]), len(res.tokens), len(res.steps),
                         res.prefill_seconds + res.decode_seconds, int(res.tokens == ref))
        ar_tps = acc["AR"][0] / acc["AR"][2]
        for method, (toks, steps, secs, same) in acc.items():
            tps_step = (toks - len(prompts)) / steps if method != "AR" else 1.0
            rows.append({"task": task, "method": method, "tokens_per_step": tps_step, "tok_per_s": toks / secs,
                         "speedup_vs_ar": toks / secs / ar_tps, "identical_to_ar": same / len(prompts)})
    lines = ["task,method,tokens_per_step,tok_per_s,speedup_vs_ar,identical_to_ar"]
    print(f"\n{'task':10s} {'method':24s} {'tok/step':>8s} {'tok/s':>7s} {'vs AR':>6s} {'=AR':>5s}")
    for r in rows:
        print(f"{r['task']:10s} {r['method']:24s} {r['tokens_per_step']:8.3f} {r['tok_per_s']:7.2f} "
              f"{r['speedup_vs_ar']:6.2f} {r['identical_to_ar']:5.2f}")
        lines.append(",".join(str(r[k]) for k in ("task", "method", "tokens_per_step", "tok_per_s", "speedup_vs_ar", "identical_to_ar")))
    lines.append(f"# machine: {mach}")
    atomic_write_bytes(args.out, ("\n".join(lines) + "\n").encode())
    print(f"\nwrote {args.out}")


def _add(acc: list, toks: int, steps: int, secs: float, same: int) -> None:
    acc[0] += toks
    acc[1] += steps
    acc[2] += secs
    acc[3] += same


def ar_decode(model, ids: list[int], n: int) -> None:
    ar_generate(model, ids, n)


if __name__ == "__main__":
    main()
