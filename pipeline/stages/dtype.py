"""dtype: the decode dtype `dtype: auto` resolves to on this machine, measured once (float32 vs
bfloat16 forwards at a decode step's row counts, in the lossless mode's arithmetic) and kept as a
stage output keyed on the model, the machine and the kernels that ran, so that computing another
stage's key only reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, machine_info, machine_key, read_json, run_stage
from pipeline.graph import forced, once_per_config
from pipeline.loaders import invariant_rows
from pipeline.paths import Layout
from pipeline.stages import model as model_stage

READS = ("lossless", "invariant_rows")
FILE = "dtype.json"


def kernel_id() -> str:
    """Which float32 CPU kernels run here (`runtime.model.small_rows.kernel_id`: the ISA and source
    digest, or "none"): they change the arithmetic, so every key that depends on it records it."""
    from runtime.model.small_rows import kernel_id as kid

    return kid()


@once_per_config
def output(cfg: DictConfig) -> Path:
    from pipeline.model.provision import model_fingerprint

    model_dir = model_stage.output(cfg)
    rows = invariant_rows(cfg)
    key = {"model": model_fingerprint(model_dir), "invariant_rows": rows, "machine": machine_key("cpu"),
           "kernel": kernel_id()}

    def build(tmp: Path) -> dict[str, Any]:
        from pipeline.timing.dtype import pick_decode_dtype

        choice = pick_decode_dtype(model_dir, invariant_rows=rows)
        atomic_write_json(tmp / FILE, {**choice, "machine": machine_info(), "kernel": key["kernel"]})
        return {"dtype": choice["dtype"], "cost_ms": choice["cost_ms"]}

    return run_stage("dtype", Layout.from_cfg(cfg).dtype_dir(rows), key, build, force=forced(cfg, "dtype"))


@once_per_config
def resolve_dtype(cfg: DictConfig) -> str:
    """The decode dtype of `cfg`: `dtype` when set, float16 on CUDA under `auto`, else this stage's
    measured choice."""
    if cfg.dtype != "auto":
        return str(cfg.dtype)
    if str(cfg.device).startswith("cuda"):
        return "float16"
    return str(read_json(output(cfg) / FILE)["dtype"])
