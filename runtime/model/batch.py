"""Batched verify: the new tokens of several sequences, each with its own KV cache, in one forward
(`Transformer.forward_batch`).

It is the row-invariant forward (`runtime.model.invariant`) over all the sequences' rows at once:
every matrix product computes a row the same way whatever rows share the call, and each sequence's
rows write and attend over their own cache with their own `RowPlan`, so each sequence gets bit for
bit what it gets decoded alone (batch invariance by construction). What a batch buys is the
products: on a memory-bound step the weights are read once for every sequence.

The classes here are mixins that `runtime.model.llama`'s Attention, TransformerBlock and
Transformer inherit; this module imports llama.py for type checking only (llama.py imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from runtime.model.cache import KVCache
from runtime.model.invariant import RowPlan, by_row_blocks, row_plan
from runtime.model.rope import apply_rope


@dataclass
class BatchItem:
    """One sequence's part of `Transformer.forward_batch`: its cache, new tokens [n] (int64),
    their absolute positions [n], and each token's ancestors among them (increasing, itself last;
    a compiled tree's `TreeBuffers.ancestor_lists`)."""

    cache: KVCache
    tokens: Tensor
    positions: Tensor
    ancestors: list[list[int]]


# a row-invariant way to run a per-row module (a Linear, the feed-forward) over many rows
RowProducts = Callable[[nn.Module, Tensor], Tensor]


class BatchAttention:
    """`Attention`'s batched forward (mixed into `runtime.model.llama.Attention`; the attention
    itself is `InvariantAttention._attend`)."""

    def forward_batch(self, x: Tensor, cos: Tensor, sin: Tensor, kvs: list[Tensor], plans: list[RowPlan],
                      bounds: list[tuple[int, int]], prod: RowProducts) -> Tensor:
        """`forward_invariant` for the rows of several sequences at once: x [rows, dim] holds sequence
        i's rows at bounds[i] (then padding); each sequence writes its K/V into its own layer cache
        kvs[i] and attends over it with its own plan, exactly as it would alone. The products run
        over all rows together, through `prod` (row-invariant)."""
        rows = x.shape[0]
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = prod(self.wqkv, x).view(rows, h + 2 * kvh, hd)
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(x.dtype)
        out = qk.new_zeros(rows, h, hd)
        for kv, plan, (a, b) in zip(kvs, plans, bounds):
            at, real = plan.write_at, plan.real
            kv[0, :, at:at + real] = qk[a:b, h:].transpose(0, 1)
            kv[1, :, at:at + real] = qkv[a:b, h + kvh:].transpose(0, 1)
            out[a:b] = self._attend(qk[a:b, :h], kv, plan)
        return prod(self.wo, out.view(rows, h * hd))


class BatchBlock:
    """`TransformerBlock`'s batched forward (mixed into `runtime.model.llama.TransformerBlock`)."""

    def forward_batch(self, x: Tensor, cos: Tensor, sin: Tensor, kvs: list[Tensor], plans: list[RowPlan],
                      bounds: list[tuple[int, int]], prod: RowProducts) -> Tensor:
        x = x + self.attention.forward_batch(self.attention_norm(x), cos, sin, kvs, plans, bounds, prod)
        return x + prod(self.feed_forward, self.ffn_norm(x))


class BatchTransformer:
    """`Transformer.forward_batch` (mixed into `runtime.model.llama.Transformer`, whose modules, RoPE
    tables and row-invariance settings it uses)."""

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[BatchItem]) -> list[tuple[Tensor, Tensor]]:
        """Verify the new tokens of several sequences in one forward: item i appends its tokens
        [n_i] at positions [n_i] to its own KV cache (`KVCache`), each token attending to that
        cache's committed prefix and to its ancestors among the item's tokens (`ancestors`, itself
        last). Returns per item (logits [n_i, V] float32, hidden [n_i, dim]); with `capture_aux`
        on, `aux_features` holds the items' feature rows one item after the other.

        Needs the row-invariant arithmetic (`set_row_invariance`, or the small-row kernels): every
        matrix product then computes a row the same way whatever rows share the call, and every row
        attends over exactly the keys, in the order, that the same sequence decoded alone would, so
        each item's results are bit-identical to `forward` on that sequence alone (batch
        invariance by construction). The matrix products run once over all rows, which is what a
        batch buys: on a memory-bound step the weights are read once for every sequence."""
        if self.invariant_rows is None and not self.kernel_decode:
            raise RuntimeError("forward_batch needs the row-invariant arithmetic: call set_row_invariance(rows) first "
                               "(lossless: exact), or decode the sequences one by one")
        if not items:
            raise ValueError("forward_batch needs at least one item")
        kernel = self.kernel_decode
        block = 1 if kernel else self.invariant_rows
        dev = self.device
        plans, bounds, tokens, positions = [], [], [], []
        row = 0
        for it in items:
            n = it.tokens.shape[0]
            if n == 0 or it.positions.shape != (n,) or len(it.ancestors) != n:
                raise ValueError(f"a batch item needs n >= 1 tokens with n positions and n ancestor lists, got "
                                 f"{tuple(it.tokens.shape)}, {tuple(it.positions.shape)}, {len(it.ancestors)}")
            start = it.cache.length
            if start + n > it.cache.capacity:
                raise ValueError(f"a sequence's KV cache holds {it.cache.capacity} positions; {start} are used and {n} "
                                 "more do not fit")
            plans.append(row_plan(start, it.ancestors, dev, block, kernel=kernel))
            bounds.append((row, row + n))
            tokens.append(it.tokens)
            positions.append(it.positions)
            row += n
        real = row
        if kernel:
            # the kernels compute a row alike in any call of up to `kernel_rows` rows (a Linear takes
            # F.linear past that): split wider ones
            padded, most = real, self.kernel_rows

            def prod(fn: nn.Module, x: Tensor) -> Tensor:
                return fn(x) if x.shape[0] <= most else torch.cat([fn(c) for c in x.split(most)])
        else:
            padded = -(-real // block) * block

            def prod(fn: nn.Module, x: Tensor) -> Tensor:
                return by_row_blocks(fn, x, block)
        tok, pos = torch.cat(tokens), torch.cat(positions)
        if padded > real:  # pad rows repeat the first token; their results are dropped
            tok = torch.cat([tok, tok[:1].expand(padded - real)])
            pos = torch.cat([pos, pos[:1].expand(padded - real)])
        cos = self.rope_cos[pos].unsqueeze(1)
        sin = self.rope_sin[pos].unsqueeze(1)
        x = self.tok_embeddings(tok)
        # captured features: every item's real rows, item after item (`capture_aux`)
        x = self._run_layers(x, real, lambda i, layer, x: layer.forward_batch(
            x, cos, sin, [it.cache.layers[i] for it in items], plans, bounds, prod))
        hidden = self.norm(x)
        logits = prod(self.output, hidden)[:real].float()
        for it in items:
            it.cache.length += it.tokens.shape[0]
        return [(logits[a:b], hidden[a:b]) for a, b in bounds]
