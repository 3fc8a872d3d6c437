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
