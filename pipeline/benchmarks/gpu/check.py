"""`make gpu-check`: the prepared check for a GPU machine that reaches no registry and holds no model.

    python3 -m pipeline.benchmarks.gpu.check --out DIR   # DIR/gpu_check.json

It runs with the machine's own Python and torch (no venv, no install): it needs torch and numpy only
(pipeline.benchmarks and this package import neither hydra-core nor omegaconf). No model either:
a random-weight model of Vicuna-7B's shape (32 layers, dim 4096, 32 heads, 11008 intermediate,
vocabulary 32000) with random Hydra heads, plus Medusa's default tree `mc_sim_7b_63` and the trees
of any banks under artifacts/banks.

For each dtype (float16 and bfloat16 on a GPU) it measures (`pipeline.benchmarks.gpu.measure`):
* row agreement: a tree verify's logits rows against AR's for the same positions, bit for bit, at
  contexts 200 / 700 / 1500, in the ordinary arithmetic and the row-invariant one (`lossless: exact`,
  padded to 8 rows), which must agree exactly (or be refused by the model on this machine);
* verify cost by new rows (1..128) and context; drafting cost by depth and level width;
* the time stage's step-cost model against timed decodes of the trees;
* eager verify forwards against CUDA-graph replays per tree (`pipeline.benchmarks.gpu.cuda_graphs`);
* decode: what users run, token for token against AR in `lossless: exact` on torch's path (the
  small-row kernel off, as on a GPU): `TreeDecoder.generate` with a fixed tree (`mc_sim_7b_63` on a
  GPU), seeded sampling (temperature 0.7), EntMTP-dyn, a random EAGLE-3 drafter, `generate_batch`
  at batch sizes 2 and 4 (these with an 8-row tree) and the batched AR baseline; ~100-token prompts
  and 96 new tokens on a GPU (several 64-key blocks); tokens/step and wall seconds per mode.

It prints each figure, writes them all to DIR/gpu_check.json after every section (a run cut short
still leaves what it measured), and keeps to a time budget (`--budget-s`; 400 s on a GPU, so that
one device call of 8 minutes holds it): sections that no longer fit are skipped and listed. Exit
status: 0 when everything ran and held, 1 when a promise broke (exact rows not bit-identical, a
decode that leaves AR, the graphs' logits off) or a section failed, 2 when a GPU is present
(nvidia-smi lists one, or /dev/nvidia0 exists) but torch cannot use it.

Without a GPU it runs in CPU MODE: the same sections at a scaled-down shape (`cpu-small`, under a
minute on 2 cores; `--quick`: the tiny shape, seconds), which exercises every line of the check
but says nothing about a GPU, and says so. `ENTMTP_ASSUME_GPU=1` (or `main(assume_gpu=True)`)
makes it act as if a GPU were present, `=0` as if none were.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

from pipeline.paths import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "artifacts" / "reports" / "benchmarks" / "gpu_check"
ENV_ASSUME_GPU = "ENTMTP_ASSUME_GPU"
REPORT = "gpu_check.json"
INVARIANT_ROWS = 8  # the schema's invariant_rows default: the padded row count of `lossless: exact`

# the sizes per mode: (shape, dtypes, contexts, rows, repeats, step-model probe rounds and check
# rounds, new tokens per timed decode, prompt tokens of the decodes, graph timing repeats, budget s,
# contexts of the attention probe: None = its own, ~200 / 700 / 1500 placed at KEY_CHUNK boundaries;
# the decode section's tree, prompt tokens and new tokens: past several 64-key blocks on a GPU, fewer
# on a CPU, where a 63-row tree and a hundred tokens per mode would cost minutes)
MODES: dict[str, dict[str, Any]] = {
    "cuda": {"shape": "vicuna-7b", "dtypes": ["float16", "bfloat16"], "contexts": [200, 700, 1500],
             "rows": [1, 2, 4, 8, 16, 32, 64, 128], "repeats": 7, "step_repeats": 3, "step_rounds": 2,
             "new_tokens": 24, "prompt_tokens": 200, "graph_repeats": 15, "budget_s": 400, "probe_contexts": None,
             "decode_tree": "mc_sim_7b_63", "decode_prompt": 100, "decode_new": 96},
    "cpu": {"shape": "cpu-small", "dtypes": ["float32", "bfloat16"], "contexts": [200, 700, 1500],
            "rows": [1, 2, 4, 8, 16, 32, 64, 128], "repeats": 3, "step_repeats": 2, "step_rounds": 1,
            "new_tokens": 12, "prompt_tokens": 200, "graph_repeats": 3, "budget_s": 240, "probe_contexts": None,
            "decode_tree": "chain4+siblings", "decode_prompt": 56, "decode_new": 24},
    "quick": {"shape": "tiny", "dtypes": ["float32", "bfloat16"], "contexts": [24, 90],
              "rows": [1, 2, 4, 8, 16], "repeats": 1, "step_repeats": 1, "step_rounds": 1,
              "new_tokens": 6, "prompt_tokens": 24, "graph_repeats": 1, "budget_s": 240, "probe_contexts": [24, 90],
              "decode_tree": "mc_sim_7b_63", "decode_prompt": 40, "decode_new": 80},
}


# seconds past the budget after which a running section is interrupted (SIGALRM): the last guard
# against a run that the device call's own limit would kill with nothing written
GRACE_S = 20


class BudgetExceeded(Exception):
    """Raised inside the running section when the budget and its grace are spent."""


def _arm_watchdog(seconds: float) -> None:
    """Interrupt the check `seconds` from now (main thread, POSIX only; elsewhere nothing)."""
    if not hasattr(signal, "setitimer"):
        return

    def fire(_sig: int, _frame: Any) -> None:
        raise BudgetExceeded(f"the time budget and its {GRACE_S} s grace are spent")

    try:
        signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    except ValueError:  # not the main thread (e.g. a test runner's worker): no watchdog
        pass


def _disarm_watchdog() -> None:
    if hasattr(signal, "setitimer"):
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        except ValueError:
            pass


def gpu_present() -> str | None:
    """How this machine shows an NVIDIA GPU (None: it shows none), asking the system, not torch:
    $ENTMTP_ASSUME_GPU (1 / 0) first, then /dev/nvidia0, then `nvidia-smi -L`."""
    forced = os.environ.get(ENV_ASSUME_GPU)
    if forced is not None and forced.strip() != "":
        return f"{ENV_ASSUME_GPU}={forced}" if forced.strip() not in ("0", "false", "no") else None
    if Path("/dev/nvidia0").exists():
        return "/dev/nvidia0 exists"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GPU ")]
        if proc.returncode == 0 and lines:
            return f"nvidia-smi: {lines[0].strip()}"
    return None


def cuda_unusable_reason() -> str | None:
    """Why torch cannot compute on the first CUDA device (None: it can: a small product ran)."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable CUDA device"
    try:
        x = torch.ones(64, 64, device="cuda")
        float((x @ x).sum())
    except Exception as e:  # noqa: BLE001 - any failure here means the device cannot be used
        return f"a matrix product on cuda:0 failed: {type(e).__name__}: {str(e)[:300]}"
    return None


