"""The stage graph: stage order, one output per stage and config per process, `force`, and `run`.

A stage is a module `pipeline/stages/<name>.py` with a function `output(cfg) -> Path` that first
asks its upstream stages for their outputs (each skipped when up to date) and then builds its own
through `pipeline.artifacts.run_stage`, keyed on what it reads: the config fields it names in
`READS` (see `config_key`) and the content of its upstream outputs (`output_digest`). So a
setting a stage does not read never rebuilds it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.artifacts import MANIFEST, before_first_build, hash_obj, read_json
from pipeline.schema import STAGE_ORDER

log = logging.getLogger(__name__)

_MEMO: dict[tuple[str, str], Any] = {}
F = TypeVar("F", bound=Callable[..., Any])


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The pipeline config for `overrides`, composed as `python -m pipeline` would (same schema,
    defaults and overrides; hydra's own node removed, as under hydra.main), for tools that run
    stages without hydra.main."""
    import os

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import pipeline.schema  # noqa: F401 - registers the typed config schemas with hydra
    from pipeline.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        cfg.hydra.runtime.cwd = os.getcwd()  # what hydra.main sets; the default paths hang off it
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def plain(node: Any) -> Any:
    """A config node as plain Python (resolved); other values unchanged."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def config_key(cfg: DictConfig, fields: Iterable[str]) -> dict[str, Any]:
    """{dotted field: resolved value} for the fields a stage reads: the config part of its key."""
    return {f: plain(OmegaConf.select(cfg, f, throw_on_missing=True)) for f in fields}


def output_digest(folder: str | Path) -> str:
    """What a downstream key records of an upstream output: a hash of its files' checksums, so an
    upstream rebuild that writes the same bytes leaves downstream stages up to date."""
    return hash_obj(read_json(Path(folder) / MANIFEST)["files"])


def forced(cfg: DictConfig, stage: str) -> bool:
    """`force=true` rebuilds only the stage asked for on the command line, not its upstream."""
    return bool(cfg.force) and cfg.stage == stage


def once_per_config(fn: F) -> F:
    """Run a stage once per process and config: later stages ask for their inputs repeatedly."""

    @functools.wraps(fn)
    def wrapper(cfg: DictConfig, *args: Any) -> Any:
        k = (f"{fn.__module__}.{fn.__qualname__}", hash_obj([plain(cfg), args]))
        if k not in _MEMO:
            _MEMO[k] = fn(cfg, *args)
        return _MEMO[k]

    return wrapper  # type: ignore[return-value]


def clear_memo() -> None:
    """Forget every stage result of this process (tests that change files between runs)."""
    _MEMO.clear()


def stage_output(name: str, cfg: DictConfig) -> Path:
    """The output of stage `name` for `cfg`, built first if it is missing or stale."""
    if name not in STAGE_ORDER:
        raise ValueError(f"stage={name!r} is unknown; choose one of: {', '.join(STAGE_ORDER)}")
    module = importlib.import_module(f"pipeline.stages.{name}")
    return module.output(cfg)


def run(cfg: DictConfig) -> Path:
    """Validate `cfg`, and build the output of `cfg.stage` (and whatever it needs), seeded."""
    from pipeline.validate import validate_config

    validate_config(cfg)

    def seed_and_threads() -> None:
        import numpy as np
        import torch

        torch.manual_seed(int(cfg.seed))
        np.random.seed(int(cfg.seed))
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))

    before_first_build(seed_and_threads)
    return stage_output(str(cfg.stage), cfg)
