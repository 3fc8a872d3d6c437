"""Do a bank's per-batch-size choices survive a rebuild on the same machine?

    python -m pipeline.experiments.rebuild_stability --task humaneval --rebuilds 3 [-- OVERRIDES...]
    python -m pipeline.experiments.rebuild_stability --banks a/bank.json b/bank.json ...   # report only

With `--rebuilds N` it rebuilds the task's time and bank stages N times (`force=true` on each, in
turn, in separate processes, as a user would), keeps each build's bank.json, and reports; with
`--banks` it reports on bank.json files already kept. The report (rebuilds.md, in `--out`;
default: the reports folder of the bank, `rebuilds/`) tabulates, per batch size, each build's
choice with its paired interval (`pipeline.timing.paired`), and a verdict:

* same: every build chose the same (a tree, or AR);
* within intervals: the builds differ, but for each pair of builds that chose differently, each of
  the two that timed both choices (at least one did) reports them within each other's interval
  (their intervals overlap; AR's interval is [1, 1 + the bank's minimum gain], since a tree below
  that margin is not chosen over AR): the build itself says the other choice is as good, up to its
  measurement;
* differs: some build reports one choice as confidently better than the other.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_bytes
from pipeline.paths import REPO_ROOT, Layout
from runtime.check import paired_min_gain

AR = None


def cell(doc: dict[str, Any], b: str) -> tuple[int | None, dict[int, tuple[float, float, float]]]:
    """A bank.json's choice at batch size `b` (None: AR) and {tree: (median, low, high)} of the
    trees its paired rounds timed there."""
    entry = doc["batch_sizes"][b]
    cands = (entry.get("paired") or {}).get("candidates", [])
    return entry.get("best_static"), {int(c["tree"]): (c["median"], c["low"], c["high"]) for c in cands}


def _interval(choice: int | None, timed: dict[int, tuple[float, float, float]], gain: float) -> tuple[float, float] | None:
    if choice is AR:
        return (1.0, 1.0 + gain)
    return timed[choice][1:] if choice in timed else None


def within(a: int | None, b: int | None, timed: dict[int, tuple[float, float, float]], gain: float = 0.0) -> bool:
    """Whether one build's measurement puts choices a and b within each other's interval (`gain`:
    that build's minimum gain over AR)."""
    ia, ib = _interval(a, timed, gain), _interval(b, timed, gain)
    return ia is not None and ib is not None and ia[0] <= ib[1] and ib[0] <= ia[1]


def verdicts(docs: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int | None], str]]:
    """{batch size: (each build's choice, verdict)} over the batch sizes every build measured."""
    sizes = sorted(set.intersection(*(set(d["batch_sizes"]) for d in docs)), key=int)
    out = {}
    for b in sizes:
        cells = [cell(d, b) for d in docs]
        choices = [c for c, _ in cells]
        if len(set(choices)) == 1:
            out[b] = (choices, "same")
            continue
        ok = True
        for i in range(len(docs)):
            for j in range(i + 1, len(docs)):
                if choices[i] == choices[j]:
                    continue
                # the builds of the pair that timed both choices (AR is always "timed": ratio 1)
                judges = [k for k in (i, j) if all(c is AR or c in cells[k][1] for c in (choices[i], choices[j]))]
                ok = ok and bool(judges) and all(
                    within(choices[i], choices[j], cells[k][1], paired_min_gain(docs[k]["batch_sizes"][b])) for k in judges)
        out[b] = (choices, "within intervals" if ok else "differs")
    return out


