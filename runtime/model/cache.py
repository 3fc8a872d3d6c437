"""A sequence's KV cache, shared by the model's forwards (`runtime.model.llama`) and the batched
forward (`runtime.model.batch`)."""

from __future__ import annotations

from torch import Tensor


class KVCache:
    """One sequence's KV cache: kv [n_layers, 2, kv_heads, capacity, head_dim] (each layer's
    slice a contiguous view, as the attention kernels read it) and the number of committed
    positions. A model decodes into the one `Transformer.use_cache` names; a batch keeps one per
    sequence (`Transformer.forward_batch`)."""

    def __init__(self, kv: Tensor) -> None:
        self.kv = kv
        self.layers = list(kv.unbind(0))  # views, so the big tensor stays the one truth
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions it holds."""
        return self.kv.shape[3]

    def copy_prefix(self, other: KVCache, length: int) -> None:
        """Take `other`'s first `length` committed positions as this cache's only ones: the prefill of
        a prompt that another sequence of the batch has already run (the same forward would write
        the same values)."""
        if not 0 <= length <= min(other.length, self.capacity):
            raise ValueError(f"cannot copy {length} positions from a cache of {other.length} into one of "
                             f"capacity {self.capacity}")
        if self.kv.shape[:3] != other.kv.shape[:3] or self.kv.shape[4:] != other.kv.shape[4:] \
                or self.kv.dtype != other.kv.dtype:
            raise ValueError(f"caches of different models: {tuple(self.kv.shape)} {self.kv.dtype} vs "
                             f"{tuple(other.kv.shape)} {other.kv.dtype}")
        self.kv[:, :, :, :length].copy_(other.kv[:, :, :, :length])
        self.length = length
