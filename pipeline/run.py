"""Stage dispatch. Each stage is a function of the config that first makes sure its inputs exist
(running the earlier stages, each skipped when up to date), then builds its own output through
`run_stage` (atomic, with a manifest). `make bank TASK=x` therefore runs only what is missing.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.artifacts import atomic_write_json, hash_obj, is_up_to_date, machine_info, read_json, run_stage
from pipeline.model import model_fingerprint, provision_model, resolve_max_seq_len
from pipeline.paths import Layout
from runtime.fingerprint import heads_fingerprint

TRAIN_TASKS = ("humaneval", "gsm8k", "sharegpt")
STAGE_ORDER = ("model", "heads", "prepare", "rollout", "merge", "grow", "recalibrate", "time", "bank", "evaluate", "compare")


def _c(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _force(cfg: DictConfig, stage: str) -> bool:
    return bool(cfg.force) and cfg.stage == stage


# ------------------------------------------------------------------------------------ checks
def validate_config(cfg: DictConfig) -> None:
    """Fail at start-up, before any long work, on configuration that cannot work (pipeline/validate.py)."""
    from pipeline.validate import validate_config as _validate

    _validate(cfg)


# ------------------------------------------------------------------------------------ stages
_MEMO: dict[tuple[str, str], Any] = {}


def memo_stage(fn):
    """Run each stage once per process and config: later stages ask for their inputs repeatedly."""

    def wrapper(cfg: DictConfig, *args: Any) -> Any:
        k = (fn.__name__, hash_obj([_c(cfg), args]))
        if k not in _MEMO:
            _MEMO[k] = fn(cfg, *args)
        return _MEMO[k]

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@memo_stage
def stage_model(cfg: DictConfig) -> Path:
    return provision_model(_c(cfg.model), cfg.artifacts_dir, force=_force(cfg, "model"))


@memo_stage
def stage_prepare(cfg: DictConfig) -> Path:
    from pipeline.prepare import prepare_task

    model_dir = stage_model(cfg)
    return prepare_task(_c(cfg.task), _c(cfg.profile), model_dir, Path(cfg.data_dir), force=_force(cfg, "prepare"))


@memo_stage
def stage_heads(cfg: DictConfig) -> Path:
    """The heads folder: `heads.dir` if given, else shipped heads whose base fingerprint matches,
    else trained now (which first prepares the training pools of every task)."""
    from pipeline.prepare import load_task_config, prepare_task
    from pipeline.train_heads import train_heads

    model_dir = stage_model(cfg)
    hc = _c(cfg.heads)
    if hc.get("dir"):
        from pipeline.heads_import import import_heads

        # project heads are used as they are; published Hydra/Medusa folders are converted once
        return import_heads(hc["dir"], model_dir, Layout.from_cfg(cfg).heads_dir(), force=_force(cfg, "heads"))
    for task in TRAIN_TASKS:  # the training mix reads every task's train pool
        prepare_task(load_task_config(task), _c(cfg.profile), model_dir, Path(cfg.data_dir))
    return train_heads(hc, model_dir, Path(cfg.data_dir), Path(cfg.artifacts_dir), force=_force(cfg, "heads"))


def pick_decode_dtype(model_dir: Path, sizes: tuple[int, ...] = (1, 8, 16), context: int = 256) -> dict[str, Any]:
    """Time fp32 and bf16 forwards side by side (interleaved) at the sizes a decode step uses and
    keep the dtype with the lower summed latency. No assumption about the CPU: some have native
    bf16 matrix units (AMX), others emulate bf16 and are slower in it."""
    from pipeline.benchmarks.cost_curve import measure_cost_curves
    from runtime.model import load_model

    models = {d: load_model(model_dir, dtype=getattr(torch, d), max_seq_len=context + max(sizes) + 1)
              for d in ("float32", "bfloat16")}
    rows = measure_cost_curves(models, list(sizes), [context], repeats=3)
    cost = {d: sum(r["median_ms"] for r in rows if r["model"] == d) for d in models}
    best = min(cost, key=cost.get)
    print(f"[dtype] step cost over new tokens {list(sizes)} at context {context}: "
          + ", ".join(f"{d} {c:.1f} ms" for d, c in cost.items()) + f" -> {best}")
    return {"dtype": best, "cost_ms": cost, "rows": rows}


@memo_stage
def resolve_dtype(cfg: DictConfig) -> str:
    """`dtype: auto` picks the faster dtype for tree decoding on this machine, measured once."""
    if cfg.dtype != "auto":
        return str(cfg.dtype)
    if cfg.device == "cuda":
        return "float16"
    lay = Layout.from_cfg(cfg)
    f = lay.artifacts / "reports" / lay.model_name / "dtype_choice.json"
    mach = machine_info()
    if f.is_file():
        doc = read_json(f)
        if doc.get("machine", {}).get("cpu") == mach["cpu"] and doc.get("machine", {}).get("cores") == mach["cores"]:
            return doc["dtype"]
    choice = pick_decode_dtype(stage_model(cfg))
    atomic_write_json(f, {**choice, "machine": mach})
    return choice["dtype"]


@cache
def _load_runtime(model_dir: str, heads_dir: str, dtype: str, max_seq_len: int, threads: int | None, device: str):
    from runtime.heads import load_heads
    from runtime.model import load_model

    model = load_model(model_dir, dtype=getattr(torch, dtype), max_seq_len=max_seq_len, device=device)
    if threads:
        torch.set_num_threads(threads)
    heads = load_heads(heads_dir, model=model)
    return model, heads


def load_runtime(cfg: DictConfig, heads_name: str | None = None):
    lay = Layout.from_cfg(cfg)
    heads_dir = stage_heads(cfg) if heads_name is None else lay.heads_dir(heads_name)
    return _load_runtime(str(stage_model(cfg)), str(heads_dir), resolve_dtype(cfg), resolve_max_seq_len(_c(cfg.model), stage_model(cfg)), cfg.threads,
                         str(cfg.device))


@memo_stage
def _inputs_key(cfg: DictConfig) -> dict[str, Any]:
    """What every task-level stage depends on: weights, heads, data split, dtype, profile."""
    from pipeline.prepare import read_split

    lay = Layout.from_cfg(cfg)
    stage_prepare(cfg)
    heads_dir = stage_heads(cfg)
    calib = read_split(Path(cfg.data_dir), lay.task, "calib")
    return {
        "model": model_fingerprint(stage_model(cfg)),
        "heads": heads_fingerprint(heads_dir),
        "calib": hash_obj([r["input_ids"] for r in calib]),
        "dtype": resolve_dtype(cfg),
        "profile": _c(cfg.profile),
    }


def _calib_rows(cfg: DictConfig, n: int | None = None, split: str = "calib") -> list[dict]:
    from pipeline.prepare import read_split

    return read_split(Path(cfg.data_dir), cfg.task.name, split, limit=n)


@memo_stage
def stage_rollout(cfg: DictConfig) -> Path:
    """One shard of the calibration rollout (`rollout.shard` of `rollout.num_shards`)."""
    from pipeline.rollout import run_rollout, shard_rows

    lay = Layout.from_cfg(cfg)
    key = {**_inputs_key(cfg), "shard": int(cfg.rollout.shard), "num_shards": int(cfg.rollout.num_shards)}
    n = int(cfg.rollout.num_shards)
    out = lay.work / "shards" / f"{int(cfg.rollout.shard)}-of-{n}"
    rows = shard_rows(_calib_rows(cfg, int(cfg.profile.calib_prompts)), int(cfg.rollout.shard), n)

    def build(tmp: Path) -> dict[str, Any]:
        model, heads = load_runtime(cfg)
        return run_rollout(model, heads, rows, int(cfg.profile.max_new_tokens), int(cfg.profile.rank_cap), tmp,
                           desc=f"rollout {cfg.task.name} shard {cfg.rollout.shard}/{n}")

    return run_stage("rollout", out, key, build, force=_force(cfg, "rollout"))


@memo_stage
def stage_merge(cfg: DictConfig) -> Path:
    """Merge the rollout shards (running any that are missing in this process)."""
    from pipeline.rollout import merge_rollouts

    lay = Layout.from_cfg(cfg)
    key = _inputs_key(cfg)  # the merged rollout does not depend on how it was sharded
    out = lay.work / "rollout"
    if not _force(cfg, "merge") and is_up_to_date(out, key):
        return out  # merged earlier, from however many shards
    n = int(cfg.rollout.num_shards)
    shard_dirs = []
    for k in range(n):
        sub = cfg.copy()
        OmegaConf.update(sub, "rollout.shard", k)
        shard_dirs.append(stage_rollout(sub))
    order = [r["id"] for r in _calib_rows(cfg, int(cfg.profile.calib_prompts))]
    return run_stage("merge", out, key, lambda tmp: merge_rollouts(shard_dirs, order, tmp), force=_force(cfg, "merge"))


@memo_stage
def stage_grow(cfg: DictConfig) -> Path:
    from pipeline.grow import grow, top_count_tree
    from pipeline.replay import replay_tokens_per_step
    from pipeline.rollout import load_rollout

    lay = Layout.from_cfg(cfg)
    rollout_dir = stage_merge(cfg)
    key = {**_inputs_key(cfg), "grow": _c(cfg.grow)}

    def build(tmp: Path) -> dict[str, Any]:
        rollouts = load_rollout(rollout_dir)
        budget = int(cfg.profile.grow_budget)
        K = int(cfg.profile.rank_cap)
        frontier: dict[str, Any] = {}
        for depth in range(1, int(cfg.grow.max_depth) + 1):
            res = grow(rollouts, max_depth=depth, budget=budget, rank_cap=K)
            frontier[str(depth)] = [{"paths": [list(p) for p in t], "tokens_per_step": float(tps)}
                                    for t, tps in zip(res.trees, res.tokens_per_step)]
        top = top_count_tree(rollouts, budget=budget, max_depth=int(cfg.grow.max_depth), rank_cap=K)
        extra = {"top_count": {"paths": [list(p) for p in top], "tokens_per_step": replay_tokens_per_step(rollouts, top)}}
        from runtime.tree import Tree

        mc = Tree.named("mc_sim_7b_63")
        if mc.depth <= int(cfg.heads.num_heads):
            extra["mc_sim_7b_63"] = {"paths": [list(p) for p in mc.paths], "tokens_per_step": replay_tokens_per_step(rollouts, mc.paths)}
        atomic_write_json(tmp / "frontier.json", {"frontier": frontier, "reference": extra})
        best = max((e for es in frontier.values() for e in es), key=lambda e: e["tokens_per_step"])
        return {"best_tokens_per_step": best["tokens_per_step"], "best_nodes": len(best["paths"]) + 1}

    return run_stage("grow", lay.work / "grow", key, build, force=_force(cfg, "grow"))


@memo_stage
def candidate_trees(cfg: DictConfig) -> list[dict[str, Any]]:
    """The frontier trees that get real decoding and timing: a size grid over every max depth.

    At one size, a tree whose replayed tokens/step is more than `grow.candidate_tolerance` below
    the best tree of that size is dropped: it verifies as many nodes for fewer tokens, and only a
    much cheaper draft (shallower Hydra chain) could save it — the tolerance keeps those close
    enough for that to matter."""
    from runtime.tree import Tree

    doc = read_json(stage_grow(cfg) / "frontier.json")
    sizes = set(int(s) for s in cfg.grow.candidate_sizes)
    seen, out = set(), []
    if 0 in sizes:  # the root alone is plain AR decoding: the bank's floor on unpredictable text
        root_only = Tree([])
        seen.add(root_only)
        out.append({"tree": root_only, "max_depth": 0, "replay_tokens_per_step": 1.0})
    best_at: dict[int, float] = {}
    for entries in doc["frontier"].values():
        for e in entries:
            n = len(e["paths"])
            best_at[n] = max(best_at.get(n, 0.0), e["tokens_per_step"])
    tol = float(cfg.grow.candidate_tolerance)
    for depth, entries in doc["frontier"].items():
        for e in entries:
            t = Tree(e["paths"])
            if len(t) in sizes and t not in seen and e["tokens_per_step"] >= (1 - tol) * best_at[len(t)]:
                seen.add(t)
                out.append({"tree": t, "max_depth": int(depth), "replay_tokens_per_step": e["tokens_per_step"]})
    out.sort(key=lambda c: (c["tree"].num_nodes, c["tree"].depth))
    return out


def _decoder(cfg: DictConfig, trees: list, heads_name: str | None = None):
    from runtime.decoder import TreeDecoder
    from runtime.tree import TreeBuffers

    model, heads = load_runtime(cfg, heads_name)
    return TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees])


@memo_stage
def stage_recalibrate(cfg: DictConfig) -> Path:
    from pipeline.recalibrate import recalibrate
    from pipeline.rollout import load_rollout

    lay = Layout.from_cfg(cfg)
    cands = candidate_trees(cfg)
    rollout_dir = stage_merge(cfg)
    key = {**_inputs_key(cfg), "grow": _c(cfg.grow)}

    def build(tmp: Path) -> dict[str, Any]:
        rollouts = {r["id"]: r for r in load_rollout(rollout_dir)}
        rows = _calib_rows(cfg, int(cfg.profile.recalib_prompts))
        dec = _decoder(cfg, [c["tree"] for c in cands])
        res = recalibrate(dec, [c["tree"] for c in cands], rows, rollouts, int(cfg.profile.max_new_tokens),
                          int(cfg.profile.rank_cap))
        for c, r in zip(cands, res):
            r["paths"] = [list(p) for p in c["tree"].paths]
            r["nodes"] = c["tree"].num_nodes
            r["depth"] = c["tree"].depth
        atomic_write_json(tmp / "recalibrate.json", {"trees": res, "prompts": [r["id"] for r in rows]})
        return {
            "trees": len(res),
            "max_tps_rel_diff": max(r["tps_rel_diff"] for r in res),
            "min_step_agreement": min(r["step_agreement"] for r in res),
            "token_mismatch_prompts": sum(r["token_mismatch_prompts"] for r in res),
        }

    return run_stage("recalibrate", lay.work / "recalibrate", key, build, force=_force(cfg, "recalibrate"))


@memo_stage
def stage_time(cfg: DictConfig) -> Path:
    from pipeline.timing import e2e_tokens_per_second, time_head_chain, time_trees
    from runtime.decoder import HEAD_SIGNALS

    lay = Layout.from_cfg(cfg)
    cands = candidate_trees(cfg)
    key = {**_inputs_key(cfg), "grow": _c(cfg.grow), "machine": {k: v for k, v in machine_info().items() if k != "torch_threads"}}

    def build(tmp: Path) -> dict[str, Any]:
        rows = _calib_rows(cfg, int(cfg.profile.timing_prompts))
        dec = _decoder(cfg, [c["tree"] for c in cands])
        replayed = [c["replay_tokens_per_step"] for c in cands]
        t = time_trees(dec, rows, rounds=int(cfg.time.rounds), new_tokens=int(cfg.time.new_tokens),
                       tokens_per_step=replayed if cfg.time.prune else None)
        n_new = int(cfg.profile.max_new_tokens)
        trees = []
        for k, (c, s) in enumerate(zip(cands, t["step_s"])):
            tps = c["replay_tokens_per_step"]
            timed = k not in t["pruned"]
            trees.append({"paths": [list(p) for p in c["tree"].paths], "nodes": c["tree"].num_nodes, "depth": c["tree"].depth,
                          "tokens_per_step": tps, "step_ms": 1000 * s if timed else None,
                          "tok_per_s": e2e_tokens_per_second(tps, s, t["prefill_s"], n_new) if timed else None,
                          **({} if timed else {"pruned": t["pruned"][k]})})
        ar_tok_s = e2e_tokens_per_second(1.0, t["ar_token_s"], t["prefill_s"], n_new)
        chain_ms = 1000 * time_head_chain(dec, rows[0])
        atomic_write_json(tmp / "timing.json", {"trees": trees, "ar_token_ms": 1000 * t["ar_token_s"], "ar_tok_per_s": ar_tok_s,
                                                "signal_ms": {name: chain_ms for name in HEAD_SIGNALS},
                                                "prefill_ms": 1000 * t["prefill_s"], "prompt_tokens": t["prompt_tokens"],
                                                "machine": machine_info(), "dtype": resolve_dtype(cfg)})
        best = max((x for x in trees if x["tok_per_s"] is not None), key=lambda x: x["tok_per_s"])
        return {"best_nodes": best["nodes"], "best_tok_per_s": best["tok_per_s"], "ar_tok_per_s": ar_tok_s,
                "pruned": len(t["pruned"])}

    return run_stage("time", lay.work / "time", key, build, force=_force(cfg, "time"))


@memo_stage
def stage_bank(cfg: DictConfig) -> Path:
    from pipeline.bank import build_bank

    lay = Layout.from_cfg(cfg)
    time_dir, recal_dir, grow_dir, rollout_dir = stage_time(cfg), stage_recalibrate(cfg), stage_grow(cfg), stage_merge(cfg)
    key = {**_inputs_key(cfg), "grow": _c(cfg.grow), "policy": _c(cfg.policy), "bank": _c(cfg.bank),
           "time": read_json(time_dir / "manifest.json")["created"]}
    heads_dir = stage_heads(cfg)

    def build(tmp: Path) -> dict[str, Any]:
        return build_bank(
            tmp, timing=read_json(time_dir / "timing.json"), recal=read_json(recal_dir / "recalibrate.json"),
            frontier=read_json(grow_dir / "frontier.json"), rollout_dir=rollout_dir, policy_cfg=_c(cfg.policy),
            members=str(cfg.bank.members), min_oracle_share=float(cfg.bank.min_oracle_share),
            provenance={
                "task": lay.task, "model_name": lay.model_name, "heads_name": lay.heads_name,
                "model_fingerprint": model_fingerprint(stage_model(cfg)),
                "heads_fingerprint": heads_fingerprint(heads_dir),
                # relative to the bank folder, so a moved checkout still finds its weights
                "model_dir": os.path.relpath(stage_model(cfg).resolve(), lay.bank_dir.resolve()),
                "heads_dir": os.path.relpath(Path(heads_dir).resolve(), lay.bank_dir.resolve()),
                "calib_hash": _inputs_key(cfg)["calib"], "dtype": resolve_dtype(cfg), "machine": machine_info(),
                "config": _c(cfg),
            },
        )

    out = run_stage("bank", lay.bank_dir, key, build, force=_force(cfg, "bank"))
    if cfg.stage == "bank":
        from runtime.bank import TopologyBank

        print(TopologyBank.load(out).summary())
    return out


@memo_stage
def stage_evaluate(cfg: DictConfig) -> Path:
    from pipeline.evaluate import evaluate

    lay = Layout.from_cfg(cfg)
    bank_dir = stage_bank(cfg)
    key = {**_inputs_key(cfg), "bank": read_json(bank_dir / "manifest.json")["created"], "evaluate": _c(cfg.evaluate)}
    return run_stage("evaluate", lay.reports / "evaluate", key, lambda tmp: evaluate(cfg, tmp, bank_dir),
                     force=_force(cfg, "evaluate"))


def stage_compare(cfg: DictConfig) -> Path:
    """Task dependence: the banks of every task side by side (run after `make banks`)."""
    from pipeline.compare import compare_banks

    lay = Layout.from_cfg(cfg)
    out = lay.artifacts / "reports" / lay.model_name / lay.heads_name
    compare_banks(lay.bank_dir.parent, lay.work.parent.parent, out, list(TRAIN_TASKS))
    return out


STAGES = {
    "model": stage_model, "heads": stage_heads, "prepare": stage_prepare, "rollout": stage_rollout,
    "merge": stage_merge, "grow": stage_grow, "recalibrate": stage_recalibrate, "time": stage_time,
    "bank": stage_bank, "evaluate": stage_evaluate, "compare": stage_compare,
}


def run(cfg: DictConfig) -> Any:
    validate_config(cfg)
    torch.manual_seed(int(cfg.seed))
    np.random.seed(int(cfg.seed))
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    return STAGES[cfg.stage](cfg)
