"""`python -m pipeline stage=<stage> task=<task> [overrides]`: run one stage and what it needs."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import pipeline.config.schema  # noqa: F401 - registers the typed config schemas with hydra
from pipeline.graph import run


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
