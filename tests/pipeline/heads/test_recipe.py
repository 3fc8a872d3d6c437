"""The shipped heads stay up to date under the current code and default config: a change to the
heads key (a new config field, a type the schema coerces) would otherwise make `make bank` on a
fresh clone retrain them for ~20 minutes without saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import pipeline.heads.recipe as heads_build
import pipeline.config.schema  # noqa: F401 - registers the typed config
from pipeline.artifacts import why_not_up_to_date
from pipeline.paths import REPO_ROOT, Layout, default_model_name
from pipeline.prepare import load_task_config, prepare_task

REPO = REPO_ROOT


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


def test_shipped_draft_vocab_heads_are_up_to_date(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default heads (`hydra` restricted to its 8,192 most frequent ids) too: their key records
    the folders it reads relative to the repository, wherever the checkout lives."""
    import pipeline.heads.draft_vocab as draft_vocab
    from pipeline.heads.draft_vocab import FrequencySettings

    model_dir = REPO / Layout.for_model("artifacts", default_model_name()).model_dir
    if not (model_dir / "config.json").is_file():
        pytest.skip("the default model is not converted yet (make model)")
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["stage=heads"])
    lay = Layout.for_model(REPO / "artifacts", default_model_name())
    seen: list[tuple[Path, dict]] = []

    def capture(name, out, key, build, force=False, **kw):  # noqa: ANN001, ANN202 - run_stage's signature
        seen.append((Path(out), key))
        return Path(out)

    monkeypatch.setattr(draft_vocab, "run_stage", capture)
    dv, train = cfg.heads.draft_vocab, cfg.heads.train
    s = FrequencySettings(tasks=list(train.tasks), prompts_per_task=int(dv.prompts_per_task),
                          max_new_tokens=int(dv.max_new_tokens))
    for task in sorted(train.tasks):  # the counted prompts come from the train pools
        prepare_task(load_task_config(task), {"max_prompt_tokens": int(cfg.profile.max_prompt_tokens)}, model_dir,
                     tmp_path / "data")
    name = f"{cfg.heads.name}-draft{int(dv.size)}"
    draft_vocab.derive_draft_vocab_heads(lay.heads_dir(str(cfg.heads.name)), model_dir, tmp_path / "data",
                                         lay.frequencies_root, lay.heads_dir(name), int(dv.size), s)
    assert [out.name for out, _ in seen][-1] == name and len(seen) == 2
    for out, key in seen:
        assert why_not_up_to_date(out, key) is None, out
