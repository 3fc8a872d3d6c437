"""Where a bank was measured, and whether this process runs somewhere else.

A bank's figures and choices are measurements of one machine: its CPU (or GPU), the dtype, the
float32 kernels (`runtime.model.small_rows.kernel_id`) and torch's thread count. The pipeline
records them in the bank's provenance (`machine`, `dtype`, `kernel`); `provenance_differences`
names those that differ here, for `EntMTP.load`'s warning.

`cpu_name_and_flags` reads no torch, so the pipeline's up-to-date checks (`pipeline.artifacts`)
use it too: the CPU name a bank records and the one compared here come from the same reader.
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpu_name_and_flags(cpuinfo: Path = CPUINFO) -> tuple[str, str]:
    """The CPU's model name (platform's name where /proc/cpuinfo has none) and its `flags` line."""
    cpu = platform.processor() or platform.machine()
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    return cpu, flags


def here(device: Any) -> dict[str, Any]:
    """What this process decodes on, in the bank provenance's terms: the device type, the CPU name,
    the GPU name (on CUDA), torch's thread count and the float32 kernel id."""
    import torch

    from runtime.model.small_rows import kernel_id

    dev = torch.device(device)
    return {"device": dev.type, "cpu": cpu_name_and_flags()[0],
            "cuda": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "torch_threads": torch.get_num_threads(), "kernel": kernel_id()}


def provenance_differences(provenance: dict[str, Any], now: dict[str, Any], dtype: str) -> list[str]:
    """What differs between where a bank was measured (its `provenance`) and `now` (`here(...)`)
    decoding in `dtype`, one phrase each ("CPU 'X' (here 'Y')"). Only what the bank records is
    compared; the CPU name, thread count and kernel only where both sides decode on the CPU (a GPU
    decode does not run them), the GPU name only where both decode on CUDA."""
    machine = provenance.get("machine") if isinstance(provenance.get("machine"), dict) else {}
    recorded = provenance.get("device") or (provenance.get("config") or {}).get("device") or "cpu"
    was = str(recorded).split(":")[0]
    out: list[str] = []

    def differs(label: str, then: Any, current: Any) -> None:
        if then is not None and then != current:
            out.append(f"{label} {then!r} (here {current!r})")

    differs("device", was, now["device"])
    differs("dtype", provenance.get("dtype"), dtype)
    if was == now["device"] == "cpu":
        differs("CPU", machine.get("cpu"), now["cpu"])
        differs("torch threads", machine.get("torch_threads"), now["torch_threads"])
        differs("small-row kernel", provenance.get("kernel"), now["kernel"])
    if was == now["device"] == "cuda":
        differs("GPU", machine.get("cuda"), now["cuda"])
    return out
