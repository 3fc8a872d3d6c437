"""The base model: a compact Llama-family decoder, its row-invariant and batched forwards, the
small-row CPU kernels and Hugging Face checkpoint reading."""

from runtime.model.llama import BatchItem, KVCache, ModelArgs, Transformer, load_model, load_tokenizer

__all__ = ["BatchItem", "KVCache", "ModelArgs", "Transformer", "load_model", "load_tokenizer"]
