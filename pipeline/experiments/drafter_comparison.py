"""Every drafter of a model side by side on the three tasks: one markdown report and one plot.

    python -m pipeline.experiments.drafter_comparison [--tasks humaneval gsm8k sharegpt] [--heads NAME ...]

The drafters are the heads run names found under artifacts/ (rollouts, banks, evaluate tables,
heads folders: e.g. `medusa-draft8192`, `hydra-draft8192`, `eagle3`), or those `--heads` names.
Per task it reports:

1. **Replayed tokens/step on the same trees.** Greedy acceptance is a rank path (README, "How it
   works"; `pipeline.replay`), so each drafter's calibration rollout replays any tree without running a model. A fixed set
   of trees (chains of depth 1..4, Medusa's default tree mc_sim_7b_63, and every drafter bank's own
   trees) is replayed on every drafter's rollout: equal trees, so equal node counts, and a ratio
   column per (EAGLE-3, Hydra) pair of drafters (issue 51 asks >= 1.25x).
2. **Measured speed** of each method against AR and its share of the oracle, from each drafter's
   evaluate table (`make eval`), with the machine the table was measured on.
3. **Training cost** from each drafter's heads report.json (a draft-vocabulary folder that refers to
   another folder's weights reports that folder's training).

Missing artifacts are skipped with a note. Reads artifacts only, runs no model. Writes
artifacts/reports/<model>/drafters/comparison.{md,png} and prints the markdown.
"""

from __future__ import annotations

import argparse
import csv
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import atomic_write_bytes, read_json, save_figure
from pipeline.benchmarks import TASKS
from pipeline.paths import Layout, default_model_name
from pipeline.replay.accept import PrefixIndex, walk
from pipeline.rollout.record import load_rollout
from runtime.tree import Tree

KIND_LABELS = {"medusa": "Medusa", "hydra": "Hydra", "eagle3": "EAGLE-3"}
KIND_ORDER = ("medusa", "hydra", "eagle3")
FIXED_TREES = ("chain1", "chain2", "chain3", "chain4", "mc_sim_7b_63")
RATIO_PASS = 1.25          # issue 51: EAGLE-3's replayed tokens/step over the Hydra heads' on each task
AR_ROWS = ("AR", "AR (ordinary arithmetic)", "HF generate")   # baselines: their tok/s is the cell's denominator
NOT_DRAFTERS = {"frequencies"}   # folders beside the heads that hold no drafter


@dataclass
class Drafter:
    name: str            # heads run name: the folder under artifacts/{heads,rollouts,banks,reports}/<model>/
    kind: str            # medusa | hydra | eagle3 | what its config says

    @property
    def label(self) -> str:
        return f"{self.name} ({KIND_LABELS.get(self.kind, self.kind)})"


@dataclass
class TaskReplay:
    """Replayed tokens/step of each tree (rows, in order) on each drafter's rollout (None: that
    rollout cannot score the tree), the ratio columns, and what each rollout holds."""

    trees: list[tuple[str, Tree]]
    tokens_per_step: dict[str, list[float | None]]          # drafter -> per tree
    ratios: dict[tuple[str, str], list[float | None]]        # (numerator, denominator) -> per tree
    rollouts: dict[str, str] = field(default_factory=dict)   # drafter -> "10 prompts, 904 tokens, depth 4, K 10"


# ---------------------------------------------------------------------------------------------
# what exists


def discover_drafters(artifacts: Path, model: str) -> list[str]:
    """Heads run names with a rollout, a bank, an evaluate table or a heads folder under `artifacts`."""
    lay = Layout(artifacts, Path("data"), model, "_", "_", "_")
    names: set[str] = set()
    for root in (lay.rollouts_root.parent, lay.banks_root.parent):
        if root.is_dir():
            names |= {p.name for p in root.iterdir() if p.is_dir()}
    if lay.model_reports.is_dir():
        names |= {p.name for p in lay.model_reports.iterdir() if any(p.glob("*/evaluate/table.csv"))}
    if lay.heads_root.is_dir():
        names |= {p.name for p in lay.heads_root.iterdir()
                  if (p / "report.json").is_file() or (p / "weights_from.json").is_file() or (p / "config.json").is_file()}
    return sorted(n for n in names if not n.startswith(".") and n not in NOT_DRAFTERS)


