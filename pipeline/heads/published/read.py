"""Load published Hydra / Hydra++ and Medusa-1 head checkpoints into `runtime.heads.DraftHeads`.

The published layouts (github.com/zankner/Hydra, github.com/FasterDecoding/Medusa), as their
training code writes them (the real checkpoints are not downloadable on the development machines;
the tests build state dicts in these layouts from an independent re-implementation and save them
as .pt files):

Hydra: `config.json` with `hydra_num_heads`, `hydra_num_layers`, `hydra_head_arch` ("mlp", or
"prefix-mlp" = Hydra++), `grounded_heads`, `hidden_state_offset`, `base_model_name_or_path`;
weights `hydra_lm_head.pt` = the state dict of their head module:

* arch "mlp": head i is `nn.Sequential(ResBlock, ...)` -> block j at `hydra_mlp.{i}.{j}`;
  output `hydra_lm_head.{i}.{weight,bias}`.
* arch "prefix-mlp": every ResBlock and the output Linear sit behind an `nn.Dropout` ->
  block j at `hydra_mlp.{i}.{2j+1}`, output `hydra_lm_head.{i}.1.{weight,bias}`; plus the
  one-layer Llama model `prefix_embeding_layer.{layers.0.*, norm.weight, embed_tokens.weight}`
  (its output is final-normed, as ours is).
* a grounded head i's first block reads (i+2)*h inputs and has `res_connection.{weight,bias}`
  (the learned linear residual); later blocks are `linear.{weight,bias}` only. Ungrounded heads
  read h_t alone: that is our `kind="medusa"` with an own output layer with bias.
* `input_embed_fn.weight` (a copy of the base token embeddings, registered by accident of
  module attribute assignment) and `prefix_embeding_layer.embed_tokens.weight` are unused; the
  first is compared against the bound model's embeddings as a base-model check.

Medusa-1: `config.json` with `medusa_num_heads`, `medusa_num_layers`; weights
`medusa_lm_head.pt` or `.safetensors` = the state dict of an `nn.ModuleList` of
`nn.Sequential(ResBlock x L, Linear(h, V, bias=False))` -> `{i}.{j}.linear.{weight,bias}`,
`{i}.{L}.weight` (an optional `medusa_head.` prefix is accepted). The published 7B config says
2 heads but the file holds 5: the count is taken from the weights, with a warning.

Unlike the published loaders (`load_state_dict(strict=False)`, which hides mismatches), every
missing or unexpected key and every shape mismatch is an error here. `.pt` files are read with
`torch.load(weights_only=True)`: a file carrying any pickled object other than tensors is refused.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.heads import DraftHeads, HeadsConfig, build_heads
from runtime.config import HYDRA_WEIGHTS, MEDUSA_WEIGHTS  # noqa: F401 - re-exported
from runtime.config import ModelArgs
from runtime.model.llama import Transformer

HYDRA_ARCHS = ("mlp", "prefix-mlp")


def load_torch_weights(path: str | Path) -> dict[str, Tensor]:
    """A `{name: tensor}` dict from a .pt file, never unpickling arbitrary objects."""
    path = Path(path)
    try:
        try:
            # memory-mapped: a tensor's bytes are read when it is converted, not all at once
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy (pre-zip) format
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} carries pickled Python objects besides tensors, and unpickling them could run "
            f"arbitrary code, so it is refused. A head checkpoint must be a plain state dict of "
            f"tensors (or a .safetensors file). Detail: {str(e).splitlines()[0]}") from e
    except RuntimeError as e:
        raise ValueError(f"{path} is not a readable torch checkpoint: {e}") from e
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        raise ValueError(f"{path} does not hold a state dict ({{name: tensor}}); got {type(obj).__name__}")
    return obj


def _load_weights_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return load_torch_weights(path)


def _read_config(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: a published head folder holds config.json and its weights file")
    return json.loads(f.read_text())


def _require(cfg: dict[str, Any], keys: tuple[str, ...], where: Path) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(f"{where}/config.json lacks {missing}")


def _indices(state: dict[str, Tensor], pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in state if (m := rx.match(k))})


def _count_heads(state: dict[str, Tensor], pattern: str, claimed: int, where: Path, key: str) -> int:
    found = _indices(state, pattern)
    if not found:
        raise ValueError(f"{where}: no head weights matching {pattern!r}")
    n = len(found)
    if found != list(range(n)):
        raise ValueError(f"{where}: head indices {found} are not 0..{n - 1}")
    if n != claimed:
        warnings.warn(f"{where}: config.json says {key}={claimed} but the weights hold {n} heads; using {n}",
                      stacklevel=3)
    return n


def _base_args(model: Transformer | None, base_args: ModelArgs | None) -> ModelArgs | None:
    return base_args if base_args is not None else (model.args if model is not None else None)


def _finish(config: HeadsConfig, state: dict[str, Tensor], where: str, model: Transformer | None,
            dtype: torch.dtype | None) -> DraftHeads:
    if model is not None and (model.args.dim, model.args.vocab_size) != (config.hidden_size, config.vocab_size):
        raise ValueError(f"{where}: heads have hidden size {config.hidden_size} and vocabulary {config.vocab_size}, "
                         f"the model {model.args.dim} and {model.args.vocab_size}: they belong to another base model")
    # built on meta, each weight cast and placed once: no fp32 random init of vocabulary-sized layers
    heads = build_heads(config, state, where, dtype or (model.dtype if model is not None else torch.float32),
                        model.device if model is not None else "cpu")
    if model is not None:
        heads.bind(model)
    return heads.eval().requires_grad_(False)


def _check_embeddings(embed: Tensor | None, model: Transformer | None, where: str) -> None:
    """The published Hydra file carries a copy of the base token embeddings: a free base-model check."""
    if embed is None or model is None:
        return
    ours = model.tok_embeddings.weight
    # a strided sample of rows, compared on the model's device: enough to tell another base model
    # apart without a float copy of a vocabulary-sized matrix
    rows = torch.arange(0, ours.shape[0], max(1, ours.shape[0] // 256), device=ours.device)
    if embed.shape != ours.shape or not torch.allclose(embed.to(ours.device)[rows].float(), ours[rows].float(),
                                                       rtol=1e-2, atol=1e-3):
        raise ValueError(f"{where}: the base token embeddings stored with the heads differ from the model's; "
                         "these heads were trained on another base model")


# ----------------------------------------------------------------------------------------------
# Hydra


def _prefix_state(state: dict[str, Tensor], args: ModelArgs, used: set[str]) -> dict[str, Tensor]:
    """Map `prefix_embeding_layer.*` (a one-layer HF LlamaModel) to our PrefixLayer's names."""
    p = "prefix_embeding_layer."

    def take(key: str) -> Tensor:
        k = p + key
        if k not in state:
            raise ValueError(f"missing keys ['{k}'] (the Hydra++ prefix layer)")
        used.add(k)
        return state[k]

    out = {
        "prefix.block.attention_norm.weight": take("layers.0.input_layernorm.weight"),
        "prefix.block.ffn_norm.weight": take("layers.0.post_attention_layernorm.weight"),
        "prefix.block.attention.wqkv.weight": torch.cat([take(f"layers.0.self_attn.{x}_proj.weight") for x in "qkv"]),
        "prefix.block.attention.wo.weight": take("layers.0.self_attn.o_proj.weight"),
        "prefix.block.feed_forward.w13.weight": torch.cat([take("layers.0.mlp.gate_proj.weight"),
                                                            take("layers.0.mlp.up_proj.weight")]),
        "prefix.block.feed_forward.w2.weight": take("layers.0.mlp.down_proj.weight"),
        "prefix.norm.weight": take("norm.weight"),
    }
    if args.qkv_bias:
        out["prefix.block.attention.wqkv.bias"] = torch.cat([take(f"layers.0.self_attn.{x}_proj.bias") for x in "qkv"])
    if args.o_bias:
        out["prefix.block.attention.wo.bias"] = take("layers.0.self_attn.o_proj.bias")
    return out


