"""Compare the banks of several tasks: one plot and one table that show the task dependence."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from pipeline.artifacts import atomic_write_bytes, save_figure  # noqa: E402
from runtime.bank import BankError, TopologyBank  # noqa: E402


log = logging.getLogger(__name__)

def compare_banks(bank_root: Path, work_root: Path, out_dir: Path, tasks: list[str]) -> dict[str, Any]:
    """`bank_root` = artifacts/banks/<model>/<heads>, `work_root` = artifacts/rollouts/<model>/<heads>
    (the grow frontiers live under <task>/<profile>/grow/). Writes task_comparison.{png,md}."""
    banks: dict[str, TopologyBank] = {}
    for t in tasks:
        try:
            banks[t] = TopologyBank.load(bank_root / t)
        except BankError as e:
            log.info("%s", f"[compare] skipping {t}: {e}")
    if not banks:
        raise SystemExit(f"no banks under {bank_root}; build them with `make banks`")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = ["| task | bank trees (nodes) | EntMTP* nodes | depth | tokens/step | tok/s | AR tok/s | vs AR |", "|---|---|---|---|---|---|---|---|"]
    for task, bank in banks.items():
        prof = bank.provenance.get("config", {}).get("profile", {}).get("name", "cpu")
        frontier_file = work_root / task / prof / "grow" / "frontier.json"
        if frontier_file.is_file():
            fr = json.loads(frontier_file.read_text())["frontier"]
            best: dict[int, float] = {}
            for entries in fr.values():
                for e in entries:
                    n = len(e["paths"]) + 1
                    best[n] = max(best.get(n, 0.0), e["tokens_per_step"])
            xs = sorted(best)
            ax1.plot(xs, [best[x] for x in xs], label=task)
        nodes = [t.num_nodes for t in bank.trees]
        line = ax2.plot(nodes, [f["tok_per_s"] for f in bank.figures], "o-", label=task)[0]
        b = bank.best_static
        ax2.scatter([nodes[b]], [bank.figures[b]["tok_per_s"]], marker="*", s=200, color=line.get_color(), zorder=5)
        ar = bank.provenance.get("ar_tok_per_s")
        f = bank.figures[b]
        rows.append(f"| {task} | {', '.join(map(str, nodes))} | {nodes[b]} | {bank.trees[b].depth} | {f['tokens_per_step']:.3f} | "
                    f"{f['tok_per_s']:.2f} | {ar:.2f} | {f['tok_per_s'] / ar:.2f}x |" if ar else f"| {task} | ... |")
    ax1.set(xlabel="tree nodes (with root)", ylabel="tokens per step (replayed, best over max depths)",
            title="Acceptance frontier per task")
    ax2.set(xlabel="tree nodes (with root)", ylabel="end-to-end tok/s (measured)",
            title="Bank trees per task; * = EntMTP*")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)  # base 2: powers of two as the only labels, no crowded minor ones
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.grid(alpha=0.3)
        ax.legend()
    m = next(iter(banks.values())).provenance.get("machine", {})
    fig.suptitle(f"Task dependence — {m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out_dir / "task_comparison.png")
    table = "\n".join(rows) + "\n"
    atomic_write_bytes(out_dir / "task_comparison.md", table.encode())
    log.info("%s", table)
    return {"tasks": list(banks), "plot": str(out_dir / "task_comparison.png")}