def drafter_kind(artifacts: Path, model: str, name: str, tasks: Sequence[str]) -> str:
    """The drafter's kind: its heads folder's config.json, else a bank's provenance, else the name."""
    lay = Layout(artifacts, Path("data"), model, name, "_", "_")
    config = lay.heads_dir() / "config.json"
    if config.is_file():
        c = read_json(config)
        if c.get("kind"):
            return str(c["kind"])
        if "eagle3" in str(c.get("format", "")) or c.get("speculators_model_type") == "eagle3":
            return "eagle3"
    for task in tasks:
        bank = Layout(artifacts, Path("data"), model, name, task, "_").bank_dir / "bank.json"
        if bank.is_file():
            kind = read_json(bank).get("provenance", {}).get("config", {}).get("heads", {}).get("kind")
            if kind:
                return str(kind)
    stem = re.split(r"[-_]", name)[0]
    return stem if stem in KIND_LABELS else "?"


def ordered(drafters: list[Drafter]) -> list[Drafter]:
    rank = {k: i for i, k in enumerate(KIND_ORDER)}
    return sorted(drafters, key=lambda d: (rank.get(d.kind, len(rank)), d.name))


def ratio_pairs(drafters: Sequence[Drafter]) -> list[tuple[str, str]]:
    """(EAGLE-3 drafter, Hydra drafter) for every such pair."""
    return [(a.name, b.name) for a in drafters if a.kind == "eagle3" for b in drafters if b.kind == "hydra"]


def ratio_header(pair: tuple[str, str], pairs: Sequence[tuple[str, str]]) -> str:
    return "EAGLE-3 / Hydra" if len(pairs) == 1 else f"{pair[0]} / {pair[1]}"


# ---------------------------------------------------------------------------------------------
# 1. replayed tokens/step on the same trees


def comparison_trees(bank_trees: dict[str, list[list[list[int]]]]) -> list[tuple[str, Tree]]:
    """The fixed trees, then each drafter bank's trees (root-only left out), each tree once: a bank
    tree equal to one already listed adds its name to that row."""
    rows: list[tuple[str, Tree]] = [(name, Tree.named(name)) for name in FIXED_TREES]
    for drafter, trees in bank_trees.items():
        for k, paths in enumerate(trees):
            if not paths:
                continue
            tree, name = Tree(paths), f"{drafter} bank #{k}"
            same = [j for j, (_, t) in enumerate(rows) if t == tree]
            if same:
                rows[same[0]] = (f"{rows[same[0]][0]} = {name}", tree)
            else:
                rows.append((name, tree))
    return rows


def replayed_tokens_per_step(index: PrefixIndex, tree: Tree) -> float | None:
    """Tokens/step of a fixed-tree decode over the rollout of `index`, pooled over prompts; None
    where the rollout cannot score the tree (deeper than its rank paths, or a rank >= its cap K)."""
    if tree.depth > index.depth or max(max(p) for p in tree.paths) >= index.rank_cap:
        return None
    steps = tokens = 0
    for a in index.accept(tree):
        steps += len(walk(a))
        tokens += max(len(a) - 1, 0)
    return tokens / steps if steps else None