def load_published_hydra(folder: str | Path, model: Transformer | None = None, base_args: ModelArgs | None = None,
                         dtype: torch.dtype | None = None) -> DraftHeads:
    """Load a published Hydra / Hydra++ folder (config.json + hydra_lm_head.pt).

    Hydra++ (`prefix-mlp`) needs the base model's shapes: pass `model` (it is then bound too) or
    `base_args`."""
    folder = Path(folder)
    cfg = _read_config(folder)
    _require(cfg, ("hydra_num_heads", "hydra_num_layers", "hydra_head_arch"), folder)
    arch = cfg["hydra_head_arch"]
    if arch not in HYDRA_ARCHS:
        raise ValueError(f"{folder}: hydra_head_arch {arch!r} is not supported; supported: {HYDRA_ARCHS} "
                         "(cross-attention and EAGLE-style heads are different models)")
    if int(cfg.get("hidden_state_offset", 0)) != 0:
        raise ValueError(f"{folder}: hidden_state_offset={cfg['hidden_state_offset']} reads a hidden state below the "
                         "last layer; this runtime exposes only the final-normed one (offset 0)")
    grounded = bool(cfg.get("grounded_heads", False))
    dropout_layout = arch == "prefix-mlp"   # every block and the output sit behind an nn.Dropout
    wfile = folder / HYDRA_WEIGHTS
    if not wfile.is_file():
        raise FileNotFoundError(f"{wfile} not found")
    state = load_torch_weights(wfile)
    where = str(wfile)

    out_key = r"hydra_lm_head\.(\d+)\.1\.weight$" if dropout_layout else r"hydra_lm_head\.(\d+)\.weight$"
    n_heads = _count_heads(state, out_key, int(cfg["hydra_num_heads"]), folder, "hydra_num_heads")
    n_layers = int(cfg["hydra_num_layers"])
    lm0 = state[f"hydra_lm_head.0.{'1.' if dropout_layout else ''}weight"]
    vocab, hidden = lm0.shape

    used: set[str] = set()
    ours: dict[str, Tensor] = {}

    def move(src: str, dst: str) -> None:
        if src in state:  # absent keys are reported by the strict load, under our names
            used.add(src)
            ours[dst] = state[src]

    for i in range(n_heads):
        for j in range(n_layers):
            pos = 2 * j + 1 if dropout_layout else j
            for part in ("weight", "bias"):
                move(f"hydra_mlp.{i}.{pos}.linear.{part}", f"heads.{i}.blocks.{j}.linear.{part}")
                if j == 0 and grounded:
                    move(f"hydra_mlp.{i}.{pos}.res_connection.{part}", f"heads.{i}.blocks.0.residual.{part}")
        out = f"hydra_lm_head.{i}.{'1.' if dropout_layout else ''}"
        for part in ("weight", "bias"):
            move(out + part, f"heads.{i}.out.{part}")

    args = _base_args(model, base_args)
    if arch == "prefix-mlp":
        if args is None:
            raise ValueError(f"{folder} holds Hydra++ heads (prefix-mlp): pass the base model (or its ModelArgs as "
                             "base_args) so the prefix layer gets the base model's attention shapes")
        ours.update(_prefix_state(state, args, used))
        used.update(k for k in state if k.startswith("prefix_embeding_layer.embed_tokens."))
    used.update(k for k in state if k.endswith("rotary_emb.inv_freq"))
    embed = state.get("input_embed_fn.weight")
    if embed is not None:
        used.add("input_embed_fn.weight")
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ValueError(f"{where} has keys this Hydra layout ({arch}, {n_heads} heads x {n_layers} layers, "
                         f"grounded={grounded}) does not use: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    _check_embeddings(embed, model, where)

    config = HeadsConfig(
        hidden_size=int(hidden), vocab_size=int(vocab), kind="hydra" if grounded else "medusa",
        num_heads=n_heads, num_layers=n_layers, prefix_layer=arch == "prefix-mlp", output="own",
        output_bias=True, base_args=None if args is None else _asdict(args),
    )
    return _finish(config, ours, where, model, dtype)


def _asdict(args: ModelArgs) -> dict[str, Any]:
    return HeadsConfig.for_model(args).base_args


# ----------------------------------------------------------------------------------------------
# Medusa-1


def load_published_medusa(folder: str | Path, model: Transformer | None = None,
                          dtype: torch.dtype | None = None) -> DraftHeads:
    """Load a published Medusa-1 folder (config.json + medusa_lm_head.pt or .safetensors)."""
    folder = Path(folder)
    cfg = _read_config(folder)
    _require(cfg, ("medusa_num_heads",), folder)
    wfile = next((folder / n for n in MEDUSA_WEIGHTS if (folder / n).is_file()), None)
    if wfile is None:
        raise FileNotFoundError(f"{folder} holds none of {MEDUSA_WEIGHTS}")
    raw = _load_weights_file(wfile)
    state = {k.removeprefix("medusa_head."): v for k, v in raw.items()}
    where = str(wfile)
    n_heads = _count_heads(state, r"(\d+)\.\d+\.weight$", int(cfg["medusa_num_heads"]), folder, "medusa_num_heads")
    # the output Linear is the last module of each Sequential: its index is the number of ResBlocks
    outs = _indices({k: v for k, v in state.items() if k.startswith("0.") and not k.endswith("linear.weight")
                     and not k.endswith("linear.bias")}, r"0\.(\d+)\.weight$")
    if len(outs) != 1:
        raise ValueError(f"{where}: cannot tell the output layer of head 0 (candidates at positions {outs})")
    n_layers = outs[0]
    claimed = cfg.get("medusa_num_layers")
    if claimed is not None and int(claimed) != n_layers:
        warnings.warn(f"{folder}: config.json says medusa_num_layers={claimed} but the weights hold {n_layers}; "
                      f"using {n_layers}", stacklevel=2)
    if n_layers < 1:
        raise ValueError(f"{where}: Medusa heads without a ResBlock are not supported")
    ours: dict[str, Tensor] = {}
    used: set[str] = set()
    for i in range(n_heads):
        for j in range(n_layers):
            for part in ("weight", "bias"):
                k = f"{i}.{j}.linear.{part}"
                if k in state:
                    used.add(k)
                    ours[f"heads.{i}.blocks.{j}.linear.{part}"] = state[k]
        k = f"{i}.{n_layers}.weight"
        if k in state:
            used.add(k)
            ours[f"heads.{i}.out.weight"] = state[k]
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ValueError(f"{where} has keys this Medusa layout ({n_heads} heads x {n_layers} layers) does not use: "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    vocab, hidden = state[f"0.{n_layers}.weight"].shape
    config = HeadsConfig(hidden_size=int(hidden), vocab_size=int(vocab), kind="medusa", num_heads=n_heads,
                         num_layers=n_layers, output="own", output_bias=False)
    return _finish(config, ours, where, model, dtype)


def load_published(folder: str | Path, model: Transformer | None = None, base_args: ModelArgs | None = None,
                   dtype: torch.dtype | None = None) -> DraftHeads:
    """Detect the layout from config.json (hydra_* or medusa_* keys) and load it."""
    folder = Path(folder)
    cfg = _read_config(folder)
    if "hydra_num_heads" in cfg:
        return load_published_hydra(folder, model, base_args, dtype)
    if "medusa_num_heads" in cfg:
        return load_published_medusa(folder, model, dtype)
    raise ValueError(f"{folder}/config.json has neither hydra_num_heads nor medusa_num_heads: not a published "
                     "Hydra or Medusa head folder (our own heads load with runtime.heads.load_heads)")
