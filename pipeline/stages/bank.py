"""bank: the TopologyBank — the throughput hull of the timed trees (plus the trees the per-step
oracle uses, `bank.members`), fitted policies, the oracle bound and plots; its choice per batch
size and EntMTP-dyn's price timed here, paired against batched AR and EntMTP* (`bank.paired_*`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import MANIFEST, machine_key, read_json, run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest, plain, runtime_key, runtime_spec
from pipeline.paths import Layout
from pipeline.stages import grow as grow_stage, heads as heads_stage, merge as merge_stage, model as model_stage
from pipeline.stages import recalibrate as recalibrate_stage, scores as scores_stage, time as time_stage
from pipeline.stages.rollout import calib_rows
from pipeline.stages.prepare import rows_hash, split_rows

log = logging.getLogger(__name__)

READS = ("bank", "sampling", "acceptance")  # the last two: how the paired timing decodes
# how the paired intervals are read (`pipeline.timing.paired`): a bank built under another rule is
# rebuilt. 2: the intervals resample the calibration prompts behind the tokens/step as well
CHOICE_RULE = 2


def policy_settings(cfg: DictConfig) -> dict[str, Any]:
    """The policy group without its unset (null) entries: the fitter applies its own defaults."""
    return {k: v for k, v in plain(cfg.policy).items() if v is not None}


def _bank_config(cfg: DictConfig) -> dict:
    """The config the bank was built from, less the invocation's own switches (`stage`, `force`):
    a bank built through `make eval` or by a forced rebuild records the same settings."""
    return {k: v for k, v in plain(cfg).items() if k not in ("stage", "force")}


@once_per_config
def output(cfg: DictConfig) -> Path:
    lay = Layout.from_cfg(cfg)
    time_dir, recal_dir = time_stage.output(cfg), recalibrate_stage.output(cfg)
    grow_dir, rollout_dir = grow_stage.output(cfg), merge_stage.output(cfg)
    model_dir, heads_dir = model_stage.output(cfg), heads_stage.output(cfg)
    key = {**runtime_key(cfg), **config_key(cfg, READS), "policy": policy_settings(cfg),
           "time": output_digest(time_dir), "recalibrate": output_digest(recal_dir), "grow": output_digest(grow_dir),
           "rollout": output_digest(rollout_dir)}
    # the choices per batch size are timed here, paired against batched AR (`pipeline.timing.paired`)
    paired_rows = split_rows(cfg, "calib", int(cfg.bank.paired_prompts))
    key.update({"paired_prompts": rows_hash(paired_rows), "machine": machine_key(str(cfg.device)),
                "choice_rule": CHOICE_RULE})
    scores_dir = scores_stage.output(cfg) if scores_stage.wanted(cfg) else None  # EntMTP-dyn's inputs
    if scores_dir is not None:
        key.update({"dynamic": plain(cfg.dynamic), "scores": output_digest(scores_dir)})

    def build(tmp: Path) -> dict[str, Any]:
        from tqdm.auto import tqdm

        from pipeline.bank.write import build_bank  # matplotlib: only when the bank is (re)built
        from pipeline.loaders import sampler_from_cfg, tree_decoder
        from pipeline.timing.paired import PairedRun, PairedSettings

        rk = runtime_key(cfg)
        dynamic = None if scores_dir is None else scores_stage.bank_inputs(cfg, scores_dir, time_dir)
        bar = tqdm(desc="batch choices: paired rounds against batched AR", unit="round")
        paired = PairedRun(lambda trees: tree_decoder(runtime_spec(cfg), trees, cfg.acceptance),
                           [r["input_ids"] for r in paired_rows], PairedSettings.from_bank_config(plain(cfg.bank)),
                           sampler_from_cfg(cfg.sampling), bar.update)
        return build_bank(
            tmp, paired=paired, timing=read_json(time_dir / "timing.json"), recal=read_json(recal_dir / "recalibrate.json"),
            frontier=read_json(grow_dir / "frontier.json"), rollout_dir=rollout_dir, policy_cfg=policy_settings(cfg),
            members=str(cfg.bank.members), min_oracle_share=float(cfg.bank.min_oracle_share),
            tie_tolerance=float(cfg.bank.tie_tolerance), dynamic=dynamic,
            provenance={
                "task": lay.task, "model_name": lay.model_name, "heads_name": lay.heads_name,
                "sampling": plain(cfg.sampling),
                # how its trees were recalibrated and timed (runtime.api.EntMTP.load decodes with it by default)
                "acceptance": plain(cfg.acceptance),
                "model_fingerprint": rk["model"], "heads_fingerprint": rk["heads"],
                # relative to the bank folder, so a moved checkout still finds its weights
                "model_dir": os.path.relpath(model_dir.resolve(), lay.bank_dir.resolve()),
                "heads_dir": os.path.relpath(Path(heads_dir).resolve(), lay.bank_dir.resolve()),
                "calib_hash": rows_hash(calib_rows(cfg)), "dtype": rk["dtype"],
                # the arithmetic its figures were measured in (runtime.api.EntMTP.load uses it by default)
                "lossless": str(cfg.lossless), "invariant_rows": rk.get("invariant_rows"),
                # the CPU kernels its arithmetic ran through (`runtime.model.small_rows.kernel_id`), or "none"
                "kernel": rk["kernel"],
                "machine": read_json(time_dir / "timing.json")["machine"], "config": _bank_config(cfg),
            },
        )

    out = run_stage("bank", lay.bank_dir, key, build, force=forced(cfg, "bank"))
    if cfg.stage == "bank":
        table = read_json(out / MANIFEST)["summary"]["table"]
        log.info("%s", "\n".join([f"TopologyBank {out}", *table]))
    return out
