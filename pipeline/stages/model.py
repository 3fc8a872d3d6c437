"""model: the base model as a Hugging Face folder (converted from a packaged GGUF, a local folder,
or downloaded from the hub)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.graph import forced, once_per_config, plain

READS = ("model",)


@once_per_config
def output(cfg: DictConfig) -> Path:
    from pipeline.model.provision import provision_model

    return provision_model(plain(cfg.model), cfg.artifacts_dir, force=forced(cfg, "model"))
