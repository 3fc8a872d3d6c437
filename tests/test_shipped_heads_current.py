"""The shipped heads stay up to date under the current code and default config: a change to the
heads key (a new config field, a type the schema coerces) would otherwise make `make bank` on a
fresh clone retrain them for ~20 minutes without saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import pipeline.heads.build as heads_build
import pipeline.schema  # noqa: F401 - registers the typed config
from pipeline.artifacts import why_not_up_to_date
from pipeline.paths import Layout, default_model_name
from pipeline.prepare import load_task_config, prepare_task

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("heads", ["hydra", "medusa"])
def test_shipped_heads_are_up_to_date(heads: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = REPO / Layout.for_model("artifacts", default_model_name()).model_dir
    if not (model_dir / "config.json").is_file():
        pytest.skip("the default model is not converted yet (make model)")
    artifacts = tmp_path / "artifacts"
    (artifacts / "models").mkdir(parents=True)
    (artifacts / "models" / model_dir.name).symlink_to(model_dir)
    (artifacts / "heads").symlink_to(REPO / "artifacts" / "heads")
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["stage=heads", f"heads={heads}"])
    hc = OmegaConf.to_container(cfg.heads, resolve=True)
    train = cfg.heads.train
    for task in sorted(set(train.tasks) | {train.functions_from, train.functions_template}):  # the mix's inputs
        prepare_task(load_task_config(task), {"max_prompt_tokens": int(cfg.profile.max_prompt_tokens)}, model_dir,
                     tmp_path / "data")
    seen: dict = {}

    def capture(name, out, key, build, force=False):  # noqa: ANN001, ANN202 - run_stage's signature
        seen.update(out=out, key=key)
        return out

    monkeypatch.setattr(heads_build, "run_stage", capture)
    heads_build.train_heads(hc, model_dir, tmp_path / "data", artifacts, model_name=model_dir.name)
    assert seen["out"].resolve() == (REPO / "artifacts" / "heads" / model_dir.name / hc["name"]).resolve()
    assert why_not_up_to_date(seen["out"], seen["key"]) is None
