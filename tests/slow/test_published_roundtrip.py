"""The default model's shipped Hydra heads written out in the published Hydra layout and read back
through `heads.dir`: the pipeline builds the same bank from them (slow: ~1 min on 2 cores).

In its own artifacts folder (the converted models linked from the repo's `artifacts/models`), for
one task, at a small size:

1. writes the shipped heads as a published Hydra folder (`export_published_hydra`: a shared output
   layer becomes a copy of the base lm_head with a zero bias);
2. builds rollout, grow and recalibrate twice: with the shipped heads (`heads.dir` = the shipped
   folder, used in place) and with the export (`heads.dir` = the published folder, converted by
   the importer into `heads/<model>/hydra_published/`);
3. times the shipped heads' candidate trees once (the time stage) and builds both banks from that
   one timing file, so that timing noise cannot make them differ;
4. compares the rollouts byte for byte (then prompt by prompt when they differ, for the message),
   the grow frontiers, the recalibrations' decoded figures (clock readings left out) and the two
   banks' trees, best static tree, policies and figures: all must be the same.

(This check was `python -m pipeline.benchmarks.published_roundtrip`; `pytest -s` prints its report.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.paths import REPO_ROOT, Layout

pytestmark = pytest.mark.slow

# recalibrate.json fields that are clock readings (they differ between any two runs)
CLOCK_FIELDS = ("seconds", "median_step_ms", "e2e_tok_per_s", "step_seconds")
TASK = "humaneval"
# small enough for ~1 min on 2 cores; every stage still runs for real on the default model
SIZE = ["threads=1", "profile.calib_prompts=2", "profile.max_new_tokens=16", "profile.recalib_prompts=1",
        "profile.timing_prompts=1", "profile.grow_budget=8", "grow.candidate_sizes=[0,2,4,8]", "time.rounds=1",
        "time.new_tokens=4", "time.cost_repeats=1", "time.cost_tokens=4"]


def compose_roundtrip(root: Path, task: str, heads_dir: Path, heads_name: str, stage: str, overrides: list[str]):  # noqa: ANN201
    from hydra import compose, initialize_config_dir

    import pipeline.config.schema  # noqa: F401 - registers the schemas

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            f"stage={stage}", f"task={task}", "dtype=float32", f"heads.dir={heads_dir}", f"heads.name={heads_name}",
            "heads.draft_vocab.size=null", f"artifacts_dir={root}", f"data_dir={root / 'data'}", *overrides])


def export_shipped(root: Path, model_name: str) -> tuple[Path, Path]:
    """(shipped heads folder, its published-layout export under `root`), exported once."""
    import torch

    from pipeline.heads.published.convert import export_published_hydra
    from runtime.heads import load_heads
    from runtime.model.checkpoint import load_model

    lay = Layout.for_model(REPO_ROOT / "artifacts", model_name)
    shipped = lay.heads_dir("hydra")
    published = root / "published-hydra"
    if not (published / "hydra_lm_head.pt").is_file():
        model = load_model(lay.model_dir, dtype=torch.float32, max_seq_len=256)
        export_published_hydra(load_heads(shipped, model=model), published, base_model_name_or_path=model_name)
    return shipped, published


def _same_files(a: Path, b: Path) -> dict[str, bool]:
    """Byte equality of every file of two stage outputs (their manifests left out: keys and clocks)."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()} - {"manifest.json"})
    return {n: (a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes()
            for n in names if n != "manifest.json"}


def compare_rollouts(a: Path, b: Path) -> dict[str, Any]:
    from pipeline.rollout.record import load_rollout

    out: dict[str, Any] = {"files_identical": _same_files(a, b)}
    if all(out["files_identical"].values()):
        return out
    ra, rb = load_rollout(a), load_rollout(b)
    out["prompts"] = len(ra)
    out["same_tokens"] = sum(x["tokens"].tolist() == y["tokens"].tolist() for x, y in zip(ra, rb))
    rows = [(x["rank_paths"] == y["rank_paths"]).all(axis=1) for x, y in zip(ra, rb)
            if x["rank_paths"].shape == y["rank_paths"].shape]
    out["same_rank_path_rows"] = f"{sum(int(r.sum()) for r in rows)} / {sum(len(r) for r in rows)}"
    return out


def _decoded(recal: dict) -> list[dict]:
    return [{k: v for k, v in t.items() if k not in CLOCK_FIELDS} for t in recal["trees"]]


def build_both_banks(root: Path, cfg_a, cfg_b, time_dir: Path) -> dict[str, Any]:  # noqa: ANN001 - DictConfigs
    """Both banks from the one timing file; their trees, best static tree and policies compared."""
    from pipeline.artifacts import read_json
    from pipeline.bank.write import build_bank
    from pipeline.stages import bank as bank_stage
    from pipeline.stages import grow as grow_stage
    from pipeline.stages import merge as merge_stage
    from pipeline.stages import recalibrate as recalibrate_stage

    timing = read_json(time_dir / "timing.json")
    docs = {}
    for name, cfg in (("shipped", cfg_a), ("published", cfg_b)):
        out = root / "banks-from-one-timing" / name
        out.mkdir(parents=True, exist_ok=True)
        build_bank(out, timing=timing, recal=read_json(recalibrate_stage.output(cfg) / "recalibrate.json"),
                   frontier=read_json(grow_stage.output(cfg) / "frontier.json"), rollout_dir=merge_stage.output(cfg),
                   policy_cfg=bank_stage.policy_settings(cfg), members=str(cfg.bank.members),
                   min_oracle_share=float(cfg.bank.min_oracle_share),
                   provenance={"task": str(cfg.task.name), "machine": timing["machine"], "dtype": timing["dtype"]})
        docs[name] = json.loads((out / "bank.json").read_text())
    a, b = docs["shipped"], docs["published"]
    return {
        "same_trees": [t["paths"] for t in a["trees"]] == [t["paths"] for t in b["trees"]],
        "trees": {"shipped": [t["nodes"] for t in a["trees"]], "published": [t["nodes"] for t in b["trees"]]},
        "same_best_static": a["best_static"] == b["best_static"],
        "same_policies": a["policies"] == b["policies"],
        "same_figures": [{k: v for k, v in t.items() if k != "paths"} for t in a["trees"]]
                        == [{k: v for k, v in t.items() if k != "paths"} for t in b["trees"]],
    }


def published_roundtrip(root: Path, task: str, overrides: list[str]) -> dict[str, Any]:
    """Run the round trip in `root` (see the module docstring); returns the comparisons."""
    from pipeline import graph
    from pipeline.artifacts import read_json
    from pipeline.paths import default_model_name
    from pipeline.stages import grow as grow_stage
    from pipeline.stages import merge as merge_stage
    from pipeline.stages import recalibrate as recalibrate_stage

    root.mkdir(parents=True, exist_ok=True)
    model_name = default_model_name()
    models = root / "models"
    if not models.exists():  # the converted default model, not converted again
        models.symlink_to((REPO_ROOT / "artifacts" / "models").resolve(), target_is_directory=True)
    shipped, published = export_shipped(root, model_name)
    cfgs = {}
    for name, heads_dir, heads_name in (("shipped", shipped, "hydra"), ("published", published, "hydra_published")):
        cfgs[name] = cfg = compose_roundtrip(root, task, heads_dir, heads_name, "recalibrate", overrides)
        graph.run(cfg)
    time_dir = graph.stage_output("time", cfgs["shipped"])
    a, b = cfgs["shipped"], cfgs["published"]
    report: dict[str, Any] = {"task": task, "overrides": overrides}
    report["rollout"] = compare_rollouts(merge_stage.output(a), merge_stage.output(b))
    fa, fb = (read_json(grow_stage.output(c) / "frontier.json") for c in (a, b))
    report["grow"] = {"frontier_identical": fa == fb}
    ra, rb = (read_json(recalibrate_stage.output(c) / "recalibrate.json") for c in (a, b))
    report["recalibrate"] = {"decoded_identical": _decoded(ra) == _decoded(rb), "trees": len(ra["trees"]),
                             "trees_identical": sum(x == y for x, y in zip(_decoded(ra), _decoded(rb)))}
    report["bank_from_one_timing"] = build_both_banks(root, a, b, time_dir)
    return report


def test_shipped_heads_through_the_published_layout_build_the_same_bank(smollm2_dir: Path, tmp_path: Path) -> None:
    from pipeline import graph
    from tests.helpers import torch_threads

    shipped = Layout.for_model(REPO_ROOT / "artifacts", smollm2_dir.name).heads_dir("hydra")
    if not (shipped / "heads.safetensors").is_file():
        pytest.skip(f"no shipped heads at {shipped}")
    graph.clear_memo()
    try:
        with torch_threads(1):  # the stages set threads=1 for the process; restored afterwards
            report = published_roundtrip(tmp_path / "roundtrip", TASK, SIZE)
    finally:
        graph.clear_memo()
    for key in ("rollout", "grow", "recalibrate", "bank_from_one_timing"):
        print(f"[published-roundtrip] {key}: {json.dumps(report[key])}")
    assert all(report["rollout"]["files_identical"].values()), report["rollout"]
    assert report["grow"]["frontier_identical"]
    assert report["recalibrate"]["decoded_identical"], report["recalibrate"]
    bank = report["bank_from_one_timing"]
    assert bank["same_trees"] and bank["same_best_static"] and bank["same_policies"] and bank["same_figures"], bank
    assert len(bank["trees"]["shipped"]) >= 2, "a one-tree bank would compare little"
