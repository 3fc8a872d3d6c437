"""Published EAGLE-3 drafters (pipeline/heads/eagle3_import.py): one random drafter written in
EAGLE's layout (safetensors and .bin) and in the speculators layout imports to the same drafter,
whose logits equal a reference computed here from the published tensors; the layer-id
conventions; malformed folders are refused with the right message; write_speculators -> read."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.heads.eagle3_import import (
    convert_aux_ids, detect_layout, ours_to_file_ids, read_config, read_eagle3, write_speculators,
)
from runtime.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Error
from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from tests.helpers import tiny_transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, DRAFT_VOCAB, HID, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 40, 32, 4, 2, 8, 48, 8
PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}


def tiny_target(seed: int = 0) -> Transformer:
    args = ModelArgs(vocab_size=VOCAB, dim=HID, n_layers=LAYERS, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_position_embeddings=512)
    return tiny_transformer(args, seed, cache=64)


def published_tensors(prefix: str, seed: int = 0, draft_vocab: int = DRAFT_VOCAB) -> dict[str, torch.Tensor]:
    """A random drafter in the published key names (norms in [0.5, 1.5], the rest N(0, 0.3))."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    def norm() -> torch.Tensor:
        return torch.rand(HID, generator=g) + 0.5

    ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return {
        "fc.weight": w(HID, 3 * HID), "norm.weight": norm(), "lm_head.weight": w(draft_vocab, HID),
        "d2t": ids - torch.arange(draft_vocab), "t2d": t2d,
        prefix + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * HID),
        prefix + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HID),
        prefix + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HID),
        prefix + "self_attn.o_proj.weight": w(HID, HEADS * HEAD_DIM),
        prefix + "mlp.gate_proj.weight": w(INTER, HID), prefix + "mlp.up_proj.weight": w(INTER, HID),
        prefix + "mlp.down_proj.weight": w(HID, INTER),
        prefix + "input_layernorm.weight": norm(), prefix + "hidden_norm.weight": norm(),
        prefix + "post_attention_layernorm.weight": norm(),
    }


def llama_fields(draft_vocab: int | None = DRAFT_VOCAB) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": HID,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "intermediate_size": INTER, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 5000.0, "rope_scaling": None, "max_position_embeddings": 512, "vocab_size": VOCAB,
            "tie_word_embeddings": False, "draft_vocab_size": draft_vocab}


def speculators_fields(draft_vocab: int = DRAFT_VOCAB, ids: list[int] | None = None, nbr: bool = False) -> dict:
    """The config speculators 0.9.0's Eagle3DraftModel.save_pretrained writes (transformers 5)."""
    layer = {k: v for k, v in llama_fields().items() if k not in ("draft_vocab_size", "rope_theta", "rope_scaling")}
    layer["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    layer["architectures"] = None
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "some/verifier",
                                                "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": nbr,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": ids, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False, "dtype": "float32"}


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor], weights: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, folder / "pytorch_model.bin")
    return folder


def as_layout(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """The same tensors under the other layout's layer prefix."""
    out = {}
    for k, v in tensors.items():
        for p in PREFIX.values():
            if k.startswith(p):
                k = PREFIX[layout] + k[len(p):]
        out[k] = v
    return out


def reference_logits(t: dict[str, torch.Tensor], prefix: str, features: torch.Tensor, tokens: torch.Tensor,
                     embed: torch.Tensor, theta: float = 5000.0, eps: float = 1e-5,
                     norm_before_residual: bool = False) -> torch.Tensor:
    """Draft logits [n, V] (target vocabulary, -inf off the draft vocabulary) of n causal rows, in
    float64, straight from the published tensors: the EAGLE-3 layer as its published code runs it."""
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    L = lambda name: t[prefix + name]  # noqa: E731

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    n = features.shape[0]
    hidden = features.double() @ t["fc.weight"].T
    normed = rms(hidden, L("hidden_norm.weight"))
    x = torch.cat([rms(embed[tokens].double(), L("input_layernorm.weight")), normed], dim=-1)
    q = (x @ L("self_attn.q_proj.weight").T).view(n, HEADS, HEAD_DIM)
    k = (x @ L("self_attn.k_proj.weight").T).view(n, KV_HEADS, HEAD_DIM)
    v = (x @ L("self_attn.v_proj.weight").T).view(n, KV_HEADS, HEAD_DIM)
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = HEAD_DIM // 2
    q, k = [z * cos + torch.cat([-z[..., half:], z[..., :half]], -1) * sin for z in (q, k)]
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    att = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1) @ L("self_attn.o_proj.weight").T
    y = (normed if norm_before_residual else hidden) + att
    z = rms(y, L("post_attention_layernorm.weight"))
    y = y + (F.silu(z @ L("mlp.gate_proj.weight").T) * (z @ L("mlp.up_proj.weight").T)) @ L("mlp.down_proj.weight").T
    draft = rms(y, t["norm.weight"]) @ t["lm_head.weight"].T
    full = torch.full((n, VOCAB), -math.inf, dtype=torch.float64)
    full[:, torch.arange(draft.shape[1]) + t["d2t"]] = draft
    return full


