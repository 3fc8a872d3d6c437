"""Training changes for the draft heads, each against the baseline recipe at one reduced scale.

    python -m pipeline.experiments.heads_ablation [--kind hydra] [--train-prompts 96]
        [--holdout-per-task 10] [--new-tokens 128] [--variants baseline sampled rank ttt sampled_8ep ...] [--seeds 0 1]

Every variant trains heads of `conf/heads/<kind>.yaml` on the same self-distilled continuations of
the same training prompts (the default mix, fewer prompts), with the same epochs and seed (unless
a variant sets them), and is judged on held-out text the heads never saw: the base model's greedy
continuations of the first calib prompts of each task (calib splits are disjoint from every train
pool). The measure is what a bank sees: replayed tokens/step of fixed trees (a 4-chain, the 9-node
depth-4 tree small banks keep, mc_sim_7b_63) along those continuations, per task, plus each head's
top-1.

A variant is a set of `heads.train` overrides (`VARIANTS`); `--set key=value ...` adds one more,
named `custom`. `--shipped` also measures every heads folder shipped for the model on the same
held-out text (coverage of the draft vocabulary per task, and tokens/step of each reduced-vocabulary
variant against its full-vocabulary heads on the same trees). Self-distillation data and finished runs are cached under
artifacts/cache/heads/<model>/ablation/, so a rerun only trains what is new. Writes
artifacts/reports/<model>/heads/ablation-<kind>{.csv,-summary.csv,.json} (every run, the mean per
variant and its change against the baseline, the machine, settings) and shipped_heads_holdout.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.artifacts import atomic_write_json, hash_obj, machine_info, read_json
from pipeline.benchmarks import write_csv
from pipeline.experiments.draft_vocab_sweep import REPLAY_TREES
from pipeline.heads.recipe import heads_config_for
from pipeline.heads.distill import build_selfdistill
from pipeline.heads.mix import read_train_rows, select_prompts
from pipeline.heads.report import evaluate_heads
from pipeline.heads.train import train_loop
from pipeline.model.provision import model_fingerprint
from pipeline.paths import CONF_DIR, REPO_ROOT, Layout, default_model_name
from pipeline.prepare import read_split
from pipeline.config.schema import TRAIN_TASKS, TrainSettings
from runtime.heads import DraftHeads
from runtime.config import ModelArgs
from runtime.model.checkpoint import load_model

log = logging.getLogger(__name__)

# heads.train overrides of each training change under trial
SAMPLED: dict[str, Any] = {"sampled_continuations": 1, "sample_temperature": 0.8}  # the shipped Hydra recipe's data
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "sampled": SAMPLED,                                                   # + one T=0.8 sample per prompt
    "rank": {"rank_loss_weight": 0.5, "rank_loss_topk": 8},              # HASS-style top-8 listwise term
    "ttt": {"ttt_weight": 0.5},                                          # EAGLE-3 training-time test
    # on top of the shipped recipe (one sampled continuation): more data, or more of the same training
    "sampled2": {**SAMPLED, "sampled_continuations": 2},                 # two T=0.8 samples per prompt
    "sampled_8ep": {**SAMPLED, "epochs": 8.0},
    "sampled_lr3e-3": {**SAMPLED, "lr": 3e-3},
}


def holdout_rows(data_dir: Path, tasks: list[str], per_task: int, max_prompt_tokens: int) -> list[dict]:
    """The first `per_task` calib prompts of each task that fit (never part of a training mix)."""
    out = []
    for task in tasks:
        rows = [r for r in read_split(data_dir, task, "calib") if 0 < len(r["input_ids"]) <= max_prompt_tokens]
        out += rows[:per_task]
    return out


def run_variant(name: str, overrides: dict[str, Any], seed: int, base: TrainSettings, heads_cfg: dict[str, Any],
                model: Any, model_dir: Path, train_rows: list[dict], greedy: list[dict], sd_dir: Path,
                holdout: dict[str, list[dict]], cache: Path) -> dict[str, Any]:
    """Train one variant (or read its cached result) and measure it on the held-out text."""
    s = dataclasses.replace(base, **overrides, seed=seed)
    config = heads_config_for(heads_cfg, model.args, None)
    key = {"heads": config.to_dict(), "train": s.key_dict(), "data": hash_obj([r["id"] for r in train_rows]),
           "holdout": {t: [len(q["tokens"]) for q in v] for t, v in holdout.items()}, "trees": list(REPLAY_TREES)}
    done = cache / f"run-{hash_obj(key)}.json"
    if done.is_file():  # keyed by what is trained, so a run cached under another name is renamed
        return {**read_json(done), "variant": name}
    seqs = list(greedy)
    for k in range(s.sampled_continuations):
        seqs += build_selfdistill(model_dir, train_rows, s, sd_dir / f"train-T{s.sample_temperature:g}-s{k}",
                                  temperature=s.sample_temperature, sample_seed=k)
    torch.manual_seed(s.seed)
    heads = DraftHeads(config)
    heads.bind(model)
    heads.init_output_from_base()
    work = cache / f"train-{hash_obj(key)}"
    work.mkdir(parents=True, exist_ok=True)
    c0 = time.process_time()
    fit = train_loop(heads, seqs, s, work, run_key=hash_obj(key))
    cpu = time.process_time() - c0
    row: dict[str, Any] = {"variant": name, "seed": seed, "settings": json.dumps(overrides, sort_keys=True),
                           "train_sequences": len(seqs), "steps": fit["steps"],
                           "train_cpu_s": round(cpu, 1) if fit["resumed_from"] == 0 else None}
    pooled = [q for v in holdout.values() for q in v]
    with torch.inference_mode():
        for task, seqs_t in [("all", pooled), *holdout.items()]:
            rep = evaluate_heads(heads, seqs_t, trees=REPLAY_TREES)
            for tree, tps in rep["tokens_per_step"].items():
                row[f"{task}/{tree}"] = tps
            if task == "all":
                row.update({f"top1_h{d + 1}": a for d, a in enumerate(rep["top1"])})
    atomic_write_json(done, row)
    return row


@torch.inference_mode()
def shipped_rows(model: Any, heads_root: Path, holdout: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Every heads folder under `heads_root` on the held-out text: coverage of the continuation
    tokens by the draft vocabulary (1.0 without one) and replayed tokens/step per task; a
    `<kind>-draft<V>` folder is also compared with its full-vocabulary `<kind>` on the same trees."""
    from runtime.heads import load_heads

    rows: dict[str, dict[str, Any]] = {}
    for folder in sorted(p for p in heads_root.iterdir() if (p / "config.json").is_file()):
        heads = load_heads(folder, model)
        row: dict[str, Any] = {"heads": folder.name, "draft_vocab": heads.config.draft_vocab_size}
        inside = torch.ones(heads.config.vocab_size, dtype=torch.bool)
        if heads.draft_ids is not None:
            inside = torch.zeros_like(inside)
            inside[heads.draft_ids] = True
        pooled = [q for v in holdout.values() for q in v]
        for task, seqs in [("all", pooled), *holdout.items()]:
            tokens = torch.cat([q["tokens"] for q in seqs])
            row[f"{task}/coverage"] = round(float(inside[tokens].float().mean()), 4)
            for tree, tps in evaluate_heads(heads, seqs, trees=REPLAY_TREES)["tokens_per_step"].items():
                row[f"{task}/{tree}"] = tps
        rows[folder.name] = row
    for name, row in rows.items():
        full = rows.get(name.split("-draft")[0]) if "-draft" in name else None
        if full is not None:
            for col in [c for c in row if "/" in c and not c.endswith("coverage")]:
                row[f"{col} vs full %"] = round(100 * (row[col] / full[col] - 1), 2)
    return list(rows.values())


