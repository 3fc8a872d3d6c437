"""What an export says about itself (runtime/export/notes.py): the bank's drafter and machine from its
provenance and heads folder, each engine's caveats, the warnings, and where the record goes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.export.engines import SCHEDULE_FORMATS, TREE_FORMATS, export_schedule
from runtime.export.notes import (
    COMMENT,
    BankFacts,
    bank_facts,
    drafter_kind,
    embed_record,
    export_record,
    in_band,
    sidecar_path,
)
from runtime.export.schedule import ServingChoice, ServingSchedule
from runtime.tree import Tree
from tests.helpers import SIX_NODE_TREE
from tests.helpers.engine_parsers import parse_schedule, strip_record

CPU_PROV = {"heads_name": "hydra-draft8192", "dtype": "float32", "kernel": "small_rows-avx512-x",
            "machine": {"cpu": "Intel Xeon", "cores": 2, "cuda": None, "torch": "2.13.0+cpu"},
            "config": {"device": "cpu", "heads": {"kind": "hydra"}}}
GPU_PROV = {"heads_name": "eagle3", "dtype": "bfloat16", "device": "cuda",
            "machine": {"cpu": "AMD EPYC", "cores": 16, "cuda": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}}
TREES = (Tree.chain(1), SIX_NODE_TREE)
# batch 8 drafts nothing, but its 1-chain measured 1100 tok/s against AR's 8 x 1000 / 8 = 1000
SCHEDULE = ServingSchedule(choices=(
    ServingChoice(1, tree=SIX_NODE_TREE, tree_index=1, chain_len=2, ar_step_ms=5.0, tree_step_ms=(5.5, 6.0),
                  tree_tok_per_s=(250.0, 300.0)),
    ServingChoice(4, chain_len=0, ar_step_ms=6.0, tree_step_ms=(7.0, 9.0), tree_tok_per_s=(600.0, 650.0)),
    ServingChoice(8, chain_len=0, ar_step_ms=8.0, tree_step_ms=(7.3, 12.0), tree_tok_per_s=(1100.0, 900.0)),
    ServingChoice(32, chain_len=0, ar_step_ms=9.0),
), trees=TREES, source="banks/tiny")


def test_bank_facts_name_the_machine_and_dtype() -> None:
    cpu = bank_facts(CPU_PROV, "hydra", "banks/x")
    assert (cpu.device, cpu.on_cpu, cpu.hardware, cpu.cores, cpu.drafter) == ("cpu", True, "Intel Xeon", 2, "hydra")
    assert cpu.measured_on() == "CPU Intel Xeon (2 cores), dtype float32, kernel small_rows-avx512-x, torch 2.13.0+cpu"
    gpu = bank_facts(GPU_PROV, "eagle3")
    assert (gpu.device, gpu.on_cpu, gpu.hardware) == ("cuda", False, "NVIDIA H100 80GB HBM3")
    assert gpu.measured_on() == "GPU NVIDIA H100 80GB HBM3, dtype bfloat16, torch 2.11.0"
    # no device recorded: a machine without a GPU timed on its CPU; with one, nobody knows
    assert bank_facts({"machine": {"cpu": "x"}}).device == "cpu"
    assert bank_facts({"machine": {"cuda": "A100"}}).device == "unknown"
    assert bank_facts({}, "mtp").drafter == "unknown"


def test_drafter_kind_reads_the_heads_folder_then_the_provenance(tmp_path: Path) -> None:
    eagle, hydra = tmp_path / "eagle", tmp_path / "hydra"
    eagle.mkdir()
    hydra.mkdir()
    (eagle / "config.json").write_text(json.dumps({"format": "entmtp-eagle3"}))
    (hydra / "config.json").write_text(json.dumps({"format": "entmtp-heads", "kind": "medusa"}))
    assert drafter_kind(eagle, CPU_PROV) == "eagle3"  # the folder wins over the recorded config
    assert drafter_kind(hydra, {}) == "medusa"
    assert drafter_kind(tmp_path / "gone", CPU_PROV) == "hydra"  # the recorded heads config
    assert drafter_kind(None, {"heads_name": "eagle3-trained"}) == "eagle3"  # the heads name
    assert drafter_kind(None, {"heads_name": "mystery"}) == "unknown"


def test_warnings_when_the_drafter_is_not_the_engines_or_the_bank_was_timed_on_a_cpu() -> None:
    hydra_cpu, eagle_gpu = bank_facts(CPU_PROV, "hydra", "b"), bank_facts(GPU_PROV, "eagle3", "b")
    for fmt in ("vllm", "sglang", "trtllm"):
        warnings = export_record(SCHEDULE, fmt, hydra_cpu).warnings
        assert len(warnings) == 2, fmt
        assert warnings[0].startswith("the bank was measured with hydra heads, but ")
        assert warnings[1].startswith("the bank was measured on a CPU (Intel Xeon)")
        # an EAGLE-3 bank timed on a GPU, with its drafter folder named: nothing to warn about
        assert export_record(SCHEDULE, fmt, eagle_gpu, drafter_path="/d").warnings == (), fmt
        # ... but a config that names no drafter folder says so
        assert "--drafter-out DIR" in export_record(SCHEDULE, fmt, eagle_gpu).warnings[0]
    assert export_record(SCHEDULE, "json", hydra_cpu).warnings == ()  # no engine reads it
    assert export_record(SCHEDULE, "tree-json", hydra_cpu).warnings == ()
    unknown = BankFacts(drafter="eagle3", device="unknown")
    assert "does not record the device" in export_record(SCHEDULE, "vllm", unknown, drafter_path="/d").warnings[0]
    medusa = export_record(SCHEDULE, "legacy-trtllm-medusa", BankFacts(drafter="medusa", device="cuda"))
    assert medusa.warnings == ()


def test_every_format_says_which_engine_versions_read_it() -> None:
    facts = bank_facts(CPU_PROV, "hydra", "banks/tiny")
    for fmt in SCHEDULE_FORMATS:
        record = export_record(SCHEDULE, fmt, facts)
        assert record.header.startswith("EntMTP export for ") and "drafter hydra (hydra-draft8192)" in record.header
        assert "measured on CPU Intel Xeon (2 cores), dtype float32" in record.header
        assert record.caveats[0].startswith("read by ")
    assert "PR #42121" in export_record(SCHEDULE, "legacy-vllm-tree", facts).caveats[0]
    assert "PR #15918" in export_record(SCHEDULE, "legacy-trtllm-medusa", facts).caveats[0]
    assert all(export_record(SCHEDULE, fmt, facts).caveats[1] == "one tree for every load" for fmt in TREE_FORMATS)


def test_vllm_caveats_price_the_zeros_and_name_the_fills() -> None:
    facts = bank_facts(CPU_PROV, "hydra", "b")
    filled = export_record(SCHEDULE, "vllm", facts)
    assert filled.filled_zeros == ((8, 1),)
    zero = filled.caveats[1]
    assert zero.startswith("vLLM still runs the drafter at draft length 0")
    # loads 2-4 draft 0, 5-8 the filled 1-chain, 0 from 9 on (up to max_num_seqs)
    assert "drafts 0 at loads 2-4, 9 and above" in zero
    assert "at batch size 8 the bank's chain of length 1 measured 1100.0 tok/s against AR's 1000.0" in zero
    kept = export_record(SCHEDULE, "vllm", facts, keep_zeros=True, margin=2)
    assert kept.filled_zeros == () and "drafts 0 at loads 4 and above" in kept.caveats[1]  # 1-3 draft 2
    assert any("V2 model runner" in c for c in kept.caveats) and any("data_parallel_size" in c for c in kept.caveats)
    assert any("(this export: margin 2)" in c for c in kept.caveats)
    none = export_record(ServingSchedule(choices=(ServingChoice(1, chain_len=1), ServingChoice(4))), "vllm", facts)
    assert "no chain at AR's speed or better" in none.caveats[1]
    assert any("eagle3_one_model" in c for c in export_record(SCHEDULE, "trtllm", bank_facts(GPU_PROV, "eagle3")).caveats)
    assert any("LlamaForCausalLMEagle3" in c for c in export_record(SCHEDULE, "sglang", bank_facts(GPU_PROV, "eagle3")).caveats)


@pytest.mark.parametrize("fmt", SCHEDULE_FORMATS)
def test_the_record_goes_inside_only_where_the_engine_ignores_it(fmt: str) -> None:
    facts = bank_facts(CPU_PROV, "hydra", "banks/tiny")
    out = export_schedule(SCHEDULE, fmt)
    record = export_record(SCHEDULE, fmt, facts, margin=1)
    inside = embed_record(out, fmt, record)
    assert in_band(fmt) == (inside != out)
    assert strip_record(inside, fmt) == out
    if fmt == "sglang":
        lines = inside.splitlines()
        assert lines[0] == out.splitlines()[0] and lines[1] == COMMENT + record.header
        assert sum(ln.startswith(COMMENT + "WARNING: ") for ln in lines) == 2
        assert json.loads(lines[-1])["_entmtp"]["margin"] == 1
        assert parse_schedule(inside, fmt) == parse_schedule(out, fmt)  # the record changes no choice
    if fmt == "json":
        assert inside["notes"] == record.to_dict() and parse_schedule(inside, fmt) == SCHEDULE
    doc = record.to_dict()
    assert doc["format"] == "entmtp-export-record" and doc["export_format"] == fmt and doc["margin"] == 1
    assert doc["bank"]["hardware"] == "Intel Xeon" and json.loads(json.dumps(doc)) == doc
    assert sidecar_path("out/vllm.json") == Path("out/vllm.json.entmtp.json")
