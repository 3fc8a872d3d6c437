"""Compact Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) for tree-speculative decoding: its
layers, its KV cache and the plain forward pass.

Batch size 1. The KV cache is preallocated once for every layer, in one tensor
`[layers, 2 (K/V), kv_heads, max_seq_len, head_dim]`, so that compacting it after a tree verify
is a single gather. A forward call appends its n new tokens at cache slots
`cache_len .. cache_len+n-1` (in input order); each new token attends to every committed slot and,
among the new ones, to those its row of `mask` allows. Positions are explicit, so a tree node at
depth d sits at RoPE position `cache_len + d` while occupying any slot.

On CPU in float32, `load_model` also keeps a transposed copy of every weight matrix, because the
one-token product is markedly faster against it (see `Linear`); pass fast_paths=False to save
that memory.

Two more forwards run over the same modules, each in a module of its own whose mixins the classes
here inherit: the row-invariant forward of `lossless: exact` (`runtime.model.invariant`), which
`Transformer.forward` takes when `set_row_invariance` is on, and the batched verify of several
sequences (`runtime.model.batch`). RoPE is `runtime.model.rope`, checkpoint loading
`runtime.model.checkpoint`, the small-row CPU kernels `runtime.model.small_rows`.

Only torch is imported here (the runtime's dependency rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import ModelArgs
from runtime.model import small_rows
from runtime.model.batch import BatchAttention, BatchBlock, BatchTransformer
from runtime.model.cache import KVCache
from runtime.model.invariant import (
    InvariantAttention,
    InvariantBlock,
    InvariantTransformer,
)
from runtime.model.rope import apply_rope, rope_tables

# ----------------------------------------------------------------------------------------------
# Layers. Inside the model activations are 2-D [n, dim]: batch size is always 1, and a plain
# matrix product is the cheapest call on the one-token path.


# Rows up to which `Linear` multiplies as W @ x^T (see there).
SMALL_ROWS = 32
# Rows up to which `Linear` uses the small-row kernel: on a 2-core AVX2 EPYC it beat MKL's F.linear
# over SmolLM2's layer products at every count measured, 2.6x at 17 rows, 1.5x at 128.
KERNEL_ROWS = 128


def _needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd would track an op on these (the C kernels have no backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class Linear(nn.Linear):
    """nn.Linear that picks its matrix product by the number of input rows once `add_fast_paths`
    ran (CPU, float32):
    * with `runtime.model.small_rows` available (x86-64 with AVX2 + FMA and a C compiler), 1..KERNEL_ROWS
      rows go through its kernel against a packed copy of the weight: one pass over the weights
      for all rows, and each row's result independent of the row count. On a 2-core AVX2 EPYC the
      whole SmolLM2 forward at context 300 took 58 / 64 / 79 / 89 ms for 1 / 3 / 5 / 9 new rows,
      side by side against 80 / 121 / 120 / 161 ms with the MKL products below;
    * otherwise, measured with MKL on the same machines: one row as x @ W_t with a contiguous
      [in, out] copy W_t (1.2-2x faster than F.linear), 2..SMALL_ROWS rows as (W @ x^T)^T (one
      pass over W for all rows, 1.2-1.8x faster; a transposed view, which the callers accept);
    * more rows (prefill): F.linear.
    Either copy doubles the weight memory. Results differ from F.linear's by float rounding only
    (~1e-6 relative). Without `add_fast_paths` (GPU, bf16) it is exactly nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # buffers, so .to(device) moves them
        self.register_buffer("weight_t", None, persistent=False)
        self.register_buffer("weight_packed", None, persistent=False)

    def add_fast_paths(self, kernel: bool = True) -> None:
        """Keep the packed (or transposed) copy; call again if the weight changes (the runtime never
        trains). Does nothing unless the weight is float32 on the CPU. kernel: use the small-row
        kernel where it is available (False: torch's products, e.g. to compare)."""
        w = self.weight.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return
        if kernel and small_rows.available():
            self.weight_packed, self.weight_t = small_rows.pack(w), None
        else:
            self.weight_packed, self.weight_t = None, w.t().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        # (the weight's dtype too: after a cast to bf16 the copies are bf16 and not for these paths)
        if x.dim() == 2 and x.dtype == self.weight.dtype == torch.float32 and not _needs_grad(x, self.weight):
            if self.weight_packed is not None and x.shape[0] <= KERNEL_ROWS and x.device.type == "cpu":
                y = small_rows.matmul(x, self.weight_packed, self.out_features)
                return y if self.bias is None else y + self.bias
            if self.weight_t is not None and x.shape[0] <= SMALL_ROWS:
                y = x @ self.weight_t if x.shape[0] == 1 else (self.weight @ x.t()).t()
                return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.use_kernel = False  # set by Transformer.add_fast_paths where the small-row kernels run

    def forward(self, x: Tensor) -> Tensor:
        # on a CPU in float32 (inference) the small-row kernel's norm: torch's runs as five ops,
        # ~70 us a row, some 60 times a forward
        if (self.use_kernel and x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
                and not _needs_grad(x, self.weight)):
            return small_rows.rms_norm(x, self.weight, self.eps)
        # it computes the statistics in float32 for bf16/fp16 inputs too
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def qkv_into_cache(wqkv: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, start: int, n_heads: int,
                   n_kv_heads: int, head_dim: int) -> Tensor:
    """The rotated queries [n, n_heads, head_dim] of x [n, in] through the fused q/k/v product `wqkv`;
    the rotated keys and the values go to slots start..start+n-1 of the layer cache kv [2, kv_heads,
    slots, head_dim]."""
    n = x.shape[0]
    qkv = wqkv(x).view(n, n_heads + 2 * n_kv_heads, head_dim)
    qk = apply_rope(qkv[:, : n_heads + n_kv_heads], cos, sin).to(x.dtype)
    kv[0, :, start:start + n] = qk[:, n_heads:].transpose(0, 1)
    kv[1, :, start:start + n] = qkv[:, n_heads + n_kv_heads:].transpose(0, 1)
    return qk[:, :n_heads]


