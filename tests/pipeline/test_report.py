"""`make report` (pipeline.report): a dated report of real artifact files, named after the machine
the artifacts record (never the one running the report), and the index of docs/results/."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from pipeline.report import MachineRecord, machine_slug, read_result_file, report_date, write_index, write_report
from tests.helpers import make_bank

XEON = {"cpu": "Intel(R) Xeon(R) Platinum 8480+", "cores": 2, "amx": True, "torch": "2.13.0+cpu", "cuda": None,
        "platform": "Linux-x86_64", "torch_threads": 2}
EPYC = {"cpu": "AMD EPYC 7B13 64-Core Processor", "cores": 2, "amx": False, "torch": "2.13.0+cpu", "cuda": None,
        "platform": "Linux-x86_64", "torch_threads": 2}
EVAL_TABLE = """### humaneval: tiny + hydra heads, greedy, batch 1, float32, Intel Xeon (2 threads), 2 eval prompts x 8 new tokens

| method | tok_per_s | tokens_per_step | speedup_vs_ar | identical_to_ar |
|---|---|---|---|---|
| AR | 20.000 | 1.000 | 1.000 | 1.000 |
| EntMTP* | 27.400 | 1.562 | 1.370 | 1.000 |
| oracle (replayed) |  | 1.959 | 1.738 |  |
"""
COMPARISON = """| task | bank trees (nodes) | EntMTP* nodes | depth | tokens/step | tok/s | AR tok/s | vs AR |
|---|---|---|---|---|---|---|---|
| humaneval | 1, 2, 4, 64 | 64 | 3 | 2.300 | 73.00 | 50.00 | 1.46x |
"""


BATCH_TABLE = """### humaneval: tiny + hydra heads, greedy, batch sizes 1, 2, float32, Intel Xeon (2 threads), 2 eval prompts x 8 new tokens

