"""Read the two published EAGLE-3 drafter layouts into `runtime.eagle3.Eagle3Drafter`, and write ours
in the speculators layout.

The layouts, as their code writes and reads them:

(a) EAGLE's own (github.com/SafeAILab/EAGLE, `eagle/model/cnets.py` `Model`,
    `eagle/traineagle3/cnets.py`; also what SGLang's trainer SpecForge writes): `config.json` is a
    LlamaConfig (`hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
    `intermediate_size`, `rms_norm_eps`, `rope_theta` / `rope_scaling`, `num_hidden_layers` = 1,
    `vocab_size` = the TARGET vocabulary) plus `draft_vocab_size`, optionally `target_hidden_size`
    and the target layers as `eagle_aux_hidden_state_layer_ids` (top level) or
    `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `model.safetensors` or
    `pytorch_model.bin`: `fc.weight` [H, 3H], `midlayer.self_attn.{q,k,v,o}_proj.weight`,
    `midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,
    post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight` [V_d, H], `d2t` (int64
    [V_d]), `t2d` (bool [V]); some files also carry `embed_tokens.weight`.
(b) speculators (github.com/vllm-project/speculators, `models/eagle3/{config,core,
    model_definitions}.py`; what `Eagle3DraftModel.save_pretrained` writes in speculators 0.9.0):
    `config.json` with `speculators_model_type: "eagle3"`, `transformer_layer_config` (a
    LlamaConfig dict with `model_type: "llama"`, `vocab_size` = the target vocabulary,
    `num_hidden_layers`: 1; a dict without `model_type` means Qwen3 there), `draft_vocab_size`,
    `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, the Eagle
    3.1 switches `norm_before_fc`, `fc_norm`, `norm_output`, and `speculators_config` (`algorithm`,
    `proposal_methods`, `default_proposal_method`, `verifier.{name_or_path,architectures}`);
    weights `model.safetensors`: the same tensors with `layers.0.` instead of `midlayer.` (vLLM's
    `llama_eagle3.py` maps one to the other), plus `embed_tokens.weight` (the verifier's copy, or
    NaN when it was never loaded); `d2t` / `t2d` are absent when the draft vocabulary is the whole
    target vocabulary. Older files may hold `verifier_lm_head.weight` / `verifier_norm.weight`
    (training-only copies of the verifier's; skipped here).

Strict, unlike the published loaders (`load_state_dict(strict=False)`): every missing or
unexpected key, every shape mismatch, a hidden size or vocabulary that does not fit the target,
a config switch this runtime does not implement, and a missing `d2t` (with a reduced draft
vocabulary) is refused with a message naming it. `.bin` files are read with
`torch.load(weights_only=True)`. A file's own `embed_tokens.weight` must equal the target's (the
drafter uses the target's embeddings).

The heads stage (`heads=eagle3 heads.dir=<folder>`) imports a published folder once
(`convert_eagle3`, keyed and filed by `pipeline.heads.published.convert.import_heads`): read strictly as above, checked against the base model, and written in our format
(`runtime.eagle3.save_drafter`) into `artifacts/heads/<model>/<name>/` with the source's checksums
in the manifest; a folder in our format is checked and used as it is.

Which target layers: our `aux_layer_ids` name the residual stream entering a layer (see
`runtime.eagle3`). A file's `eagle_aux_hidden_state_layer_ids` mean that in vLLM (which captures
the input of layer id) but the output of layer id in SGLang and SpecForge (which capture the input
of id + 1): `aux_convention` says which one a file follows. Defaults: the speculators layout is
"vllm" (speculators makes its training data with vLLM); EAGLE's layout with ids in the file is
"sglang" (SpecForge writes those files; note that vLLM reads the same numbers as layer inputs, so
such a file drafts from other layers there). Without ids every engine uses EAGLE's
(2, L//2, L-3) layer inputs. Ids are sorted: both engines concatenate the states in layer order.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.eagle3 import (
    Eagle3Config, Eagle3Drafter, Eagle3Error, build_drafter, check_vocab_maps, default_aux_layer_ids, rope_from_hf,
)
from runtime.export.drafters import write_speculators  # noqa: F401 (the pipeline writes with the runtime's writer)
from runtime.config import ModelArgs
from runtime.model.llama import Transformer

ORIGINAL, SPECULATORS = "eagle", "speculators"
LAYOUTS = (ORIGINAL, SPECULATORS)
CONVENTIONS = ("vllm", "sglang")
DEFAULT_CONVENTION = {ORIGINAL: "sglang", SPECULATORS: "vllm"}
PREFIX = {ORIGINAL: "midlayer.", SPECULATORS: "layers.0."}

# published layer tensor -> (our key, its rows in our fused tensor: "q", "k", "v", "gate", "up" or None)
_LAYER_KEYS = {
    "self_attn.q_proj.weight": ("layer.attention.wqkv.weight", "q"),
    "self_attn.k_proj.weight": ("layer.attention.wqkv.weight", "k"),
    "self_attn.v_proj.weight": ("layer.attention.wqkv.weight", "v"),
    "self_attn.o_proj.weight": ("layer.attention.wo.weight", None),
    "mlp.gate_proj.weight": ("layer.feed_forward.w13.weight", "gate"),
    "mlp.up_proj.weight": ("layer.feed_forward.w13.weight", "up"),
    "mlp.down_proj.weight": ("layer.feed_forward.w2.weight", None),
    "input_layernorm.weight": ("layer.input_layernorm.weight", None),
    "hidden_norm.weight": ("layer.hidden_norm.weight", None),
    "post_attention_layernorm.weight": ("layer.post_attention_layernorm.weight", None),
}
_TOP_KEYS = ("fc.weight", "norm.weight", "lm_head.weight")
_VOCAB_KEYS = ("d2t", "t2d")
_SKIPPED = {SPECULATORS: ("verifier_lm_head.weight", "verifier_norm.weight"), ORIGINAL: ()}


# ----------------------------------------------------------------------------------------------
# files


def _read_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an EAGLE-3 drafter folder holds config.json and its weights")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3Error(f"{path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise Eagle3Error(f"{path} does not hold a JSON object")
    return cfg


def detect_layout(folder: str | Path) -> str:
    """"speculators" for a config with `speculators_model_type`, "eagle" for EAGLE's own layout."""
    return SPECULATORS if "speculators_model_type" in _read_json(Path(folder)) else ORIGINAL


