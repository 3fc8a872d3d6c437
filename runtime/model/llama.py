"""Compact Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) for tree-speculative decoding.

Batch size 1. The KV cache is preallocated once for every layer, in one tensor
`[layers, 2 (K/V), kv_heads, max_seq_len, head_dim]`, so that compacting it after a tree verify
is a single gather. A forward call appends its n new tokens at cache slots
`cache_len .. cache_len+n-1` (in input order); each new token attends to every committed slot and,
among the new ones, to those its row of `mask` allows. Positions are explicit, so a tree node at
depth d sits at RoPE position `cache_len + d` while occupying any slot.

On CPU in float32, `load_model` also keeps a transposed copy of every weight matrix, because the
one-token product is markedly faster against it (see `Linear`); pass fast_paths=False to save
that memory.

Only torch, safetensors and tokenizers are imported here (the runtime's dependency rule).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.model import small_rows
from runtime.config import DTYPES, SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ModelArgs, _read_rope  # noqa: F401 - re-exported

SUPPORTED_DTYPES = tuple(getattr(torch, d) for d in DTYPES)


# ----------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(args: ModelArgs, device: torch.device | str = "cpu") -> Tensor:
    """Per-pair inverse frequencies (float32, [head_dim/2], on `device`) with the checkpoint's scaling applied."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args: ModelArgs, max_len: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """cos and sin tables [max_len, head_dim] in float32 (each frequency repeated for both halves)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), rope_inv_freq(args, device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [n, heads, head_dim] by cos/sin [n, 1, head_dim] (rotate-half convention), in float32."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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


# (module shapes, dtype, device, block rows, call rows) -> whether one call over that many rows gives
# each row bit for bit what calls on blocks of `block rows` give (see `by_row_blocks`)
_CALL_MATCHES_BLOCKS: dict[tuple, bool] = {}
# (module shapes, dtype, device, block rows, total rows) -> the rows per call `by_row_blocks` uses
_CALL_WIDTH: dict[tuple, int] = {}


def _module_key(fn: nn.Module, x: Tensor, rows: int) -> tuple:
    return (tuple(tuple(p.shape) for p in fn.parameters()), x.dtype, x.device.type, rows)


def _call_matches_blocks(fn: nn.Module, x: Tensor, rows: int, width: int) -> bool:
    """Whether one call of fn over `width` rows (a multiple of `rows`) rounds every row as calls on
    blocks of `rows` rows do, probed once per shape on random rows. For width == rows it checks
    that a row's result does not depend on its place in the block, without which no padded row
    count makes the forward row-invariant (raises: pick another `invariant_rows`)."""
    key = (*_module_key(fn, x, rows), width)
    ok = _CALL_MATCHES_BLOCKS.get(key)
    if ok is None:
        g = torch.Generator(device=x.device).manual_seed(width)
        probe = torch.randn(width, x.shape[1], generator=g, device=x.device, dtype=x.dtype)
        with torch.no_grad():
            whole = fn(probe)
            if width == rows:
                ok = bool(torch.equal(fn(probe.roll(1, 0)), whole.roll(1, 0)))
                if not ok:
                    raise RuntimeError(
                        f"row invariance with blocks of {rows} rows is impossible here: this machine's "
                        f"{x.dtype} matrix product rounds a row differently by its place in a {rows}-row call; "
                        "set another invariant_rows (e.g. 8 or 16), or lossless=numerical")
            else:
                ok = bool(torch.equal(whole, torch.cat([fn(probe[i:i + rows]) for i in range(0, width, rows)])))
        _CALL_MATCHES_BLOCKS[key] = ok
    return ok


def by_row_blocks(fn: nn.Module, x: Tensor, rows: int) -> Tensor:
    """fn (a per-row module: a Linear, the feed-forward) on x, whose row count is a multiple of
    `rows`, with each row's result exactly as fn computes it on blocks of `rows` rows.

    Separate calls per block cost nearly a whole call each on a CPU (the kernel reads all the
    weights again every call), while one call over many rows costs little more than one block.
    Whether a wider call rounds like the blocks depends on how the kernel tiles rows (on one AVX2
    machine with MKL, 4 to 11 rows round alike and 12 or more otherwise), so it is probed, not
    assumed: the widest call that rounds like the blocks is used, in as few calls as possible."""
    n = x.shape[0]
    key = (*_module_key(fn, x, rows), n)
    width = _CALL_WIDTH.get(key)
    if width is None:
        width = rows
        for w in range(n, rows, -rows):  # widest first; the remainder call must match too
            rest = n % w
            if _call_matches_blocks(fn, x, rows, w) and (rest == 0 or rest == rows or _call_matches_blocks(fn, x, rows, rest)):
                width = w
                break
        _call_matches_blocks(fn, x, rows, rows)  # the block itself: a row's place must not matter
        _CALL_WIDTH[key] = width
    if width >= n:
        return fn(x)
    return torch.cat([fn(x[i:i + width]) for i in range(0, n, width)])


