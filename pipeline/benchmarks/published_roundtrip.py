"""The default model's shipped Hydra heads written out in the published Hydra layout and read back
through `heads.dir`: does the pipeline build the same bank from them?

In its own artifacts folder (the converted models linked from `artifacts/models`), for one task:

1. writes the shipped heads as a published Hydra folder (`export_published_hydra`: a shared output
   layer becomes a copy of the base lm_head with a zero bias);
2. builds rollout, grow and recalibrate twice: with the shipped heads (`heads.dir` = the shipped
   folder, used in place) and with the export (`heads.dir` = the published folder, converted by
   the importer into `heads/<model>/hydra_published/`);
3. times the shipped heads' candidate trees once (the time stage) and builds both banks from that
   one timing file, so that timing noise cannot make them differ;
4. compares the rollouts byte for byte (then prompt by prompt when they differ), the grow
   frontiers, the recalibrations' decoded figures (clock readings left out) and the two banks'
   trees, best static tree and policies.

    python -m pipeline.benchmarks.published_roundtrip [--task humaneval] [override ...]

Overrides are pipeline overrides (e.g. `profile.calib_prompts=4`). Prints one line per comparison
and writes `report.json` into the artifacts folder (default `artifacts/published_roundtrip/`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.paths import REPO_ROOT, Layout, default_model_name

log = logging.getLogger(__name__)

# recalibrate.json fields that are clock readings (they differ between any two runs)
CLOCK_FIELDS = ("seconds", "median_step_ms", "e2e_tok_per_s", "step_seconds")


def _compose(root: Path, task: str, heads_dir: Path, heads_name: str, stage: str, overrides: list[str]):  # noqa: ANN202
    from hydra import compose, initialize_config_dir

    import pipeline.schema  # noqa: F401 - registers the schemas

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            f"stage={stage}", f"task={task}", "dtype=float32", f"heads.dir={heads_dir}", f"heads.name={heads_name}",
            "heads.draft_vocab.size=null", f"artifacts_dir={root}", f"data_dir={root / 'data'}", *overrides])


def export_shipped(root: Path, model_name: str) -> tuple[Path, Path]:
    """(shipped heads folder, its published-layout export under `root`), exported once."""
    import torch

    from pipeline.heads.published import export_published_hydra
    from runtime.heads import load_heads
    from runtime.model import load_model

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
    from pipeline.rollout import load_rollout

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
    from pipeline.bank.build import build_bank
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


def main(argv: list[str] | None = None) -> int:
    from pipeline import graph

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--root", default=str(REPO_ROOT / "artifacts" / "published_roundtrip"))
    ap.add_argument("overrides", nargs="*", help="pipeline overrides, e.g. profile.calib_prompts=4")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model_name = default_model_name()
    models = root / "models"
    if not models.exists():  # the converted default model, not converted again
        models.symlink_to((REPO_ROOT / "artifacts" / "models").resolve(), target_is_directory=True)
    shipped, published = export_shipped(root, model_name)

    from pipeline.artifacts import read_json
    from pipeline.stages import grow as grow_stage
    from pipeline.stages import merge as merge_stage
    from pipeline.stages import recalibrate as recalibrate_stage

    seconds: dict[str, float] = {}
    cfgs = {}
    for name, heads_dir, heads_name in (("shipped", shipped, "hydra"), ("published", published, "hydra_published")):
        cfg = _compose(root, args.task, heads_dir, heads_name, "recalibrate", args.overrides)
        t0 = time.perf_counter()
        graph.run(cfg)
        seconds[name] = time.perf_counter() - t0
        cfgs[name] = cfg
    t0 = time.perf_counter()
    time_dir = graph.stage_output("time", cfgs["shipped"])
    seconds["time"] = time.perf_counter() - t0

    a, b = cfgs["shipped"], cfgs["published"]
    report: dict[str, Any] = {"task": args.task, "overrides": args.overrides, "seconds": seconds}
    report["rollout"] = compare_rollouts(merge_stage.output(a), merge_stage.output(b))
    fa, fb = (read_json(grow_stage.output(c) / "frontier.json") for c in (a, b))
    report["grow"] = {"frontier_identical": fa == fb}
    ra, rb = (read_json(recalibrate_stage.output(c) / "recalibrate.json") for c in (a, b))
    report["recalibrate"] = {"decoded_identical": _decoded(ra) == _decoded(rb),
                             "trees": len(ra["trees"]),
                             "trees_identical": sum(x == y for x, y in zip(_decoded(ra), _decoded(rb)))}
    report["bank_from_one_timing"] = build_both_banks(root, a, b, time_dir)
    (root / "report.json").write_text(json.dumps(report, indent=1))
    for key in ("rollout", "grow", "recalibrate", "bank_from_one_timing"):
        print(f"[published-roundtrip] {key}: {json.dumps(report[key])}")
    print(f"[published-roundtrip] seconds: {json.dumps({k: round(v) for k, v in seconds.items()})}; "
          f"report: {root / 'report.json'}")
    same = (all(report["rollout"]["files_identical"].values()) and report["grow"]["frontier_identical"]
            and report["recalibrate"]["decoded_identical"] and report["bank_from_one_timing"]["same_trees"])
    print(f"[published-roundtrip] {'SAME' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
