"""evaluate: every decoding method (AR, transformers generate, Medusa / Hydra defaults, the bank's
static tree and policies, the oracle bound) on the held-out eval split; then the batched evaluation
(batched AR and the bank's methods at each of `evaluate.batch_sizes`, on the split's first
`evaluate.batch_prompts`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.artifacts import run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest
from pipeline.paths import Layout
from pipeline.stages import bank as bank_stage
from pipeline.graph import runtime_key, runtime_spec
from pipeline.stages.prepare import rows_hash, split_rows

READS = ("evaluate", "profile.eval_prompts", "sampling", "acceptance")


@once_per_config
def output(cfg: DictConfig) -> Path:
    bank_dir = bank_stage.output(cfg)
    n_single, n_batch = int(cfg.profile.eval_prompts), int(cfg.evaluate.batch_prompts)
    rows = split_rows(cfg, "eval", max(n_single, n_batch) if cfg.evaluate.batch_sizes else n_single)
    key = {**runtime_key(cfg), **config_key(cfg, READS), "prompts": rows_hash(rows), "bank": output_digest(bank_dir)}

    def build(tmp: Path) -> dict:
        from pipeline.evaluate.run import evaluate  # pandas, transformers: only when evaluating

        return evaluate(cfg, tmp, bank_dir, rows[:n_single], runtime_spec(cfg), Layout.from_cfg(cfg).heads_dir("medusa"),
                        batch_rows=rows[:n_batch])

    return run_stage("evaluate", Layout.from_cfg(cfg).reports / "evaluate", key, build, force=forced(cfg, "evaluate"))
