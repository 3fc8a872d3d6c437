"""The bank's batch plot: a second panel of paired ratios where the bank timed its choices."""

from __future__ import annotations

import struct
from pathlib import Path

from pipeline.bank.write import plot_batch_throughput
from runtime.tree import Tree

TREES = [Tree([]), Tree.chain(1), Tree.chain(2)]


def _width(png: Path) -> int:
    return struct.unpack(">I", png.read_bytes()[16:20])[0]   # the IHDR chunk's width


def _batch(paired: bool) -> dict[str, dict]:
    out = {}
    for b in (1, 2, 4):
        entry = {"best_static": 2 if b < 4 else None, "tok_per_s": [100.0 * b, 110.0 * b, 120.0 * b]}
        if paired:
            entry["paired"] = {"level": 0.9, "candidates": [
                {"tree": 2, "median": 1.2, "low": 1.1, "high": 1.3, "rounds": 4, "model_ratio": 1.25},
                {"tree": 1, "median": 1.1, "low": 0.95, "high": 1.2, "rounds": 6, "model_ratio": None}]}
        out[str(b)] = entry
    return out


def test_the_batch_plot_adds_the_paired_panel_only_where_there_are_intervals(tmp_path: Path) -> None:
    prov = {"task": "t", "machine": {"cpu": "c", "torch_threads": 1}, "dtype": "float32"}
    plot_batch_throughput(TREES, _batch(False), tmp_path / "plain.png", prov)
    plot_batch_throughput(TREES, _batch(True), tmp_path / "paired.png", prov)
    assert _width(tmp_path / "plain.png") == 7 * 110 and _width(tmp_path / "paired.png") == 13 * 110