# a row-invariant way to run a per-row module (a Linear, the feed-forward) over many rows
RowProducts = Callable[[nn.Module, Tensor], Tensor]


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


# Row-invariant attention in torch (`lossless: exact` where the small-row kernel does not run: bf16,
# fp16, CUDA). A row's keys, in logical order (committed prefix, then its ancestors among the new
# tokens), are cut into pieces of KEY_CHUNK keys by logical position alone: its last KEY_CHUNK keys
# (the *tail*, gathered per row: they hold every new token it sees) and, before them, the *head*
# (committed slots only, shared by all rows) in chunks at multiples of KEY_CHUNK. Each piece is one
# matrix product of a fixed shape, and the pieces' sums are added in a fixed order, so a row's
# result depends on its keys alone: not on how many rows the forward holds, where its keys sit in
# the cache, or how many chunks other rows need. (CUDA's flash attention, by contrast, picks how many
# key splits to sum over from batch x heads.) A forward may hold tokens at most KEY_CHUNK - 1 deep.
KEY_CHUNK = 64
# Rows per attention product, by device type: 1 = each row its own products ([query heads of a KV
# head, head_dim] x [head_dim, KEY_CHUNK]); elsewhere the plan's block (`RowPlan.block`) of rows
# shares the head's products (one read of the shared keys for all), and the tail's products run on
# exactly a block of rows per call, so that no product's shape or batch count follows the row count.
# On a CPU a one-token step would pay a block's products for one row; there a batched product's
# per-matrix result was measured not to depend on its batch count (MKL, 64-byte-aligned matrices),
# which is all that per-row products need.
ATTENTION_ROWS: dict[str, int] = {"cpu": 1}
# At 1 row per product, a forward whose rows x pieces come to at most this (and any one-row
# forward) gathers each row's keys whole and runs one product for all pieces; a larger one reads
# the head in place, one call per chunk x KV head. The same arithmetic, either way: the choice is by
# cost (gathering copies the head once per row; on a 2-core EPYC with SmolLM2 in bf16 it was the
# faster below about 40).
GATHER_PIECES = 40


@dataclass
class RowPlan:
    """How one row-invariant forward (see `Transformer.set_row_invariance`) attends: shared by all
    layers. Each real row attends to exactly its own cache slots, in the order AR holds the same
    keys: the committed prefix (slots 0 .. write_at-1), then its ancestors among the new tokens by
    depth, itself last. Pad rows (`real` and after) attend to nothing: they exist for the matrix
    products' row count only. Two encodings, one per attention path:
    * torch (`Attention._attend_chunked`, see KEY_CHUNK), rows grouped `group` to a product (padded
      to whole groups): `tail_slots` [rows, KEY_CHUNK] the cache slots of each row's last KEY_CHUNK
      keys in logical order (slot 0 where there is no key); `head_chunks` the KEY_CHUNK-key chunks
      of committed slots that the longest head reaches; `masked` [groups, head_chunks + 1, 1, group,
      1, KEY_CHUNK] which places of each row's pieces (head chunks, then the tail) hold no key of the
      row (all, for pad rows);
    * `offsets`, `slots`, `longest` (`runtime.model.small_rows.attention`): row i's new-token slots are
      slots[offsets[i]:offsets[i+1]]; `longest` is the longest such list."""

    write_at: int   # cache slot of row 0's K/V
    real: int       # rows that are tokens; the rest are padding
    block: int      # the padded row count every matrix product sees (`by_row_blocks`)
    group: int = 1
    tail_slots: Tensor | None = None
    head_chunks: int = 0
    masked: Tensor | None = None
    offsets: Tensor | None = None
    slots: Tensor | None = None
    longest: int = 0
    # working tensors shared by the layers of one forward (made by the first layer)
    scratch: dict[str, Tensor] = field(default_factory=dict, repr=False)


