"""Policy thresholds and tables are fitted on the calibration split only, never on `eval` (issue 5).

The whole chain `stage=bank` (prepare, rollout, merge, grow, recalibrate, time, bank with its
fitted policies) runs in-process on the tiny bundle with every read of a prepared split recorded.
The bank stage must read `calib` and never `eval`; the prompts behind the fitted policies (the
rollout's) must be calibration prompts, disjoint from the eval prompts; and replacing the eval
split afterwards must leave the bank up to date (it is not an input of the fit).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.prepare
from pipeline.rollout.record import load_rollout
from tests.helpers import MODEL_NAME, REPO, TinyBundle, tiny_pipeline_cfg, tiny_pipeline_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bank_fits_on_calib_and_never_reads_eval(bundle: TinyBundle, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import graph

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    reads: list[str] = []
    real_read_split = pipeline.prepare.read_split

    def recording_read_split(data_dir, task, split, *args, **kwargs):  # noqa: ANN001, ANN202
        reads.append(split)
        return real_read_split(data_dir, task, split, *args, **kwargs)

    monkeypatch.setattr(pipeline.prepare, "read_split", recording_read_split)
    cfg = tiny_pipeline_cfg(artifacts, data, bundle)
    graph.clear_memo()
    bank_dir = graph.run(cfg)

    assert "calib" in reads, "the bank stage never read the calibration split: the recording is broken"
    assert "eval" not in reads, f"the bank stage read the eval split: {reads}"
    bank = json.loads((bank_dir / "bank.json").read_text())
    assert bank["policies"], "the bank holds no fitted policies"
    # EntMTP* (the bank's best static tree) is the fitted static policy, not a second choice
    assert bank["best_static"] == bank["policies"]["static"]["index"]
    recorded = bank["provenance"]["config"]
    assert recorded["task"]["name"] == "humaneval" and recorded["lossless"] == cfg.lossless
    assert "stage" not in recorded and "force" not in recorded, "the bank records how it was invoked"

    calib = real_read_split(data, "humaneval", "calib", limit=3)
    evals = real_read_split(data, "humaneval", "eval")
    fitted_on = [r["id"] for r in load_rollout(artifacts / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu" / "rollout")]
    assert fitted_on == [r["id"] for r in calib]
    assert not set(fitted_on) & {r["id"] for r in evals}
    assert not {tuple(r["input_ids"]) for r in calib} & {tuple(r["input_ids"]) for r in evals}

    # the eval split is not an input of the fit: a different eval split leaves the bank up to date
    eval_file = data / "humaneval" / "eval.jsonl"
    manifest_before = (bank_dir / "manifest.json").read_text()
    eval_file.write_text(eval_file.read_text().splitlines(keepends=True)[0])
    graph.clear_memo()
    again = graph.run(cfg)
    assert again == bank_dir and (bank_dir / "manifest.json").read_text() == manifest_before

    # the eval split's size is read by the evaluate stage only: every calibration stage stays up to date
    work = artifacts / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu"
    stage_dirs = [work / "rollout", work / "grow", work / "recalibrate", work / "time", bank_dir]
    before = {d: (d / "manifest.json").read_text() for d in stage_dirs}
    graph.clear_memo()
    assert graph.run(tiny_pipeline_cfg(artifacts, data, bundle, "profile.eval_prompts=1")) == bank_dir
    assert {d: (d / "manifest.json").read_text() for d in stage_dirs} == before

    # an up-to-date check of the whole chain never imports torch (3 s of every `make bank`): run
    # `python -m pipeline` with torch made unimportable; it must find every stage up to date
    blocker = (
        "import sys, runpy\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError(f'{name} imported by an up-to-date check')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "sys.argv = ['pipeline', *sys.argv[1:]]\n"
        "runpy.run_module('pipeline', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker, *tiny_pipeline_overrides(artifacts, data, bundle),
                          "hydra.run.dir=" + str(tmp_path / "hydra")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, f"up-to-date `python -m pipeline stage=bank` needed torch:\n{out.stderr[-3000:]}"
    assert "[bank] up to date" in out.stderr + out.stdout
    assert {d: (d / "manifest.json").read_text() for d in stage_dirs} == before
