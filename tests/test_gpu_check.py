"""The prepared GPU check skips cleanly where there is no CUDA device (CI, the CPU bench)."""

from __future__ import annotations

import pytest
import torch

from pipeline.benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the check would run for real")
def test_gpu_check_skips_without_cuda(capsys, tmp_path) -> None:
    assert gpu_check.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SKIP: no CUDA device" in out and "make gpu-check" in out
    assert not any(tmp_path.iterdir())  # nothing was built