def _mask_ancestors(mask: Tensor | None, n: int) -> list[list[int]]:
    """Each new token's ancestors among the n new tokens (itself last), read from the mask on the
    host (None: causal)."""
    if mask is None:
        return [list(range(i + 1)) for i in range(n)]
    m = mask.cpu()
    ancestors = [m[i, : i + 1].nonzero().flatten().tolist() for i in range(n)]
    if any(a[-1:] != [i] for i, a in enumerate(ancestors)) or bool(m.triu(1).any()):
        raise ValueError("under row invariance the mask must let each token attend to itself and to earlier "
                         "tokens only (a tree in node order)")
    return ancestors


# (ancestor lists (a tree's shape), device, encoding, rows per attention product) -> the plan's slots
# relative to the first new slot: built once per tree, so a step copies nothing to the device
_ROW_GROUPS: dict[tuple, Any] = {}


_NO_KEY = -(1 << 40)  # a relative slot / head length that puts every place of a pad row before position 0


def _tail_layout(ancestors: list[list[int]], group: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """The torch encoding's per-tree part: each row's last KEY_CHUNK keys as slots relative to the
    first new slot (a committed key k slots back: -k; new token j: j), and each row's head length
    minus the first new slot, both padded to whole groups of rows (pad rows: no keys); and the
    longest ancestor list."""
    longest = max(len(a) for a in ancestors)
    if longest > KEY_CHUNK:
        raise ValueError(f"a token with {longest - 1} ancestors among the new tokens: the row-invariant attention "
                         f"takes each row's last KEY_CHUNK={KEY_CHUNK} keys as one piece, so a forward may hold tokens "
                         f"at most {KEY_CHUNK - 1} deep; verify a shallower tree (or split the forward)")
    rows = -(-len(ancestors) // group) * group
    rel = [[a[u] if (u := t - (KEY_CHUNK - len(a))) >= 0 else u for t in range(KEY_CHUNK)] for a in ancestors]
    rel += [[_NO_KEY] * KEY_CHUNK] * (rows - len(ancestors))
    head = [len(a) - KEY_CHUNK for a in ancestors] + [_NO_KEY] * (rows - len(ancestors))
    return (torch.tensor(rel, dtype=torch.long, device=device), torch.tensor(head, dtype=torch.long, device=device),
            longest)


def row_plan(start: int, ancestors: list[list[int]], device: torch.device, block: int,
             kernel: bool = False) -> RowPlan:
    """The plan for the new tokens of a forward that appends after `start` committed slots;
    ancestors[i] lists the new tokens (indices, increasing, i itself last) token i attends to;
    `block` is the row count of every matrix product; `kernel`: encode it for
    `runtime.model.small_rows.attention` instead of torch's products."""
    device = torch.device(device)
    group = 1 if kernel else ATTENTION_ROWS.get(device.type, block)
    shape = (tuple(map(tuple, ancestors)), str(device), kernel, group)
    rel = _ROW_GROUPS.get(shape)
    if rel is None:
        if kernel:
            lengths = [len(a) for a in ancestors]
            offsets = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
            rel = (offsets, torch.tensor([j for a in ancestors for j in a], dtype=torch.long), max(lengths))
        else:
            rel = _tail_layout(ancestors, group, device)
        _ROW_GROUPS[shape] = rel
    if kernel:
        offsets, slots, longest = rel
        return RowPlan(write_at=start, real=len(ancestors), block=block, offsets=offsets, slots=slots + start,
                       longest=longest)
    rel_slots, head_rel, longest = rel
    slots = rel_slots + start
    groups = slots.shape[0] // group
    masked = (slots < 0).view(groups, 1, 1, group, 1, KEY_CHUNK)
    head_keys = start + longest - KEY_CHUNK  # the longest head
    chunks = -(-head_keys // KEY_CHUNK) if head_keys > 0 else 0
    if chunks:
        at = torch.arange(chunks * KEY_CHUNK, device=device).view(1, chunks, 1, 1, 1, KEY_CHUNK)
        masked = torch.cat([at >= (head_rel + start).view(groups, 1, 1, group, 1, 1), masked], dim=1)
    return RowPlan(write_at=start, real=len(ancestors), block=block, group=group, tail_slots=slots.clamp_(min=0),
                   head_chunks=chunks, masked=masked)


class Attention(nn.Module):
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
        qkv = self.wqkv(x).view(n, h + 2 * kvh, hd)
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(x.dtype)
        end = start + n
        kv[0, :, start:end] = qk[:, h:].transpose(0, 1)
        kv[1, :, start:end] = qkv[:, h + kvh:].transpose(0, 1)
        # GQA without copying K/V: the query heads sharing a KV head are stacked along the query
        # axis, so attention runs per KV head over [groups*n] query rows.
        # (4-D inputs: SDPA's fused CPU kernel only takes those; 3-D ones fall back to the math path)
        groups = h // kvh
        q = qk[:, :h].view(n, kvh, groups, hd).permute(1, 2, 0, 3).reshape(1, kvh, groups * n, hd)
        out = F.scaled_dot_product_attention(q, kv[None, 0, :, :end], kv[None, 1, :, :end], attn_mask=mask)
        out = out.view(kvh, groups, n, hd).permute(2, 0, 1, 3).reshape(n, h * hd)
        return self.wo(out)

    def forward_invariant(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        """Row-invariant attention (see `RowPlan`): x has the plan's padded row count; only its first
        `plan.real` rows' K/V are written (at slots `plan.write_at ...`); every row attends over
        its own keys in logical order, in pieces fixed by their positions (`_attend_chunked`)."""
        rows = x.shape[0]
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = by_row_blocks(self.wqkv, x, plan.block).view(rows, h + 2 * kvh, hd)
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(x.dtype)
        at, real = plan.write_at, plan.real
        kv[0, :, at:at + real] = qk[:real, h:].transpose(0, 1)
        kv[1, :, at:at + real] = qkv[:real, h + kvh:].transpose(0, 1)
        out = self._attend(qk[:, :h], kv, plan)
        return by_row_blocks(self.wo, out.reshape(rows, h * hd), plan.block)

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

    def _attend(self, q: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        """Each row of q [rows, h, hd] over its own keys of the layer cache kv, as `plan` lists them
        (rows past `plan.real` attend to nothing and come back as garbage or zeros)."""
        if plan.slots is not None:  # the small-row kernel reads each row's slots in place
            return small_rows.attention(q, kv[0], kv[1], plan.write_at, plan.offsets, plan.slots, plan.longest,
                                        1.0 / math.sqrt(self.head_dim))
        return self._attend_chunked(q, kv, plan)

    def _attend_chunked(self, q: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        """`_attend` in torch's products, row-invariant by construction (see KEY_CHUNK), in float32.

        Every piece of a row's keys (its head's chunks, then its tail) is one product [rows per
        product x query heads of a KV head, head_dim] x [head_dim, KEY_CHUNK] for the scores and one
        [.., KEY_CHUNK] x [KEY_CHUNK, head_dim] for the weighted values, with the same operand
        layouts however the keys were fetched. The softmax is taken against the row's maximum over
        all its keys (exact in any order); each piece's weights are summed over its KEY_CHUNK places
        (a reduction of fixed length: masked places add exact zeros); the pieces' sums are
        accumulated in piece order (cumsum: sequential along that dimension). The products' shapes
        depend on the plan's `group` alone, never on the row count; only batch counts vary (see
        ATTENTION_ROWS)."""
        rows = q.shape[0]
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        g, width = h // kvh, KEY_CHUNK
        real, group = plan.real, plan.group
        assert plan.tail_slots is not None and plan.masked is not None
        groups, pieces = plan.masked.shape[0], plan.head_chunks + 1
        padded = groups * group
        if group == 1:  # scores [pieces, kvh, rows, g, C]
            scores, weigh = self._row_scores(q, kv, plan)
            s6, along = scores.permute(2, 0, 1, 3, 4).unsqueeze(3), 0
        else:  # scores [groups, pieces, kvh, group*g, C]
            scores, weigh = self._group_scores(q, kv, plan)
            s6, along = scores.view(groups, pieces, kvh, group, g, width), 1
        s6.masked_fill_(plan.masked, -math.inf)
        top = s6.amax(dim=(1, 5), keepdim=True)
        if padded > real:  # pad rows have no key: any finite maximum
            top.clamp_(min=torch.finfo(torch.float32).min)
        s6.sub_(top).exp_()
        # the weighted values beside the weights' sums, each summed over the pieces in order
        total = torch.cat([weigh(scores), scores.sum(-1, keepdim=True)], dim=-1).cumsum(along).select(along, -1)
        result = q.new_zeros(rows, h, hd) if rows > real else q.new_empty(rows, h, hd)
        if group == 1:  # total [kvh, rows, g, hd + 1]
            torch.div(total[..., :hd], total[..., hd:], out=result[:real].view(real, kvh, g, hd).transpose(0, 1))
        else:  # total [groups, kvh, group*g, hd + 1]
            res = (total[..., :hd] / total[..., hd:]).view(groups, kvh, group, g, hd).transpose(1, 2)
            result[:real] = res.reshape(padded, h, hd)[:real]
        return result

    def _scratch_kv(self, plan: RowPlan, name: str, *shape: int) -> Tensor:
        """A float32 buffer [2 (K/V), *shape, head_dim], kept for the forward's other layers."""
        buf = plan.scratch.get(name)
        if buf is None:
            assert plan.tail_slots is not None
            buf = plan.scratch[name] = plan.tail_slots.new_empty(2, *shape, self.head_dim, dtype=torch.float32)
        return buf

    def _head_keys(self, kv: Tensor, plan: RowPlan) -> Tensor:
        """The committed slots the heads read, chunk-major: [2, head_chunks, kvh, KEY_CHUNK, hd]
        float32. (They lie in the cache: the longest head ends KEY_CHUNK keys before the forward's
        last slot, so its last chunk ends before the cache does.)"""
        chunks, kvh, hd = plan.head_chunks, self.n_kv_heads, self.head_dim
        head = self._scratch_kv(plan, "head", chunks, kvh, KEY_CHUNK)
        head.copy_(kv[:, :, :chunks * KEY_CHUNK].view(2, kvh, chunks, KEY_CHUNK, hd).transpose(1, 2))
        return head

    def _row_scores(self, q: Tensor, kv: Tensor, plan: RowPlan) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """One row per product: scores [pieces, kvh, rows, g, C] and the weighted values' function
        (probabilities of that shape -> [pieces, kvh, rows, g, hd]). Every product is [g, hd] x
        [hd, C] (then [g, C] x [C, hd]) with the same operand layouts on both routes: a few rows
        gather their keys whole and take one batched call; more rows read the head once, each
        chunk x KV head one call over all rows (the keys broadcast, no copy), and gather their
        tails."""
        assert plan.tail_slots is not None
        rows, chunks = plan.real, plan.head_chunks
        kvh, hd, width = self.n_kv_heads, self.head_dim, KEY_CHUNK
        g, pieces, scale = self.n_heads // kvh, chunks + 1, 1.0 / math.sqrt(hd)
        qk = q[:rows].view(rows, kvh, g, hd).transpose(0, 1)  # [kvh, rows, g, hd]
        first = plan.write_at + 1 - width  # a one-row forward's tail is a run of slots
        if rows == 1 or rows * pieces <= GATHER_PIECES:
            keys = self._scratch_kv(plan, "keys", pieces, kvh, rows, width)
            keys[:, :chunks] = kv[:, :, :chunks * width].view(2, kvh, chunks, 1, width, hd).transpose(1, 2)
            if rows == 1 and first >= 0:
                keys[:, chunks, :, 0] = kv[:, :, first:first + width]
            else:
                keys[:, chunks] = kv.index_select(2, plan.tail_slots.view(-1)).view(2, kvh, rows, width, hd)
            k, v = keys.view(2, -1, width, hd).unbind(0)
            qx = k.new_empty(pieces, kvh, rows, g, hd)
            qx.copy_(qk.expand(pieces, kvh, rows, g, hd)).mul_(scale)
            scores = torch.bmm(qx.view(-1, g, hd), k.transpose(1, 2)).view(pieces, kvh, rows, g, width)
            return scores, lambda p: torch.bmm(p.view(-1, g, width), v).view(pieces, kvh, rows, g, hd)
        qk = torch.mul(qk.float(), scale)
        scores = qk.new_empty(pieces, kvh, rows, g, width)
        tail = self._scratch_kv(plan, "tail", kvh, rows, width)
        tail.copy_(kv.index_select(2, plan.tail_slots.view(-1)).view(2, kvh, rows, width, hd))
        kt, vt = tail.view(2, kvh * rows, width, hd).unbind(0)
        torch.bmm(qk.reshape(kvh * rows, g, hd), kt.transpose(1, 2), out=scores[chunks].view(-1, g, width))
        head = self._head_keys(kv, plan) if chunks else None
        for c in range(chunks):
            for j in range(kvh):
                torch.bmm(qk[j], head[0, c, j].t().expand(rows, hd, width), out=scores[c, j])

        def weigh(probs: Tensor) -> Tensor:
            out = probs.new_empty(pieces, kvh, rows, g, hd)
            torch.bmm(probs[chunks].view(-1, g, width), vt, out=out[chunks].view(-1, g, hd))
            for c in range(chunks):
                for j in range(kvh):
                    torch.bmm(probs[c, j], head[1, c, j].expand(rows, width, hd), out=out[c, j])
            return out

        return scores, weigh

    def _group_scores(self, q: Tensor, kv: Tensor, plan: RowPlan) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """`group` rows per product: scores [groups, pieces, kvh, group*g, C] and the weighted
        values' function. A group's rows share each head chunk's products ([group*g, hd] x [hd, C],
        one call per group); each row's tail is its own product, `group` rows per call."""
        assert plan.tail_slots is not None and plan.masked is not None
        group, chunks, groups = plan.group, plan.head_chunks, plan.masked.shape[0]
        kvh, hd, width = self.n_kv_heads, self.head_dim, KEY_CHUNK
        g, pieces, padded = self.n_heads // kvh, chunks + 1, groups * group
        qf = torch.mul(q[:padded].float(), 1.0 / math.sqrt(hd))
        if qf.shape[0] < padded:  # forward_batch passes the real rows only
            qf = torch.cat([qf, qf.new_zeros(padded - qf.shape[0], self.n_heads, hd)])
        scores = qf.new_empty(groups, pieces, kvh, group * g, width)
        head = None
        if chunks:  # [2, chunks*kvh, C, hd]
            head = self._head_keys(kv, plan).view(2, chunks * kvh, width, hd)
            qh = qf.view(groups, 1, group, kvh, g, hd).transpose(2, 3).expand(groups, chunks, kvh, group, g, hd)
            qh = qh.reshape(groups, chunks * kvh, group * g, hd)
            for b in range(groups):
                torch.bmm(qh[b], head[0].transpose(1, 2), out=scores[b, :chunks].view(-1, group * g, width))
        tail = self._scratch_kv(plan, "tail", padded, kvh, width)
        tail.copy_(kv.index_select(2, plan.tail_slots.view(-1)).view(2, kvh, padded, width, hd).transpose(1, 2))
        kt, vt = tail.view(2, padded * kvh, width, hd).unbind(0)
        qt, step = qf.view(padded * kvh, g, hd), group * kvh
        st = qf.new_empty(padded * kvh, g, width)
        for i in range(0, padded * kvh, step):
            torch.bmm(qt[i:i + step], kt[i:i + step].transpose(1, 2), out=st[i:i + step])
        scores.view(groups, pieces, kvh, group, g, width)[:, chunks] = \
            st.view(groups, group, kvh, g, width).transpose(1, 2)

        def weigh(probs: Tensor) -> Tensor:
            out = probs.new_empty(groups, pieces, kvh, group * g, hd)
            for b in range(groups if head is not None else 0):
                torch.bmm(probs[b, :chunks].view(-1, group * g, width), head[1],
                          out=out[b, :chunks].view(-1, group * g, hd))
            pt = probs.view(groups, pieces, kvh, group, g, width)[:, chunks].transpose(1, 2)
            pt = pt.reshape(padded * kvh, g, width)
            ot = probs.new_empty(padded * kvh, g, hd)
            for i in range(0, padded * kvh, step):
                torch.bmm(pt[i:i + step], vt[i:i + step], out=ot[i:i + step])
            out.view(groups, pieces, kvh, group, g, hd)[:, chunks] = ot.view(groups, group, kvh, g, hd).transpose(1, 2)
            return out

        return scores, weigh


# (heads, kv heads, head_dim, dtype, device type, block, rows per product, GATHER_PIECES) -> whether
# `_attention_rows_match_ar` held
_ATTENTION_MATCHES_AR: dict[tuple, bool] = {}


def _attention_rows_match_ar(attn: Attention, dtype: torch.dtype, device: torch.device, block: int) -> bool:
    """Whether `attn`'s row-invariant attention gives every row of a tree forward bit for bit what
    a one-token (AR) forward gives the same token at the same position, on random queries and
    caches of this dtype and device: a 10-node tree (a 5-deep chain, a sibling beside each node)
    whose rows' heads end on both sides of a KEY_CHUNK boundary. The construction
    (`Attention._attend_chunked`) leaves one assumption about the machine: that a batched product
    computes each matrix alike whatever the batch count; this tests it where it matters. Probed
    once per shape."""
    key = (attn.n_heads, attn.n_kv_heads, attn.head_dim, dtype, device.type, block,
           ATTENTION_ROWS.get(device.type, block), GATHER_PIECES)
    ok = _ATTENTION_MATCHES_AR.get(key)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        h, kvh, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        parents = [-1, 0, 0, 1, 1, 3, 3, 5, 5, 7]  # chain 0-1-3-5-7-9 with a sibling beside each node
        ancestors = []
        for i, par in enumerate(parents):
            ancestors.append((ancestors[par] if par >= 0 else []) + [i])
        start = 3 * KEY_CHUNK - 3
        n = len(parents)
        kv = torch.randn(2, kvh, start + n + 8, hd, generator=g, device=device).to(dtype)
        rows = -(-n // block) * block
        q = torch.randn(rows, h, hd, generator=g, device=device).to(dtype)
        tree = attn._attend(q, kv, row_plan(start, ancestors, device, block))
        ok = True
        for i, anc in enumerate(ancestors):
            kv_ar = kv.clone()  # AR's cache holds the row's ancestors in order after the prefix
            kv_ar[:, :, start:start + len(anc)] = kv[:, :, [start + a for a in anc]]
            q_ar = q[i:i + 1].expand(block, h, hd).contiguous()
            ar = attn._attend(q_ar, kv_ar, row_plan(start + len(anc) - 1, [[0]], device, block))
            ok = ok and torch.equal(ar[0], tree[i])
        _ATTENTION_MATCHES_AR[key] = ok
    return ok


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, start: int, mask: Tensor | None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, start, mask)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_invariant(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        x = x + self.attention.forward_invariant(self.attention_norm(x), cos, sin, kv, plan)
        return x + by_row_blocks(self.feed_forward, self.ffn_norm(x), plan.block)

    def forward_batch(self, x: Tensor, cos: Tensor, sin: Tensor, kvs: list[Tensor], plans: list[RowPlan],
                      bounds: list[tuple[int, int]], prod: RowProducts) -> Tensor:
        x = x + self.attention.forward_batch(self.attention_norm(x), cos, sin, kvs, plans, bounds, prod)
        return x + prod(self.feed_forward, self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-family causal LM, batch size 1, with a preallocated KV cache (see module docstring)."""

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

    def set_row_invariance(self, rows: int | None) -> None:
        """Make every decode forward compute each token's row bit-identically however many tokens
        the call holds and wherever they sit (None: off, the fastest arithmetic).

        Matrix-product kernels block their work by the number of rows, so the same row rounds
        differently in a 1-row and an N-row product, and attention over a tree's masked slots sums
        its keys in another order than over AR's contiguous cache (and CUDA's flash attention picks
        how many key splits to sum over by the row count). With `rows` = P set, a forward of n <= P
        tokens is padded to exactly P rows (pad rows' K/V are never written), a larger one to the
        next multiple of P, every matrix product runs on blocks of P rows, and each token attends
        over its own keys in logical order (prefix, then its ancestors by depth) in pieces fixed by
        their logical positions (`Attention._attend_chunked`, KEY_CHUNK). AR decoding (one token)
        and every tree verify then produce the same logits for the same position in any dtype. A
        prefill (mask None, more than one token) keeps the ordinary path: AR and tree decoding share
        it. Both the products and the attention are probed here on random data, and a machine
        where they cannot be row-invariant is refused (RuntimeError).
        Where every Linear runs `runtime.model.small_rows` (float32 on an AVX2 CPU) no padding is needed
        and P is taken as 1 (`invariant_rows` then reads 1)."""
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ValueError(f"row invariance takes a positive padded row count or None, got {rows!r}")
        if rows is not None and self.kernel_decode:
            # every product runs the small-row kernel, which rounds a row alike in any call: padding
            # would only add rows to compute (a one-token AR step would cost an 8-row forward)
            rows = 1
        if rows is not None:  # fail now, not by diverging later, where this machine's products cannot do it
            layer = self.layers[0]
            for fn in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward, self.output):
                width = next(p for p in fn.parameters() if p.dim() == 2).shape[1]
                _call_matches_blocks(fn, torch.empty(rows, width, dtype=self.dtype, device=self.device), rows, rows)
            if not self.kernel_decode and not _attention_rows_match_ar(layer.attention, self.dtype, self.device, rows):
                raise RuntimeError(
                    f"row invariance is impossible here: this machine's {self.dtype} attention on {self.device} "
                    "gives a tree row other bits than AR gives the same token (its batched products round a matrix "
                    "by the batch count); use lossless=numerical, and report the machine")
        self.invariant_rows = rows

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
        for layer, kv in zip(self.layers, self._layer_caches):
            x = layer(x, cos, sin, kv, start, attn_mask)
        self._cache_len = start + n
        hidden = self.norm(x)
        logits = self.output(hidden[-1:] if last_only else hidden).float()
        return logits.unsqueeze(0), hidden.unsqueeze(0)


    def _forward_invariant(self, tokens: Tensor, input_pos: Tensor, mask: Tensor | None,
                           last_only: bool, ancestors: list[list[int]] | None = None) -> tuple[Tensor, Tensor]:
        """`forward` under row invariance (see `set_row_invariance`): the tokens padded to a multiple
        of `invariant_rows` rows, every matrix product on blocks of that many. Reads the mask on the
        host unless `ancestors` (each new token's ancestors among the new tokens, itself last) is given."""
        kernel = self.kernel_decode
        rows = 1 if kernel else self.invariant_rows
        assert rows is not None
        n, start, dev = tokens.shape[1], self._cache_len, self.device
        if ancestors is None:  # a compiled tree passes its own, checked when it was compiled
            ancestors = _mask_ancestors(mask, n)
        padded = -(-n // rows) * rows
        plan = row_plan(start, ancestors, dev, rows, kernel=kernel)
        pad = padded - n
        if pad:  # pad rows repeat the first token; their results are dropped
            tokens = torch.cat([tokens[0], tokens[0, :1].expand(pad)])[None]
            input_pos = torch.cat([input_pos, input_pos[:1].expand(pad)])
        cos = self.rope_cos[input_pos].unsqueeze(1)
        sin = self.rope_sin[input_pos].unsqueeze(1)
        x = self.tok_embeddings(tokens[0])
        for layer, kv in zip(self.layers, self._layer_caches):
            x = layer.forward_invariant(x, cos, sin, kv, plan)
        hidden = self.norm(x)
        # the lm_head too sees blocks of `rows` rows, so a token's logits do not depend on n
        if last_only:  # only the block holding the last token goes through the lm_head
            first = (n - 1) // rows * rows
            out = self.output(hidden[first:first + rows])[n - 1 - first:n - first].float()
        else:
            out = by_row_blocks(self.output, hidden, rows)[:n].float()
        self._cache_len = start + n
        return out.unsqueeze(0), hidden[:n].unsqueeze(0)


    @torch.inference_mode()
    def forward_batch(self, items: Sequence[BatchItem]) -> list[tuple[Tensor, Tensor]]:
        """Verify the new tokens of several sequences in one forward: item i appends its tokens
        [n_i] at positions [n_i] to its own KV cache (`KVCache`), each token attending to that
        cache's committed prefix and to its ancestors among the item's tokens (`ancestors`, itself
        last). Returns per item (logits [n_i, V] float32, hidden [n_i, dim]).

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
            # the kernels compute a row alike in any call of up to KERNEL_ROWS rows: split wider ones
            padded = real

            def prod(fn: nn.Module, x: Tensor) -> Tensor:
                return fn(x) if x.shape[0] <= KERNEL_ROWS else torch.cat([fn(c) for c in x.split(KERNEL_ROWS)])
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
        for index, layer in enumerate(self.layers):
            x = layer.forward_batch(x, cos, sin, [it.cache.layers[index] for it in items], plans, bounds, prod)
        hidden = self.norm(x)
        logits = prod(self.output, hidden)[:real].float()
        for it in items:
            it.cache.length += it.tokens.shape[0]
        return [(logits[a:b], hidden[a:b]) for a, b in bounds]


@dataclass
class BatchItem:
    """One sequence's part of `Transformer.forward_batch`: its cache, new tokens [n] (int64),
    their absolute positions [n], and each token's ancestors among them (increasing, itself last;
    a compiled tree's `TreeBuffers.ancestor_lists`)."""

    cache: KVCache
    tokens: Tensor
    positions: Tensor
    ancestors: list[list[int]]


# ----------------------------------------------------------------------------------------------
# Loading


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
