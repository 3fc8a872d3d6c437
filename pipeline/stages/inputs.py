"""What every decoding stage reads besides its own settings: the runtime (model and heads folders
from their stages, the dtype from the dtype stage, the arithmetic) and the part of a stage key
that names it. Not a stage itself; kept in the stage graph because it asks stages for outputs."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from pipeline.graph import once_per_config, plain
from pipeline.loaders import RuntimeSpec, invariant_rows
from pipeline.paths import Layout
from pipeline.stages import dtype as dtype_stage
from pipeline.stages import heads as heads_stage
from pipeline.stages import model as model_stage


def runtime_spec(cfg: DictConfig, heads_name: str | None = None) -> RuntimeSpec:
    """The runtime `cfg` decodes with; `heads_name` picks another trained kind of the same model
    (the evaluate stage's Medusa baseline)."""
    from pipeline.model import resolve_max_seq_len

    model_dir = model_stage.output(cfg)
    heads_dir = heads_stage.output(cfg) if heads_name is None else Layout.from_cfg(cfg).heads_dir(heads_name)
    return RuntimeSpec(str(model_dir), str(heads_dir), dtype_stage.resolve_dtype(cfg),
                       resolve_max_seq_len(plain(cfg.model), model_dir), cfg.threads, str(cfg.device),
                       invariant_rows(cfg))


def kernel(cfg: DictConfig) -> str:
    """The CPU kernels the decode arithmetic runs through: `dtype_stage.kernel_id()` for float32 on
    the CPU, "none" elsewhere (they only serve float32 CPU forwards)."""
    if str(cfg.device) == "cpu" and dtype_stage.resolve_dtype(cfg) == "float32":
        return dtype_stage.kernel_id()
    return "none"


@once_per_config
def runtime_key(cfg: DictConfig) -> dict[str, Any]:
    """The part of a stage key shared by every stage that decodes: weights, heads, dtype, the
    arithmetic (row-invariant padding, CPU kernels)."""
    from pipeline.model import model_fingerprint
    from runtime.fingerprint import heads_fingerprint

    key = {"model": model_fingerprint(model_stage.output(cfg)), "heads": heads_fingerprint(heads_stage.output(cfg)),
           "dtype": dtype_stage.resolve_dtype(cfg), "kernel": kernel(cfg)}
    rows = invariant_rows(cfg)
    if rows is not None:
        key["invariant_rows"] = rows
    return key
