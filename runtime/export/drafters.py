"""An EAGLE-3 drafter written in the folder layout each serving engine loads (`entmtp export --drafter-out`).

Our own drafter folder (`runtime.eagle3.save_drafter`: config.json tagged ``entmtp-eagle3`` +
drafter.safetensors with a fused qkv) is read by this runtime only. The engines read two published
layouts, checked against their code:

* ``speculators`` (vLLM): what speculators 0.9.0's ``Eagle3DraftModel.save_pretrained`` writes
  (github.com/vllm-project/speculators ``src/speculators/models/eagle3/{config,core}.py``):
  config.json with ``speculators_model_type: "eagle3"``, a Llama ``transformer_layer_config``,
  ``draft_vocab_size``, ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids`` (vLLM's
  convention: the input of layer id) and ``speculators_config.verifier``; model.safetensors with
  ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``/``t2d`` (absent over the whole vocabulary)
  and the verifier's ``embed_tokens`` (speculators' from_pretrained leaves a file's missing
  embeddings uninitialised). vLLM detects the layout by ``speculators_model_type``
  (vllm/transformers_utils/configs/speculators/) and maps ``layers.0.`` to its layer
  (vllm/model_executor/models/llama_eagle3.py). The pipeline writes this layout with this function.
* ``eagle`` (SGLang, TensorRT-LLM): EAGLE's own layout as SpecForge writes it, a LlamaConfig with
  ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention (the OUTPUT of layer
  id: SGLang adds one when capturing, python/sglang/srt/models/llama.py
  ``set_eagle3_layers_to_capture``; it reads the ids from the draft config,
  python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py), weights
  ``midlayer.*``. SGLang 0.5.23 has no speculators reader: it picks the draft class by
  ``architectures`` (python/sglang/srt/models/llama_eagle3.py ``LlamaForCausalLMEagle3``, whose
  ``load_weights`` maps ``midlayer`` to ``layers.0``, turns ``d2t`` into its hot-token ids and skips
  ``t2d``). Its input layer keeps the un-normed features as the residual, i.e. no
  ``norm_before_residual``: such a drafter is refused for this layout. TensorRT-LLM's
  ``Eagle3ForCausalLM.load_weights`` (tensorrt_llm/_torch/models/modeling_speculative.py) accepts
  ``midlayer.*`` and ``layers.0.*`` alike and reads ``draft_vocab_size`` from the draft config;
  its layer ids come from the speculative config (`runtime.export.engines`).

Only torch, safetensors and the runtime are imported here (the runtime's dependency rule).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Error
from runtime.io import atomic_write_bytes

SPECULATORS, EAGLE = "speculators", "eagle"
LAYOUTS = (SPECULATORS, EAGLE)
# the layout each export format's engine loads
ENGINE_LAYOUT = {"vllm": SPECULATORS, "json": SPECULATORS, "sglang": EAGLE, "trtllm": EAGLE}
SPECULATORS_VERSION = "0.9.0"  # the version whose layout `write_speculators` writes (and the tests load it with)
WEIGHTS_FILE = "model.safetensors"
_PREFIX = {SPECULATORS: "layers.0.", EAGLE: "midlayer."}
_TOP_KEYS = ("fc.weight", "norm.weight", "lm_head.weight")


def published_tensors(drafter: Eagle3Drafter, layout: str) -> dict[str, Tensor]:
    """The drafter's tensors under the published names of `layout` (fused qkv / gate-up split
    again; ``d2t``/``t2d`` only for a reduced draft vocabulary in the speculators layout)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    c, prefix = drafter.config, _PREFIX[layout]
    sd = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    q, k, v = sd["layer.attention.wqkv.weight"].split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
    gate, up = sd["layer.feed_forward.w13.weight"].split(c.intermediate_size)
    out = {key: sd[key] for key in _TOP_KEYS}
    out.update({prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": sd["layer.attention.wo.weight"],
                prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": sd["layer.feed_forward.w2.weight"]})
    for name in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight"):
        out[prefix + name] = sd[f"layer.{name}"]
    if layout == EAGLE or c.draft_vocab_size < c.vocab_size:
        out["d2t"], out["t2d"] = sd["d2t"], sd["t2d"]
    elif not torch.equal(sd["d2t"], torch.zeros_like(sd["d2t"])):
        raise Eagle3Error("a drafter over the whole target vocabulary must map draft id i to target id i to be written "
                          "in the speculators layout (it keeps no d2t then)")
    return out


def _rope_parameters(config: Eagle3Config) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        params.update(config.rope_scaling)
    return params


def _llama_layer(c: Eagle3Config) -> dict[str, Any]:
    """The draft layer as a transformers LlamaConfig dict (vocab_size: the TARGET vocabulary)."""
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "rope_parameters": _rope_parameters(c), "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
    }


def _cast(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> tuple[dict[str, Tensor], torch.dtype]:
    state = {k: (v.to(dtype) if v.is_floating_point() and dtype is not None else v).contiguous()
             for k, v in tensors.items()}
    return state, next(v.dtype for v in state.values() if v.is_floating_point())


def _write(folder: Path, state: dict[str, Tensor], config: dict[str, Any]) -> Path:
    from safetensors.torch import save

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / WEIGHTS_FILE, save(state, metadata={"format": "pt"}))
    atomic_write_bytes(folder / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return folder


def _embeddings(drafter: Eagle3Drafter, what: str) -> Tensor:
    if not drafter.is_bound:
        raise Eagle3Error(f"{what} needs a drafter bound to its target model (drafter.bind(model)): the embeddings "
                          "written are the target's")
    return drafter.embed(torch.arange(drafter.config.vocab_size)).detach().cpu()


def write_speculators(drafter: Eagle3Drafter, folder: str | Path, verifier_name_or_path: str | None,
                      verifier_architectures: Sequence[str] = ("LlamaForCausalLM",), dtype: torch.dtype | None = None,
                      speculative_tokens: int = 3, include_embeddings: bool = True) -> Path:
    """Write `drafter` as speculators 0.9.0 writes an Eagle3DraftModel: config.json + model.safetensors,
    layer ids in vLLM's convention (ours). `dtype` casts the floating weights (default: the drafter's);
    `include_embeddings` (needs a bound drafter) adds the target's token embeddings, as speculators'
    own save_pretrained does. `verifier_name_or_path`: the target model (speculators' from_pretrained
    reads its config there: a local folder or a hub id)."""
    c = drafter.config
    tensors = published_tensors(drafter, SPECULATORS)
    if include_embeddings:
        tensors["embed_tokens.weight"] = _embeddings(drafter, "write_speculators(include_embeddings=True)")
    state, float_dtype = _cast(tensors, dtype)
    meta = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": _llama_layer(c),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in c.aux_layer_ids],
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": str(float_dtype).removeprefix("torch."),
    }
    return _write(Path(folder), state, meta)


def sglang_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """Our layer ids (the input of layer i) in SGLang's / TensorRT-LLM's convention (the output of
    layer i - 1); layer 0's input (the token embeddings) has no name there."""
    if min(aux_layer_ids) < 1:
        raise Eagle3Error(f"the drafter reads layer 0's input (the token embeddings; aux_layer_ids "
                          f"{list(aux_layer_ids)}), which SGLang and TensorRT-LLM cannot capture: they name a layer's "
                          "output")
    return [int(i) - 1 for i in aux_layer_ids]


def write_eagle(drafter: Eagle3Drafter, folder: str | Path, dtype: torch.dtype | None = None,
                include_embeddings: bool = False) -> Path:
    """Write `drafter` in EAGLE's own layout as SGLang loads it (``LlamaForCausalLMEagle3``): a
    LlamaConfig + ``draft_vocab_size`` + ``eagle_config`` (layer ids in SGLang's convention), and
    ``midlayer.*`` tensors with ``d2t`` / ``t2d``; the engines share the target's embeddings, so
    they are left out unless `include_embeddings`."""
    c = drafter.config
    if c.norm_before_residual:
        raise Eagle3Error("this drafter uses norm_before_residual, which SGLang's LlamaForCausalLMEagle3 does not "
                          "implement (its input layer keeps the un-normed features as the residual): export it for "
                          "vLLM (--format vllm) instead")
    tensors = published_tensors(drafter, EAGLE)
    if include_embeddings:
        tensors["embed_tokens.weight"] = _embeddings(drafter, "write_eagle(include_embeddings=True)")
    state, float_dtype = _cast(tensors, dtype)
    config = {**_llama_layer(c), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": c.draft_vocab_size,
              "torch_dtype": str(float_dtype).removeprefix("torch."),
              "eagle_config": {"use_aux_hidden_state": True,
                               "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(c.aux_layer_ids)}}
    return _write(Path(folder), state, config)


def write_for_engine(drafter: Eagle3Drafter, folder: str | Path, fmt: str, verifier_name_or_path: str | None,
                     speculative_tokens: int = 3) -> Path:
    """The drafter in the layout the engine of export format `fmt` loads (`ENGINE_LAYOUT`)."""
    if fmt not in ENGINE_LAYOUT:
        raise ValueError(f"--drafter-out writes a drafter for an engine format ({', '.join(ENGINE_LAYOUT)}), not "
                         f"{fmt!r}")
    if ENGINE_LAYOUT[fmt] == SPECULATORS:
        return write_speculators(drafter, folder, verifier_name_or_path,
                                 speculative_tokens=max(1, int(speculative_tokens)))
    return write_eagle(drafter, folder)
