"""Converting a `heads.dir` folder: published Hydra / Hydra++ / Medusa-1 folders and EAGLE-3
drafters, converted once.

`heads.dir=<folder>` accepts either
* a folder in this project's format (`config.json` with `format: entmtp-heads` + `heads.safetensors`,
  as `runtime.heads.save_heads` writes): used as it is; or
* a published head folder: Hydra / Hydra++ (`hydra_lm_head.pt` + a config.json with `hydra_num_heads`,
  `hydra_head_arch`, ...) or Medusa-1 (`medusa_lm_head.pt` / `.safetensors` + `medusa_num_heads`).
  It is read by `pipeline.heads.published.read` (strictly: every missing or unexpected key and every shape
  mismatch is an error), checked against the base model (hidden size, vocabulary, and the copy of
  the base token embeddings a Hydra file carries), and written in the project's format under
  `artifacts/heads/<model>/<name>/` with its provenance (source folder, checkpoint file and its
  SHA-256) in the stage manifest. Every later stage reads that folder; or
* an EAGLE-3 drafter (`heads=eagle3`): one in this project's format (`format: entmtp-eagle3`,
  `runtime.eagle3.save_drafter`), checked against the base model and used as it is, or one in EAGLE's
  own or the speculators layout, converted once in the same way by `pipeline.heads.eagle3_import.
  import_eagle3` (`import_heads` hands it over).

Heads whose output layer is their own (published Hydra / Medusa, project heads with output own or
draft, EAGLE-3 drafters with their d2t) take no frequency-ranked draft vocabulary (`own_output_reason`):
the heads stage skips it for them.

`export_published_hydra` writes project heads in the published Hydra layout (the reverse): used to
check the converter against heads whose drafts are known, and to hand heads to Hydra's own code.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.artifacts import hash_bytes, run_stage
from runtime.config import FORMAT, HYDRA_WEIGHTS, MEDUSA_WEIGHTS, ModelArgs
from runtime.fingerprint import file_sha256, weights_fingerprint
from runtime.heads_ref import is_referring_folder

if TYPE_CHECKING:  # torch only where weights are read: using project heads as they are stays torch-free
    import torch
    from torch import Tensor

    from runtime.heads import DraftHeads

PUBLISHED_KINDS = ("hydra", "medusa")
STAGE = "heads_import"   # the manifest's stage name: marks a folder this module may rebuild
# `runtime.eagle3.FORMAT`, the format tag of a drafter folder of ours (not imported: that module needs torch)
DRAFTER_FORMAT = "entmtp-eagle3"
# EAGLE-3 folder kinds: ours (used as it is), EAGLE's own layout and the speculators layout (converted)
EAGLE3_FOLDERS = ("eagle3", "eagle3_eagle", "eagle3_speculators")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def heads_folder_kind(folder: str | Path) -> str:
    """"project" (our format), "hydra" or "medusa" (published layouts), or an EAGLE-3 drafter:
    "eagle3" (our format), "eagle3_eagle" (EAGLE's own layout: a LlamaConfig with draft_vocab_size)
    or "eagle3_speculators" (speculators_model_type); raises for anything else."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"heads.dir={folder} holds no config.json: expected project heads (config.json + "
                                f"heads.safetensors), a published Hydra/Medusa folder (config.json + "
                                f"{HYDRA_WEIGHTS} or {' / '.join(MEDUSA_WEIGHTS)}) or an EAGLE-3 drafter "
                                "(config.json + drafter.safetensors / model.safetensors / pytorch_model.bin)")
    cfg = _read_json(cfg_file)
    if cfg.get("format") == FORMAT:
        return "project"
    if cfg.get("format") == DRAFTER_FORMAT:
        return "eagle3"
    if "hydra_num_heads" in cfg:
        return "hydra"
    if "medusa_num_heads" in cfg:
        return "medusa"
    if "speculators_model_type" in cfg:
        return "eagle3_speculators"
    if "draft_vocab_size" in cfg:
        return "eagle3_eagle"
    raise ValueError(f"{cfg_file} is neither project heads (format: {FORMAT}), a published Hydra "
                     "(hydra_num_heads) or Medusa (medusa_num_heads) config, nor an EAGLE-3 drafter's (format: "
                     f"{DRAFTER_FORMAT}, speculators_model_type, or EAGLE's draft_vocab_size)")


def folder_own_output(folder: str | Path) -> str | None:
    """What the heads in `folder` are when their output layer is their own (a published Hydra /
    Medusa folder, project heads with output own / draft, an EAGLE-3 drafter), None when they share
    the base lm_head. Raises as `heads_folder_kind` for a folder that holds no heads."""
    folder = Path(folder)
    kind = heads_folder_kind(folder)
    if kind in EAGLE3_FOLDERS:
        return "an EAGLE-3 drafter (its own lm_head over its draft vocabulary, mapped by d2t)"
    if kind != "project":
        return f"a published {kind} folder (one output layer per head)"
    output = _read_json(folder / "config.json").get("output", "shared")
    return None if output == "shared" else f"project heads with output={output!r}"


def own_output_reason(heads: Any) -> str | None:
    """Why the heads of the `heads` config group (a mapping) take no frequency-ranked draft
    vocabulary (`heads.draft_vocab`), which restricts the base lm_head that heads share: their
    output layer is their own (kind eagle3, `output` other than shared, or a `heads.dir` folder
    whose heads have their own, whatever the config says). None when the vocabulary applies. A
    `heads.dir` that cannot be read counts as shared here (start-up validation reports it)."""
    from omegaconf.errors import MissingMandatoryValue

    if heads.get("kind") == "eagle3":
        return "heads.kind=eagle3: an EAGLE-3 drafter has its own output layer (d2t)"
    output = heads.get("output", "shared")
    if output != "shared":
        return f"heads.output={output}: the heads have their own output layers"
    try:
        folder = heads.get("dir")
    except MissingMandatoryValue:
        return None
    if not folder:
        return None
    try:
        what = folder_own_output(Path(str(folder)))
    except (OSError, ValueError):
        return None
    return None if what is None else f"heads.dir={folder} holds {what}"


def published_checkpoint(folder: Path, kind: str) -> Path:
    """The weights file of a published head folder."""
    names = (HYDRA_WEIGHTS,) if kind == "hydra" else MEDUSA_WEIGHTS
    for n in names:
        if (folder / n).is_file():
            return folder / n
    raise FileNotFoundError(f"{folder} is a published {kind} folder but holds none of {list(names)}")


def _model_args(model_dir: Path) -> ModelArgs:
    return ModelArgs.from_hf_config(_read_json(model_dir / "config.json"))


def _base_embeddings(model_dir: Path) -> Tensor:
    """The base model's token embedding matrix, read from its safetensors without loading the rest."""
    from safetensors import safe_open

    key = "model.embed_tokens.weight"
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                return st.get_tensor(key)
    raise ValueError(f"{model_dir} has no {key} in its safetensors; is it a Llama-family model folder?")


def _read_checkpoint(checkpoint: Path) -> dict[str, Tensor]:
    if checkpoint.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(checkpoint))
    from pipeline.heads.published.read import load_torch_weights

    return load_torch_weights(checkpoint)