def report(docs: Sequence[dict[str, Any]], names: Sequence[str],
           minutes: Sequence[dict[str, float]] | None = None) -> str:
    """rebuilds.md: per batch size, each build's choice and the paired interval of what it chose;
    with `minutes` ({stage: minutes} per build), a last row with each build's stage times."""
    prov = docs[0].get("provenance", {})
    machine = prov.get("machine", {})
    head = (f"# Rebuild stability: {prov.get('task', '?')}, {prov.get('model_name', '?')} + "
            f"{prov.get('heads_name', '?')}, {machine.get('cpu', '?')} ({machine.get('torch_threads', '?')} threads), "
            f"{prov.get('dtype', '?')}\n\n"
            f"{len(docs)} builds of the time and bank stages. Each cell: the build's choice at that batch size and "
            "its paired ratio to batched AR, median [interval] (AR: no tree's interval lay above 1 + the bank's "
            "minimum gain; its best candidate's in brackets).\n\n")
    v = verdicts(docs)
    lines = ["| batch | " + " | ".join(names) + " | verdict |", "|---" * (len(names) + 2) + "|"]
    for b, (choices, verdict) in v.items():
        row = []
        for d, c in zip(docs, choices):
            _, timed = cell(d, b)
            if c is AR:
                best = max(timed.items(), key=lambda kv: kv[1][0]) if timed else None
                row.append("AR" + (f" (tree {best[0]}: {best[1][0]:.2f} [{best[1][1]:.2f}, {best[1][2]:.2f}])" if best else ""))
            else:
                m, lo, hi = timed.get(c, (float("nan"),) * 3)
                row.append(f"tree {c} ({len(d['trees'][c]['paths']) + 1} nodes): {m:.2f} [{lo:.2f}, {hi:.2f}]")
        lines.append(f"| {b} | " + " | ".join(row) + f" | {verdict} |")
    if minutes:
        lines.append("| minutes | " + " | ".join(" + ".join(f"{s} {m:.1f}" for s, m in d.items()) for d in minutes)
                     + " | |")
    return head + "\n".join(lines) + "\n"


def rebuild(task: str, n: int, out: Path, overrides: Sequence[str]) -> tuple[list[Path], list[dict[str, float]]]:
    """Rebuild the task's time and bank stages `n` times (force=true each), keeping each bank.json;
    returns the kept files and each build's wall minutes per stage."""
    bank = _layout(task, overrides).bank_dir / "bank.json"
    out.mkdir(parents=True, exist_ok=True)
    kept, minutes = [], []
    for i in range(1, n + 1):
        took = {}
        for stage in ("time", "bank"):
            cmd = [sys.executable, "-m", "pipeline", f"stage={stage}", f"task={task}", "force=true", *overrides]
            print(f"[rebuilds] build {i}/{n}: {' '.join(cmd[2:])}", flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=REPO_ROOT)
            took[stage] = (time.perf_counter() - t0) / 60
        kept.append(out / f"build-{i}.json")
        shutil.copyfile(bank, kept[-1])
        minutes.append(took)
    return kept, minutes


def _layout(task: str, overrides: Sequence[str]) -> Layout:
    from pipeline.graph import compose_cfg

    return Layout.from_cfg(compose_cfg([f"task={task}", *overrides]))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--rebuilds", type=int, default=3, help="builds to run (ignored with --banks)")
    ap.add_argument("--banks", nargs="+", type=Path, help="bank.json files already kept: report only")
    ap.add_argument("--out", type=Path, help="folder for the builds' bank.json and rebuilds.md")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides for every build (after --)")
    args = ap.parse_args(argv)
    minutes = None
    if args.banks:
        files = list(args.banks)
        out = args.out or files[0].parent
    else:
        if args.rebuilds < 2:
            ap.error("--rebuilds needs at least 2 builds to compare")
        out = args.out or _layout(args.task, args.overrides).reports / "rebuilds"
        files, minutes = rebuild(args.task, args.rebuilds, out, args.overrides)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        ap.error(f"no such bank.json: {', '.join(missing)}")
    docs = [json.loads(f.read_text()) for f in files]
    text = report(docs, [f.stem for f in files], minutes)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "rebuilds.md", text.encode())
    print(text)
    print(f"[rebuilds] wrote {out / 'rebuilds.md'}")


if __name__ == "__main__":
    main()
