"""Runtime objects the decoding stages share, loaded once per process: the model with its draft
heads, tree decoders over them, and the sampler and acceptance rule a config asks for.

Everything here takes resolved inputs (a `RuntimeSpec`: folders, dtype, arithmetic); which
folders and which dtype is the stage graph's business (`pipeline.graph.runtime_spec`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeSpec:
    """What a decoding stage loads: the converted model and heads folders, the decode dtype, the KV
    cache capacity, torch's thread count, the device, and the padded row count of every decode
    forward under `lossless: exact` (None: the ordinary arithmetic)."""

    model_dir: str
    heads_dir: str
    dtype: str
    max_seq_len: int
    threads: int | None
    device: str
    invariant_rows: int | None


def invariant_rows(cfg: Any) -> int | None:
    """The padded row count of every decode forward: `cfg.invariant_rows` under `lossless: exact`,
    None (ordinary arithmetic) under `numerical`."""
    return int(cfg.invariant_rows) if cfg.get("lossless", "exact") == "exact" else None


@cache
def _load(spec: RuntimeSpec):
    import torch

    from runtime.heads import load_heads
    from runtime.model.checkpoint import load_model

    model = load_model(spec.model_dir, dtype=getattr(torch, spec.dtype), max_seq_len=spec.max_seq_len, device=spec.device)
    rows = spec.invariant_rows
    model.set_row_invariance(rows)
    if model.kernel_decode:
        how = f"{'exact' if rows else 'numerical'} (small-row CPU kernels: every decode forward row-invariant, unpadded)"
    else:
        how = f"exact (row-invariant forwards of {rows} rows)" if rows else "numerical (ordinary arithmetic)"
    log.info("[runtime] %s, lossless %s", spec.dtype, how)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    heads = load_heads(spec.heads_dir, model=model)
    return model, heads


def load_runtime(spec: RuntimeSpec):
    """(model, heads) for `spec`, loaded once per process."""
    return _load(spec)


def tree_decoder(spec: RuntimeSpec, trees: list, acceptance: Any = None):
    """A TreeDecoder over the runtime model and heads of `spec` for the given trees, accepting as
    the `acceptance` config node says (None: exact)."""
    from runtime.decoder import TreeDecoder
    from runtime.tree import TreeBuffers

    model, heads = load_runtime(spec)
    return TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in trees], acceptance=acceptance_from_cfg(acceptance))


def acceptance_from_cfg(acc: Any):
    """The runtime acceptance for an `acceptance` config node: "exact", or a `TypicalAcceptance`."""
    from omegaconf import DictConfig, OmegaConf

    from runtime.decoder import make_acceptance

    if isinstance(acc, DictConfig):
        acc = OmegaConf.to_container(acc, resolve=True)
    return make_acceptance(acc)


def sampler_from_cfg(sc: Any):
    """The runtime sampler for a `sampling` config node (greedy when None or at temperature 0)."""
    from runtime.sampling import Sampler, SamplingConfig

    if sc is None:
        return Sampler()
    return Sampler(SamplingConfig(temperature=float(sc.temperature), top_k=int(sc.top_k), top_p=float(sc.top_p),
                                  seed=int(sc.seed)))


