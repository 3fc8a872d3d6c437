"""Runtime objects the stages share, loaded once per process: the decode dtype chosen for this
machine, the model with its draft heads, and tree decoders over them."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, cpu_identity, machine_info, read_json, run_build_setup
from pipeline.graph import once_per_config, plain
from pipeline.model import resolve_max_seq_len
from pipeline.paths import Layout
from pipeline.stages import heads as heads_stage
from pipeline.stages import model as model_stage

log = logging.getLogger(__name__)


def pick_decode_dtype(model_dir: Path, sizes: tuple[int, ...] = (1, 8, 16), context: int = 256,
                      invariant_rows: int | None = None) -> dict[str, Any]:
    """Time fp32 and bf16 forwards side by side (interleaved) at the sizes a decode step uses and
    keep the dtype with the lower summed latency. No assumption about the CPU: some have native
    bf16 matrix units (AMX), others emulate bf16 and are slower in it. With `invariant_rows`, both
    models run row-invariant (`lossless: exact`), whose cost differs from the ordinary path's."""
    import torch

    from pipeline.benchmarks.cost_curve import measure_cost_curves
    from runtime.model import load_model

    models = {d: load_model(model_dir, dtype=getattr(torch, d), max_seq_len=context + max(sizes) + 1)
              for d in ("float32", "bfloat16")}
    for m in models.values():
        m.set_row_invariance(invariant_rows)
    rows = measure_cost_curves(models, list(sizes), [context], repeats=3)
    cost = {d: sum(r["median_ms"] for r in rows if r["model"] == d) for d in models}
    best = min(cost, key=cost.get)
    log.info("[dtype] step cost over new tokens %s at context %d%s: %s -> %s", list(sizes), context,
             f" (row-invariant, {invariant_rows} rows)" if invariant_rows else "",
             ", ".join(f"{d} {c:.1f} ms" for d, c in cost.items()), best)
    return {"dtype": best, "cost_ms": cost, "rows": rows, "invariant_rows": invariant_rows}


def invariant_rows(cfg: DictConfig) -> int | None:
    """The padded row count of every decode forward: `cfg.invariant_rows` under `lossless: exact`,
    None (ordinary arithmetic) under `numerical`."""
    return int(cfg.invariant_rows) if cfg.get("lossless", "exact") == "exact" else None


@once_per_config
def resolve_dtype(cfg: DictConfig) -> str:
    """`dtype: auto` picks the faster dtype for tree decoding on this machine, measured once, in the
    arithmetic of the lossless mode (row-invariant under exact)."""
    if cfg.dtype != "auto":
        return str(cfg.dtype)
    if cfg.device == "cuda":
        return "float16"
    rows = invariant_rows(cfg)
    lay = Layout.from_cfg(cfg)
    f = lay.dtype_choice if rows is None else lay.dtype_choice_invariant(rows)
    from runtime import small_rows

    here = cpu_identity()
    # the float32 products differ with and without the small-row kernel: a choice measured with the
    # other one (or before it existed) is measured again
    kernel = small_rows.available()
    if f.is_file():
        doc = read_json(f)
        if all(doc.get("machine", {}).get(k) == v for k, v in here.items()) and doc.get("small_rows") == kernel:
            return doc["dtype"]
    run_build_setup()  # a measurement: seeded, at the configured thread count
    choice = pick_decode_dtype(model_stage.output(cfg), invariant_rows=rows)
    atomic_write_json(f, {**choice, "machine": machine_info(), "small_rows": kernel})
    return choice["dtype"]


@cache
def _load_runtime(model_dir: str, heads_dir: str, dtype: str, max_seq_len: int, threads: int | None, device: str,
                  rows: int | None = None):
    import torch

    from runtime.heads import load_heads
    from runtime.model import load_model

    model = load_model(model_dir, dtype=getattr(torch, dtype), max_seq_len=max_seq_len, device=device)
    model.set_row_invariance(rows)
    if model.kernel_decode:
        how = f"{'exact' if rows else 'numerical'} (small-row CPU kernels: every decode forward row-invariant, unpadded)"
    else:
        how = f"exact (row-invariant forwards of {rows} rows)" if rows else "numerical (ordinary arithmetic)"
    log.info("[runtime] %s, lossless %s", dtype, how)
    if threads:
        torch.set_num_threads(threads)
    heads = load_heads(heads_dir, model=model)
    return model, heads


def load_runtime(cfg: DictConfig, heads_name: str | None = None):
    """(model, heads) for `cfg`, loaded once per process; `heads_name` picks another trained kind
    of the same model (the evaluate stage's Medusa baseline)."""
    lay = Layout.from_cfg(cfg)
    heads_dir = heads_stage.output(cfg) if heads_name is None else lay.heads_dir(heads_name)
    return _load_runtime(str(model_stage.output(cfg)), str(heads_dir), resolve_dtype(cfg),
                         resolve_max_seq_len(plain(cfg.model), model_stage.output(cfg)),
                         cfg.threads, str(cfg.device), invariant_rows(cfg))


def tree_decoder(cfg: DictConfig, trees: list, heads_name: str | None = None):
    """A TreeDecoder over the runtime model and heads for the given trees, accepting as
    `cfg.acceptance` says."""
    from runtime.decoder import TreeDecoder
    from runtime.tree import TreeBuffers

    model, heads = load_runtime(cfg, heads_name)
    return TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees], acceptance=acceptance_from_cfg(cfg))


def acceptance_from_cfg(cfg: DictConfig):
    """The runtime acceptance for `cfg.acceptance`: "exact", or a `TypicalAcceptance`."""
    from runtime.decoder import make_acceptance

    acc = cfg.get("acceptance")
    return make_acceptance(plain(acc) if acc is not None else None)


@once_per_config
def runtime_key(cfg: DictConfig) -> dict[str, Any]:
    """The part of a stage key shared by every stage that decodes: weights, heads and dtype."""
    from pipeline.model import model_fingerprint
    from runtime.fingerprint import heads_fingerprint

    key = {"model": model_fingerprint(model_stage.output(cfg)), "heads": heads_fingerprint(heads_stage.output(cfg)),
           "dtype": resolve_dtype(cfg)}
    rows = invariant_rows(cfg)
    if rows is not None:  # row-invariant arithmetic rounds otherwise (numerical keeps the keys it always had)
        key["invariant_rows"] = rows
    return key


def sampler_from_cfg(cfg: DictConfig):
    """The runtime sampler for `cfg.sampling` (greedy at temperature 0)."""
    from runtime.sampling import Sampler, SamplingConfig

    sc = cfg.get("sampling")
    if sc is None:
        return Sampler()
    return Sampler(SamplingConfig(temperature=float(sc.temperature), top_k=int(sc.top_k), top_p=float(sc.top_p),
                                  seed=int(sc.seed)))