def summarise(rows: list[dict[str, Any]], metric: str = "all/tree9") -> list[dict[str, Any]]:
    """Per variant: the mean of `metric`-like columns over seeds and the change against the baseline."""
    cols = [c for c in rows[0] if "/" in c]
    out = []
    base = {c: np.mean([r[c] for r in rows if r["variant"] == "baseline"]) for c in cols} \
        if any(r["variant"] == "baseline" for r in rows) else None
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        s = {"variant": v, "seeds": len(rs), "steps": rs[0]["steps"],
             "train_cpu_s": rs[0]["train_cpu_s"]}
        for c in cols:
            s[c] = round(float(np.mean([r[c] for r in rs])), 4)
            if base is not None:
                s[f"{c} vs baseline %"] = round(100 * (s[c] / base[c] - 1), 2)
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="hydra", help="a file of conf/heads/")
    ap.add_argument("--train-prompts", type=int, default=96)
    ap.add_argument("--holdout-per-task", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128, help="length of every self-distilled continuation")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--set", nargs="*", default=[], help="key=value heads.train overrides of a `custom` variant")
    ap.add_argument("--shipped", action="store_true", help="also measure every shipped heads folder on the held-out text")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--artifacts", default=str(REPO_ROOT / "artifacts"))
    ap.add_argument("--data", default=str(REPO_ROOT / "data"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {v: VARIANTS[v] for v in args.variants}
    if args.set:
        variants["custom"] = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)}

    from omegaconf import OmegaConf

    lay = Layout.for_model(args.artifacts, default_model_name(), args.data)
    model_dir, data_dir = lay.model_dir, Path(args.data)
    heads_cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "heads" / f"{args.kind}.yaml"))
    base = TrainSettings(max_prompts=args.train_prompts + 1, holdout_prompts=1, epochs=args.epochs,
                         max_new_tokens=args.new_tokens)
    train_rows, _ = select_prompts(read_train_rows(data_dir, model_dir, base), base)
    hold_rows = holdout_rows(data_dir, list(TRAIN_TASKS), args.holdout_per_task, base.max_prompt_tokens)
    fingerprint = model_fingerprint(model_dir)
    cache = lay.heads_cache / "ablation"
    sd_dir = cache / f"selfdistill-{hash_obj([base.data_dict(), [r['id'] for r in train_rows], fingerprint])}"
    t0, c0 = time.time(), time.process_time()
    greedy = build_selfdistill(model_dir, train_rows, base, sd_dir / "train")
    held = build_selfdistill(model_dir, hold_rows, base, cache / f"holdout-{hash_obj([[r['id'] for r in hold_rows], base.max_new_tokens, fingerprint])}")
    log.info("self-distillation data: %.0f s wall, %.0f s CPU", time.time() - t0, time.process_time() - c0)
    holdout: dict[str, list[dict]] = {}
    for r, q in zip(hold_rows, held):
        holdout.setdefault(r["id"].split("/")[0], []).append(q)
    margs = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    threads = torch.get_num_threads()
    model = load_model(model_dir, dtype=torch.float32, max_seq_len=min(margs.max_position_embeddings, 2048))
    torch.set_num_threads(threads)
    out = lay.heads_training_reports
    if args.shipped:
        shipped = shipped_rows(model, lay.heads_root, holdout)
        write_csv(out / "shipped_heads_holdout.csv", shipped)
        for r in shipped:
            log.info("%s", r)
    rows = []
    for seed in args.seeds:  # seeds outside: a first full pass over the variants comes early
        for name, overrides in variants.items():
            row = run_variant(name, overrides, seed, base, heads_cfg, model, model_dir, train_rows, greedy, sd_dir,
                              holdout, cache)
            log.info("%s seed %d: %s", name, seed, {k: v for k, v in row.items() if k.startswith("all/")})
            rows.append(row)
    write_csv(out / f"ablation-{args.kind}.csv", rows)
    summary = summarise(rows)
    write_csv(out / f"ablation-{args.kind}-summary.csv", summary)
    atomic_write_json(out / f"ablation-{args.kind}.json", {
        "kind": args.kind, "train_prompts": len(train_rows), "new_tokens": args.new_tokens, "epochs": args.epochs,
        "holdout": {t: {"sequences": len(v), "positions": int(sum(len(q["tokens"]) for q in v))} for t, v in holdout.items()},
        "variants": variants, "seeds": args.seeds, "rows": rows, "summary": summary, "machine": machine_info(),
        "threads": torch.get_num_threads()})
    for s in summary:
        log.info("%s", s)


if __name__ == "__main__":
    main()
