"""An EAGLE-3 drafter written in the layouts the engines load (runtime/export/drafters.py).

Both layouts read back, through the pipeline's strict importer, into the same drafter (weights and draft logits); the EAGLE layout's config is the
one SGLang reads (a transformers LlamaConfig whose ``architectures`` picks
python/sglang/srt/models/llama_eagle3.py ``LlamaForCausalLMEagle3``, with ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in its convention). The speculators package
itself loads the speculators folders in test_drafters_speculators.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.eagle3 import Eagle3Drafter, Eagle3Error
from runtime.export.drafters import (
    ENGINE_LAYOUT,
    published_tensors,
    sglang_layer_ids,
    write_eagle,
    write_for_engine,
    write_speculators,
)
from tests.helpers.drafters import eagle3_target, random_eagle3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _drafter(**config: bool) -> Eagle3Drafter:
    return random_eagle3(eagle3_target(), seed=3, aux=(1, 2), **config)  # the 3-layer tiny target's layers 1, 2


def _logits(drafter: Eagle3Drafter) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    features = torch.randn(12, drafter.config.feature_size, generator=g)
    tokens = torch.randint(0, drafter.config.vocab_size, (12,), generator=g)
    drafter.reset()
    with torch.no_grad():
        return drafter.logits(drafter.extend(features, tokens, return_all=True))


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_each_layout_reads_back_into_the_same_drafter(tmp_path: Path, layout: str) -> None:
    from pipeline.heads.eagle3_import import read_eagle3

    drafter = _drafter()
    model = eagle3_target()  # a fresh target with the same (seeded) weights
    folder = (write_speculators(drafter, tmp_path / layout, "models/target") if layout == "speculators"
              else write_eagle(drafter, tmp_path / layout))
    back = read_eagle3(folder, model)  # the layout's default convention: vLLM's ids, SGLang's ids
    assert back.config == drafter.config
    want = drafter.state_dict()
    assert back.state_dict().keys() == want.keys()
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    torch.testing.assert_close(_logits(back), _logits(drafter), rtol=0, atol=0)


def test_the_eagle_layout_is_what_sglang_reads(tmp_path: Path) -> None:
    from transformers import AutoConfig

    drafter = _drafter()
    folder = write_eagle(drafter, tmp_path / "eagle")
    cfg = AutoConfig.from_pretrained(folder)  # SGLang's hf_config of the draft model
    assert cfg.architectures == ["LlamaForCausalLMEagle3"] and cfg.model_type == "llama"
    assert (cfg.draft_vocab_size, cfg.vocab_size, cfg.num_hidden_layers) == (40, 48, 1)
    # SGLang adds one to these (set_eagle3_layers_to_capture): it then captures our layers 1 and 2
    assert cfg.eagle_config == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1]}
    tensors = load_file(str(folder / "model.safetensors"))
    # the names LlamaForCausalLMEagle3.load_weights maps (midlayer -> layers.0, q/k/v -> qkv_proj,
    # gate/up -> gate_up_proj, d2t -> hot_token_id, t2d skipped); no embeddings: shared with the target
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                         "hidden_norm", "post_attention_layernorm")}
    assert torch.equal(tensors["d2t"] + torch.arange(40), drafter.target_ids().cpu())  # SGLang's hot-token ids


def test_what_a_layout_cannot_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(Eagle3Error, match="norm_before_residual, which SGLang's LlamaForCausalLMEagle3 does not"):
        write_eagle(_drafter(norm_before_residual=True), tmp_path / "nbr")
    assert sglang_layer_ids((1, 2, 5)) == [0, 1, 4]
    with pytest.raises(Eagle3Error, match="layer 0's input"):
        write_eagle(random_eagle3(eagle3_target(), aux=(0, 1, 2)), tmp_path / "emb")
    with pytest.raises(ValueError, match="layout must be one of"):
        published_tensors(_drafter(), "medusa")
    with pytest.raises(ValueError, match="--drafter-out writes a drafter for an engine format"):
        write_for_engine(_drafter(), tmp_path / "x", "tree-json", None)


def test_write_for_engine_picks_the_engines_layout(tmp_path: Path) -> None:
    drafter = _drafter()
    assert ENGINE_LAYOUT == {"vllm": "speculators", "json": "speculators", "sglang": "eagle", "trtllm": "eagle"}
    for fmt, layout in ENGINE_LAYOUT.items():
        doc = json.loads((write_for_engine(drafter, tmp_path / fmt, fmt, "models/target", 4) / "config.json").read_text())
        assert ("speculators_model_type" in doc) == (layout == "speculators"), fmt
        if layout == "speculators":
            assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