def replay_on_trees(rollouts: dict[str, list[dict]], trees: list[tuple[str, Tree]],
                    pairs: Sequence[tuple[str, str]]) -> TaskReplay:
    """Every tree replayed on every drafter's rollout (`rollouts`: drafter -> per-prompt dicts with
    `rank_paths`), with the ratio of each pair's columns."""
    tps: dict[str, list[float | None]] = {}
    described: dict[str, str] = {}
    for name, rolls in rollouts.items():
        index = PrefixIndex(rolls)
        tps[name] = [replayed_tokens_per_step(index, t) for _, t in trees]
        described[name] = (f"{len(rolls)} prompts, {sum(index.lengths)} tokens, rank paths of depth {index.depth}, "
                           f"K {index.rank_cap}")
    ratios = {}
    for num, den in pairs:
        if num in tps and den in tps:
            ratios[(num, den)] = [a / b if a is not None and b else None for a, b in zip(tps[num], tps[den])]
    return TaskReplay(trees, tps, ratios, described)


def same_text_note(rollouts: dict[str, list[dict]]) -> str | None:
    """A note when the drafters' rollouts are not the same continuations of the same prompts (the
    rank paths then replay different text and the columns compare less than like with like)."""
    if len(rollouts) < 2:
        return None
    ref_name, ref = next(iter(rollouts.items()))
    key = {r["id"]: np.asarray(r["tokens"]).tolist() for r in ref if "id" in r and "tokens" in r}
    differ = [n for n, rolls in rollouts.items() if n != ref_name
              and {r["id"]: np.asarray(r["tokens"]).tolist() for r in rolls if "id" in r and "tokens" in r} != key]
    if not differ:
        return None
    return (f"the rollouts of {', '.join(differ)} are not the same prompts and continuations as {ref_name}'s "
            "(other calibration prompts, profile or arithmetic): their columns replay other text")


# ---------------------------------------------------------------------------------------------
# 2. measured speed from the evaluate tables


