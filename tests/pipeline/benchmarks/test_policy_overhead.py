"""The policy-overhead benchmark (`python -m pipeline.benchmarks.policy_overhead`): it measures
every policy kind, runs without a bank, and times a dynamic step part by part. No wall-clock bound
here (one fails on a loaded machine): the verdict against the 0.1 ms target is the script's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipeline.benchmarks.policy_overhead import policy_overhead_us, time_dynamic
from tests.helpers import GENTLE, SUPER, tiny_heads, tiny_model


def test_policy_overhead_us_measures_every_policy_kind() -> None:
    """The micro-benchmark runs every policy kind through choose + update and reports a per-step
    figure for each. No bound on it here (a wall-clock bound fails on a loaded machine): the figure
    against the 0.1 ms per-step target is `python -m pipeline.benchmarks.policy_overhead`."""
    us = policy_overhead_us(n_steps=200)
    assert set(us) >= {"static", "ladder", "hysteresis", "expected_throughput"}
    assert all(math.isfinite(v) and v > 0 for v in us.values()), us


def test_policy_overhead_benchmark_runs_without_a_bank(tmp_path: Path) -> None:
    """The benchmark's own command line with its defaults (no --bank, no --step-cost) writes its
    report: the dynamic section is optional, and a missing path must not reach Path(None)."""
    import json

    from pipeline.benchmarks.policy_overhead import main

    out = tmp_path / "policy_overhead.json"
    main(["--threads", "1", "--calls", "3", "--repeats", "1", "--super-nodes", "0", "--out", str(out)])
    r = json.loads(out.read_text())
    assert set(r["policy_us"]) >= {"static", "ladder", "hysteresis", "expected_throughput"}
    assert "dynamic" not in r


@pytest.mark.usefixtures("one_torch_thread")
def test_the_scheduling_benchmark_times_every_part() -> None:
    """`python -m pipeline.benchmarks.policy_overhead` times a dynamic step part by part (the
    README's scheduling cost); on tiny heads, every part is timed and the subset is a real one."""
    model = tiny_model(4)
    heads = tiny_heads(model, "hydra", seed=4)
    out = time_dynamic(heads, torch.randn(1, model.args.dim), 3, SUPER, GENTLE, rounds=2, repeats=1)
    assert all(out[k] > 0 for k in ("draft_plain", "draft_scored", "rank", "key", "lookup_hit", "lookup_miss",
                                    "stop_check"))
    # the step's scheduling is a sum of parts, one of them a difference of two timings (scored minus
    # plain draft), which a loaded machine can make negative: check the sum, not its sign
    parts = out["score_in_situ"] + out["rank"] + out["key"] + out["subset_tokens"]
    assert out["scheduling_hit"] == pytest.approx(parts + out["lookup_hit"])
    assert out["scheduling_miss"] == pytest.approx(parts + out["lookup_miss"])
    assert 1 <= out["selected_nodes"] <= SUPER.num_nodes
