"""The stage graph: stage order, one output per stage and config per process, `force`, `run`, and
what every decoding stage reads from its upstream stages (`runtime_spec`, `runtime_key`).

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
from pipeline.config.schema import STAGE_ORDER, key_view
from pipeline.loaders import RuntimeSpec, invariant_rows
from pipeline.paths import Layout

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

    import pipeline.config.schema  # noqa: F401 - registers the typed config schemas with hydra
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
    """{dotted field: resolved value} for the fields a stage reads: the config part of its key.
    Settings newer than the outputs already built are left out while at their default
    (`pipeline.config.schema.KEY_NEUTRAL_DEFAULTS`), so adding one rebuilds nothing."""
    return {f: key_view(f, plain(OmegaConf.select(cfg, f, throw_on_missing=True))) for f in fields}


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


# Stage `s` is the module pipeline/stages/<s>.py, which builds its output with the library
# pipeline/<s>/ (or pipeline/<s>.py). The exceptions, where one library serves several stages:
STAGE_LIBRARY = {
    **{s: f"pipeline.{s}" for s in STAGE_ORDER},
    "dtype": "pipeline.timing",  # the decode dtype is a timing measurement (`pipeline.timing.dtype`)
    "time": "pipeline.timing",
    "merge": "pipeline.rollout",  # shards of the rollout (`pipeline.rollout.merge`)
    "scores": "pipeline.rollout",  # the rollout's head scores for EntMTP-dyn (`pipeline.rollout.scores`)
}


def stage_module(name: str) -> Any:
    """The module of stage `name` (imported on demand, so the graph imports no stage statically)."""
    if name not in STAGE_ORDER:
        raise ValueError(f"stage={name!r} is unknown; choose one of: {', '.join(STAGE_ORDER)}")
    return importlib.import_module(f"pipeline.stages.{name}")


def stage_output(name: str, cfg: DictConfig) -> Path:
    """The output of stage `name` for `cfg`, built first if it is missing or stale."""
    return stage_module(name).output(cfg)


def runtime_spec(cfg: DictConfig, heads_name: str | None = None) -> RuntimeSpec:
    """The runtime a decoding stage decodes with: the model and heads folders from their stages, the
    dtype from the dtype stage, the arithmetic; `heads_name` picks another trained kind of the same
    model (the evaluate stage's Medusa baseline)."""
    from pipeline.model.provision import resolve_max_seq_len

    model_dir = stage_output("model", cfg)
    heads_dir = stage_output("heads", cfg) if heads_name is None else Layout.from_cfg(cfg).heads_dir(heads_name)
    return RuntimeSpec(str(model_dir), str(heads_dir), stage_module("dtype").resolve_dtype(cfg),
                       resolve_max_seq_len(plain(cfg.model), model_dir), cfg.threads, str(cfg.device),
                       invariant_rows(cfg))


def kernel(cfg: DictConfig) -> str:
    """The CPU kernels the decode arithmetic runs through: the dtype stage's `kernel_id()` for float32
    on the CPU, "none" elsewhere (they only serve float32 CPU forwards)."""
    dtype_stage = stage_module("dtype")
    if str(cfg.device) == "cpu" and dtype_stage.resolve_dtype(cfg) == "float32":
        return dtype_stage.kernel_id()
    return "none"


@once_per_config
def runtime_key(cfg: DictConfig) -> dict[str, Any]:
    """The part of a stage key shared by every stage that decodes: weights, heads, dtype, the
    arithmetic (row-invariant padding, CPU kernels)."""
    from pipeline.model.provision import model_fingerprint
    from runtime.fingerprint import heads_fingerprint

    key = {"model": model_fingerprint(stage_output("model", cfg)),
           "heads": heads_fingerprint(stage_output("heads", cfg)),
           "dtype": stage_module("dtype").resolve_dtype(cfg), "kernel": kernel(cfg)}
    rows = invariant_rows(cfg)
    if rows is not None:
        key["invariant_rows"] = rows
    return key


def run(cfg: DictConfig) -> Path:
    """Validate `cfg`, and build the output of `cfg.stage` (and whatever it needs), seeded."""
    from pipeline.config.validate import validate_config

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
