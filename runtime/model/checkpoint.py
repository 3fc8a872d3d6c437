"""Loading a Hugging Face Llama-family model folder: config.json (with the extra stop tokens of
generation_config.json) into `ModelArgs`, the safetensors weights (one file, or shards named by
`model.safetensors.index.json`; never pickle) into a `Transformer`, and tokenizer.json.

`load_model` builds the module on the `meta` device (no memory, no random init) and reads the
weights one tensor at a time, each cast and placed directly on the target device (q/k/v and
gate/up fused into preallocated matrices part by part), so the host never holds more than the
weights already placed plus one tensor. It also sets torch's CPU threads to every core this process
may use (once per process) and, on a CPU in float32, adds the fast paths of
`runtime.model.llama.Linear`.

Only torch, safetensors and tokenizers are imported here (the runtime's dependency rule).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.config import DTYPES, ModelArgs
from runtime.model.llama import Transformer

SUPPORTED_DTYPES = tuple(getattr(torch, d) for d in DTYPES)


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (containers, taskset)
    except AttributeError:
        return os.cpu_count() or 1


_THREADS_SET = False


def _set_threads_once() -> None:
    global _THREADS_SET
    if not _THREADS_SET:
        torch.set_num_threads(_threads())
        _THREADS_SET = True


def _read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: pass a Hugging Face model folder (config.json + safetensors)")
    cfg = json.loads(cfg_file.read_text())
    # the generation config may add stop tokens (e.g. chat models that end turns with a second id)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        extra = json.loads(gen_file.read_text()).get("eos_token_id")
        base = cfg.get("eos_token_id")
        ids = [] if base is None else [base] if isinstance(base, int) else list(base)
        for t in [] if extra is None else [extra] if isinstance(extra, int) else extra:
            if t not in ids:
                ids.append(t)
        cfg = {**cfg, "eos_token_id": ids}
    return cfg


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; this runtime loads safetensors only (no pickle)")
    return files


class _CheckpointReader:
    """Reads a model folder's safetensors one tensor at a time, single-file or sharded (a
    `model.safetensors.index.json` names each tensor's shard).

    Each read opens its file, copies the one tensor out and closes it again: the memory-mapped
    pages of a shard are released after every tensor instead of accumulating to the whole shard,
    so the host never holds more than the weights already placed plus one tensor in flight."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        index = path / "model.safetensors.index.json"
        self.file_of: dict[str, Path] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map; is it a Hugging Face sharded-checkpoint index?")
            for key, name in weight_map.items():
                f = path / name
                if not f.is_file():
                    raise FileNotFoundError(f"{index} names shard {name} for {key}, but {f} does not exist")
                self.file_of[key] = f
        else:
            for f in _safetensors_files(path):
                with safe_open(str(f), framework="pt") as st:
                    for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                        self.file_of[key] = f

    def shape(self, key: str) -> list[int]:
        with self._open(str(self.file_of[key]), framework="pt") as st:
            return list(st.get_slice(key).get_shape())

    def read(self, key: str) -> Tensor:
        with self._open(str(self.file_of[key]), framework="pt") as st:
            return st.get_tensor(key)


# HF checkpoint keys that carry no weights we need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _load_hf_weights(reader: _CheckpointReader, args: ModelArgs, dtype: torch.dtype,
                     device: torch.device) -> dict[str, Tensor]:
    """This module's state dict from a HF Llama/Qwen2 checkpoint, every tensor made directly in
    `dtype` on `device`; q/k/v and gate/up are fused into preallocated matrices part by part."""
    used: set[str] = set()

    def check(key: str) -> None:
        if key not in reader.file_of:
            raise ValueError(f"checkpoint lacks {key!r}; is it a {args.n_layers}-layer Llama-family model?")
        used.add(key)

    def take(key: str) -> Tensor:
        check(key)
        return reader.read(key).to(device=device, dtype=dtype)

    def fused(keys: list[str]) -> Tensor:
        for k in keys:
            check(k)
        shapes = [reader.shape(k) for k in keys]
        rows = sum(s[0] for s in shapes)
        out = torch.empty(rows, *shapes[0][1:], dtype=dtype, device=device)
        at = 0
        for k, shape in zip(keys, shapes):
            if list(shape[1:]) != list(shapes[0][1:]):
                raise ValueError(f"checkpoint tensor {k} has shape {shape}, which cannot be stacked with "
                                 f"{keys[0]} {shapes[0]}")
            out[at:at + shape[0]].copy_(reader.read(k))  # converts dtype and moves in one copy
            at += shape[0]
        return out

    out = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        out[q + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        out[q + "attention.wqkv.weight"] = fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"])
        if args.qkv_bias:
            out[q + "attention.wqkv.bias"] = fused([p + f"self_attn.{x}_proj.bias" for x in "qkv"])
        out[q + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        if args.o_bias:
            out[q + "attention.wo.bias"] = take(p + "self_attn.o_proj.bias")
        out[q + "feed_forward.w13.weight"] = fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        out[q + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
    if args.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints still store a copy; the embedding wins, as in HF
        out["output.weight"] = out["tok_embeddings.weight"]
    elif "lm_head.weight" in reader.file_of:
        out["output.weight"] = take("lm_head.weight")
    else:
        raise ValueError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
    unexpected = sorted(k for k in set(reader.file_of) - used if not k.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint has weights this runtime does not know: {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    return out


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, max_seq_len: int = 2048,
               device: str | torch.device = "cpu", fast_paths: bool | None = None) -> Transformer:
    """Load a Hugging Face Llama-family folder (config.json + *.safetensors, one file or shards
    with `model.safetensors.index.json`) and allocate its cache.

    The module is built on the `meta` device (no memory, no random init) and takes the weights
    with `load_state_dict(assign=True)`; each weight is read, cast and placed on `device` one
    tensor at a time, so the host holds at most the weights (on a CPU) plus one tensor.

    fast_paths: keep transposed weight copies for faster CPU decoding (see `Linear`); None = on
    for float32 on CPU, where it was measured to pay off, off otherwise."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    _set_threads_once()
    path = Path(path)
    device = torch.device(device)
    args = ModelArgs.from_hf_config(_read_config(path))
    state = _load_hf_weights(_CheckpointReader(path), args, dtype, device)
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    if args.tie_embeddings:  # assign=True replaced the embedding Parameter; point the head at it again
        model.output.weight = model.tok_embeddings.weight
    model.requires_grad_(False)
    model.eval()
    if fast_paths is None:
        fast_paths = dtype == torch.float32 and model.device.type == "cpu"
    if fast_paths:
        model.add_fast_paths()
    model.setup_cache(max_seq_len)
    return model


def load_tokenizer(path: str | Path):  # -> tokenizers.Tokenizer
    """The fast tokenizer of a model folder (or a tokenizer.json path)."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: the runtime needs the model's tokenizer.json")
    return Tokenizer.from_file(str(file))