class Attention(InvariantAttention, BatchAttention, nn.Module):
    """Grouped-query self-attention over one layer's KV cache (`forward`, through SDPA); the
    row-invariant and batched forwards over the same weights come from the mixins."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v in one matrix product: one call instead of three on the latency-bound path
        self.wqkv = Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, start: int, mask: Tensor | None) -> Tensor:
        """x [n, dim]; kv is this layer's cache [2, kv_heads, max_seq, head_dim]; mask [groups*n, start+n]
        (rows ordered group-major, see `Transformer._attention_mask`) or None = attend to everything."""
        n = x.shape[0]
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qk, end = qkv_into_cache(self.wqkv, x, cos, sin, kv, start, h, kvh, hd), start + n
        # GQA without copying K/V: the query heads sharing a KV head are stacked along the query
        # axis, so attention runs per KV head over [groups*n] query rows.
        # (4-D inputs: SDPA's fused CPU kernel only takes those; 3-D ones fall back to the math path)
        groups = h // kvh
        q = qk.view(n, kvh, groups, hd).permute(1, 2, 0, 3).reshape(1, kvh, groups * n, hd)
        out = F.scaled_dot_product_attention(q, kv[None, 0, :, :end], kv[None, 1, :, :end], attn_mask=mask)
        out = out.view(kvh, groups, n, hd).permute(2, 0, 1, 3).reshape(n, h * hd)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(InvariantBlock, BatchBlock, nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, start: int, mask: Tensor | None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, start, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(InvariantTransformer, BatchTransformer, nn.Module):
    """Llama-family causal LM, batch size 1, with a preallocated KV cache (see module docstring).
    `set_row_invariance` and `forward_batch` come from the mixins (runtime.model.invariant, .batch)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # an inference runtime: the base model is frozen, so no autograd graph is ever built
        self.requires_grad_(False)
        self.register_buffer("kv_cache", None, persistent=False)
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self._cache: KVCache | None = None  # the sequence that forwards read and extend (`use_cache`)
        self.max_seq_len = 0
        self.invariant_rows: int | None = None  # see set_row_invariance
        self._kernel_decode = False  # see kernel_decode
        # residual streams a drafter reads (see `capture_aux`): layer id -> place in aux_features
        self.aux_layer_ids: tuple[int, ...] = ()
        self._aux_index: dict[int, int] | None = None
        self.aux_features: Tensor | None = None

    # -- cache ------------------------------------------------------------------------------

    def setup_cache(self, max_seq_len: int) -> None:
        """Allocate the KV cache for `max_seq_len` positions (in the weights' dtype) and empty it."""
        if not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        a = self.args
        if max_seq_len > a.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{a.max_position_embeddings}; ask for a shorter cache")
        if a.sliding_window is not None and max_seq_len > a.sliding_window:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the sliding window {a.sliding_window}, "
                             "which this runtime does not implement; ask for a shorter cache")
        weight = self.output.weight
        self.max_seq_len = max_seq_len
        self.use_cache(self.new_cache())
        self.rope_cos, self.rope_sin = rope_tables(a, max_seq_len, weight.device)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache of another sequence for `capacity` positions (default: this model's
        `max_seq_len`, the most it may hold): a batch holds one per sequence, each as large as
        that sequence needs (zeroing a full-length cache per sequence costs more than its
        prefill), and `use_cache` says which one the single-sequence calls use."""
        if self.max_seq_len == 0:
            raise RuntimeError("the KV cache is not allocated: call setup_cache(max_seq_len) first")
        capacity = self.max_seq_len if capacity is None else capacity
        if not 1 <= capacity <= self.max_seq_len:
            raise ValueError(f"a KV cache of {capacity} positions: give 1 to max_seq_len ({self.max_seq_len})")
        a, weight = self.args, self.output.weight
        return KVCache(torch.zeros(a.n_layers, 2, a.n_kv_heads, capacity, a.head_dim,
                                   dtype=weight.dtype, device=weight.device))

    def use_cache(self, cache: KVCache) -> None:
        """Make `cache` the one that `forward`, `compact_cache`, `truncate_cache` ... read and extend."""
        self._cache = cache
        self.kv_cache = cache.kv

    @property
    def cache(self) -> KVCache | None:
        """The KV cache in use (see `use_cache`)."""
        return self._cache

    @property
    def _cache_len(self) -> int:
        return self._cache.length if self._cache is not None else 0

    @_cache_len.setter
    def _cache_len(self, value: int) -> None:
        assert self._cache is not None, "no KV cache in use"
        self._cache.length = int(value)

    @property
    def _layer_caches(self) -> list[Tensor]:
        return self._cache.layers if self._cache is not None else []

    @property
    def cache_len(self) -> int:
        """Number of committed positions in the KV cache."""
        return self._cache_len

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    def reset_cache(self) -> None:
        self._cache_len = 0

    def add_fast_paths(self, kernel: bool = True) -> None:
        """Switch every Linear to the row-count-dependent products (worth it on CPU in float32;
        costs a second copy of the weights, see `Linear`); `kernel` as in `Linear.add_fast_paths`."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for module in linears:
            module.add_fast_paths(kernel)
        self._kernel_decode = all(m.weight_packed is not None for m in linears)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.use_kernel = self._kernel_decode

    @property
    def kernel_decode(self) -> bool:
        """Whether decode forwards run on `runtime.model.small_rows` (float32 on an AVX2 CPU, after
        `add_fast_paths`): every product, norm and attention row-invariant by construction, so
        each decode forward takes the row-invariant path at no extra cost, under either lossless
        mode (the arithmetic is the same: AR and tree verify agree bit for bit)."""
        return self._kernel_decode and self.dtype == torch.float32 and self.device.type == "cpu"

    @property
    def kernel_rows(self) -> int:
        """The most rows one product of a Linear runs through the small-row kernel (`KERNEL_ROWS`;
        read here, where `Linear` reads it, for `forward_batch`)."""
        return KERNEL_ROWS

    def truncate_cache(self, length: int) -> None:
        """Forget every slot from `length` on."""
        if not 0 <= length <= self._cache_len:
            raise ValueError(f"cannot truncate the cache to {length}: it holds {self._cache_len} positions")
        self._cache_len = int(length)

    def keep_cache(self, start: int, keep: Tensor) -> None:
        """After a tree verify: move slots `start + keep[i]` to `start + i` for every layer in one
        gather, then set cache_len = start + len(keep). `keep` must be increasing offsets (a path
        root..leaf in node order). Checks the offsets' values, which reads them on the host; the
        decoder's step uses `compact_cache`, whose indices come checked with the compiled tree."""
        if keep.dim() != 1 or keep.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"keep must be a 1-D integer tensor, got shape {tuple(keep.shape)} dtype {keep.dtype}")
        if not 0 <= start <= self._cache_len:
            raise ValueError(f"start {start} is outside the committed cache [0, {self._cache_len}]")
        m, avail = keep.numel(), self._cache_len - start
        if m > avail:
            raise ValueError(f"cannot keep {m} slots: only {avail} were written after start {start}")
        if m:
            lo, hi = int(keep.min()), int(keep.max())
            if lo < 0 or hi >= avail:
                raise ValueError(f"keep offsets must lie in [0, {avail}); got min {lo} max {hi}")
            self.compact_cache(start, keep.to(device=self.kv_cache.device, dtype=torch.int64))
        self._cache_len = start + m

    def compact_cache(self, start: int, offsets: Tensor) -> None:
        """Copy slots `start + offsets[i]` to `start + i` (all layers, one gather) and set cache_len
        = start + len(offsets). `offsets` is an int64 tensor on the cache's device whose values are
        trusted (they are not read on the host, so that this never waits for the device): each must
        lie in [0, cache_len - start). The copy goes through a gathered temporary, so any order of
        offsets is safe. Shorten afterwards with `truncate_cache` when only a prefix is kept."""
        m, avail = offsets.numel(), self._cache_len - start
        if offsets.dim() != 1 or offsets.dtype != torch.int64 or offsets.device != self.kv_cache.device:
            raise ValueError(f"offsets must be a 1-D int64 tensor on {self.kv_cache.device}, got "
                             f"{tuple(offsets.shape)} {offsets.dtype} on {offsets.device}")
        if not 0 <= start <= self._cache_len or m > avail:
            raise ValueError(f"cannot compact {m} slots after start {start}: the cache holds {self._cache_len}")
        if m:
            self.kv_cache[:, :, :, start:start + m] = self.kv_cache.index_select(3, offsets + start)
        self._cache_len = start + m

    # -- auxiliary features (an EAGLE-3 drafter's input) ---------------------------------------

    def capture_aux(self, ids: Sequence[int] | None) -> None:
        """Make every forward (`forward` on any of its paths, `forward_batch`) leave in
        `aux_features` [rows, k*dim] the residual streams ENTERING layers `ids` (id i: the token
        embeddings for i = 0, the output of layer i - 1 otherwise; Hugging Face's
        `output_hidden_states[i]`), concatenated in the order given, for the call's real rows in
        input order (a row-invariant forward's pad rows are left out; `forward_batch`: its items'
        rows one after the other). They come from the same forward that computes the logits, so a
        drafter reads them at no extra pass; in a row-invariant arithmetic a row's features are,
        like its logits, the same whatever else the call holds. None or () turns capture off
        (nothing is kept then, at no cost)."""
        ids = tuple(int(i) for i in ids) if ids else ()
        if any(not 0 <= i < self.args.n_layers for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids {list(ids)}: give distinct ids of the model's layers 0..{self.args.n_layers - 1} "
                             "(id i = the input of layer i)")
        self.aux_layer_ids = ids
        self._aux_index = {i: k for k, i in enumerate(ids)} or None
        self.aux_features = None

    def _run_layers(self, x: Tensor, rows: int, layer_call: Callable[[int, nn.Module, Tensor], Tensor]) -> Tensor:
        """x through every layer (`layer_call(i, layer i, x)`); with capture on, the inputs of the
        `aux_layer_ids` layers (their first `rows` rows) become `aux_features`."""
        index = self._aux_index
        captured: list[Tensor] = [x] * (0 if index is None else len(index))
        for i, layer in enumerate(self.layers):
            if index is not None and i in index:
                captured[index[i]] = x
            x = layer_call(i, layer, x)
        if index is not None:
            self.aux_features = torch.cat([c[:rows] for c in captured], dim=-1)
        return x

    # -- forward ----------------------------------------------------------------------------

    @staticmethod
    def _check_mask(mask: Tensor | None, n: int, check: bool) -> None:
        if mask is not None:
            if mask.shape != (n, n) or mask.dtype != torch.bool:
                raise ValueError(f"mask must be a bool tensor of shape ({n}, {n}), got {tuple(mask.shape)} "
                                 f"{mask.dtype}")
            if check and not bool(mask.diagonal().all()):
                raise ValueError("mask must let every new token attend to itself (its diagonal must be True)")

    def _attention_mask(self, mask: Tensor | None, start: int, n: int) -> Tensor | None:
        """Boolean mask [groups*n, start+n] for SDPA (True = may attend), or None for one token
        that sees everything. Built once per call and shared by all layers."""
        if n == 1:
            return None
        full = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
        if mask is None:
            full[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        else:
            full[:, start:] = mask
        groups = self.args.n_groups
        return full.repeat(groups, 1) if groups > 1 else full

    def forward(self, tokens: Tensor, input_pos: Tensor, mask: Tensor | None = None,
                last_only: bool = False, check_mask: bool = True,
                ancestors: list[list[int]] | None = None) -> tuple[Tensor, Tensor]:
        """Run n new tokens. tokens [1, n] (int64), input_pos [n] absolute RoPE positions, mask
        [n, n] bool over the new tokens (None = causal). Appends their K/V after the committed
        cache and advances cache_len by n. check_mask=False skips the check that the mask's
        diagonal is set, which reads it on the host: for masks checked once already (a compiled
        tree's, see `runtime.tree.TreeBuffers`). `ancestors` (the mask as lists, `TreeBuffers.
        ancestor_lists`) spares the row-invariant forward its read of the mask on the host.

        Returns (logits [1, n, V] float32, hidden [1, n, dim]) where hidden is the final-normed
        state the lm_head reads. With last_only=True the logits are for the last token only
        ([1, 1, V]); hidden is still returned for all n (a prefill needs only one row of logits).
        With `capture_aux` on, `aux_features` then holds the n rows' drafter features.
        """
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated: call setup_cache(max_seq_len) first")
        if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must have shape [1, n] with n >= 1 (batch size 1), got {tuple(tokens.shape)}")
        n = tokens.shape[1]
        if input_pos.shape != (n,):
            raise ValueError(f"input_pos must have shape [{n}], got {tuple(input_pos.shape)}")
        start, capacity = self._cache_len, self._cache.capacity
        if start + n > capacity:
            raise ValueError(f"the KV cache holds {capacity} positions; {start} are used and {n} more "
                             "do not fit. Call setup_cache with a larger max_seq_len (or truncate/reset the cache)")
        self._check_mask(mask, n, check_mask and ancestors is None)
        if (self.invariant_rows is not None or self.kernel_decode) and (mask is not None or n == 1):
            return self._forward_invariant(tokens, input_pos, mask, last_only, ancestors)
        attn_mask = self._attention_mask(mask, start, n)
        cos = self.rope_cos[input_pos].unsqueeze(1)
        sin = self.rope_sin[input_pos].unsqueeze(1)

        x = self.tok_embeddings(tokens[0])
        caches = self._layer_caches
        x = self._run_layers(x, n, lambda i, layer, x: layer(x, cos, sin, caches[i], start, attn_mask))
        self._cache_len = start + n
        hidden = self.norm(x)
        logits = self.output(hidden[-1:] if last_only else hidden).float()
        return logits.unsqueeze(0), hidden.unsqueeze(0)
