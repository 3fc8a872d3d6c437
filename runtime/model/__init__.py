"""The base model: a compact Llama-family decoder, its row-invariant and batched forwards, the
small-row CPU kernels and Hugging Face checkpoint reading.

* `llama`: the layers, the KV cache and the plain forward pass (`Transformer`);
* `invariant`: the row-invariant forward of `lossless: exact` (`Transformer.set_row_invariance`);
* `batch`: several sequences verified in one forward (`Transformer.forward_batch`, `BatchItem`);
* `rope`: rotary position embeddings; `checkpoint`: `load_model`, `load_tokenizer`;
* `small_rows`: the float32 CPU kernels for a decode step's few rows (`csrc/small_rows.c`).
"""

from runtime.config import ModelArgs
from runtime.model.batch import BatchItem
from runtime.model.cache import KVCache
from runtime.model.checkpoint import load_model, load_tokenizer
from runtime.model.llama import Transformer

__all__ = ["BatchItem", "KVCache", "ModelArgs", "Transformer", "load_model", "load_tokenizer"]