class Report:
    """The JSON document, written atomically to `path` whenever a section adds to it."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc

    def write(self) -> None:
        from runtime.io import atomic_write_bytes

        atomic_write_bytes(self.path, (json.dumps(self.doc, indent=1) + "\n").encode())


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def _fmt_grid(rows: list[int], ms: list[float | None]) -> str:
    return "  ".join(f"{n}:{'-' if m is None else f'{m:.3g}'}" for n, m in zip(rows, ms))


def _print_rows(arith: str, ctx: dict[str, Any]) -> None:
    parts = [f"{r['layout']} {r['identical']}/{r['compared']}" + (f" (max|d| {r['max_abs_diff']})" if r["identical"]
             != r["compared"] else "") for r in ctx["layouts"]]
    say(f"    rows {arith:<9} ctx {ctx['context']:>5}: bit-identical to AR: " + ", ".join(parts))


def run_dtype(name: str, cfg: dict[str, Any], device: Any, budget: Any, dtypes_left: int,
              sections: set[str], machine: dict[str, Any], out: dict[str, Any], report: Report) -> None:
    """Every section for one dtype, each guarded: an exception is recorded and the next runs."""
    import torch

    from pipeline.benchmarks.gpu import measure as gm

    dtype = getattr(torch, name)
    args = gm.SHAPES[cfg["shape"]]
    contexts, rows = cfg["contexts"], cfg["rows"]
    span = max(max(contexts) + max(max(rows), 64) + 16,
               gm.decode_tokens_needed(cfg["decode_prompt"], cfg["decode_new"], cfg["decode_tree"]))
    max_seq = min(args.max_position_embeddings, -(-span // 64) * 64)
    dtype_end = time.perf_counter() + max(0.0, budget.left()) / dtypes_left
    out["skipped"], out["errors"] = [], []

    def left() -> float:
        return dtype_end - time.perf_counter()

    def guarded(section: str, fn: Any) -> None:
        if section not in sections:
            return
        if left() <= 0:
            out["skipped"].append(f"{section}: no time left in the budget")
            say(f"  {section}: SKIPPED (time budget)")
            return
        t0 = time.perf_counter()
        try:
            fn()
        except BudgetExceeded:
            out["skipped"].append(f"{section}: cut short by the time budget (what it measured before is kept)")
            say(f"  {section}: CUT SHORT (time budget)")
        except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others'
            out["errors"].append(f"{section}: {type(e).__name__}: {str(e)[:500]}")
            say(f"  {section}: ERROR {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        out.setdefault("section_s", {})[section] = round(time.perf_counter() - t0, 1)
        report.write()

    t0 = time.perf_counter()
    model = gm.random_model(args, dtype, device, max_seq)
    heads = gm.random_heads(model)
    out["model_s"] = round(time.perf_counter() - t0, 1)
    out["max_seq_len"] = max_seq
    say(f"{name}: random {cfg['shape']} model and {gm.NUM_HEADS} Hydra heads ready in {out['model_s']} s "
        f"(cache {max_seq} positions)")
    trees = gm.check_trees()
    try:
        exact_refused = gm.set_arithmetic(model, "exact", INVARIANT_ROWS)
    except Exception as e:  # noqa: BLE001 - not the documented refusal: a fault, recorded; run the rest numerical
        exact_refused = f"set_row_invariance({INVARIANT_ROWS}) failed: {type(e).__name__}: {str(e)[:300]}"
        out["errors"].append(exact_refused)
    model.set_row_invariance(None)
    out["exact_refused"] = exact_refused
    if exact_refused:
        say(f"  lossless exact is REFUSED by the model here: {exact_refused}")
    exact_rows = None if exact_refused else INVARIANT_ROWS

    def rows_section() -> None:
        layouts = {"chain8": gm.Tree.chain(8), "branchy8": gm.branchy_tree(8), **trees}
        out["row_agreement"] = res = {}  # filled as it goes: a run cut short keeps what it compared
        for arith in ("numerical", "exact"):
            if arith == "exact" and exact_refused:
                res[arith] = {"refused": exact_refused}
                continue
            gm.set_arithmetic(model, arith, INVARIANT_ROWS)
            res[arith] = {"contexts": []}
            for c in contexts:
                ctx = {"context": c, "layouts": gm.row_agreement(model, c, layouts)}
                res[arith]["contexts"].append(ctx)
                _print_rows(arith, ctx)
        model.set_row_invariance(None)

    def probe_section() -> None:
        # the row-invariance probe at Vicuna-7B's and Llama-3-8B's attention shapes (1-layer models,
        # every row of two trees against an AR walk), where pipeline.timing.invariance has it
        from pipeline.timing import invariance

        probe = getattr(invariance, "invariance_probe", None)
        if probe is None:
            out["attention_probe"] = {"unavailable": "pipeline.timing.invariance has no invariance_probe"}
            say("    attention probe: unavailable (no pipeline.timing.invariance.invariance_probe)")
            return
        kwargs = {} if cfg["probe_contexts"] is None else {"contexts": cfg["probe_contexts"]}
        try:
            r = probe(device, dtype, rows=INVARIANT_ROWS, **kwargs)
        except RuntimeError as e:  # set_row_invariance's own refusal on this machine
            out["attention_probe"] = {"refused": str(e)}
            say(f"    attention probe: exact REFUSED here: {str(e)[:200]}")
            return
        out["attention_probe"] = r
        for e in r["results"]:
            say(f"    attention probe {e['shape']:>10} ctx {e['context']:>5} {e['tree']:>9}: {e['identical_rows']}/"
                f"{e['nodes']} rows bit-identical to AR (max|d| {e['max_abs_diff']})")

    def verify_section() -> None:
        out["verify_cost"] = res = {}
        arithmetics = ["numerical"] + ([] if exact_refused else ["exact"])
        for arith in arithmetics:
            gm.set_arithmetic(model, arith, INVARIANT_ROWS)
            res[arith] = r = gm.verify_cost(model, rows, contexts, cfg["repeats"], time.perf_counter() + 0.12 * left())
            for c, ms in zip(r["contexts"], r["ms"]):
                say(f"    verify ms {arith:<9} ctx {c:>5} by rows: {_fmt_grid(r['rows'], ms)}")
        model.set_row_invariance(None)

    def draft_section() -> None:
        r = gm.draft_cost(model, heads, contexts[0], [1, 4, 16], cfg["repeats"], time.perf_counter() + 0.08 * left())
        out["draft_cost"] = r
        for d, ms, lv in zip(r["depths"], r["ms"], r["level_ms"]):
            say(f"    draft depth {d}: ms by width {_fmt_grid(r['widths'], ms)}   (level {d} alone: "
                f"{_fmt_grid(r['widths'], lv)})")

    def graphs_section() -> None:
        r = gm.graph_timing(model, trees, contexts, cfg["graph_repeats"], time.perf_counter() + 0.5 * left(),
                            exact_rows)
        out["cuda_graphs"] = r
        if not r["available"]:
            say(f"    CUDA graphs unavailable: {r['unavailable']}")
        else:
            say(f"    CUDA graphs: {r['trees_captured']} trees captured in {r['capture_s']} s")
        for e in r["entries"]:
            timing = (f"eager {e['eager_ms']} ms" + (f", eager exact {e['eager_exact_ms']} ms" if "eager_exact_ms" in e
                      else "") + (f", graph {e['graph_ms']} ms ({e['speedup']}x)" if "graph_ms" in e else ""))
            say(f"    verify {e['tree']:>14} ({e['nodes']:>2} nodes) ctx {e['context']:>5}: {timing}; graph logits "
                f"vs eager: max rel diff {e['max_rel_diff']}, argmax same {e['argmax_same']}/{e['nodes']}")

    def decode_section() -> None:
        out["decode"] = r = {}  # filled as it goes: a run cut short keeps the modes it decoded
        gm.decode_identity(model, heads, cfg["decode_tree"], cfg["decode_prompt"], cfg["decode_new"],
                           time.perf_counter() + 0.35 * left(), INVARIANT_ROWS, into=r)
        if "refused" in r:
            say(f"    decode: exact REFUSED on torch's path here: {r['refused'][:200]}")
            return
        say(f"    decode in {r['arithmetic']}: prompts of {r['prompt_tokens']} tokens, {r['new_tokens']} new tokens "
            f"each; AR {r['ar_token_ms']} ms/token")
        for m in r["modes"]:
            verdict = "identical to AR" if m["identical"] else f"DIFFERS from AR: {m['first_mismatch']}"
            per_step = "" if m["tokens_per_step"] is None else f", {m['tokens_per_step']} tokens/step"
            tree = "" if m["tree"] is None else f", {m['tree']}"
            say(f"    decode {m['mode']:<9} ({m['sequences']} seq{tree}): {verdict}{per_step}, {m['wall_s']} s")
        for mode in r["skipped"]:
            out["skipped"].append(f"decode {mode}: no time left in the section's share of the budget")
            say(f"    decode {mode:<9}: SKIPPED (time budget)")

    def step_section() -> None:
        arith = "numerical" if exact_refused else "exact"
        gm.set_arithmetic(model, arith, INVARIANT_ROWS)
        one_row = None
        vc = out.get("verify_cost", {}).get(arith)
        if vc:
            one_row = vc["ms"][0][0]
        reps, rounds = cfg["step_repeats"], cfg["step_rounds"]
        grid = [n for n in rows if n <= 64]  # the time stage's verify grid: chains, at most 63 deep
        if one_row:  # the most rounds that fit what is left, by a rough estimate from the one-row forward
            sizes = [(r, k) for r in range(reps, 0, -1) for k in range(rounds, 0, -1)]
            fits = [(r, k) for r, k in sizes if gm.estimate_step_model_s(
                one_row, len(trees), len(grid) + len(trees), 2, r, k, cfg["new_tokens"]) <= 0.9 * left()]
            if not fits:
                est = gm.estimate_step_model_s(one_row, len(trees), len(grid) + len(trees), 2, 1, 1, cfg["new_tokens"])
                out["skipped"].append(f"step_model: estimated {est:.0f} s, {left():.0f} s left")
                say(f"  step_model: SKIPPED (estimated {est:.0f} s, {left():.0f} s left)")
                return
            reps, rounds = max(fits, key=lambda rk: (rk[0] + rk[1], rk[0]))
        r = gm.step_model(model, heads, trees, cfg["prompt_tokens"], grid, reps, rounds, cfg["new_tokens"], name,
                          machine)
        r["arithmetic"] = arith
        out["step_model"] = r
        say(f"    step-cost model ({arith}, {reps} probe rounds, {rounds} check rounds, {r['seconds']} s); "
            f"AR token {r['ar_token_ms']} ms")
        for e in r["trees"]:
            say(f"    step {e['tree']:>14} ({e['nodes']:>2} nodes, depth {e['depth']}): model {e['predicted_ms']} ms "
                f"(draft {e['draft_ms']} + verify {e['verify_ms']} + fixed {e['fixed_ms']}), timed {e['measured_ms']} ms, "
                f"phase-corrected {e['phase_corrected_ms']} ms, error {e['error_pct']}%")
        model.set_row_invariance(None)

    with torch.inference_mode():
        guarded("row_agreement", rows_section)
        guarded("attention_probe", probe_section)
        guarded("verify_cost", verify_section)
        guarded("draft_cost", draft_section)
        guarded("decode", decode_section)
    guarded("cuda_graphs", graphs_section)
    guarded("step_model", step_section)
    estimate = gm.graph_step_estimate(out.get("step_model"), out.get("cuda_graphs"))
    if estimate:
        out["graph_step_estimate"] = estimate
        for e in estimate["trees"]:
            say(f"    step with graph {e['tree']:>14}: timed {e['step_ms']} ms, verify eager {e['verify_eager_ms']} ms -> "
                f"graph {e['verify_graph_ms']} ms: about {e['step_with_graph_ms']} ms ({e['speedup']}x; estimated)")
    out["failures"] = gm.failures_of(out.get("row_agreement", {}), out.get("cuda_graphs", {}), dtype,
                                     out.get("attention_probe"), out.get("decode"))
    del model, heads
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_dtypes(cfg: dict[str, Any], device: Any, budget: Any, sections: set[str], machine: dict[str, Any],
                doc: dict[str, Any], report: Report) -> None:
    for i, name in enumerate(cfg["dtypes"]):
        res: dict[str, Any] = {}
        doc["dtypes"][name] = res
        if budget.left() <= 0:
            res["skipped"] = ["every section: no time left in the budget"]
            say(f"{name}: SKIPPED (time budget)")
            continue
        try:
            run_dtype(name, cfg, device, budget, len(cfg["dtypes"]) - i, sections, machine, res, report)
        except BudgetExceeded:
            res.setdefault("skipped", []).append("cut short by the time budget (what it measured before is kept)")
            say(f"{name}: CUT SHORT (time budget)")
        except Exception as e:  # noqa: BLE001 - building the model failed (e.g. out of memory): say so, go on
            res.setdefault("errors", []).append(f"setup: {type(e).__name__}: {str(e)[:500]}")
            say(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        report.write()


SECTIONS = ("row_agreement", "attention_probe", "verify_cost", "draft_cost", "decode", "cuda_graphs", "step_model")


def main(argv: list[str] | None = None, assume_gpu: bool | None = None) -> int:
    """Run the check; returns the exit status (0 ok, 1 a failure, 2 a GPU torch cannot use).
    `assume_gpu`: True / False overrides what the system says (`gpu_present`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"folder for {REPORT} (or a .json path)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: the GPU when one is present (and exit 2 when torch cannot use it), else CPU mode")
    ap.add_argument("--quick", action="store_true", help="the tiny shape and the fewest repeats (seconds; the tests)")
    ap.add_argument("--dtypes", nargs="+", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--contexts", nargs="+", type=int)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--budget-s", type=float, help="wall-clock allowance for the whole check (default per mode)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    from pipeline.benchmarks.gpu.measure import Budget

    present = gpu_present() if assume_gpu is None else ("assumed by the caller" if assume_gpu else None)
    unusable = cuda_unusable_reason()
    out_path = Path(a.out)
    out_path = out_path if out_path.suffix == ".json" else out_path / REPORT
    doc: dict[str, Any] = {"check": "gpu_check", "schema": 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "gpu_present": present}
    report = Report(out_path, doc)
    if a.device == "cpu":
        mode = "cpu"
    elif present or a.device == "cuda" or unusable is None:
        if unusable is not None:
            doc.update(mode="unusable-gpu", verdict="FAIL", failures=[f"GPU present ({present or 'asked for'}) "
                                                                      f"but torch cannot use it: {unusable}"])
            report.write()
            say(f"FAIL: a GPU is present ({present or '--device cuda'}) but torch cannot use it: {unusable}.")
            say("Run the check with the machine's own python3 (its torch is a CUDA build), not a venv "
                "that `make install` made (that one holds the CPU wheel).")
            return 2
        mode = "cuda"
    else:
        mode = "cpu"
    cfg = dict(MODES["quick" if a.quick else mode])
    if a.dtypes:
        cfg["dtypes"] = a.dtypes
    if a.contexts:
        cfg["contexts"] = sorted(a.contexts)
    budget = Budget(a.budget_s if a.budget_s is not None else cfg["budget_s"], t0=t_start)
    device = torch.device("cuda" if mode == "cuda" else "cpu")
    from pipeline.artifacts import machine_info

    machine = machine_info()
    doc.update(mode=mode, shape=cfg["shape"], quick=a.quick, settings={k: v for k, v in cfg.items()},
               machine=machine, device_name=torch.cuda.get_device_name(0) if mode == "cuda" else machine["cpu"],
               budget_s=budget.seconds, dtypes={})
    if mode == "cpu":
        note = ("CPU MODE: " + ("asked for with --device cpu" if a.device == "cpu" else
                                "no GPU on this machine (no /dev/nvidia0, no GPU listed by nvidia-smi)")
                + f". Every section runs on the CPU at the scaled-down shape {cfg['shape']!r}: this exercises the "
                "check end to end, and its figures say NOTHING about a GPU. It is not a GPU check result.")
        doc["note"] = note
        say(note)
    else:
        say(f"CUDA MODE: {doc['device_name']}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"Python {doc['python']}; random {cfg['shape']} model; budget {budget.seconds:.0f} s")
    report.write()
    _arm_watchdog(budget.left() + GRACE_S)
    try:
        _run_dtypes(cfg, device, budget, set(a.sections), machine, doc, report)
    except BudgetExceeded:  # between sections: what ran is in the report already
        doc.setdefault("cut_short", "the time budget ran out between sections")
    finally:
        _disarm_watchdog()

    failures = [f"{d}: {f}" for d, r in doc["dtypes"].items() for f in r.get("failures", []) + r.get("errors", [])]
    skipped = [f"{d}: {s}" for d, r in doc["dtypes"].items() for s in r.get("skipped", [])]
    # the model's own guard refusing `lossless: exact` here is no broken promise, but banks built
    # with device=cuda in that dtype cannot be exact: said at the end, where it is seen
    warnings = [f"{d}: lossless exact refused: {r['exact_refused']}" for d, r in doc["dtypes"].items()
                if r.get("exact_refused")]
    warnings += [f"{d}: attention probe: exact refused: {r['attention_probe']['refused']}"
                 for d, r in doc["dtypes"].items() if "refused" in r.get("attention_probe", {})]
    warnings += [f"{d}: decode: exact refused on torch's path: {r['decode']['refused']}"
                 for d, r in doc["dtypes"].items() if "refused" in r.get("decode", {})]
    doc.update(failures=failures, skipped=skipped, warnings=warnings,
               elapsed_s=round(time.perf_counter() - t_start, 1), verdict="FAIL" if failures else "OK")
    report.write()
    for w in warnings:
        say(f"WARNING {w}")
    for f in failures:
        say(f"FAIL {f}")
    for s in skipped:
        say(f"skipped {s}")
    tail = " (CPU MODE: not a GPU result)" if mode == "cpu" else ""
    say(f"{doc['verdict']}{tail}: {len(failures)} failures, {len(skipped)} skipped, {doc['elapsed_s']} s; "
        f"wrote {out_path}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
