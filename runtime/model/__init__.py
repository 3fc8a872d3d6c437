"""The base model: a compact Llama-family decoder, its row-invariant and batched forwards, the
small-row CPU kernels and Hugging Face checkpoint reading.

* `llama`: the layers, the KV cache and the plain forward pass (`Transformer`);
* `invariant`: the row-invariant forward of `lossless: exact` (`Transformer.set_row_invariance`);
* `batch`: several sequences verified in one forward (`Transformer.forward_batch`, `BatchItem`);
* `rope`: rotary position embeddings; `checkpoint`: `load_model`, `load_tokenizer`;
* `small_rows`: the float32 CPU kernels for a decode step's few rows (`csrc/small_rows.c`).
"""

from typing import Any

# where each public name lives; imported on first use, so that importing `runtime.model.small_rows`
# (the kernel id an up-to-date check reads) does not load torch
_HOMES = {"BatchItem": "runtime.model.batch", "KVCache": "runtime.model.cache", "ModelArgs": "runtime.config",
          "Transformer": "runtime.model.llama", "load_model": "runtime.model.checkpoint",
          "load_tokenizer": "runtime.model.checkpoint"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'runtime.model' has no attribute {name!r}")
