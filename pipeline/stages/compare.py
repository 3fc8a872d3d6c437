"""compare: the banks of every task side by side (run after `make banks`); not cached."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.config.schema import TRAIN_TASKS
from pipeline.paths import Layout

READS = ()


def output(cfg: DictConfig) -> Path:
    from pipeline.compare import compare_banks

    lay = Layout.from_cfg(cfg)
    compare_banks(lay.banks_root, lay.rollouts_root, lay.heads_reports, list(TRAIN_TASKS))
    return lay.heads_reports
