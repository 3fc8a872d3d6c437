"""How the evaluate stage names its methods and the run's decoding, in tables and plots."""

from __future__ import annotations

from omegaconf import DictConfig

POLICY_LABELS = {"ladder": "EntMTP-l", "hysteresis": "EntMTPτ", "expected_throughput": "expected-throughput"}
DYNAMIC_LABEL = "EntMTP-dyn"
EAGLE2_LABEL = "EAGLE-2 tree"   # EAGLE-2's dynamic tree (runtime.eagle2), the field's default baseline


def decoding_words(cfg: DictConfig) -> str:
    """'greedy', or the seeded sampling settings of the run."""
    sc = cfg.get("sampling")
    if sc is None or float(sc.temperature) == 0:
        return "greedy"
    return f"seeded sampling (T {float(sc.temperature):g}, top-k {int(sc.top_k)}, top-p {float(sc.top_p):g}, seed {int(sc.seed)})"
