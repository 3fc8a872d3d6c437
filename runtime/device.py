"""Device helpers shared by the runtime, the pipeline and the benchmarks.

* `synchronize(device)` waits for the device's queued work, so a clock read after it measures
  work that has finished (CUDA kernels run asynchronously; on the CPU every op has returned by
  the time the next Python line runs, so it does nothing there).
* `torch_dtype(name)`: the torch dtype of one of `runtime.config.DTYPES`.
* `resolve_device(requested, recorded)` picks the device to load on: the one asked for, else the
  one a bank was built on, falling back to the CPU with a warning when that one is missing.
"""

from __future__ import annotations

import time
import warnings

import torch

from runtime.config import DTYPES


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype for a name of `DTYPES` ("float32", "bfloat16", "float16")."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def synchronize(device: torch.device | str) -> None:
    """Block until every queued op on `device` has finished (a no-op on the CPU and on meta)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()
    elif kind == "xpu":
        torch.xpu.synchronize(device)


def clock(device: torch.device | str) -> float:
    """`time.perf_counter()` after synchronising `device`: the clock read for timed regions."""
    synchronize(device)
    return time.perf_counter()


def device_available(device: torch.device | str) -> bool:
    """Whether tensors can be allocated on `device` in this process."""
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index is None or dev.index < torch.cuda.device_count())
    if dev.type == "mps":
        return torch.backends.mps.is_available()
    if dev.type == "xpu":
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    return False


def resolve_device(requested: str | torch.device | None, recorded: str | None = None) -> torch.device:
    """The device to load on. An explicit `requested` device is used as given (and must exist);
    with None, the `recorded` one (e.g. where a bank was built), or the CPU with a warning when
    that device is not available here; with neither, the CPU."""
    if requested is not None:
        dev = torch.device(requested)
        if not device_available(dev):
            raise ValueError(f"device {str(dev)!r} is not available in this process; pass another device "
                             "(e.g. 'cpu') or run where it exists")
        return dev
    if not recorded:
        return torch.device("cpu")
    dev = torch.device(recorded)
    if device_available(dev):
        return dev
    warnings.warn(f"this bank was built on device {recorded!r}, which is not available here; loading on the CPU "
                  "instead (pass device=... to choose)", stacklevel=3)
    return torch.device("cpu")
