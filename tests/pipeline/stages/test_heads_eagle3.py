"""The heads stage with `heads=eagle3 heads.dir=DIR`: a drafter in this project's format is checked and
used as it is, one in EAGLE's own layout or the speculators layout is converted once into
artifacts/heads/<model>/eagle3/ (checked against the base model, the source's checksums in the
manifest, the file's layer-id convention applied), a malformed one is refused with a message that
names the problem, and heads with an output layer of their own skip the frequency-ranked draft
vocabulary (the log says so) while the default heads keep their key."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.paths import Layout
from runtime.eagle3 import Eagle3Drafter
from runtime.heads import load_heads
from tests.helpers import MODEL_NAME, TinyBundle, tiny_pipeline_cfg
from tests.helpers.eagle3_folders import drafter_for, write_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SKIPPED = "no frequency-ranked draft vocabulary"


@pytest.fixture
def setup(bundle: TinyBundle, tmp_path: Path) -> tuple[TinyBundle, Path, Path]:
    from pipeline import graph

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    graph.clear_memo()
    return bundle, artifacts, data


def _heads(setup: tuple, *extra: str) -> tuple[Path, object]:
    from pipeline.config.validate import validate_config
    from pipeline.stages import heads as heads_stage

    bundle, artifacts, data = setup
    cfg = tiny_pipeline_cfg(artifacts, data, bundle, "heads=eagle3", "heads.num_heads=4", *extra)
    validate_config(cfg)
    return heads_stage.output(cfg), cfg


def _same_drafter(got: Eagle3Drafter, want: Eagle3Drafter) -> None:
    assert got.config == want.config
    mine, theirs = got.state_dict(), want.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k].to(mine[k].dtype)), k


# (layout, the drafter's layer ids in our convention, the ids written in the file, heads.aux_convention)
CASES = {
    "ours": ("ours", (0, 1), None, None),
    "speculators, vLLM ids": ("speculators", (0, 1), None, None),             # write_speculators: [0, 1]
    "eagle, SGLang ids (the layout's default)": ("eagle", (1,), [0], None),    # SGLang's layer 0 output = input of 1
    "eagle, vLLM ids (heads.aux_convention)": ("eagle", (1,), [1], "vllm"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_drafter_in_each_layout_imports_through_the_heads_stage(setup: tuple, tmp_path: Path, case: str) -> None:
    layout, aux, file_ids, convention = CASES[case]
    bundle, artifacts, _ = setup
    drafter, model = drafter_for(bundle.model_dir, aux, draft_vocab=64, seed=3)
    src = write_drafter(drafter, tmp_path / "src", layout, file_ids=file_ids, embeddings=layout == "speculators")
    out, cfg = _heads(setup, f"heads.dir={src}", *([f"heads.aux_convention={convention}"] if convention else []))
    lay = Layout.from_cfg(cfg)
    assert lay.heads_name == "eagle3"                       # no -draft<size>: the drafter has its own output
    loaded = load_heads(out, model=model)
    assert isinstance(loaded, Eagle3Drafter) and loaded.aux_layer_ids == aux
    _same_drafter(loaded, drafter)
    if layout == "ours":
        assert out == src                                   # used as it is
        return
    assert out == lay.heads_dir() == artifacts / "heads" / MODEL_NAME / "eagle3"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "heads_import"
    summary = manifest["summary"]
    assert summary["source"] == str(src.resolve()) and summary["layout"] == layout
    from runtime.fingerprint import file_sha256

    assert summary["checkpoint_sha256"] == {"model.safetensors": file_sha256(src / "model.safetensors")}
    assert summary["aux_layer_ids"] == list(aux) and summary["file_aux_layer_ids"] == (file_ids or list(aux))
    assert summary["base_embeddings_checked"] == (layout == "speculators")
    # once: a second run finds it up to date
    before = (out / "drafter.safetensors").stat().st_mtime_ns
    from pipeline import graph

    graph.clear_memo()
    assert _heads(setup, f"heads.dir={src}", *([f"heads.aux_convention={convention}"] if convention else []))[0] == out
    assert (out / "drafter.safetensors").stat().st_mtime_ns == before


def _malformed(case: str, drafter: Eagle3Drafter, tmp_path: Path) -> Path:
    """A broken published folder (EAGLE's layout unless the case says)."""
    from safetensors.torch import load_file, save_file

    if case == "embeddings of another model":
        src = write_drafter(drafter, tmp_path / "src", "speculators", embeddings=True)
        t = load_file(str(src / "model.safetensors"))
        t["embed_tokens.weight"][3] += 1.0
        save_file(t, str(src / "model.safetensors"))
        return src
    src = write_drafter(drafter, tmp_path / "src", "eagle", file_ids=[0])
    cfg, tensors = json.loads((src / "config.json").read_text()), load_file(str(src / "model.safetensors"))
    if case == "missing tensor":
        del tensors["fc.weight"]
    elif case == "layer id past the model":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [4]
    elif case == "another hidden size":
        cfg["hidden_size"] = 2 * cfg["hidden_size"]
    elif case == "no d2t":
        del tensors["d2t"]
    (src / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(src / "model.safetensors"))
    return src


MALFORMED = {
    "missing tensor": r"missing keys \['fc.weight'\]",
    "layer id past the model": r"aux_layer_ids \[5\] but the target has only 2 layers",
    "another hidden size": r"does not fit the target model: hidden size 128",
    "no d2t": r"no d2t: the draft vocabulary \(64 ids\) is smaller than the target's",
    "embeddings of another model": r"embed_tokens.weight differs from the target model's token embeddings",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_drafter_is_refused_with_a_clear_message(setup: tuple, tmp_path: Path, case: str) -> None:
    bundle, artifacts, _ = setup
    drafter, _ = drafter_for(bundle.model_dir, (1,), draft_vocab=64, seed=4)
    src = _malformed(case, drafter, tmp_path)
    with pytest.raises(ValueError, match=MALFORMED[case]):
        _heads(setup, f"heads.dir={src}")
    out = artifacts / "heads" / MODEL_NAME / "eagle3"
    assert not (out / "drafter.safetensors").exists()      # nothing half-written under the final name


def test_start_up_validation_names_the_mix_ups(setup: tuple, tmp_path: Path) -> None:
    from pipeline.config.validate import config_problems

    bundle, artifacts, data = setup
    drafter, _ = drafter_for(bundle.model_dir, (0, 1), draft_vocab=64)
    ours = write_drafter(drafter, tmp_path / "ours", "ours")
    spec = write_drafter(drafter, tmp_path / "spec", "speculators")

    def problems(*extra: str) -> list[str]:
        return config_problems(tiny_pipeline_cfg(artifacts, data, bundle, *extra))

    assert problems("heads=eagle3", f"heads.dir={spec}", "heads.aux_convention=sglang") == []
    assert problems("heads=eagle3", "heads.dir=null") == []   # trained here
    assert any("holds an EAGLE-3 drafter, but heads.kind=hydra: use heads=eagle3" in p for p in problems(f"heads.dir={spec}"))
    assert any("heads=eagle3 needs an EAGLE-3 drafter folder" in p and "holds project heads" in p
               for p in problems("heads=eagle3", f"heads.dir={bundle.heads_dir}"))
    assert any("layer ids already name layer inputs" in p
               for p in problems("heads=eagle3", f"heads.dir={ours}", "heads.aux_convention=vllm"))
    assert any("heads.aux_convention=vllm says what an EAGLE-3 drafter file's layer ids mean" in p
               for p in problems("heads.aux_convention=vllm"))
    assert any("heads.num_heads=9" in p and "at most 8 deep" in p
               for p in problems("heads=eagle3", f"heads.dir={spec}", "heads.num_heads=9", "grow.max_depth=4"))


def test_the_eagle3_config_trains_a_drafter_with_a_shared_output_over_the_frequent_ids() -> None:
    from pipeline.config.schema import TrainSettings
    from pipeline.graph import compose_cfg
    from pipeline.paths import heads_run_name

    cfg = compose_cfg(["heads=eagle3"])
    assert cfg.heads.dir is None and cfg.heads.output == "shared" and cfg.heads.draft_vocab.size == 8192
    assert heads_run_name(cfg.heads) == "eagle3"       # its vocabulary is its own, not a derived folder
    s = TrainSettings.from_dict(dict(cfg.heads.train))
    assert s.ttt_steps > 1 and s.reference_prompts > 0


def test_an_eagle3_drafter_skips_the_draft_vocabulary_and_says_so(setup: tuple, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    bundle, artifacts, _ = setup
    drafter, _ = drafter_for(bundle.model_dir, (0, 1), draft_vocab=64)
    src = write_drafter(drafter, tmp_path / "src", "speculators")
    with caplog.at_level(logging.INFO, logger="pipeline.stages.heads"):
        out, cfg = _heads(setup, f"heads.dir={src}", "heads.draft_vocab.size=32")
    assert out == artifacts / "heads" / MODEL_NAME / "eagle3" and Layout.from_cfg(cfg).heads_name == "eagle3"
    assert any(SKIPPED in r.getMessage() and "EAGLE-3" in r.getMessage() for r in caplog.records)
    assert not Layout.from_cfg(cfg).frequencies_root.exists()    # no token counting either


def test_published_hydra_heads_under_the_default_heads_config_skip_it_too(setup: tuple, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """`heads.dir=<published Hydra folder>` with the default config (heads=hydra, draft_vocab.size 8192)
    no longer stops for `heads.draft_vocab.size=null`: the stage converts the heads and skips it."""
    from pipeline.config.validate import config_problems
    from pipeline.heads.published.convert import export_published_hydra
    from pipeline.stages import heads as heads_stage
    from runtime.model.checkpoint import load_model

    bundle, artifacts, data = setup
    model = load_model(bundle.model_dir, max_seq_len=64)
    pub = export_published_hydra(load_heads(bundle.heads_dir, model=model), tmp_path / "pub")
    cfg = tiny_pipeline_cfg(artifacts, data, bundle, "heads.draft_vocab.size=8192", f"heads.dir={pub}",
                            "heads.name=hydra_published")
    assert config_problems(cfg) == []
    lay = Layout.from_cfg(cfg)
    assert lay.heads_name == "hydra_published"
    with caplog.at_level(logging.INFO, logger="pipeline.stages.heads"):
        out = heads_stage.output(cfg)
    assert out == lay.heads_dir() and json.loads((out / "manifest.json").read_text())["stage"] == "heads_import"
    assert load_heads(out).config.output == "own" and load_heads(out).draft_ids is None
    assert any(SKIPPED in r.getMessage() and "published hydra folder" in r.getMessage() for r in caplog.records)
    assert not lay.frequencies_root.exists()


def test_the_default_heads_keep_their_stage_key() -> None:
    """The new setting (heads.aux_convention) stays out of keys while null: the default config's heads key
    is what it was, and the default heads' shape is the one the shipped heads' manifest records."""
    from pipeline.graph import compose_cfg, config_key, plain
    from pipeline.heads.recipe import heads_config_for
    from pipeline.paths import REPO_ROOT
    from pipeline.stages import heads as heads_stage
    from runtime.config import ModelArgs

    cfg = compose_cfg([])
    assert cfg.heads.aux_convention is None
    key = config_key(cfg, heads_stage.READS)
    assert "aux_convention" not in key["heads"] and key["heads"]["draft_vocab"]["size"] == 8192
    assert Layout.from_cfg(cfg).heads_name == "hydra-draft8192"
    eagle3 = config_key(compose_cfg(["heads=eagle3", "heads.dir=/x", "heads.aux_convention=sglang"]), heads_stage.READS)
    assert eagle3["heads"]["aux_convention"] == "sglang"
    shipped = REPO_ROOT / "artifacts" / "heads" / "smollm2-135m-instruct" / "hydra" / "manifest.json"
    model_cfg = REPO_ROOT / "artifacts" / "models" / "smollm2-135m-instruct" / "config.json"
    if not shipped.is_file() or not model_cfg.is_file():
        pytest.skip("the shipped heads or the default model's config are not here")
    recorded = json.loads(shipped.read_text())["key"]
    args = ModelArgs.from_hf_config(json.loads(model_cfg.read_text()))
    shape = heads_config_for(plain(cfg.heads), args, recorded["model"]).to_dict()
    assert {k: v for k, v in shape.items() if k != "draft_dtype"} == recorded["heads"]