def read_table(path: Path) -> list[dict[str, Any]]:
    """The evaluate stage's table.csv as rows (numbers as floats, empty cells as None)."""
    def cell(v: str) -> Any:
        if v == "":
            return None
        try:
            return float(v)
        except ValueError:
            return v

    with open(path, newline="", encoding="utf-8") as f:
        return [{k: cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def table_machine(table_md: Path, bank_json: Path) -> str:
    """The machine a table was measured on: its markdown header's "<cpu> (<n> threads)"; else the
    bank's provenance (the machine that timed the bank), said so; else '?'."""
    if table_md.is_file():
        head = table_md.read_text(encoding="utf-8").splitlines()[0] if table_md.stat().st_size else ""
        m = re.search(r", ([^,]+ \(\d+ threads?\)),", head)
        if m:
            return m.group(1)
    if bank_json.is_file():
        m = read_json(bank_json).get("provenance", {}).get("machine") or {}
        if m.get("cpu"):
            return f"{m.get('cuda') or m['cpu']} ({m.get('torch_threads', '?')} threads; the bank's timing machine)"
    return "?"


def speed_cell(row: dict[str, Any]) -> str:
    """'1.48x · 91%' (speed vs AR, replayed share of the oracle), '!' when not identical to AR."""
    sp, share = row.get("speedup_vs_ar"), row.get("replayed_share_of_oracle")
    text = "-" if sp is None else f"{sp:.2f}x"
    if share is not None:
        text += f" · {100 * share:.0f}%"
    ident = row.get("identical_to_ar")
    if ident is not None and ident < 1:
        text += f" ! {100 * ident:.0f}% identical"
    return text


# ---------------------------------------------------------------------------------------------
# 3. training cost


def _total(x: Any) -> float | None:
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, dict):
        for k in ("total", "total_this_run"):
            if isinstance(x.get(k), (int, float)):
                return float(x[k])
    return None


def _train_part(x: Any) -> float | None:
    if isinstance(x, dict):
        for k in ("train", "train_this_run"):
            if isinstance(x.get(k), (int, float)):
                return float(x[k])
    return None


def training_cost(heads_dir: Path) -> dict[str, Any] | None:
    """What training a heads folder cost, from its report.json, or from the report of the folder
    whose weights it refers to (`weights_from.json`); None without either. Hydra/Medusa and EAGLE-3
    reports name their figures differently: absent figures are None."""
    report, source = heads_dir / "report.json", heads_dir.name
    if not report.is_file() and (heads_dir / "weights_from.json").is_file():
        base = (heads_dir / read_json(heads_dir / "weights_from.json")["base"]["folder"]).resolve()
        report, source = base / "report.json", base.name
    if not report.is_file():
        return None
    r = read_json(report)
    seqs = r.get("train_sequences")
    machine = r.get("machine") or {}
    return {
        "trained_as": source,
        "wall_s": _total(r.get("wall_s")),
        "train_wall_s": _train_part(r.get("wall_s")),
        "cpu_s": _total(r.get("cpu_s")),
        "train_positions": r.get("train_positions"),
        "train_tokens_seen": r.get("train_tokens_seen"),
        "train_sequences": sum(seqs.values()) if isinstance(seqs, dict) else seqs,
        "steps": r.get("steps"),
        "machine": (f"{machine.get('cuda') or machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)"
                    if machine else None),
        "this_run_only": isinstance(r.get("wall_s"), dict) and "total_this_run" in r["wall_s"],
    }


# ---------------------------------------------------------------------------------------------
# the report


def _num(x: Any, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def replay_markdown(task: str, rep: TaskReplay, pairs: Sequence[tuple[str, str]]) -> list[str]:
    names = list(rep.tokens_per_step)
    ratio_keys = [p for p in pairs if p in rep.ratios]   # the pairs that both have a rollout here
    pairs = ratio_keys
    lines = [f"### {task}", "",
             "| tree | nodes | depth | " + " | ".join(names) + "".join(f" | {ratio_header(p, pairs)}" for p in ratio_keys)
             + " |", "|---|---|---|" + "---|" * (len(names) + len(ratio_keys))]
    for i, (tname, tree) in enumerate(rep.trees):
        cells = [_num(rep.tokens_per_step[n][i], "{:.3f}") for n in names]
        cells += [_num(rep.ratios[p][i], "{:.2f}x") for p in ratio_keys]
        lines.append(f"| {tname} | {tree.num_nodes} | {tree.depth} | " + " | ".join(cells) + " |")
    lines.append("")
    for n, what in rep.rollouts.items():
        lines.append(f"* {n}: {what}")
    for p in ratio_keys:
        vals = [v for v in rep.ratios[p] if v is not None]
        if vals:
            verdict = "passes" if min(vals) >= RATIO_PASS else "does not pass"
            lines.append(f"* {ratio_header(p, pairs)} ({p[0]} over {p[1]}): {min(vals):.2f}x to {max(vals):.2f}x over "
                         f"{len(vals)} trees; {verdict} the >= {RATIO_PASS}x asked on every tree")
    lines.append("")
    return lines


def speed_markdown(task: str, tables: dict[str, list[dict[str, Any]]], machines: dict[str, str]) -> list[str]:
    names = list(tables)
    methods: list[str] = []
    for rows in tables.values():
        methods += [r["method"] for r in rows if r["method"] not in AR_ROWS and r["method"] not in methods]
    by = {n: {r["method"]: r for r in rows} for n, rows in tables.items()}
    lines = [f"### {task}", "", "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    ar = [_num((by[n].get("AR") or {}).get("tok_per_s"), "{:.1f} tok/s") for n in names]
    lines.append("| AR | " + " | ".join(ar) + " |")
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(speed_cell(by[n][m]) if m in by[n] else "-" for n in names) + " |")
    lines.append("")
    lines += [f"* {n}: measured on {machines[n]}" for n in names]
    if len(set(machines.values())) > 1:
        lines.append("* measured on different machines: compare the drafters' ratios, not their tok/s")
    lines.append("")
    return lines


def training_markdown(costs: dict[str, dict[str, Any] | None], kinds: dict[str, str]) -> list[str]:
    lines = ["| drafter | kind | trained as | wall s | of it training | CPU s | training positions | "
             "training tokens seen | sequences | steps | machine |", "|---|" + "---|" * 10]
    for n, c in costs.items():
        if c is None:
            lines.append(f"| {n} | {KIND_LABELS.get(kinds[n], kinds[n])} |" + " - |" * 9)
            continue
        lines.append(f"| {n} | {KIND_LABELS.get(kinds[n], kinds[n])} | {c['trained_as']} | {_num(c['wall_s'])} | "
                     f"{_num(c['train_wall_s'])} | {_num(c['cpu_s'])} | {_num(c['train_positions'])} | "
                     f"{_num(c['train_tokens_seen'])} | {_num(c['train_sequences'])} | {_num(c['steps'])} | "
                     f"{c['machine'] or '-'} |")
    lines.append("")
    if any(c and c["this_run_only"] for c in costs.values()):
        lines.append("Hydra/Medusa reports time their last run (`*_this_run`): a training resumed from a checkpoint "
                     "counts only the part after it. Training tokens seen: the tokens its training steps processed, "
                     "where the report records it (EAGLE-3).\n")
    return lines


def plot(replays: dict[str, TaskReplay], tasks: Sequence[str], path: Path) -> None:
    """Grouped bars of replayed tokens/step per tree and drafter, one panel per task; each ratio
    column's figure written above its numerator's bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(tasks) or ["(no task)"]
    widest = max([len(r.trees) for r in replays.values()] or [1])
    fig, axes = plt.subplots(len(tasks), 1, figsize=(max(8.0, 0.9 * widest + 3), 3.6 * len(tasks)), squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        rep = replays.get(task)
        if rep is None:
            ax.text(0.5, 0.5, f"{task}: no drafter rollout found", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        names = list(rep.tokens_per_step)
        x, w = np.arange(len(rep.trees)), 0.8 / max(len(names), 1)
        offset = {n: (j - (len(names) - 1) / 2) * w for j, n in enumerate(names)}
        for n in names:
            ys = [np.nan if v is None else v for v in rep.tokens_per_step[n]]
            ax.bar(x + offset[n], ys, w, label=n)
        for (num, _), ratios in rep.ratios.items():
            for i, (r, v) in enumerate(zip(ratios, rep.tokens_per_step[num])):
                if r is not None and v is not None:
                    ax.text(x[i] + offset[num], v, f"{r:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [f"{t}\n({tree.num_nodes} nodes)" for t, tree in rep.trees], fontsize=7, rotation=20,
                      ha="right")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_ylabel("tokens/step (replayed)")
        ax.set_title(f"{task}: every drafter's rollout replayed on the same trees", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def compare_drafters(artifacts: Path, model: str, tasks: Sequence[str], profile: str = "cpu",
                     heads: Sequence[str] | None = None, out: Path | None = None) -> tuple[str, Path]:
    """Write comparison.{md,png} for the drafters of `model` (discovered, or `heads`) on `tasks`;
    return the markdown and its path. Whatever is missing is skipped with a note."""
    artifacts = Path(artifacts)
    names = list(heads) if heads else discover_drafters(artifacts, model)
    drafters = ordered([Drafter(n, drafter_kind(artifacts, model, n, tasks)) for n in names])
    if heads:   # the order asked for
        drafters.sort(key=lambda d: list(heads).index(d.name))
    kinds = {d.name: d.kind for d in drafters}
    pairs = ratio_pairs(drafters)
    notes: list[str] = []
    if not drafters:
        notes.append(f"no drafter found under {artifacts} for model {model}")
    if not pairs:
        notes.append("no ratio column: it needs an EAGLE-3 drafter and a Hydra one")
    missing_by: dict[str, dict[str, list[str]]] = {d.name: {} for d in drafters}
    replays: dict[str, TaskReplay] = {}
    speed: list[str] = []
    replay_md: list[str] = []
    for task in tasks:
        lays = {d.name: Layout(artifacts, Path("data"), model, d.name, task, profile) for d in drafters}
        rollouts: dict[str, list[dict]] = {}
        bank_trees: dict[str, list] = {}
        tables: dict[str, list[dict[str, Any]]] = {}
        machines: dict[str, str] = {}
        for n, lay in lays.items():
            missing = missing_by[n].setdefault(task, [])
            rollout = lay.work / "rollout"
            if (rollout / "rollout.safetensors").is_file():
                rollouts[n] = load_rollout(rollout)
            else:
                missing.append("rollout")
            bank = lay.bank_dir / "bank.json"
            if bank.is_file():
                bank_trees[n] = [t["paths"] for t in read_json(bank)["trees"]]
            else:
                missing.append("bank")
            table = lay.reports / "evaluate" / "table.csv"
            if table.is_file():
                tables[n] = read_table(table)
                machines[n] = table_machine(table.with_name("table.md"), bank)
            else:
                missing.append("evaluate table")
        if rollouts:
            trees = comparison_trees(bank_trees)
            rep = replay_on_trees(rollouts, trees, pairs)
            replays[task] = rep
            replay_md += replay_markdown(task, rep, pairs)
            same = same_text_note(rollouts)
            if same:
                notes.append(f"{task}: {same}")
            for n, vals in rep.tokens_per_step.items():
                unscored = [t for (t, _), v in zip(trees, vals) if v is None]
                if unscored:
                    notes.append(f"{task}: {n}'s rollout cannot score {', '.join(unscored)} (deeper than its rank "
                                 "paths, or a rank >= its cap K): '-'")
        else:
            replay_md += [f"### {task}", "", "No drafter has a rollout for this task.", ""]
        speed += speed_markdown(task, tables, machines) if tables else [f"### {task}", "", "No evaluate table.", ""]
    for n, by_task in missing_by.items():
        if all(len(m) == 3 for m in by_task.values()):
            notes.append(f"{n}: no rollout, bank or evaluate table for any task")
        else:
            notes += [f"{task}, {n}: no {', no '.join(m)}; skipped there" for task, m in by_task.items() if m]
    costs = {d.name: training_cost(Layout(artifacts, Path("data"), model, d.name, "_", "_").heads_dir())
             for d in drafters}
    notes += [f"{n}: no heads report.json (training cost unknown)" for n, c in costs.items() if c is None]

    out = out or Layout.for_model(artifacts, model).model_reports / "drafters"
    md = "\n".join([
        f"# Drafters side by side: {model}", "",
        f"{time.strftime('%Y-%m-%d')}; profile {profile}; drafters: "
        + (", ".join(d.label for d in drafters) or "none") + ".", "",
        "## 1. Replayed tokens/step on the same trees", "",
        "Each drafter's greedy calibration rollout (its rank paths) replays every tree: the fixed trees and "
        "every drafter bank's own trees, so each row compares the drafters at an equal node count. "
        "'-': the rollout cannot score that tree.", "",
        *replay_md,
        "## 2. Measured speed against AR and share of the oracle", "",
        "From each drafter's `make eval` table: speed against AR in the same arithmetic (`speedup_vs_ar`) · the "
        "method's tokens/s replayed at the bank's step costs as a share of the oracle's (`replayed_share_of_oracle`; "
        "absent for the fixed default trees and the EAGLE-2 tree). 'x% identical': outputs that differ from AR.", "",
        *speed,
        "## 3. Training cost", "",
        *training_markdown(costs, kinds),
        "## Skipped", "",
        *([f"* {n}" for n in notes] or ["Nothing."]), "",
    ])
    atomic_write_bytes(out / "comparison.md", md.encode())
    plot(replays, tasks, out / "comparison.png")
    return md, out / "comparison.md"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--model-name", default=None, help="model folder name (default: the config's default model)")
    p.add_argument("--heads", nargs="+", default=None, help="heads run names to compare (default: every one found)")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--out", default=None, help="output folder (default: artifacts/reports/<model>/drafters)")
    a = p.parse_args(argv)
    md, path = compare_drafters(Path(a.artifacts), a.model_name or default_model_name(), a.tasks, a.profile, a.heads,
                                Path(a.out) if a.out else None)
    print(md)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
