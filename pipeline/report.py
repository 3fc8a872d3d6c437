"""`make report`: one dated markdown report of what the artifacts hold, and the index of docs/results/.

`write_report(artifacts, results)` reads what the pipeline and the benchmarks left under
`<artifacts>/reports/` and `<artifacts>/banks/` and writes `<results>/<date>-<machine slug>.md`:

* per model and heads, the task comparison (`task_comparison.md`) and, per task, the evaluation
  table (`<task>/evaluate/table.md`) and the bank's summary (trees, best static tree, policies,
  machine, dtype: read from `bank.json` through `runtime.bank.TopologyBank`);
* the heads reports (`reports/<model>/heads/*.csv`) and any other report files of the model;
* the benchmark reports under `reports/benchmarks/`, each with its headline table.

The machine is the one the artifacts record (the `machine` dicts that `pipeline.artifacts.machine_info`
writes into evaluate manifests, bank provenance and benchmark JSON), never the machine running the
report; the date is the newest `created` time of the stage manifests there, or today when none
records one. Both are in the file name, so a report is regenerated in place, and a report of other
artifacts goes to another file. `write_index(results)` then lists every file of `<results>/` (their
first heading and their `> ... · date: ... · machine: ... · summary: ...` line) in
`<results>/README.md`. Every file is written atomically. Nothing here needs hydra or a model:
`python -m pipeline.report [--artifacts DIR] [--results DIR] [--date YYYY-MM-DD]`.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.artifacts import MANIFEST, atomic_write_bytes
from pipeline.paths import REPO_ROOT, Layout

RESULTS_DIR = REPO_ROOT / "docs" / "results"
INDEX = "README.md"
BENCHMARKS = "benchmarks"          # <artifacts>/reports/benchmarks/: the benchmark scripts' reports
EVAL_TABLE = ("evaluate", "table.md")
TASK_COMPARISON = "task_comparison.md"
MAX_TABLE_ROWS = 40                # a CSV longer than this is cut, with a line saying how much is left out
MAX_TABLE_COLUMNS = 16             # wider CSVs keep their label columns and the "all/..." aggregate ones
MAX_JSON_BYTES = 8 << 20           # larger JSON files (decode traces) are listed, not read
META_SEP = " · "                   # separates the fields of a results file's "> ..." line
# the order of a day's sessions in the index (a name without one of these sorts between "earlier" and the rest)
SLOTS = {"earlier": -1, "morning": 1, "first-half": 1, "afternoon": 2, "evening": 3, "second-half": 3, "night": 4}
# machine_info() keys, in the order a report shows them
MACHINE_FIELDS = ("cpu", "cores", "amx", "isa", "flags", "cuda", "torch", "torch_threads", "platform")


# ------------------------------------------------------------------------------------ machine


@dataclass(frozen=True)
class MachineRecord:
    """A `machine` dict found in an artifact, with what else that artifact says about its arithmetic."""

    source: Path                    # the JSON file it was read from
    machine: Mapping[str, Any]      # pipeline.artifacts.machine_info(): cpu, cores, amx, torch, cuda, platform, ...
    dtype: str | None = None        # the dtype the figures were measured in, where the file records it
    kernel: str | None = None       # runtime.model.small_rows.kernel_id() ("small_rows-<isa>-<sha>" or "none"), where recorded

    def identity(self) -> tuple[Any, ...]:
        """What makes two records the same machine (thread count and kernel build aside)."""
        m = self.machine
        return tuple(str(m.get(k)) for k in ("cpu", "cores", "amx", "cuda", "torch"))


def _roots(artifacts: Path) -> tuple[Path, Path]:
    """`<artifacts>/reports` and `<artifacts>/banks` as `pipeline.paths.Layout` names them (a model,
    heads and task name of "" give the folder above every model's)."""
    lay = Layout.for_model(artifacts, "")
    return lay.model_reports, lay.bank_dir


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it is too large, unreadable or not JSON."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _machine_of(doc: Any) -> tuple[Mapping[str, Any] | None, str | None, str | None]:
    """(machine, dtype, kernel) from a JSON document: a top-level `machine`, a bank's
    `provenance.machine` or a stage manifest's `summary.machine`."""
    if not isinstance(doc, Mapping):
        return None, None, None
    for holder in (doc, doc.get("provenance"), doc.get("summary")):
        if isinstance(holder, Mapping) and isinstance(holder.get("machine"), Mapping):
            dtype = holder.get("dtype", doc.get("dtype"))
            kernel = holder.get("kernel", doc.get("kernel"))
            return holder["machine"], str(dtype) if dtype else None, str(kernel) if kernel else None
    return None, None, None


def _priority(path: Path) -> int:
    """Which record names the report's machine: the evaluation's own first, then the bank's, then
    the time stage's, then any other report's."""
    if path.name == MANIFEST and path.parent.name == EVAL_TABLE[0]:
        return 0
    return {"bank.json": 1, "timing.json": 2}.get(path.name, 3)


def find_machines(artifacts: Path) -> list[MachineRecord]:
    """Every machine record under `<artifacts>/reports` and `<artifacts>/banks`, the one that names
    the report first (see `_priority`), then by path."""
    found = []
    for root in _roots(artifacts):
        if not root.is_dir():
            continue
        for path in root.rglob("*.json"):
            machine, dtype, kernel = _machine_of(_read_json(path))
            if machine is not None:
                found.append(MachineRecord(path, machine, dtype, kernel))
    return sorted(found, key=lambda r: (_priority(r.source), r.source.as_posix()))


def _isa(rec: MachineRecord) -> str | None:
    """The widest vector instruction set the record shows: its own `isa`, its `flags`, or the ISA
    part of the small-row kernel's id."""
    m = rec.machine
    if m.get("isa"):
        return str(m["isa"]).lower()
    flags = str(m.get("flags") or "").split()
    if flags:
        return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else None
    if rec.kernel and rec.kernel.startswith("small_rows-"):
        return rec.kernel.split("-")[1]
    return None


def _name_words(name: str) -> list[str]:
    """The words of a CPU or GPU name without trademarks, clock, and generic words."""
    name = re.sub(r"\((r|tm|c)\)", " ", name.lower())
    name = re.sub(r"@.*$", " ", name)
    drop = {"cpu", "processor", "core", "cores", "with", "graphics"}
    return [w for w in re.findall(r"[a-z0-9]+", name) if w not in drop and not re.fullmatch(r"\d+-?core", w)]


def machine_slug(rec: MachineRecord) -> str:
    """A file-name slug that depends only on the record: vendor and family of the CPU (or the GPU's
    name under CUDA), then "amx" where the CPU has AMX, else its vector ISA where the record shows
    one: e.g. "amd-epyc", "amd-epyc-avx2", "intel-xeon-amx", "nvidia-h200"."""
    m = rec.machine
    if m.get("cuda"):
        return "-".join(_name_words(str(m["cuda"]))[:2]) or "cuda"
    words = _name_words(str(m.get("cpu") or "")) or ["unknown", "cpu"]
    parts = words[:2]
    if m.get("amx"):
        parts.append("amx")
    elif (isa := _isa(rec)) is not None:
        parts.append(isa)
    return "-".join(parts)


def machine_label(rec: MachineRecord) -> str:
    """One line naming the machine: "AMD EPYC, 2 cores, no AMX, torch 2.13.0+cpu, float32"."""
    m = rec.machine
    bits = [str(m.get("cuda") or m.get("cpu") or "unknown CPU")]
    if m.get("cores") is not None:
        bits.append(f"{m['cores']} cores")
    if not m.get("cuda") and "amx" in m:
        bits.append("AMX" if m["amx"] else "no AMX")
    if (isa := _isa(rec)) is not None:
        bits.append(isa.upper().replace("AVX512", "AVX-512"))
    if m.get("torch"):
        bits.append(f"torch {m['torch']}")
    if rec.dtype:
        bits.append(rec.dtype)
    return ", ".join(bits)


# ------------------------------------------------------------------------------------ date


def report_date(artifacts: Path, today: dt.date | None = None) -> tuple[dt.date, str]:
    """The newest `created` date of the stage manifests under reports/ and banks/, and where it
    came from; `today` (default: the current date) when no manifest records one."""
    newest: tuple[dt.datetime, Path] | None = None
    for root in _roots(artifacts):
        if not root.is_dir():
            continue
        for path in root.rglob(MANIFEST):
            doc = _read_json(path)
            created = doc.get("created") if isinstance(doc, Mapping) else None
            if not isinstance(created, str):
                continue
            try:
                when = dt.datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z")
            except ValueError:
                continue
            if newest is None or when > newest[0]:
                newest = (when, path)
    if newest is None:
        day = today or dt.date.today()
        return day, "no stage manifest under the artifacts records when they were built: the date of this report"
    return newest[0].date(), f"the newest stage manifest, `{_shown(newest[1], artifacts)}`"


# ------------------------------------------------------------------------------------ markdown


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table (pipes in cells escaped)."""
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return out


def csv_table(path: Path) -> list[str]:
    """A CSV file as a markdown table: at most `MAX_TABLE_ROWS` rows; a file wider than
    `MAX_TABLE_COLUMNS` keeps its label columns (no "/" in the name) and its "all/..." aggregates."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        return ["(empty)"]
    header, body = rows[0], rows[1:]
    keep = list(range(len(header)))
    note = []
    if len(header) > MAX_TABLE_COLUMNS:
        keep = [i for i, h in enumerate(header) if "/" not in h or h.startswith("all/")][:MAX_TABLE_COLUMNS]
        note.append(f"{len(header) - len(keep)} more columns (per task) in the file")
    if len(body) > MAX_TABLE_ROWS:
        note.append(f"{len(body) - MAX_TABLE_ROWS} more rows in the file")
        body = body[:MAX_TABLE_ROWS]
    lines = markdown_table([header[i] for i in keep], ([r[i] if i < len(r) else "" for i in keep] for r in body))
    return lines + ([f"\n({'; '.join(note)})"] if note else [])


def parse_markdown_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in `text`, as {column: cell}."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    split = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header = split[0]
    return [dict(zip(header, r)) for r in split[2:]]


def _link(target: Path, results: Path) -> str:
    return Path(os.path.relpath(target, results)).as_posix()


def _shown(path: Path, artifacts: Path) -> str:
    """A path as the report shows it: relative to the artifacts folder's parent (the repository)."""
    try:
        return path.relative_to(artifacts.parent).as_posix()
    except ValueError:
        return path.as_posix()


# ------------------------------------------------------------------------------------ sections


def _subdirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []


def _eval_table(task_reports: Path) -> Path | None:
    path = task_reports.joinpath(*EVAL_TABLE)
    return path if path.is_file() else None


def headline(artifacts: Path) -> str:
    """EntMTP*'s speed against AR per task, from the evaluation tables ("" when there are none)."""
    reports, _ = _roots(artifacts)
    bits = []
    for model in _subdirs(reports):
        if model.name == BENCHMARKS:
            continue
        for heads in _subdirs(model):
            for task in _subdirs(heads):
                table = _eval_table(task)
                if table is None:
                    continue
                rows = parse_markdown_table(table.read_text(encoding="utf-8"))
                star = next((r for r in rows if r.get("method") == "EntMTP*"), None)
                if star and star.get("speedup_vs_ar"):
                    identical = all(r.get("identical_to_ar") in ("", "1.000", "1.0", "1", None) for r in rows)
                    bits.append(f"{task.name} {float(star['speedup_vs_ar']):.2f}x" + ("" if identical else " (not all identical to AR)"))
    return "EntMTP* vs AR: " + ", ".join(bits) if bits else "no evaluation tables"


def bank_section(bank_dir: Path, artifacts: Path, results: Path) -> list[str]:
    """The bank's summary (`TopologyBank.summary()`) and its provenance, or what the folder lacks."""
    out = [f"Bank `{_shown(bank_dir, artifacts)}/`:", ""]
    plots = sorted(p for p in bank_dir.glob("*.png"))
    if not (bank_dir / "bank.json").is_file():
        out.append("no `bank.json` here (only its plots; `make bank` builds it).")
    else:
        from runtime.bank import BankError, TopologyBank  # torch: only when there is a bank to read

        try:
            bank = TopologyBank.load(bank_dir)
        except BankError as e:
            out.append(f"`bank.json` does not load: {e}")
        else:
            prov = bank.provenance
            best = bank.trees[bank.best_static]
            rec = MachineRecord(bank_dir / "bank.json", prov.get("machine") or {}, prov.get("dtype"), prov.get("kernel"))
            out += [f"* trees (nodes): {', '.join(str(t.num_nodes) for t in bank.trees)}; max depth {bank.max_depth}",
                    f"* best static tree (EntMTP*): {best.num_nodes} nodes, depth {best.depth}",
                    f"* policies: {', '.join(bank.policies) or 'none'} (default {bank.default_policy})",
                    f"* machine: {machine_label(rec)}; lossless: {prov.get('lossless', '?')}; kernel: {prov.get('kernel', '?')}",
                    "", "```", bank.summary().replace(str(bank_dir), _shown(bank_dir, artifacts)), "```"]
    if plots:
        out += ["", " ".join(f"[{p.name}]({_link(p, results)})" for p in plots)]
    return out


def model_sections(model: str, artifacts: Path, results: Path) -> list[str]:
    """Per heads of `model`: the task comparison, then per task the evaluation table and the bank."""
    reports, banks_root = _roots(artifacts)
    model_reports, model_banks = reports / model, banks_root / model
    heads_training = Layout.for_model(artifacts, model).heads_training_reports
    heads_names = sorted({p.name for p in _subdirs(model_reports) if p != heads_training
                          and ((p / TASK_COMPARISON).is_file() or any(_eval_table(t) for t in _subdirs(p)))}
                         | {p.name for p in _subdirs(model_banks)})
    out: list[str] = []
    for heads in heads_names:
        rep, banks = model_reports / heads, model_banks / heads
        out += ["", f"## {model} + {heads}", ""]
        comparison = rep / TASK_COMPARISON
        if comparison.is_file():
            out += [f"### Task comparison (`{_shown(comparison, artifacts)}`)", "",
                    comparison.read_text(encoding="utf-8").strip()]
            if (png := comparison.with_suffix(".png")).is_file():
                out += ["", f"![task comparison]({_link(png, results)})"]
            out.append("")
        tasks = sorted({t.name for t in _subdirs(rep) if _eval_table(t)} | {t.name for t in _subdirs(banks)})
        for task in tasks:
            out += [f"### {task}", ""]
            table = _eval_table(rep / task)
            if table is not None:
                text = table.read_text(encoding="utf-8").strip().splitlines()
                if text and text[0].startswith("#"):
                    text[0] = f"**{text[0].lstrip('#').strip()}**"
                out += [f"Evaluation (`{_shown(table, artifacts)}`):", "", *text]
                if (png := table.with_name("methods.png")).is_file():
                    out += ["", f"![{task} methods]({_link(png, results)})"]
                if (batch := table.with_name("batch_table.md")).is_file():
                    lines = batch.read_text(encoding="utf-8").strip().splitlines()
                    if lines and lines[0].startswith("#"):
                        lines[0] = f"**{lines[0].lstrip('#').strip()}**"
                    out += ["", f"Batched evaluation (`{_shown(batch, artifacts)}`):", "", *lines]
                    if (png := batch.with_name("batch_throughput.png")).is_file():
                        out += ["", f"![{task} throughput by batch size]({_link(png, results)})"]
            else:
                out.append("No evaluation table (`make eval TASK=...` writes one).")
            out.append("")
            if (banks / task).is_dir():
                out += [*bank_section(banks / task, artifacts, results), ""]
    return out


def heads_section(model: str, artifacts: Path) -> list[str]:
    """The heads reports of one model: every CSV under `reports/<model>/heads/` as a table."""
    folder = Layout.for_model(artifacts, model).heads_training_reports
    csvs = sorted(folder.glob("*.csv")) if folder.is_dir() else []
    if not csvs:
        return []
    out = ["", f"## Heads reports ({model})", ""]
    for path in csvs:
        out += [f"### `{_shown(path, artifacts)}`", "", *csv_table(path), ""]
    return out


def other_reports(model_reports: Path, listed: set[Path], artifacts: Path, results: Path) -> list[str]:
    """Every other file under `reports/<model>/` (draft-vocabulary sweep, dtype choice, ...), linked."""
    files = sorted(p for p in model_reports.rglob("*") if p.is_file() and not p.name.startswith(".")
                   and p not in listed)
    if not files:
        return []
    return ["", f"## Other reports ({model_reports.name})", "",
            *(f"* [{_shown(p, artifacts)}]({_link(p, results)})" for p in files)]


def _json_headline(path: Path) -> list[str]:
    doc = _read_json(path)
    if not isinstance(doc, Mapping):
        return ["(not a JSON object, or too large to read)"]
    summary = doc.get("summary")
    if isinstance(summary, list) and summary and all(isinstance(r, Mapping) for r in summary):
        cols = list(dict.fromkeys(k for r in summary for k in r))[:MAX_TABLE_COLUMNS]
        return markdown_table(cols, ([r.get(c, "") for c in cols] for r in summary[:MAX_TABLE_ROWS]))
    if isinstance(summary, Mapping):
        return [f"* {k}: {json.dumps(v, default=str)[:200]}" for k, v in summary.items()]
    return [f"keys: {', '.join(f'`{k}`' for k in doc)}"]


def benchmarks_section(artifacts: Path, results: Path) -> list[str]:
    """The benchmark reports under `reports/benchmarks/`: CSVs as tables, JSON by their summary."""
    folder = _roots(artifacts)[0] / BENCHMARKS
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")) if folder.is_dir() else []
    if not files:
        return []
    out = ["", f"## Benchmarks (`{_shown(folder, artifacts)}/`)", ""]
    for path in files:
        out += [f"### `{_shown(path, artifacts)}`", ""]
        if path.suffix == ".csv":
            out += csv_table(path)
        elif path.suffix == ".json":
            out += _json_headline(path)
        elif path.suffix == ".png":
            out.append(f"![{path.stem}]({_link(path, results)})")
        else:
            out.append(f"[{path.name}]({_link(path, results)})")
        out.append("")
    return out


def _completed(first: MachineRecord, records: list[MachineRecord]) -> MachineRecord:
    """`first` with the dtype and kernel of the next record of the same machine where it lacks them."""
    same = [r for r in records if r.identity() == first.identity()]
    dtype = first.dtype or next((r.dtype for r in same if r.dtype), None)
    kernel = first.kernel or next((r.kernel for r in same if r.kernel), None)
    return replace(first, dtype=dtype, kernel=kernel)


def machine_section(records: list[MachineRecord], artifacts: Path) -> list[str]:
    """The report's machine (the first record) field by field, and any other machine the artifacts name."""
    if not records:
        return ["## Machine", "", "No artifact under reports/ or banks/ records its machine."]
    first = records[0]
    m = first.machine
    rows = [(k, m[k]) for k in MACHINE_FIELDS if k in m] + [(k, v) for k, v in m.items() if k not in MACHINE_FIELDS]
    if first.dtype:
        rows.append(("dtype", first.dtype))
    if first.kernel:
        rows.append(("small-row kernel", first.kernel))
    out = ["## Machine", "", f"As recorded in `{_shown(first.source, artifacts)}`"
           + ("" if _priority(first.source) < 3 else
              " (the evaluation tables and banks here carry no machine record of their own, and each section"
              " below may come from another session: it names its file)") + ":", "",
           *markdown_table(("field", "value"), rows)]
    others: dict[tuple[Any, ...], list[MachineRecord]] = {}
    for r in records:
        others.setdefault(r.identity(), []).append(r)
    if len(others) > 1:
        out += ["", "The artifacts name more than one machine; figures from different machines are not comparable:", ""]
        for group in others.values():
            out.append(f"* {machine_label(group[0])}: " + ", ".join(f"`{_shown(r.source, artifacts)}`" for r in group))
    return out


# ------------------------------------------------------------------------------------ files


def report_markdown(artifacts: Path, results: Path, today: dt.date | None = None) -> tuple[str, str]:
    """(file name, content) of the report of `artifacts`, with links relative to `results`."""
    artifacts = Path(artifacts).resolve()
    results = Path(results).resolve()
    records = find_machines(artifacts)
    if records:
        records[0] = _completed(records[0], records)
    day, day_from = report_date(artifacts, today)
    machine = machine_label(records[0]) if records else "machine not recorded"
    slug = machine_slug(records[0]) if records else "unknown-machine"
    reports, banks = _roots(artifacts)
    body: list[str] = []
    listed: set[Path] = set()
    models = sorted({p.name for p in _subdirs(reports) if p.name != BENCHMARKS} | {p.name for p in _subdirs(banks)})
    for model in models:
        body += model_sections(model, artifacts, results)
        body += heads_section(model, artifacts)
        listed |= {p for p in (reports / model).rglob("*") if p.is_file() and (
            p.name in (TASK_COMPARISON, "task_comparison.png") or p.parent.name == EVAL_TABLE[0]
            or p.parent == Layout.for_model(artifacts, model).heads_training_reports and p.suffix == ".csv")}
        body += other_reports(reports / model, listed, artifacts, results)
    body += benchmarks_section(artifacts, results)
    summary = headline(artifacts)
    head = [f"# Artifacts of {day.isoformat()}: {machine}", "",
            f"> Generated by `make report` (pipeline/report.py) from {_shown(reports, artifacts)}/ and "
            f"{_shown(banks, artifacts)}/{META_SEP}date: {day.isoformat()}{META_SEP}machine: {machine}"
            f"{META_SEP}summary: {summary}",
            "", f"Date: {day.isoformat()} ({day_from}).",
            "Reproduce on the machine below: `make banks && make eval-all && make report`.", "",
            *machine_section(records, artifacts)]
    return f"{day.isoformat()}-{slug}.md", "\n".join(head + body).rstrip() + "\n"


@dataclass(frozen=True)
class ResultFile:
    """What the index says about one file of docs/results/."""

    name: str
    date: str
    machine: str
    summary: str
    title: str


def read_result_file(path: Path) -> ResultFile:
    """The file's first `# ` heading and the fields of its `> ... · date: ... · machine: ... ·
    summary: ...` line; the date falls back to the file name's, the summary to the heading."""
    title, meta = path.stem, {}
    for line in path.read_text(encoding="utf-8").splitlines()[:8]:
        if line.startswith("# ") and title == path.stem:
            title = line[2:].strip()
        elif line.startswith("> "):
            for part in line[2:].split(META_SEP):
                key, sep, value = part.partition(": ")
                if sep and key.strip() in ("date", "machine", "summary"):
                    meta[key.strip()] = value.strip()
            break
    m = re.match(r"\d{4}-\d{2}-\d{2}", path.name)
    return ResultFile(path.name, meta.get("date", m.group(0) if m else "?"), meta.get("machine", "?"),
                      meta.get("summary", title), title)


def _order(name: str) -> tuple[str, int, str]:
    slot = next((rank for s, rank in SLOTS.items() if f"-{s}-" in name), 0)
    return name[:10], slot, name


def write_index(results: Path) -> Path:
    """Write `<results>/README.md`: every other markdown file there, newest first, with its date,
    machine and summary."""
    results = Path(results)
    files = sorted((p for p in results.glob("*.md") if p.name != INDEX), key=lambda p: _order(p.name), reverse=True)
    entries = [read_result_file(p) for p in files]
    lines = ["# Results", "",
             "Every dated measurement of this project, one file per run or session, newest first. A figure",
             "from one machine does not compare with another's. `make report` (pipeline/report.py) writes",
             "the report of the current artifacts here and regenerates this index from the files' first lines.",
             "", *markdown_table(("date", "machine", "file", "summary"),
                                 ((e.date, e.machine, f"[{e.name}]({e.name})", e.summary) for e in entries))]
    path = results / INDEX
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


def write_report(artifacts: Path, results: Path = RESULTS_DIR, today: dt.date | None = None) -> Path:
    """Write the report of `artifacts` into `results` and regenerate the index; return the report's path."""
    name, text = report_markdown(artifacts, results, today)
    path = Path(results) / name
    atomic_write_bytes(path, text.encode())
    write_index(results)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=REPO_ROOT / "artifacts", help="the artifacts folder to report on")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the report and the index go")
    parser.add_argument("--date", type=dt.date.fromisoformat, default=None,
                        help="the date to use when no stage manifest records one (default: today)")
    args = parser.parse_args(argv)
    path = write_report(args.artifacts, args.results, args.date)
    print(f"wrote {path} and {Path(args.results) / INDEX}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
