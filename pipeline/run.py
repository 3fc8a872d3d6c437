"""Stage dispatch: each stage is a function of the config that ensures its inputs exist first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.model import provision_model


def _c(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def stage_model(cfg: DictConfig) -> Path:
    return provision_model(_c(cfg.model), cfg.artifacts_dir, force=cfg.force and cfg.stage == "model")


STAGES = {"model": stage_model}


def run(cfg: DictConfig) -> Any:
    if cfg.stage not in STAGES:
        raise SystemExit(f"unknown stage {cfg.stage!r}; choose one of: {', '.join(STAGES)}")
    return STAGES[cfg.stage](cfg)
