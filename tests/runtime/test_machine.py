"""What a bank records about where it was measured, and what `provenance_differences` says differs
here: only recorded fields, the CPU-side ones on the CPU, the GPU name on CUDA."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from runtime.machine import cpu_name_and_flags, here, provenance_differences

HERE_CPU = {"device": "cpu", "cpu": "Fake CPU 9000", "cuda": None, "torch_threads": 2, "kernel": "small_rows-avx2-abc"}
MEASURED_HERE = {"dtype": "float32", "kernel": "small_rows-avx2-abc", "device": "cpu",
                 "machine": {"cpu": "Fake CPU 9000", "torch_threads": 2, "cuda": "NVIDIA H100"}}


def test_cpu_name_and_flags_read_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "processor", lambda: "")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Fake CPU 9000 @ 2.0GHz\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_name_and_flags(info) == ("Fake CPU 9000 @ 2.0GHz", "flags\t\t: fpu avx2 amx_bf16")
    assert cpu_name_and_flags(tmp_path / "missing") == (platform.machine(), "")


def test_here_describes_this_process() -> None:
    import torch

    now = here("cpu")
    assert now["device"] == "cpu" and now["cuda"] is None and now["cpu"] == cpu_name_and_flags()[0]
    assert now["torch_threads"] == torch.get_num_threads()
    assert now["kernel"] == "none" or now["kernel"].startswith("small_rows-")


def test_a_bank_measured_here_differs_in_nothing() -> None:
    assert provenance_differences(MEASURED_HERE, HERE_CPU, "float32") == []
    assert provenance_differences({}, HERE_CPU, "bfloat16") == []  # nothing recorded, nothing compared


def test_each_recorded_difference_is_named() -> None:
    prov = {**MEASURED_HERE, "kernel": "none", "machine": {"cpu": "Other CPU", "torch_threads": 16}}
    assert provenance_differences(prov, HERE_CPU, "bfloat16") == [
        "dtype 'float32' (here 'bfloat16')", "CPU 'Other CPU' (here 'Fake CPU 9000')",
        "torch threads 16 (here 2)", "small-row kernel 'none' (here 'small_rows-avx2-abc')"]


def test_gpu_banks_compare_the_gpu_not_the_host() -> None:
    gpu_bank = {**MEASURED_HERE, "device": None, "config": {"device": "cuda:0"},
                "machine": {"cpu": "Other CPU", "torch_threads": 16, "cuda": "NVIDIA H100 80GB HBM3"}}
    on_gpu = {**HERE_CPU, "device": "cuda", "cuda": "NVIDIA H200"}
    assert provenance_differences(gpu_bank, on_gpu, "float32") == [
        "GPU 'NVIDIA H100 80GB HBM3' (here 'NVIDIA H200')"]
    assert provenance_differences(gpu_bank, {**on_gpu, "cuda": "NVIDIA H100 80GB HBM3"}, "float32") == []
    # decoded on the CPU, a GPU bank says so (and the CPU side is not compared: it was not what ran)
    assert provenance_differences(gpu_bank, HERE_CPU, "float32") == ["device 'cuda' (here 'cpu')"]