| method | batch | decoded with | tok/s | x batched AR | tokens/step | identical |
|---|---|---|---|---|---|---|
| AR (batched) | 2 | AR | 72.4 | 1.000 | 1.00 | 2/2 |
| EntMTP* static per batch size | 2 | tree 1 (2 nodes) | 79.2 | 1.095 | 1.39 | 2/2 |
"""


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def make_artifacts(root: Path) -> Path:
    """A small artifacts tree as the pipeline and a benchmark leave it: an evaluation (table and
    manifest), a real bank, the task comparison, a heads report and a benchmark report."""
    art = root / "artifacts"
    task_reports = art / "reports" / "tiny" / "hydra" / "humaneval" / "evaluate"
    task_reports.mkdir(parents=True)
    (task_reports / "table.md").write_text(EVAL_TABLE)
    (task_reports / "methods.png").write_bytes(b"\x89PNG")
    (task_reports / "batch_table.md").write_text(BATCH_TABLE)
    write_json(task_reports / "manifest.json", {"created": "2026-11-30T21:15:00+0000",
                                                "summary": {"machine": XEON, "table": []}})
    (art / "reports" / "tiny" / "hydra" / "task_comparison.md").write_text(COMPARISON)
    heads = art / "reports" / "tiny" / "heads"
    heads.mkdir(parents=True)
    (heads / "ablation-hydra-summary.csv").write_text("variant,train_cpu_s,all/tree9,humaneval/tree9\n"
                                                      "baseline,73.9,1.6067,1.6606\nsampled,138.8,1.7507,1.8221\n")
    bench = art / "reports" / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "ar_speed.csv").write_text("method,tok_per_s\nruntime,31.5\ntransformers,14.2\n")
    write_json(bench / "ar_speed.json", {"machine": EPYC, "summary": [{"method": "runtime", "tok_per_s": 31.5}]})
    bank = make_bank()
    bank.provenance = {**bank.provenance, "machine": XEON, "dtype": "float32", "lossless": "exact",
                       "kernel": "small_rows-avx512-0123456789ab"}
    bank.save(art / "banks" / "tiny" / "hydra" / "humaneval")
    return art


def test_report_holds_the_eval_table_and_the_recorded_machine(tmp_path: Path) -> None:
    art = make_artifacts(tmp_path)
    results = tmp_path / "docs" / "results"
    path = write_report(art, results, today=dt.date(2030, 1, 1))
    # the date of the newest manifest, the machine the evaluation recorded
    assert path.name == "2026-11-30-intel-xeon-amx.md"
    text = path.read_text()
    for row in EVAL_TABLE.splitlines()[2:] + COMPARISON.splitlines()[2:]:
        assert row in text, row
    assert "Intel(R) Xeon(R) Platinum 8480+" in text
    assert "summary: EntMTP* vs AR: humaneval 1.37x" in text
    # the bank, read through runtime.bank
    assert "trees (nodes): 2, 3, 5, 64" in text and "best static tree (EntMTP*): 64 nodes" in text
    assert "small_rows-avx512-0123456789ab" in text
    # the batched evaluation beside the single-sequence one
    assert "| EntMTP* static per batch size | 2 | tree 1 (2 nodes) | 79.2 | 1.095 | 1.39 | 2/2 |" in text
    assert "**humaneval: tiny + hydra heads, greedy, batch sizes 1, 2," in text
    # heads and benchmark reports
    assert "| baseline | 73.9 | 1.6067 | 1.6606 |" in text
    assert "| runtime | 31.5 |" in text
    # a benchmark from another machine is named as such
    assert "AMD EPYC 7B13 64-Core Processor, 2 cores, no AMX" in text and "`artifacts/reports/benchmarks/ar_speed.json`" in text
    # links reach the artifacts from the report's folder
    assert "](../../artifacts/reports/tiny/hydra/humaneval/evaluate/methods.png)" in text
    # regenerating gives the same file
    assert write_report(art, results, today=dt.date(2030, 1, 1)) == path and path.read_text() == text


def test_index_lists_every_results_file(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-11-02-night-amd-epyc-zen3.md").write_text(
        "# Night figures\n\n> Moved from the README unchanged · date: 2026-11-02 (night) · machine: AMD EPYC Zen 3"
        " · summary: the night's figures\n\ntext\n")
    (results / "2026-11-02-morning-amd-epyc-zen3.md").write_text("# Morning figures\n\nno meta line\n")
    report = write_report(make_artifacts(tmp_path), results)
    index = write_index(results).read_text()
    names = sorted(p.name for p in results.glob("*.md") if p.name != "README.md")
    assert len(names) == 3
    for name in names:
        assert f"[{name}]({name})" in index
    assert "| 2026-11-02 (night) | AMD EPYC Zen 3 |" in index and "the night's figures" in index
    # a file without the line: date from its name, summary from its heading
    assert read_result_file(results / "2026-11-02-morning-amd-epyc-zen3.md").date == "2026-11-02"
    assert "| Morning figures |" in index
    # newest first, the night after the morning of the same day
    assert index.index(report.name) < index.index("night-amd") < index.index("morning-amd")


def test_date_without_manifests_is_today(tmp_path: Path) -> None:
    art = tmp_path / "artifacts"
    (art / "reports").mkdir(parents=True)
    day, why = report_date(art, today=dt.date(2031, 5, 6))
    assert day == dt.date(2031, 5, 6) and "no stage manifest" in why


def test_machine_slug_depends_only_on_the_record() -> None:
    src = Path("x.json")
    assert machine_slug(MachineRecord(src, XEON)) == "intel-xeon-amx"
    assert machine_slug(MachineRecord(src, EPYC)) == "amd-epyc"
    assert machine_slug(MachineRecord(src, EPYC, kernel="small_rows-avx2-0123456789ab")) == "amd-epyc-avx2"
    assert machine_slug(MachineRecord(src, {**EPYC, "flags": "flags : fma avx2 avx512f"})) == "amd-epyc-avx512"
    assert machine_slug(MachineRecord(src, {**EPYC, "cuda": "NVIDIA H200"})) == "nvidia-h200"
    assert machine_slug(MachineRecord(src, {"cpu": "x86_64"})) == "x86-64"
