"""Crash-safe file writing shared by the runtime and the pipeline, and the weights folder format of
draft heads and drafters (config.json + one safetensors file)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def fsync_dir(folder: str | Path) -> None:
    """Make a rename inside `folder` durable (best effort: not every platform can open a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one.

    The bytes go to a temporary sibling that is fsynced and then renamed over `path`; if anything
    fails (or the process is interrupted) before the rename, `path` is untouched and the
    temporary file is removed (a SIGKILL can leave a hidden `.<name>.*.tmp` behind, never a
    partial `path`).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes writes bytes, got {type(data).__name__}; encode text first")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; artifacts are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def save_weights_folder(module: torch.nn.Module, meta: dict[str, Any], folder: str | Path, weights_file: str,
                        config_file: str, dtype: torch.dtype | None = None, what: str = "weights",
                        exclude: tuple[str, ...] = ()) -> Path:
    """Write `module`'s state dict (less the keys in `exclude`) as `weights_file` (safetensors) and
    `meta` plus the stored dtype as `config_file` (JSON) in `folder`, each atomically. `dtype` casts
    the floating tensors; they must end up in one dtype."""
    import torch
    from safetensors.torch import save

    from runtime.config import DTYPES

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in module.state_dict().items():
        if k in exclude:
            continue
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous().cpu()
    float_dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(float_dtypes) != 1:
        raise ValueError(f"{what} mix dtypes {float_dtypes}; cast them to one dtype before saving")
    dtype_name = next(k for k in DTYPES if getattr(torch, k) in float_dtypes)
    doc = {"format": meta["format"], "format_version": meta["format_version"], "dtype": dtype_name,
           **{k: v for k, v in meta.items() if k not in ("format", "format_version")}}
    atomic_write_bytes(folder / weights_file, save(state, metadata={"format": "pt", "entmtp": str(meta["format"])}))
    atomic_write_bytes(folder / config_file, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    return folder


def read_weights_config(path: Path, fmt: str, fmt_version: int, what: str, elsewhere: str) -> tuple[dict[str, Any], str]:
    """(the settings, the stored dtype name) of a weights folder's config file written by
    `save_weights_folder`, its format tag and version checked; ValueError naming what is wrong.
    `what` names the kind of folder, `elsewhere` where other layouts load."""
    from runtime.config import DTYPES

    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or raw.pop("format", None) != fmt:
        raise ValueError(f"{path} is not an EntMTP {what} config (its 'format' is not {fmt!r}); {elsewhere}")
    version = raw.pop("format_version", None)
    if version != fmt_version:
        raise ValueError(f"{path}: format_version {version!r} is not supported (expected {fmt_version})")
    dtype = raw.pop("dtype", None)
    if dtype not in DTYPES:
        raise ValueError(f"{path}: 'dtype' must be one of {list(DTYPES)}, got {dtype!r}")
    return raw, dtype


def check_config_keys(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError unless `d`'s keys are fields of the dataclass `cls`, every field without a default
    included."""
    import dataclasses

    fields = dataclasses.fields(cls)
    unknown = sorted(set(d) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known keys: {sorted(f.name for f in fields)}")
    missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{what} lacks required keys {missing}")
