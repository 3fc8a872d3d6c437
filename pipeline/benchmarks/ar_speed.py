"""AR greedy decoding speed: the runtime vs transformers `generate`, side by side.

    python -m pipeline.benchmarks.ar_speed [--prompts-per-task 2] [--max-new-tokens 64] ...

Engines run interleaved on the same prompts (the order alternates every round), with the same
thread count, so that the load of a shared machine hits all of them alike; ratios are taken per
(prompt, round) pair and then summarised by their median. Every engine must emit the same tokens
(greedy decoding is deterministic): a mismatch is reported, since it would make the comparison
meaningless.

Figures: total tok/s = new tokens / wall time including the prefill; decode tok/s = (new tokens - 1)
/ time from the first to the last new token (the per-token path alone).
Writes artifacts/reports/benchmarks/ar_speed.csv (one row per run) and ar_speed.json (machine,
settings, summary).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import atomic_write_json, machine_info
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, TASKS, median, write_csv
from pipeline.prepare.render import task_prompts
from runtime.ar import ar_generate
from runtime.device import clock
from runtime.model.checkpoint import load_model

# An engine runs one greedy generation and returns (tokens, seconds to first token, total seconds).
Engine = Callable[[list[int], int], tuple[list[int], float, float]]


def runtime_engine(model_dir: Path, dtype: torch.dtype, max_seq_len: int) -> Engine:
    model = load_model(model_dir, dtype=dtype, max_seq_len=max_seq_len)

    def run(ids: list[int], n: int) -> tuple[list[int], float, float]:
        t0 = clock(model.device)
        first: list[float] = []  # a streamed token has been read on the host: the device is idle
        out = ar_generate(model, ids, n, eos_ids=(), stream=lambda _t: first or first.append(time.perf_counter()))
        t1 = clock(model.device)
        return out, first[0] - t0, t1 - t0

    return run


def transformers_engine(model_dir: Path, dtype: torch.dtype) -> Engine:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.first = 0.0

        def put(self, value: Any) -> None:  # first call: the prompt; second: the first new token
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def run(ids: list[int], n: int) -> tuple[list[int], float, float]:
        # EOS disabled so every engine produces exactly n tokens (we compare speeds, not lengths);
        # eos_token_id=None would fall back to the model's EOS, an empty list really disables it
        gc = GenerationConfig(max_new_tokens=n, do_sample=False, num_beams=1,
                              eos_token_id=[], pad_token_id=hf.config.pad_token_id or 0)
        streamer = FirstToken()
        x = torch.tensor([ids])
        t0 = clock(hf.device)
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, streamer=streamer)
        t1 = clock(hf.device)
        return y[0, len(ids):].tolist(), streamer.first - t0, t1 - t0

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="AR greedy speed: runtime vs transformers generate")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--tasks", nargs="+", default=["humaneval", "gsm8k"], choices=TASKS)
    p.add_argument("--prompts-per-task", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts (engine order alternates)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-bf16", action="store_true", help="skip the runtime bf16 engine")
    p.add_argument("--hf-bf16", action="store_true", help="also time transformers in bf16")
    p.add_argument("--out", type=Path, default=REPORT_DIR)
    a = p.parse_args(argv)

    prompts = task_prompts(a.model, a.tasks, a.prompts_per_task)
    max_seq = max(len(ids) for _, ids in prompts) + a.max_new_tokens
    engines: dict[str, Engine] = {
        "transformers_fp32": transformers_engine(a.model, torch.float32),
        "runtime_fp32": runtime_engine(a.model, torch.float32, max_seq),
    }
    if not a.no_bf16:
        engines["runtime_bf16"] = runtime_engine(a.model, torch.bfloat16, max_seq)
    if a.hf_bf16:
        engines["transformers_bf16"] = transformers_engine(a.model, torch.bfloat16)
    torch.set_num_threads(a.threads)  # after loading: load_model sets the thread count too
    print(f"{len(prompts)} prompts ({', '.join(a.tasks)}), {a.max_new_tokens} new tokens, {a.rounds} rounds, "
          f"{torch.get_num_threads()} threads; engines: {', '.join(engines)}")

    names = list(engines)
    rows: list[dict[str, Any]] = []
    for ids in (prompts[0][1],):  # warm-up (allocators, oneDNN kernels), not recorded
        for fn in engines.values():
            fn(ids, 4)
    for rnd in range(a.rounds):
        for pi, (task, ids) in enumerate(prompts):
            order = names if (rnd + pi) % 2 == 0 else names[::-1]
            outs: dict[str, list[int]] = {}
            for name in order:
                out, first, total = engines[name](ids, a.max_new_tokens)
                outs[name] = out
                rows.append({
                    "round": rnd, "prompt": pi, "task": task, "engine": name, "prompt_tokens": len(ids),
                    "new_tokens": len(out), "seconds": round(total, 4),
                    "total_tok_s": round(len(out) / total, 3),
                    "decode_tok_s": round((len(out) - 1) / (total - first), 3) if len(out) > 1 else float("nan"),
                })
                print(f"  round {rnd} prompt {pi} ({task}, {len(ids)} tokens) {name:<18} "
                      f"{rows[-1]['total_tok_s']:7.2f} tok/s total, {rows[-1]['decode_tok_s']:7.2f} decode", flush=True)
            ref = outs["transformers_fp32"]
            for r in rows[-len(order):]:
                same = outs[r["engine"]] == ref
                r["same_tokens_as_transformers_fp32"] = same
                if not same and r["engine"] == "runtime_fp32":
                    print(f"WARNING: runtime_fp32 differs from transformers_fp32 on prompt {pi} (round {rnd})")

    summary: dict[str, Any] = {}
    for name in names:
        mine = [r for r in rows if r["engine"] == name]
        summary[name] = {
            "median_total_tok_s": round(median([r["total_tok_s"] for r in mine]), 2),
            "median_decode_tok_s": round(median([r["decode_tok_s"] for r in mine]), 2),
            "token_identical_runs": sum(r["same_tokens_as_transformers_fp32"] for r in mine),
            "runs": len(mine),
        }
    ratios: dict[str, dict[str, float]] = {}
    for name in names[1:]:
        for metric in ("total_tok_s", "decode_tok_s"):
            paired = [
                r[metric] / b[metric]
                for r in rows if r["engine"] == name
                for b in rows if b["engine"] == "transformers_fp32" and (b["round"], b["prompt"]) == (r["round"], r["prompt"])
            ]
            ratios.setdefault(f"{name}/transformers_fp32", {})[metric] = round(median(paired), 3)

    print(f"\n{'engine':<20}{'total tok/s':>13}{'decode tok/s':>14}{'identical':>11}")
    for name, s in summary.items():
        print(f"{name:<20}{s['median_total_tok_s']:>13.2f}{s['median_decode_tok_s']:>14.2f}"
              f"{s['token_identical_runs']:>6}/{s['runs']}")
    print("\nmedian paired ratios (per prompt and round):")
    for k, v in ratios.items():
        print(f"  {k:<40} total x{v['total_tok_s']:.2f}   decode x{v['decode_tok_s']:.2f}")

    a.out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(a.out / "ar_speed.csv", rows)
    report = {"machine": machine_info(), "settings": {k: str(v) for k, v in vars(a).items()},
              "prompts": len(prompts), "summary": summary, "ratios_vs_transformers_fp32": ratios}
    atomic_write_json(a.out / "ar_speed.json", report)
    print(f"\nwrote {csv_path} and {a.out / 'ar_speed.json'} (machine: {report['machine']['cpu']}, "
          f"{report['machine']['cores']} cores; timings on a shared machine are noisy, trust the paired ratios)")
    return report


if __name__ == "__main__":
    main()
