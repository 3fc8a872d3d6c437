"""Acceptance frontiers of one task at several sampling temperatures, in one plot.

    python -m pipeline.experiments.temperature_frontiers task=humaneval [--temperatures 0 0.7 1.0] [overrides]

For each temperature the config is composed as for `python -m pipeline stage=grow
sampling.temperature=T [overrides]` and the grow stage runs through the pipeline graph (rollout
with the seeded sampler at that temperature, merge, grow; outputs that are up to date are
reused). The frontier at a temperature is, for each tree size, the best replayed tokens/step over
the grown max depths (grow's `frontier.json`); Medusa's `mc_sim_7b_63` is marked at its replayed
figure. Writes frontiers.csv, frontiers.md and frontiers.png to `Layout.temperature_reports`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pipeline.config.schema  # noqa: F401 - registers the typed config schemas with hydra
from pipeline.artifacts import atomic_write_bytes, machine_info, read_json, save_figure
from pipeline.graph import compose_cfg
from pipeline.paths import Layout

log = logging.getLogger(__name__)

# the draft-node counts the summary table reads the frontier at (as the README's bank figures)
SUMMARY_DRAFT_NODES = (1, 4, 16, 64)


def frontier_rows(frontier_doc: dict[str, Any], temperature: float) -> list[dict[str, Any]]:
    """One row per tree size: the best replayed tokens/step over max depths (and the depth giving it)."""
    best: dict[int, tuple[float, int]] = {}
    for depth, entries in frontier_doc["frontier"].items():
        for e in entries:
            n = len(e["paths"])
            if n not in best or e["tokens_per_step"] > best[n][0]:
                best[n] = (float(e["tokens_per_step"]), int(depth))
    return [{"temperature": temperature, "draft_nodes": n, "tree_nodes": n + 1, "tokens_per_step": tps, "max_depth": d}
            for n, (tps, d) in sorted(best.items())]


def frontiers(temperatures: list[float], overrides: list[str]) -> Path:
    import pandas as pd

    from pipeline.graph import run

    rows: list[dict[str, Any]] = []
    reference: dict[float, float] = {}
    cfg = None
    for t in temperatures:
        cfg = compose_cfg([*overrides, "stage=grow", f"sampling.temperature={t}"])
        doc = read_json(Path(run(cfg)) / "frontier.json")
        rows += frontier_rows(doc, t)
        if "mc_sim_7b_63" in doc.get("reference", {}):
            reference[t] = float(doc["reference"]["mc_sim_7b_63"]["tokens_per_step"])
    df = pd.DataFrame(rows)
    out = Layout.from_cfg(cfg).temperature_reports
    atomic_write_bytes(out / "frontiers.csv", df.to_csv(index=False).encode())
    table = summary_markdown(df, reference, cfg)
    atomic_write_bytes(out / "frontiers.md", table.encode())
    plot(df, reference, out / "frontiers.png", cfg)
    log.info("%s", table)
    return out


def summary_markdown(df: Any, reference: dict[float, float], cfg: Any) -> str:
    m = machine_info()
    lines = [f"### {cfg.task.name}: acceptance frontier by sampling temperature ({cfg.model.name} + {cfg.heads.name} heads, "
             f"profile {cfg.profile.name}, dtype {cfg.dtype}, seed {int(cfg.sampling.seed)}, {m['cpu']})", "",
             "Replayed tokens/step of the best grown tree with this many draft nodes (root excluded).", "",
             "| T | " + " | ".join(f"{n} nodes" for n in SUMMARY_DRAFT_NODES) + " | mc_sim_7b_63 |",
             "|---|" + "---|" * (len(SUMMARY_DRAFT_NODES) + 1)]
    for t, d in df.groupby("temperature", sort=True):
        by_n = dict(zip(d.draft_nodes, d.tokens_per_step))
        cells = [f"{by_n[n]:.2f}" if n in by_n else "" for n in SUMMARY_DRAFT_NODES]
        ref = f"{reference[t]:.2f}" if t in reference else ""
        lines.append(f"| {t:g} | " + " | ".join(cells) + f" | {ref} |")
    return "\n".join(lines) + "\n"


def plot(df: Any, reference: dict[float, float], path: Path, cfg: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, d in df.groupby("temperature", sort=True):
        line = ax.plot(d.tree_nodes, d.tokens_per_step, label=f"T = {t:g}" + (" (greedy)" if t == 0 else ""))[0]
        if t in reference:
            ax.scatter([64], [reference[t]], marker="x", color=line.get_color(), zorder=5)
    ax.scatter([], [], marker="x", color="gray", label="mc_sim_7b_63 (64 nodes)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set(xlabel="tree nodes (with root)", ylabel="tokens per step (replayed, best over max depths)",
           title=f"{cfg.task.name}: acceptance frontier by sampling temperature")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    ap.add_argument("overrides", nargs="*", help="pipeline config overrides, e.g. task=humaneval dtype=float32")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if any(o.startswith(("stage=", "sampling.temperature=")) for o in a.overrides):
        raise SystemExit("stage and sampling.temperature are set by this tool; use --temperatures")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    print(frontiers(a.temperatures, a.overrides))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