def weight_files(folder: str | Path) -> list[Path]:
    """The files `load_weights` reads: `model.safetensors`, the shards a `model.safetensors.index.json`
    lists, or `pytorch_model.bin`."""
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (ValueError, KeyError, AttributeError) as e:
            raise Eagle3Error(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from e
        files = sorted({folder / f for f in shards})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {folder}: {absent}")
        return files
    binary = folder / "pytorch_model.bin"
    if not binary.is_file():
        raise FileNotFoundError(f"{folder} holds neither model.safetensors nor pytorch_model.bin")
    return [binary]


def load_weights(folder: str | Path) -> tuple[dict[str, Tensor], Path]:
    """The drafter's tensors and the file they came from: `model.safetensors` (or the shards a
    `model.safetensors.index.json` lists), else `pytorch_model.bin` read with
    torch.load(weights_only=True) (a file holding any other pickled object is refused)."""
    folder = Path(folder)
    files = weight_files(folder)
    if files[0].suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        state: dict[str, Tensor] = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except (SafetensorError, OSError) as e:
                raise Eagle3Error(f"{f} is not a readable safetensors file: {e}") from e
        return state, files[0]
    binary = files[0]
    try:
        obj = torch.load(str(binary), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise Eagle3Error(f"{binary} carries pickled Python objects besides tensors, and unpickling them could run "
                          f"arbitrary code, so it is refused. Detail: {str(e).splitlines()[0]}") from e
    except RuntimeError as e:
        raise Eagle3Error(f"{binary} is not a readable torch checkpoint: {e}") from e
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        raise Eagle3Error(f"{binary} does not hold a state dict ({{name: tensor}}); got {type(obj).__name__}")
    return obj, binary


# ----------------------------------------------------------------------------------------------
# configs


def convert_aux_ids(ids: Sequence[int], convention: str) -> tuple[int, ...]:
    """A file's layer ids in our convention (the residual stream entering layer id), sorted: "vllm"
    ids already mean that; an "sglang" id i names layer i's output, which enters layer i + 1."""
    if convention not in CONVENTIONS:
        raise Eagle3Error(f"aux_convention must be one of {CONVENTIONS}, got {convention!r}")
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids or any(
            isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise Eagle3Error(f"eagle_aux_hidden_state_layer_ids must be a non-empty list of ints, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise Eagle3Error(f"eagle_aux_hidden_state_layer_ids {list(ids)} names a layer twice")
    shift = 1 if convention == "sglang" else 0
    return tuple(sorted(int(i) + shift for i in ids))


def ours_to_file_ids(ids: Sequence[int], convention: str) -> list[int]:
    """Our layer ids written in `convention` (inverse of `convert_aux_ids` for sorted ids)."""
    if convention not in CONVENTIONS:
        raise Eagle3Error(f"aux_convention must be one of {CONVENTIONS}, got {convention!r}")
    shift = 1 if convention == "sglang" else 0
    if shift and min(ids) == 0:
        raise Eagle3Error("layer id 0 (the token embeddings) has no SGLang name (it would be layer -1's output)")
    return [int(i) - shift for i in ids]


def _layer_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The draft layer's shape from a LlamaConfig-like dict (EAGLE's config, or speculators'
    transformer_layer_config), every setting this runtime does not implement refused."""
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise Eagle3Error(f"{where}: a {model_type!r} draft layer is not supported (only Llama-style layers; "
                          "speculators' Qwen3 layers add per-head q/k norms)")
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise Eagle3Error(f"{where} lacks {missing}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise Eagle3Error(f"{where}: num_hidden_layers {cfg['num_hidden_layers']}: only one-layer EAGLE-3 drafters are "
                          "supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise Eagle3Error(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU / silu only)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise Eagle3Error(f"{where}: {key}=true is not supported (the drafter's projections have no bias)")
    try:
        theta, scaling = rope_from_hf(cfg)
    except ValueError as e:
        raise Eagle3Error(f"{where}: {e}") from e
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return dict(hidden_size=hidden, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)))


def _aux_ids(file_ids: Any, layout: str, aux_convention: str | None, args: ModelArgs) -> tuple[int, ...]:
    if file_ids is None:
        return default_aux_layer_ids(args.n_layers)
    return convert_aux_ids(file_ids, aux_convention or DEFAULT_CONVENTION[layout])


def read_config(folder: str | Path, target: ModelArgs, layout: str | None = None,
                aux_convention: str | None = None) -> tuple[Eagle3Config, str]:
    """(our config, the layout) of a published EAGLE-3 folder, checked against the target's args."""
    folder = Path(folder)
    cfg = _read_json(folder)
    found = SPECULATORS if "speculators_model_type" in cfg else ORIGINAL
    layout = layout or found
    if layout not in LAYOUTS:
        raise Eagle3Error(f"layout must be one of {LAYOUTS}, got {layout!r}")
    where = f"{folder / 'config.json'}"
    if layout != found:
        raise Eagle3Error(f"{where} is in the {found!r} layout, not {layout!r}")
    if layout == SPECULATORS:
        if cfg["speculators_model_type"] != "eagle3":
            raise Eagle3Error(f"{where}: speculators_model_type {cfg['speculators_model_type']!r} is not an EAGLE-3 "
                              "drafter ('eagle3')")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise Eagle3Error(f"{where} lacks transformer_layer_config")
        if "model_type" not in layer:
            raise Eagle3Error(f"{where}: transformer_layer_config has no model_type, which speculators reads as a "
                              "Qwen3 layer; only Llama layers are supported")
        fields = _layer_config(layer, f"{where} (transformer_layer_config)")
        if "draft_vocab_size" not in cfg:
            raise Eagle3Error(f"{where} lacks draft_vocab_size")
        on = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)]
        if on:
            raise Eagle3Error(f"{where}: {on} (Eagle 3.1 / gpt-oss variants) are not supported")
        file_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    else:
        if "draft_vocab_size" not in cfg:
            raise Eagle3Error(f"{where} has no draft_vocab_size: not an EAGLE-3 drafter config (EAGLE-1/2 drafters "
                              "are not supported)")
        fields = _layer_config(cfg, where)
        eagle_cfg = cfg.get("eagle_config") or {}
        if not isinstance(eagle_cfg, dict):
            raise Eagle3Error(f"{where}: eagle_config must be an object")
        if eagle_cfg.get("use_aux_hidden_state") is False:
            raise Eagle3Error(f"{where}: eagle_config.use_aux_hidden_state=false (a drafter fed the last hidden state "
                              "only) is not supported")
        file_ids = cfg.get("eagle_aux_hidden_state_layer_ids", eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != fields["hidden_size"]:
        raise Eagle3Error(f"{where}: target_hidden_size {target_hidden} differs from the drafter's hidden_size "
                          f"{fields['hidden_size']}; this runtime shares the target's embeddings, so they must match")
    norm_before_residual = cfg.get("norm_before_residual", False)
    if not isinstance(norm_before_residual, bool):
        raise Eagle3Error(f"{where}: norm_before_residual must be true or false, got {norm_before_residual!r}")
    draft_vocab = cfg["draft_vocab_size"]
    if draft_vocab is None:  # EAGLE / vLLM: no reduced vocabulary
        draft_vocab = fields["vocab_size"]
    try:
        config = Eagle3Config(**fields, draft_vocab_size=int(draft_vocab),
                              aux_layer_ids=_aux_ids(file_ids, layout, aux_convention, target),
                              norm_before_residual=norm_before_residual)
    except Eagle3Error as e:
        raise Eagle3Error(f"{where}: {e}") from e
    config.check_target(target, where=f"the EAGLE-3 drafter in {folder}")
    return config, layout


# ----------------------------------------------------------------------------------------------
# weights


def _to_ours(state: dict[str, Tensor], config: Eagle3Config, layout: str, where: str,
             embeddings: Tensor | None) -> dict[str, Tensor]:
    """Our state dict from a published one; every key and shape checked first."""
    c, prefix = config, PREFIX[layout]
    h, kvh, hd, hid, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {
        "self_attn.q_proj.weight": (h * hd, 2 * hid), "self_attn.k_proj.weight": (kvh * hd, 2 * hid),
        "self_attn.v_proj.weight": (kvh * hd, 2 * hid), "self_attn.o_proj.weight": (hid, h * hd),
        "mlp.gate_proj.weight": (inter, hid), "mlp.up_proj.weight": (inter, hid), "mlp.down_proj.weight": (hid, inter),
        "input_layernorm.weight": (hid,), "hidden_norm.weight": (hid,), "post_attention_layernorm.weight": (hid,),
    }
    expected = {prefix + k: v for k, v in shapes.items()}
    expected.update({"fc.weight": (hid, c.feature_size), "norm.weight": (hid,),
                     "lm_head.weight": (c.draft_vocab_size, hid)})
    reduced = c.draft_vocab_size < c.vocab_size
    vocab_shapes = {"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    optional = {"embed_tokens.weight": (c.vocab_size, hid)}
    if reduced:
        expected.update(vocab_shapes)
    else:
        optional.update(vocab_shapes)
    present = dict(state)
    for k in _SKIPPED[layout]:
        present.pop(k, None)
    problems = []
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected) - set(optional))
    if "d2t" in missing:
        problems.append(f"no d2t: the draft vocabulary ({c.draft_vocab_size} ids) is smaller than the target's "
                        f"({c.vocab_size}), and without d2t its ids cannot be mapped to target ids")
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k, shape in {**expected, **optional}.items():
        if k in present and tuple(present[k].shape) != shape:
            problems.append(f"{k}: shape {tuple(present[k].shape)}, expected {shape}")
    for k in list(expected) + list(optional):
        if k in present and k not in _VOCAB_KEYS and not present[k].is_floating_point():
            problems.append(f"{k}: dtype {present[k].dtype}, expected a floating tensor")
    if problems:
        raise Eagle3Error(f"{where} does not match its config.json: " + "; ".join(problems))

    own_embed = present.get("embed_tokens.weight")
    if own_embed is not None and not bool(torch.isnan(own_embed).all()):  # speculators saves NaN when never loaded
        if embeddings is None:
            raise Eagle3Error(f"{where} carries its own embed_tokens.weight: pass the target model (not just its args) "
                              "so that it can be checked against the target's embeddings, which the drafter uses")
        if not torch.equal(own_embed, embeddings.detach().cpu().to(own_embed.dtype)):
            raise Eagle3Error(f"{where}: its embed_tokens.weight differs from the target model's token embeddings; "
                              "this runtime drafts with the target's embeddings, so this drafter belongs to another "
                              "model")

    out: dict[str, Tensor] = {k: present[k] for k in _TOP_KEYS}
    get = lambda name: present[prefix + name]  # noqa: E731
    out["layer.attention.wqkv.weight"] = torch.cat([get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"),
                                                    get("self_attn.v_proj.weight")])
    out["layer.attention.wo.weight"] = get("self_attn.o_proj.weight")
    out["layer.feed_forward.w13.weight"] = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
    out["layer.feed_forward.w2.weight"] = get("mlp.down_proj.weight")
    for name in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight"):
        out[f"layer.{name}"] = get(name)
    if "d2t" in present or "t2d" in present:
        if "d2t" not in present or "t2d" not in present:
            raise Eagle3Error(f"{where} holds only one of d2t / t2d; both describe the draft vocabulary")
        d2t, t2d = present["d2t"], present["t2d"]
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise Eagle3Error(f"{where}: d2t must hold integers (target id - draft id), got {d2t.dtype}")
        if t2d.is_floating_point() or (t2d.dtype != torch.bool and bool(((t2d != 0) & (t2d != 1)).any())):
            raise Eagle3Error(f"{where}: t2d must be a boolean mask over the target vocabulary, got {t2d.dtype}")
        out["d2t"], out["t2d"] = d2t.to(torch.long), t2d.to(torch.bool)
    else:  # the whole target vocabulary, in order
        out["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        out["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    check_vocab_maps(out["d2t"], out["t2d"], c.vocab_size, c.draft_vocab_size, where)
    return out


def read_eagle3(folder: str | Path, target: Transformer | ModelArgs, layout: str | None = None,
                aux_convention: str | None = None, dtype: torch.dtype | None = None,
                embeddings: Tensor | None = None) -> Eagle3Drafter:
    """An Eagle3Drafter from a published folder in either layout (detected unless `layout` says),
    checked against the target (a Transformer, to which it is then bound and whose dtype and
    device it takes unless `dtype` is given; or just its ModelArgs, with the target's token
    `embeddings` [V, hidden] to check a file that carries its own against). `aux_convention`
    ("vllm" / "sglang") says what the file's layer ids mean; the default is the layout's (module
    docstring)."""
    folder = Path(folder)
    model = target if isinstance(target, Transformer) else None
    args = model.args if model is not None else target
    if not isinstance(args, ModelArgs):
        raise TypeError(f"target must be the runtime Transformer or its ModelArgs, got {type(target).__name__}")
    config, layout = read_config(folder, args, layout, aux_convention)
    state, wfile = load_weights(folder)
    ours = _to_ours(state, config, layout, str(wfile), model.tok_embeddings.weight if model is not None else embeddings)
    floats = {v.dtype for k, v in ours.items() if v.is_floating_point()}
    want = dtype or (model.dtype if model is not None else (floats.pop() if len(floats) == 1 else torch.float32))
    drafter = build_drafter(config, ours, str(wfile), want, model.device if model is not None else "cpu")
    drafter = drafter.eval().requires_grad_(False)
    if model is not None:
        drafter.bind(model)
    return drafter


# ----------------------------------------------------------------------------------------------
# the heads stage: `heads=eagle3 heads.dir=<folder>`


def _target_args(model_dir: Path) -> ModelArgs:
    path = model_dir / "config.json"
    try:
        return ModelArgs.from_hf_config(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable model config: {e}") from e


def folder_layout(kind: str) -> str:
    """The eagle3_import layout of a `pipeline.heads.published.convert.heads_folder_kind` EAGLE-3 kind."""
    layouts = {"eagle3_eagle": ORIGINAL, "eagle3_speculators": SPECULATORS}
    if kind not in layouts:
        raise ValueError(f"{kind!r} is not a published EAGLE-3 folder kind ({sorted(layouts)})")
    return layouts[kind]


def resolved_convention(layout: str, aux_convention: str | None) -> str:
    """The layer-id convention a published file is read in: `aux_convention`, else the layout's default."""
    if aux_convention is not None and aux_convention not in CONVENTIONS:
        raise Eagle3Error(f"heads.aux_convention must be one of {CONVENTIONS} (or null: the layout's default), got "
                          f"{aux_convention!r}")
    return aux_convention or DEFAULT_CONVENTION[layout]


def convert_eagle3(src: Path, model_dir: Path, out: Path, layout: str, aux_convention: str | None,
                   base_embeddings: Callable[[Path], Tensor]) -> dict[str, Any]:
    """Read the published drafter in `src` strictly (`read_eagle3`), checked against the base model
    in `model_dir` (hidden size, vocabulary, layer ids, and the token embeddings a file may carry,
    which `base_embeddings(model_dir)` reads), and write it in our format into `out` (`save_drafter`,
    in the dtype the file stores); returns the provenance the manifest keeps. The heads stage's
    import (`pipeline.heads.published.convert.import_heads`) keys and files it."""
    from pipeline.artifacts import hash_bytes
    from runtime.eagle3 import save_drafter
    from runtime.fingerprint import file_sha256, weights_fingerprint

    args = _target_args(model_dir)
    src_cfg = _read_json(src)
    # a file that carries its own embeddings is checked against the model's (the drafter uses the model's)
    embeddings = base_embeddings(model_dir) if any(_file_has_embeddings(f) for f in weight_files(src)) else None
    convention = resolved_convention(layout, aux_convention)
    drafter = read_eagle3(src, args, layout=layout, aux_convention=convention, embeddings=embeddings)
    c = drafter.config
    dtype = drafter.dtype
    save_drafter(drafter, out, dtype=dtype)
    if layout == SPECULATORS:
        file_ids = src_cfg.get("eagle_aux_hidden_state_layer_ids")
        verifier = (src_cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
    else:
        file_ids = src_cfg.get("eagle_aux_hidden_state_layer_ids",
                               (src_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        verifier = src_cfg.get("base_model_name_or_path")
    files = weight_files(src)
    return {
        "source": str(src.resolve()),
        "layout": layout,
        "checkpoint": [f.name for f in files],
        "checkpoint_sha256": {f.name: file_sha256(f) for f in files},
        "config_sha256": hash_bytes((src / "config.json").read_bytes()),
        "aux_convention": convention if file_ids is not None else None,
        "file_aux_layer_ids": file_ids,
        "aux_layer_ids": list(c.aux_layer_ids),
        "verifier": verifier,
        "base_fingerprint": weights_fingerprint(model_dir),
        "base_embeddings_checked": embeddings is not None,
        "drafter": {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
                    "num_aux": c.num_aux, "norm_before_residual": c.norm_before_residual,
                    "dtype": str(dtype).removeprefix("torch.")},
    }


def _file_has_embeddings(path: Path) -> bool:
    """Whether a weights file holds `embed_tokens.weight` (read from the safetensors header; a .bin's
    keys through a memory-mapped, weights-only load that reads no tensor data)."""
    if path.suffix != ".safetensors":
        try:
            return "embed_tokens.weight" in torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - whatever torch raises on a corrupt file, said plainly
            raise Eagle3Error(f"{path} is not a readable PyTorch weights file: {e}") from e
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return "embed_tokens.weight" in f.keys()  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError) as e:
        raise Eagle3Error(f"{path} is not a readable safetensors file: {e}") from e


def check_own_drafter(src: Path, model_dir: Path, aux_convention: str | None = None) -> None:
    """A drafter folder in our format, checked against the base model before use: its config (hidden
    size, vocabulary, layer ids) and the weights file's presence (`runtime.heads.load_heads` checks
    every tensor when a stage loads it). Its layer ids are in the runtime's convention already, so an
    `aux_convention` is refused."""
    from runtime.eagle3 import WEIGHTS_FILE, read_drafter_config

    if aux_convention is not None:
        raise ValueError(f"heads.aux_convention={aux_convention}: heads.dir={src} holds a drafter in this project's "
                         "format, whose layer ids already name layer inputs; set heads.aux_convention=null")
    config, _ = read_drafter_config(src)
    config.check_target(_target_args(model_dir), where=f"the EAGLE-3 drafter in heads.dir={src}")
    if not (src / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"heads.dir={src} has an EAGLE-3 drafter config.json but no {WEIGHTS_FILE}")