def check_embeddings_match(state: dict[str, Tensor], model_dir: Path, where: Path) -> bool:
    """Compare the copy of the base embeddings a published Hydra file carries with the model's.
    False when the file carries none (Medusa; Hydra checkpoints saved without it)."""
    import torch

    stored = state.get("input_embed_fn.weight")
    if stored is None:
        return False
    ours = _base_embeddings(model_dir)
    if stored.shape != ours.shape or not torch.allclose(stored.float(), ours.float(), rtol=1e-2, atol=1e-3):
        raise ValueError(f"{where}: the base token embeddings stored with the heads differ from those of "
                         f"{model_dir}; these heads were trained for another base model")
    return True


def stored_dtype(state: dict[str, Tensor]) -> torch.dtype:
    """The floating dtype the published weights were saved in (the converted heads keep it); for
    mixed files (e.g. fp32 norms beside fp16 matrices) the widest of them."""
    import torch

    found = {v.dtype for v in state.values() if v.is_floating_point()}
    return next((d for d in (torch.float32, torch.bfloat16, torch.float16) if d in found), torch.float32)


def convert_published(src: Path, model_dir: Path, out: Path) -> dict[str, Any]:
    """Convert the published folder `src` for the base model in `model_dir` into `out` (project format)."""
    from runtime.heads import save_heads
    from pipeline.heads.published.read import load_published

    kind = heads_folder_kind(src)
    if kind == "project":
        raise ValueError(f"{src} is already in the project's heads format; use it as it is")
    checkpoint = published_checkpoint(src, kind)
    args = _model_args(model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        heads = load_published(src, base_args=args)
    notes = [str(w.message) for w in caught]
    for note in notes:  # surface them, as load_published would have
        warnings.warn(note, stacklevel=2)
    c = heads.config
    if (c.hidden_size, c.vocab_size) != (args.dim, args.vocab_size):
        raise ValueError(f"{checkpoint}: heads for hidden size {c.hidden_size} and vocabulary {c.vocab_size}, but the "
                         f"base model in {model_dir} has {args.dim} and {args.vocab_size}: they belong to another model")
    raw = _read_checkpoint(checkpoint)
    embeddings_checked = check_embeddings_match(raw, model_dir, checkpoint)
    dtype = stored_dtype(raw)
    del raw
    c.base_fingerprint = weights_fingerprint(model_dir)
    save_heads(heads, out, dtype=dtype)
    src_cfg = _read_json(src / "config.json")
    return {
        "source": str(src.resolve()),
        "checkpoint": checkpoint.name,
        "checkpoint_sha256": file_sha256(checkpoint),
        "config_sha256": hash_bytes((src / "config.json").read_bytes()),
        "layout": kind if kind == "medusa" else f"hydra {src_cfg.get('hydra_head_arch')}",
        "base_model_name_or_path": src_cfg.get("base_model_name_or_path"),
        "base_fingerprint": c.base_fingerprint,
        "base_embeddings_checked": embeddings_checked,
        "heads": {"kind": c.kind, "num_heads": c.num_heads, "num_layers": c.num_layers,
                  "prefix_layer": c.prefix_layer, "output": c.output, "dtype": str(dtype).removeprefix("torch.")},
        "warnings": notes,
    }


def check_import_target(out: Path) -> None:
    """Refuse to convert into a folder that holds heads this module did not write."""
    manifest = out / "manifest.json"
    if out.exists() and (not manifest.is_file() or _read_json(manifest).get("stage") != STAGE):
        raise ValueError(f"{out} holds other heads (trained or shipped, not converted from a published folder); "
                         f"give the converted heads their own name, e.g. heads.name={out.name}_published")


def import_heads(src: str | Path, model_dir: str | Path, out: str | Path, force: bool = False,
                 aux_convention: str | None = None) -> Path:
    """The heads folder every stage uses for `heads.dir=src`: `src` itself when it is in the
    project's format, else its conversion in `out` (built once; rebuilt when the checkpoint, its
    config or the base model change). EAGLE-3 drafters go to `pipeline.heads.eagle3_import.
    import_eagle3` (`aux_convention`: what a published file's layer ids mean; EAGLE-3 only)."""
    src, model_dir, out = Path(src), Path(model_dir), Path(out)
    kind = heads_folder_kind(src)
    if kind in EAGLE3_FOLDERS:
        return _import_eagle3(src, kind, model_dir, out, aux_convention, force)
    if aux_convention is not None:
        raise ValueError(f"heads.aux_convention={aux_convention} names EAGLE-3 layer ids, but heads.dir={src} holds "
                         f"{kind} heads; set heads.aux_convention=null")
    if kind == "project":
        if not (src / "heads.safetensors").is_file() and not is_referring_folder(src):  # runtime.heads_ref
            raise FileNotFoundError(f"heads.dir={src} has a project config.json but no heads.safetensors")
        return src
    checkpoint = published_checkpoint(src, kind)
    check_import_target(out)
    key = {
        "source": str(src.resolve()),
        "checkpoint": checkpoint.name,
        "checkpoint_sha256": file_sha256(checkpoint),
        "config_sha256": hash_bytes((src / "config.json").read_bytes()),
        "base_fingerprint": weights_fingerprint(model_dir),
    }
    run_stage(STAGE, out, key, lambda tmp: convert_published(src, model_dir, tmp), force=force)
    return out


def _import_eagle3(src: Path, kind: str, model_dir: Path, out: Path, aux_convention: str | None, force: bool) -> Path:
    """`import_heads` for an EAGLE-3 drafter (`heads=eagle3`): `src` itself when it is in our format
    (checked against the base model: hidden size, vocabulary, layer ids), else its conversion into
    `out` (`pipeline.heads.eagle3_import.convert_eagle3`), built once and rebuilt when the weights,
    the config, the layer-id convention or the base model change, with the source's checksums in
    the manifest."""
    from pipeline.heads.eagle3_import import (check_own_drafter, convert_eagle3, folder_layout, resolved_convention,
                                              weight_files)

    if kind == "eagle3":
        check_own_drafter(src, model_dir, aux_convention)
        return src
    layout = folder_layout(kind)
    convention = resolved_convention(layout, aux_convention)
    check_import_target(out)
    key = {
        "source": str(src.resolve()),
        "layout": layout,
        "checkpoint_sha256": {f.name: file_sha256(f) for f in weight_files(src)},
        "config_sha256": hash_bytes((src / "config.json").read_bytes()),
        "aux_convention": convention,
        "base_fingerprint": weights_fingerprint(model_dir),
    }
    run_stage(STAGE, out, key, lambda tmp: convert_eagle3(src, model_dir, tmp, layout, convention, _base_embeddings),
              force=force)
    return out


# ----------------------------------------------------------------------------------------------
# the reverse: project heads -> published Hydra layout


def export_published_hydra(heads: DraftHeads, folder: str | Path, base_model_name_or_path: str = "") -> Path:
    """Write bound `heads` as a published Hydra folder (config.json + hydra_lm_head.pt).

    Hydra heads become grounded heads, Medusa heads ungrounded ones (`mlp` arch), heads with a
    prefix layer `prefix-mlp` (Hydra++). The published head always has its own output layer with a
    bias: a shared output becomes a copy of the base lm_head with a zero bias. Heads with a draft
    vocabulary have no published equivalent and are refused."""
    import torch

    from runtime.io import atomic_write_bytes

    c = heads.config
    if c.output == "draft":
        raise ValueError("heads with a draft vocabulary (output='draft') have no published Hydra layout")
    if not heads.is_bound:
        raise ValueError("bind the heads to their base model first (heads.bind(model)): the published file "
                         "carries the base embeddings and, for a shared output, a copy of the lm_head")
    refs = heads._refs()
    embed, lm_head = refs.embed.weight.detach(), refs.lm_head.weight.detach()
    grounded = c.kind == "hydra"
    dropout_layout = c.prefix_layer
    state: dict[str, Tensor] = {}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            pos = 2 * j + 1 if dropout_layout else j
            state[f"hydra_mlp.{i}.{pos}.linear.weight"] = block.linear.weight
            state[f"hydra_mlp.{i}.{pos}.linear.bias"] = block.linear.bias
            if block.residual is not None:
                state[f"hydra_mlp.{i}.{pos}.res_connection.weight"] = block.residual.weight
                state[f"hydra_mlp.{i}.{pos}.res_connection.bias"] = block.residual.bias
        out = f"hydra_lm_head.{i}.{'1.' if dropout_layout else ''}"
        weight = head.out.weight if head.out is not None else lm_head
        bias = head.out.bias if head.out is not None and head.out.bias is not None else None
        state[out + "weight"] = weight
        state[out + "bias"] = bias if bias is not None else torch.zeros(weight.shape[0], dtype=weight.dtype)
    if c.prefix_layer:
        a = heads.prefix.args
        blk = heads.prefix.block
        p = "prefix_embeding_layer."
        q, k = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        wq, wk, wv = blk.attention.wqkv.weight.split([q, k, k])
        state.update({
            p + "layers.0.input_layernorm.weight": blk.attention_norm.weight,
            p + "layers.0.post_attention_layernorm.weight": blk.ffn_norm.weight,
            p + "layers.0.self_attn.q_proj.weight": wq,
            p + "layers.0.self_attn.k_proj.weight": wk,
            p + "layers.0.self_attn.v_proj.weight": wv,
            p + "layers.0.self_attn.o_proj.weight": blk.attention.wo.weight,
            p + "layers.0.mlp.down_proj.weight": blk.feed_forward.w2.weight,
            p + "norm.weight": heads.prefix.norm.weight,
            p + "embed_tokens.weight": embed,
        })
        gate, up = blk.feed_forward.w13.weight.chunk(2)
        state[p + "layers.0.mlp.gate_proj.weight"] = gate
        state[p + "layers.0.mlp.up_proj.weight"] = up
        if a.qkv_bias:
            bq, bk, bv = blk.attention.wqkv.bias.split([q, k, k])
            state.update({p + f"layers.0.self_attn.{n}_proj.bias": b for n, b in zip("qkv", (bq, bk, bv))})
        if a.o_bias:
            state[p + "layers.0.self_attn.o_proj.bias"] = blk.attention.wo.bias
    state["input_embed_fn.weight"] = embed
    dtype = heads.dtype
    # own storage per tensor (torch.save keeps views of shared storage together), one dtype, on the CPU
    state = {k: v.detach().to("cpu", dtype).clone().contiguous() for k, v in state.items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(folder / HYDRA_WEIGHTS, buf.getvalue())
    config = {
        "hydra_num_heads": c.num_heads,
        "hydra_num_layers": c.num_layers,
        "hydra_head_arch": "prefix-mlp" if c.prefix_layer else "mlp",
        "grounded_heads": grounded,
        "hidden_state_offset": 0,
        "base_model_name_or_path": base_model_name_or_path,
    }
    atomic_write_bytes(folder / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return folder
