"""evaluate: every decoding method (AR, transformers generate, Medusa / Hydra defaults, the bank's
static tree and policies, the oracle bound) on the held-out eval split."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.artifacts import run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest
from pipeline.paths import Layout
from pipeline.stages import bank as bank_stage
from pipeline.stages.inputs import runtime_key, runtime_spec
from pipeline.stages.prepare import rows_hash, split_rows

READS = ("evaluate", "profile.eval_prompts", "sampling", "acceptance")


@once_per_config
def output(cfg: DictConfig) -> Path:
    bank_dir = bank_stage.output(cfg)
    rows = split_rows(cfg, "eval", int(cfg.profile.eval_prompts))
    key = {**runtime_key(cfg), **config_key(cfg, READS), "prompts": rows_hash(rows), "bank": output_digest(bank_dir)}

    def build(tmp: Path) -> dict:
        from pipeline.evaluate import evaluate  # pandas, transformers: only when evaluating

        return evaluate(cfg, tmp, bank_dir, rows, runtime_spec(cfg), Layout.from_cfg(cfg).heads_dir("medusa"))

    return run_stage("evaluate", Layout.from_cfg(cfg).reports / "evaluate", key, build, force=forced(cfg, "evaluate"))