def drafter_logits(drafter: Eagle3Drafter, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    drafter.reset()
    return drafter.to_target_logits(drafter.logits(drafter.extend(features, tokens, return_all=True)))


def inputs(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 3 * HID, generator=g), torch.randint(0, VOCAB, (n,), generator=g)


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_both_layouts_import_to_the_same_drafter(tmp_path: Path, norm_before_residual: bool) -> None:
    model = tiny_target()
    tensors = published_tensors(PREFIX["eagle"])
    eagle_cfg = {**llama_fields(), "norm_before_residual": norm_before_residual}
    folders = {
        "eagle-safetensors": write_folder(tmp_path / "a", eagle_cfg, tensors),
        "eagle-bin": write_folder(tmp_path / "b", eagle_cfg, tensors, weights="bin"),
        "speculators": write_folder(tmp_path / "c", speculators_fields(nbr=norm_before_residual),
                                    as_layout(tensors, "speculators")),
    }
    assert detect_layout(folders["eagle-bin"]) == "eagle" and detect_layout(folders["speculators"]) == "speculators"
    drafters = {name: read_eagle3(folder, model) for name, folder in folders.items()}
    first = drafters["eagle-safetensors"]
    assert first.is_bound and first.config.norm_before_residual is norm_before_residual
    for name, d in drafters.items():
        assert d.config == first.config, name
        for k, v in first.state_dict().items():
            assert torch.equal(d.state_dict()[k], v), (name, k)
    features, tokens = inputs()
    want = reference_logits(tensors, PREFIX["eagle"], features, tokens, model.tok_embeddings.weight,
                            norm_before_residual=norm_before_residual)
    for name, d in drafters.items():
        got = drafter_logits(d, features, tokens)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("layout,file_ids,convention,ours", [
    ("speculators", [1, 3, 6], None, (1, 3, 6)),       # speculators default: vLLM's (input of layer id)
    ("speculators", [1, 3, 6], "sglang", (2, 4, 7)),
    ("eagle", [1, 3, 6], None, (2, 4, 7)),             # EAGLE layout with ids: SGLang / SpecForge (output of id)
    ("eagle", [1, 3, 6], "vllm", (1, 3, 6)),
    ("eagle", [6, 1, 3], "vllm", (1, 3, 6)),           # the engines concatenate in layer order
    ("eagle", None, None, (2, 4, 5)),                  # no ids: EAGLE's (2, L//2, L-3), L = 8
    ("speculators", None, "sglang", (2, 4, 5)),
])
def test_aux_layer_conventions(tmp_path: Path, layout: str, file_ids: list[int] | None, convention: str | None,
                               ours: tuple[int, ...]) -> None:
    args = tiny_target().args
    cfg = llama_fields() if layout == "eagle" else speculators_fields(ids=file_ids)
    if layout == "eagle" and file_ids is not None:
        cfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": file_ids}
    write_folder(tmp_path, cfg, {})
    config, found = read_config(tmp_path, args, aux_convention=convention)
    assert found == layout and config.aux_layer_ids == ours
    assert ours_to_file_ids(ours, "vllm") == list(ours)
    assert convert_aux_ids(ours_to_file_ids(ours, "sglang"), "sglang") == ours


def test_layer_ids_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    args = tiny_target().args
    write_folder(tmp_path, {**llama_fields(), "eagle_aux_hidden_state_layer_ids": [2, 4, 7]}, {})
    with pytest.raises(Eagle3Error, match=r"aux_layer_ids \[3, 5, 8\] but the target has only 8 layers"):
        read_config(tmp_path, args)  # SGLang ids 2, 4, 7 are the inputs of layers 3, 5, 8
    assert read_config(tmp_path, args, aux_convention="vllm")[0].aux_layer_ids == (2, 4, 7)
    with pytest.raises(Eagle3Error, match="names a layer twice"):
        convert_aux_ids([1, 1, 2], "vllm")
    with pytest.raises(Eagle3Error, match="aux_convention"):
        convert_aux_ids([1, 2, 3], "tensorrt")
    with pytest.raises(Eagle3Error, match="no SGLang name"):
        ours_to_file_ids((0, 2, 3), "sglang")


def test_the_whole_vocabulary_needs_no_maps(tmp_path: Path) -> None:
    model = tiny_target()
    tensors = published_tensors(PREFIX["speculators"], draft_vocab=VOCAB)
    del tensors["d2t"], tensors["t2d"]  # speculators keeps none when nothing is reduced
    d = read_eagle3(write_folder(tmp_path / "s", speculators_fields(draft_vocab=VOCAB), tensors), model)
    assert torch.equal(d.target_ids(), torch.arange(VOCAB)) and bool(d.t2d.all())
    e = read_eagle3(write_folder(tmp_path / "e", llama_fields(draft_vocab=None), as_layout(tensors, "eagle")), model)
    assert e.config.draft_vocab_size == VOCAB


def _without(key: str) -> Callable[[dict, dict], None]:
    return lambda cfg, t: t.pop(key)


MALFORMED: dict[str, tuple[str, Callable[[dict, dict], None], str]] = {
    "missing layer key": ("eagle", _without("midlayer.hidden_norm.weight"),
                          r"missing keys \['midlayer.hidden_norm.weight'\]"),
    "missing d2t": ("speculators", _without("d2t"), "no d2t: the draft vocabulary .40 ids. is smaller"),
    "only t2d with full vocab": ("eagle", lambda c, t: (c.update(draft_vocab_size=VOCAB), t.pop("d2t"),
                                                        t.update({"lm_head.weight": torch.zeros(VOCAB, HID)}),
                                                        t.update(t2d=torch.ones(VOCAB, dtype=torch.bool))),
                                 "only one of d2t / t2d"),
    "unexpected key": ("speculators", lambda c, t: t.update({"layers.1.mlp.up_proj.weight": torch.zeros(1)}),
                       r"unexpected keys \['layers.1.mlp.up_proj.weight'\]"),
    "wrong layout prefix": ("speculators", lambda c, t: (lambda new: (t.clear(), t.update(new)))(as_layout(t, "eagle")),
                            r"missing keys \['layers.0.hidden_norm.weight'"),
    "wrong shape": ("eagle", lambda c, t: t.update({"fc.weight": torch.zeros(HID, 2 * HID)}),
                    r"fc.weight: shape \(32, 64\), expected \(32, 96\)"),
    "integer weight": ("eagle", lambda c, t: t.update({"norm.weight": torch.ones(HID, dtype=torch.long)}),
                       "norm.weight: dtype torch.int64"),
    "d2t collision": ("eagle", lambda c, t: t["d2t"].__setitem__(0, int(t["d2t"][1]) + 1), "two draft ids to one"),
    "t2d disagrees": ("speculators", lambda c, t: t.update(t2d=~t["t2d"]), "t2d does not mark exactly"),
    "target vocabulary": ("eagle", lambda c, t: c.update(vocab_size=96),
                          "target vocabulary 96 but the target model has 64"),
    "hidden size": ("speculators", lambda c, t: c["transformer_layer_config"].update(hidden_size=48, head_dim=12),
                    "hidden size 48 but the target's is 32"),
    "target hidden size": ("eagle", lambda c, t: c.update(target_hidden_size=64), "target_hidden_size 64 differs"),
    "two layers": ("speculators", lambda c, t: c["transformer_layer_config"].update(num_hidden_layers=2),
                   "only one-layer EAGLE-3 drafters"),
    "qwen3 layer": ("speculators", lambda c, t: c["transformer_layer_config"].update(model_type="qwen3"),
                    "'qwen3' draft layer is not supported"),
    "no layer model_type": ("speculators", lambda c, t: c["transformer_layer_config"].pop("model_type"),
                            "reads as a Qwen3 layer"),
    "eagle 3.1": ("speculators", lambda c, t: c.update(norm_output=True), r"\['norm_output'\] .* not supported"),
    "not eagle3": ("speculators", lambda c, t: c.update(speculators_model_type="mtp"), "not an EAGLE-3 drafter"),
    "eagle-1 config": ("eagle", lambda c, t: c.pop("draft_vocab_size"), "no draft_vocab_size: not an EAGLE-3"),
    "no aux states": ("eagle", lambda c, t: c.update(eagle_config={"use_aux_hidden_state": False}),
                      "use_aux_hidden_state=false"),
    "attention bias": ("eagle", lambda c, t: c.update(attention_bias=True), "attention_bias=true is not supported"),
    "rope": ("eagle", lambda c, t: c.update(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn'"),
    "own embeddings": ("eagle", lambda c, t: t.update({"embed_tokens.weight": torch.zeros(VOCAB, HID)}),
                       "embed_tokens.weight differs from the target model's"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_published_folders_are_refused(tmp_path: Path, case: str) -> None:
    layout, corrupt, message = MALFORMED[case]
    cfg = llama_fields() if layout == "eagle" else speculators_fields()
    tensors = published_tensors(PREFIX[layout])
    corrupt(cfg, tensors)
    write_folder(tmp_path, cfg, tensors)
    with pytest.raises(Eagle3Error, match=message):
        read_eagle3(tmp_path, tiny_target())


def test_embeddings_in_the_file(tmp_path: Path) -> None:
    model = tiny_target()
    tensors = published_tensors(PREFIX["speculators"])
    same = {**tensors, "embed_tokens.weight": model.tok_embeddings.weight.detach().clone()}
    read_eagle3(write_folder(tmp_path / "same", speculators_fields(), same), model)
    never_loaded = {**tensors, "embed_tokens.weight": torch.full((VOCAB, HID), math.nan)}  # speculators' placeholder
    read_eagle3(write_folder(tmp_path / "nan", speculators_fields(), never_loaded), model)
    with pytest.raises(Eagle3Error, match="pass the target model"):
        read_eagle3(tmp_path / "same", model.args)
    read_eagle3(write_folder(tmp_path / "none", speculators_fields(), tensors), model.args)  # args suffice without


class Payload:
    """Any object that is not a tensor: unpickling it could run code."""


def test_a_pickled_object_is_refused(tmp_path: Path) -> None:
    tensors = published_tensors(PREFIX["eagle"])
    write_folder(tmp_path, llama_fields(), {**tensors, "extra": Payload()}, weights="bin")  # type: ignore[dict-item]
    with pytest.raises(Eagle3Error, match="pickled Python objects"):
        read_eagle3(tmp_path, tiny_target())


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_write_speculators_then_read(tmp_path: Path, norm_before_residual: bool) -> None:
    model = tiny_target()
    cfg = Eagle3Config.for_model(model.args, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(0, 3, 6),
                                 norm_before_residual=norm_before_residual, rope_theta=5000.0, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.3)
    drafter.set_draft_vocab(torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values)
    with pytest.raises(Eagle3Error, match="bound to its target"):
        write_speculators(drafter, tmp_path / "x", "verifier")
    drafter.bind(model)
    folder = write_speculators(drafter, tmp_path / "spec", "/models/tiny-llama")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["speculators_model_type"] == "eagle3" and meta["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
    assert meta["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny-llama"
    assert meta["transformer_layer_config"]["model_type"] == "llama"
    assert meta["norm_before_residual"] is norm_before_residual
    back = read_eagle3(folder, model)
    assert back.config == drafter.config
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    features, tokens = inputs()
    assert torch.equal(drafter_logits(back, features, tokens), drafter_logits(drafter, features, tokens))

    from safetensors import safe_open

    small = write_speculators(drafter, tmp_path / "small", None, include_embeddings=False)
    with safe_open(str(small / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "embed_tokens.weight" not in keys and {"d2t", "t2d", "layers.0.self_attn.q_proj.weight"} <= keys
    assert read_eagle3(small, model.args).config == drafter.config
