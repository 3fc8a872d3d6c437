"""Published EAGLE-3 drafters with the default model's real shapes (SmolLM2-135M: hidden size 576,
vocabulary 49,152, 9 / 3 heads, 30 layers) through the heads stage's import (`import_heads`, what
`heads=eagle3 heads.dir=DIR` calls): an intact folder in each layout imports with EAGLE-3's default
layers (2, 15, 27), and a folder made for another model, or broken, is refused with a message that
names what is wrong, leaving no converted drafter behind. (The tiny-model cases, one per check, are
in test_eagle3_import.py; tests/slow/test_published_eagle3_bank.py builds a bank from such a folder.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pipeline.heads.published.convert import import_heads
from runtime.eagle3 import Eagle3Drafter, default_aux_layer_ids
from runtime.export.drafters import sglang_layer_ids
from runtime.heads import load_heads
from tests.helpers.eagle3_folders import drafter_for, write_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DRAFT_VOCAB = 1024


@pytest.fixture(scope="module")
def drafter(smollm2_dir: Path) -> Eagle3Drafter:
    """A random drafter for the default model, reading EAGLE-3's default layers."""
    layers = json.loads((smollm2_dir / "config.json").read_text())["num_hidden_layers"]
    return drafter_for(smollm2_dir, default_aux_layer_ids(layers), draft_vocab=DRAFT_VOCAB)[0]


def write_folder(drafter: Eagle3Drafter, folder: Path, layout: str,
                 corrupt: Callable[[dict, dict], None] = lambda cfg, tensors: None) -> Path:
    """`drafter` as a published folder in `layout` (EAGLE's with its ids in SGLang's convention, as
    SpecForge writes them), its config.json and tensors passed through `corrupt` first."""
    from safetensors.torch import load_file, save_file

    file_ids = sglang_layer_ids(drafter.aux_layer_ids) if layout == "eagle" else None
    write_drafter(drafter, folder, layout, file_ids=file_ids)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    corrupt(cfg, tensors)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_an_intact_drafter_for_the_default_model_imports(drafter: Eagle3Drafter, smollm2_dir: Path, tmp_path: Path,
                                                         layout: str) -> None:
    src = write_folder(drafter, tmp_path / "src", layout)
    out = import_heads(src, smollm2_dir, tmp_path / "out")
    loaded = load_heads(out)
    assert isinstance(loaded, Eagle3Drafter) and loaded.config == drafter.config
    assert loaded.aux_layer_ids == (2, 15, 27) and loaded.config.hidden_size == 576
    assert torch.equal(loaded.target_ids(), drafter.target_ids())
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert summary["layout"] == layout
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        carries = "embed_tokens.weight" in f.keys()  # noqa: SIM118 (safe_open is not a dict)
    assert summary["base_embeddings_checked"] == carries


def test_a_pytorch_bin_says_whether_it_carries_embeddings(tmp_path: Path) -> None:
    """The manifest's `base_embeddings_checked` is true only where the file held embeddings to check."""
    from pipeline.heads.eagle3_import import _file_has_embeddings

    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "without.bin")
    torch.save({"fc.weight": torch.zeros(2, 2), "embed_tokens.weight": torch.zeros(3, 2)}, tmp_path / "with.bin")
    assert not _file_has_embeddings(tmp_path / "without.bin")
    assert _file_has_embeddings(tmp_path / "with.bin")


def _layer(cfg: dict, layout: str) -> dict:
    """The draft layer's LlamaConfig fields of either layout's config.json."""
    return cfg["transformer_layer_config"] if layout == "speculators" else cfg


def _smollm2_360m_layer(layout: str) -> Callable[[dict, dict], None]:
    """A drafter made for SmolLM2-360M: hidden size 960, 15 / 5 heads."""
    return lambda cfg, t: _layer(cfg, layout).update(hidden_size=960, num_attention_heads=15, num_key_value_heads=5)


# case -> (layout, corruption, the message that names the problem)
MALFORMED: dict[str, tuple[str, Callable[[dict, dict], None], str]] = {
    "no d2t": ("eagle", lambda cfg, t: t.pop("d2t"),
               r"no d2t: the draft vocabulary \(1024 ids\) is smaller than the target's \(49152\)"),
    "another model's hidden size": ("speculators", _smollm2_360m_layer("speculators"),
                                    r"does not fit the target model: hidden size 960 but the target's is 576"),
    "another model's vocabulary": ("eagle", lambda cfg, t: cfg.update(vocab_size=128256),
                                   "target vocabulary 128256 but the target model has 49152"),
    "layers of a deeper model": ("eagle", lambda cfg, t: cfg["eagle_config"].update(
                                     eagle_aux_hidden_state_layer_ids=[1, 15, 31]),
                                 r"aux_layer_ids \[2, 16, 32\] but the target has only 30 layers"),
    "fc over two layers": ("speculators", lambda cfg, t: t.update({"fc.weight": t["fc.weight"][:, :1152].clone()}),
                           r"fc.weight: shape \(576, 1152\), expected \(576, 1728\)"),
    "missing lm_head": ("speculators", lambda cfg, t: t.pop("lm_head.weight"), r"missing keys \['lm_head.weight'\]"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_drafter_for_the_default_model_is_refused(drafter: Eagle3Drafter, smollm2_dir: Path,
                                                              tmp_path: Path, case: str) -> None:
    layout, corrupt, message = MALFORMED[case]
    src = write_folder(drafter, tmp_path / "src", layout, corrupt)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message) as refused:
        import_heads(src, smollm2_dir, out)
    assert str(src) in str(refused.value)                  # the message says which folder
    assert not (out / "drafter.safetensors").exists()      # nothing converted under the final name
