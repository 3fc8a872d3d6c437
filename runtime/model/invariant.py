"""The row-invariant forward (`lossless: exact`): every token's row of logits bit-identical however
many tokens the forward holds and wherever they sit, so that AR decoding and every tree verify give
the same logits for the same position in any dtype.

Why it takes a forward of its own: matrix-product kernels block their work by the number of rows,
so the same row rounds differently in a 1-row and an N-row product; attention over a tree's masked
slots sums its keys in another order than over AR's contiguous cache; and CUDA's flash attention
picks how many key splits to sum over by the row count. Under `set_row_invariance(P)`:
* every matrix product runs on blocks of P rows (`by_row_blocks`; the forward padded to a multiple
  of P rows, pad rows' K/V never written), merged into wider calls only where a probe shows that
  they round each row as the blocks do;
* each token attends over its own keys in logical order (committed prefix, then its ancestors by
  depth, itself last; `RowPlan`), cut into pieces of KEY_CHUNK keys by logical position and summed
  in a fixed order (`InvariantAttention._attend_chunked`), or through the small-row kernel
  (`runtime.model.small_rows.attention`) where every product runs it (float32 on an AVX2 CPU: there
  P is 1 and no padding is needed).
Both rest on assumptions about the machine's kernels, probed on random data when invariance is
switched on (`_call_matches_blocks`, `_attention_rows_match_ar`): a machine where they fail is
refused then, not found out by diverging later.

The classes here are mixins that `runtime.model.llama`'s Attention, TransformerBlock and
Transformer inherit; those provide the weights and the cache. This module imports llama.py for
type checking only (llama.py imports it), and shares RoPE through `runtime.model.rope`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from runtime.model import small_rows
from runtime.model.rope import apply_rope

# ----------------------------------------------------------------------------------------------
# Matrix products on row blocks


# (module shapes, product path, dtype, device, block rows, call rows) -> whether one call over that
# many rows gives each row bit for bit what calls on blocks of `block rows` give (`by_row_blocks`)
_CALL_MATCHES_BLOCKS: dict[tuple, bool] = {}
# (module shapes, product path, dtype, device, block rows, total rows) -> the rows per call
# `by_row_blocks` uses
_CALL_WIDTH: dict[tuple, int] = {}


def _product_path(fn: nn.Module) -> tuple:
    """Which product each Linear inside `fn` runs (`runtime.model.llama.Linear.add_fast_paths`: the
    small-row kernel's packed weight, torch's transposed copy, or F.linear): the same shapes round
    differently on another path, so a probe's answer holds for its path only."""
    return tuple((getattr(m, "weight_packed", None) is not None, getattr(m, "weight_t", None) is not None)
                 for m in fn.modules() if isinstance(m, nn.Linear))


def _module_key(fn: nn.Module, x: Tensor, rows: int) -> tuple:
    return (tuple(tuple(p.shape) for p in fn.parameters()), _product_path(fn), x.dtype, x.device.type, rows)


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
            if width == rows:  # every place in the block, not one shift: a kernel may treat each tile edge apart
                ok = all(torch.equal(fn(probe.roll(k, 0)), whole.roll(k, 0)) for k in range(1, rows))
                if not ok:
                    raise RuntimeError(
                        f"row invariance with blocks of {rows} rows is impossible here: this machine's "
                        f"{x.dtype} matrix product rounds a row differently by its place in a {rows}-row call; "
                        "set another invariant_rows (e.g. 8 or 16), or lossless=numerical")
            else:
                ok = bool(torch.equal(whole, torch.cat([fn(probe[i:i + rows]) for i in range(0, width, rows)])))
        _CALL_MATCHES_BLOCKS[key] = ok
    return ok


# (norm shape, its kernel switch, dtype, device type, rows) -> whether `_norm_rows_match` held
_NORM_MATCHES: dict[tuple, bool] = {}


def _norm_rows_match(norm: nn.Module, dtype: torch.dtype, device: torch.device, rows: int) -> bool:
    """Whether a per-row norm (RMSNorm: the forward runs it over all of a call's rows at once, not in
    row blocks) gives every row the same bits whatever the call's row count (1 .. 4 blocks of
    `rows`) and wherever the row sits in it (every place of a padded block). Probed once per shape."""
    dim = norm.weight.shape[0]
    key = (dim, bool(getattr(norm, "use_kernel", False)), dtype, device.type, rows)
    ok = _NORM_MATCHES.get(key)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(rows)
        x = torch.randn(4 * rows, dim, generator=g, device=device).to(dtype)
        with torch.no_grad():
            alone = torch.cat([norm(x[i:i + 1]) for i in range(x.shape[0])])
            ok = all(torch.equal(norm(x[:n]), alone[:n]) for n in range(2, 4 * rows + 1))
            ok = ok and all(torch.equal(norm(x[:rows].roll(k, 0)), alone[:rows].roll(k, 0)) for k in range(rows))
        _NORM_MATCHES[key] = ok
    return ok


def by_row_blocks(fn: nn.Module, x: Tensor, rows: int) -> Tensor:
    """fn (a per-row module: a Linear, the feed-forward) on x, whose row count is a multiple of
    `rows`, with each row's result exactly as fn computes it on blocks of `rows` rows.

    Separate calls per block cost nearly a whole call each on a CPU (the kernel reads all the
    weights again every call), while one call over many rows costs little more than one block.
    Whether a wider call rounds like the blocks depends on how the kernel tiles rows (on one AVX2
    machine with MKL, 4 to 11 rows round alike and 12 or more otherwise), so it is probed, not
    assumed: the widest call that rounds like the blocks is used, in as few calls as possible.

    Only float32 results are merged so. A wider call that sums in another order changes most of
    its float32 results, but rounding to 8 (bf16) or 11 (fp16) significant bits hides the change
    in all but about 1 in 10^4 (bf16) or 10^3 (fp16) of them: a random probe can pass by chance
    while a whole forward meets a result that differs (on an Intel Xeon with AMX-BF16, 32-row bf16
    calls passed the probe and changed a 33-node chain's rows from row 22 on). In bf16 and fp16
    every call is one block."""
    n = x.shape[0]
    key = (*_module_key(fn, x, rows), n)
    width = _CALL_WIDTH.get(key)
    if width is None:
        width = rows
        wider = range(n, rows, -rows) if x.dtype == torch.float32 else range(0)
        for w in wider:  # widest first; the remainder call must match too
            rest = n % w
            if _call_matches_blocks(fn, x, rows, w) and (rest == 0 or rest == rows or _call_matches_blocks(fn, x, rows, rest)):
                width = w
                break
        _call_matches_blocks(fn, x, rows, rows)  # the block itself: a row's place must not matter
        _CALL_WIDTH[key] = width
    if width >= n:
        return fn(x)
    return torch.cat([fn(x[i:i + width]) for i in range(0, n, width)])


# ----------------------------------------------------------------------------------------------
# Attention over each row's own keys, in logical order

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
    # the blocked encoding (`InvariantAttention._attend_blocked`, EXACT_ATTENTION = "blocked"):
    # `shared_blocks` KEY_BLOCK-key blocks of committed slots that every row reads in place, then per
    # row `block_slots` [rows, tail blocks * KEY_BLOCK] the slots of its later keys in logical order
    # from position shared_blocks * KEY_BLOCK on (0 where masked) and `block_masked` which hold none
    shared_blocks: int = 0
    block_slots: Tensor | None = None
    block_masked: Tensor | None = None
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
    if not kernel and EXACT_ATTENTION == "blocked":
        return _blocked_plan(start, ancestors, device, block, group)
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


# ----------------------------------------------------------------------------------------------
# Exact attention over position-keyed key blocks (the default; see `InvariantAttention._attend_blocked`)

# Which exact attention the torch path runs: "blocked" (`_attend_blocked`: keys read in the compute
# dtype, the committed cache in place, no depth limit) or "chunked" (`_attend_chunked`, the older
# design: every key copied to float32 per layer and step, tokens at most KEY_CHUNK - 1 deep).
EXACT_ATTENTION = "blocked"
# Keys per block of the blocked attention: block b holds logical positions [b*KEY_BLOCK, (b+1)*KEY_BLOCK)
# of every row, whatever the context, the row count or where the keys sit in the cache.
KEY_BLOCK = 64

# (ancestor lists, first new position modulo KEY_BLOCK, device) -> (tail slots relative to the first
# new slot, masked places): built once per tree and offset, so a step copies nothing to the device
_BLOCK_LAYOUTS: dict[tuple, tuple[Tensor, Tensor]] = {}


def _block_layout(ancestors: list[list[int]], offset: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The per-row part of a blocked plan: each row's keys from the first block that holds a new
    token (it starts `offset` committed keys before the first new slot) to its last block, as
    slots relative to the first new slot ([rows, tail blocks * KEY_BLOCK]; a masked place: 0), and
    which places hold no key of the row."""
    longest = max(len(a) for a in ancestors)
    width = -(-(offset + longest) // KEY_BLOCK) * KEY_BLOCK
    rel, masked = [], []
    for a in ancestors:
        row = list(range(-offset, 0)) + list(a)
        masked.append([False] * len(row) + [True] * (width - len(row)))
        rel.append(row + [0] * (width - len(row)))
    return (torch.tensor(rel, dtype=torch.long, device=device), torch.tensor(masked, dtype=torch.bool, device=device))


def _blocked_plan(start: int, ancestors: list[list[int]], device: torch.device, block: int, group: int) -> RowPlan:
    offset = start % KEY_BLOCK
    key = (tuple(map(tuple, ancestors)), offset, str(device))
    layout = _BLOCK_LAYOUTS.get(key)
    if layout is None:
        layout = _BLOCK_LAYOUTS[key] = _block_layout(ancestors, offset, device)
    rel, masked = layout
    return RowPlan(write_at=start, real=len(ancestors), block=block, group=group, shared_blocks=start // KEY_BLOCK,
                   block_slots=(rel + start).clamp_(min=0), block_masked=masked)


def _block_products(left: Tensor, right: Tensor) -> Tensor:
    """Every (group of rows, KV head, key block) product of left [kvh, groups, blocks, m, k] (one
    operand per KV head, group and block; an expanded view where the blocks share it) and right
    [kvh, blocks, k, n] (one per KV head and block: views of the cache): [groups, kvh, blocks, m, n].
    Each is one [m, k] x [k, n] product whatever the counts; they run batched over whichever of
    groups, KV heads or blocks leaves the fewest calls (bmm takes one batch dimension, and the
    cache's blocks and heads lie at two strides)."""
    kvh, groups, blocks, m, k = left.shape
    n = right.shape[3]
    out = left.new_empty(groups, kvh, blocks, m, n)
    by_group, by_block, by_head = kvh * blocks, groups * kvh, groups * blocks
    if by_group <= min(by_block, by_head):
        for j in range(kvh):
            for b in range(blocks):
                out[:, j, b] = torch.bmm(left[j, :, b], right[j, b].expand(groups, k, n))
    elif by_block <= by_head:
        for i in range(groups):
            for j in range(kvh):
                out[i, j] = torch.bmm(left[j, i], right[j])
    else:
        for i in range(groups):
            for b in range(blocks):
                out[i, :, b] = torch.bmm(left[:, i, b], right[:, b])
    return out


class InvariantAttention:
    """`Attention`'s row-invariant forward and the attention it runs (see `RowPlan`); mixed into
    `runtime.model.llama.Attention`, whose wqkv, wo, n_heads, n_kv_heads and head_dim it uses."""

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

    def _attend(self, q: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        """Each row of q [rows, h, hd] over its own keys of the layer cache kv, as `plan` lists them
        (rows past `plan.real` attend to nothing and come back as garbage or zeros)."""
        if plan.slots is not None:  # the small-row kernel reads each row's slots in place
            return small_rows.attention(q, kv[0], kv[1], plan.write_at, plan.offsets, plan.slots, plan.longest,
                                        1.0 / math.sqrt(self.head_dim))
        if plan.block_slots is not None:
            return self._attend_blocked(q, kv, plan)
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

    def _attend_blocked(self, q: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        """`_attend` in torch's products over position-keyed key blocks (KEY_BLOCK), row- and
        batch-invariant by construction, reading the keys and values in the cache's dtype.

        A row's keys in logical order (committed prefix, then its ancestors, itself last) are cut
        into blocks by logical position alone. Blocks wholly inside the committed prefix are read
        in place (shared by the sequence's rows); the others are gathered per row. Every block is
        one [group*g, head_dim] x [head_dim, KEY_BLOCK] product for the scores and one
        [group*g, KEY_BLOCK] x [KEY_BLOCK, head_dim] for the weighted values (group = the plan's
        rows per product; a gathered block's product holds its row at the row's own place), so a
        product's shape never follows the row count, the context length or the batch. The softmax
        is taken against the row's maximum over all its keys (exact in any order) in float32;
        each block's weights are summed over its KEY_BLOCK places (masked places add exact zeros)
        and the blocks' sums accumulated in block order (cumsum along the block dimension), so
        blocks past a row's last key, which a deeper row in the same forward needs, add nothing.
        The weights enter the value product in the cache's dtype, as flash attention does."""
        assert plan.block_slots is not None and plan.block_masked is not None
        rows_in, real, group = q.shape[0], plan.real, plan.group
        h, kvh, hd, width = self.n_heads, self.n_kv_heads, self.head_dim, KEY_BLOCK
        g = h // kvh
        groups = -(-real // group)
        padded, shared = groups * group, plan.shared_blocks
        tails = plan.block_slots.shape[1] // width
        qp = q[:real] if padded == real else torch.cat([q[:real], q[:1].expand(padded - real, h, hd)])
        # [kvh, groups, group*g, hd]: a group's query heads of one KV head, row after row
        qg = qp.reshape(groups, group, kvh, g, hd).permute(2, 0, 1, 3, 4).reshape(kvh, groups, group * g, hd)
        index = plan.scratch.get("block_rows")  # each row, its product group and its place there: once per forward
        if index is None:
            rows = torch.arange(real, device=q.device)
            index = plan.scratch["block_rows"] = (rows, rows // group, rows % group)
        rows, of_group, place = index
        # the gathered blocks: each row's query group against that row's keys
        keys = kv.index_select(2, plan.block_slots.view(-1)).view(2, kvh * real * tails, width, hd)
        qt = qg.index_select(1, of_group)[:, :, None].expand(kvh, real, tails, group * g, hd)
        qt = qt.reshape(kvh * real * tails, group * g, hd)
        st = torch.bmm(qt, keys[0].transpose(1, 2)).view(kvh, real, tails, group, g, width)
        parts = [st[:, rows, :, place]]  # [real, kvh, tails, g, C]
        blocks = None
        if shared:  # [2, kvh, shared, C, hd]: the committed blocks, in place
            blocks = kv[:, :, :shared * width].view(2, kvh, shared, width, hd)
            qs = qg[:, :, None].expand(kvh, groups, shared, group * g, hd)
            ss = _block_products(qs, blocks[0].transpose(2, 3)).view(groups, kvh, shared, group, g, width)
            parts.insert(0, ss[of_group, :, :, place])  # [real, kvh, shared, g, C]
        scores = torch.cat(parts, dim=2).float().mul_(1.0 / math.sqrt(hd))  # [real, kvh, blocks, g, C]
        scores[:, :, shared:].masked_fill_(plan.block_masked.view(real, 1, tails, 1, width), -math.inf)
        top = scores.amax(dim=(2, 4), keepdim=True)
        probs = scores.sub_(top).exp_()
        sums = probs.sum(-1, keepdim=True)  # [real, kvh, blocks, g, 1]
        weights = probs.to(kv.dtype)
        # the weighted values, each block's in the same product shape as its scores
        pt = weights.new_zeros(kvh, real, tails, group, g, width)
        pt[:, rows, :, place] = weights[:, :, shared:]
        ot = torch.bmm(pt.view(-1, group * g, width), keys[1]).view(kvh, real, tails, group, g, hd)
        outs = [ot[:, rows, :, place]]
        if blocks is not None:
            ps = weights.new_zeros(groups, kvh, shared, group, g, width)
            ps[of_group, :, :, place] = weights[:, :, :shared]
            ps = ps.permute(1, 0, 2, 3, 4, 5).reshape(kvh, groups, shared, group * g, width)
            os_ = _block_products(ps, blocks[1])
            outs.insert(0, os_.view(groups, kvh, shared, group, g, hd)[of_group, :, :, place])
        total = torch.cat([torch.cat(outs, dim=2).float(), sums], dim=-1).cumsum(2).select(2, -1)
        result = q.new_zeros(rows_in, h, hd) if rows_in > real else q.new_empty(rows_in, h, hd)
        result[:real] = (total[..., :hd] / total[..., hd:]).reshape(real, h, hd)
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


def _attention_rows_match_ar(attn: InvariantAttention, dtype: torch.dtype, device: torch.device, block: int) -> bool:
    """Whether `attn`'s row-invariant attention gives every row of a tree forward bit for bit what
    a one-token (AR) forward gives the same token at the same position, on random queries and
    caches of this dtype and device: a 10-node tree (a 5-deep chain, a sibling beside each node)
    whose rows' keys end on both sides of a block (KEY_BLOCK, KEY_CHUNK) boundary, at two contexts.
    The construction (`_attend_blocked`, `_attend_chunked`) leaves assumptions about the machine:
    that a batched product computes each matrix alike whatever the batch count and the operands'
    batch strides, and a row alike wherever it sits in a product; this tests them where they
    matter. Probed once per shape."""
    key = (attn.n_heads, attn.n_kv_heads, attn.head_dim, dtype, device.type, block,
           ATTENTION_ROWS.get(device.type, block), GATHER_PIECES, EXACT_ATTENTION)
    ok = _ATTENTION_MATCHES_AR.get(key)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        h, kvh, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        parents = [-1, 0, 0, 1, 1, 3, 3, 5, 5, 7]  # chain 0-1-3-5-7-9 with a sibling beside each node
        ancestors = []
        for i, par in enumerate(parents):
            ancestors.append((ancestors[par] if par >= 0 else []) + [i])
        n, ok = len(parents), True
        # rows whose keys end on both sides of a block boundary, with no committed block and with three
        for start in (KEY_CHUNK - 3, 3 * KEY_CHUNK - 3):
            kv = torch.randn(2, kvh, start + n + 8, hd, generator=g, device=device).to(dtype)
            rows = -(-n // block) * block
            q = torch.randn(rows, h, hd, generator=g, device=device).to(dtype)
            tree = attn._attend(q, kv, row_plan(start, ancestors, device, block))
            for i, anc in enumerate(ancestors):
                kv_ar = kv.clone()  # AR's cache holds the row's ancestors in order after the prefix
                kv_ar[:, :, start:start + len(anc)] = kv[:, :, [start + a for a in anc]]
                q_ar = q[i:i + 1].expand(block, h, hd).contiguous()
                ar = attn._attend(q_ar, kv_ar, row_plan(start + len(anc) - 1, [[0]], device, block))
                ok = ok and torch.equal(ar[0], tree[i])
        _ATTENTION_MATCHES_AR[key] = ok
    return ok


class InvariantBlock:
    """`TransformerBlock`'s row-invariant forward (mixed into `runtime.model.llama.TransformerBlock`)."""

    def forward_invariant(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, plan: RowPlan) -> Tensor:
        x = x + self.attention.forward_invariant(self.attention_norm(x), cos, sin, kv, plan)
        return x + by_row_blocks(self.feed_forward, self.ffn_norm(x), plan.block)


class InvariantTransformer:
    """Switching row invariance on (`set_row_invariance`) and the forward it selects
    (`_forward_invariant`, which `Transformer.forward` calls); mixed into
    `runtime.model.llama.Transformer`, whose modules, cache and RoPE tables it uses."""

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
            for norm in (layer.attention_norm, layer.ffn_norm, self.norm):
                if not _norm_rows_match(norm, self.dtype, self.device, rows):
                    raise RuntimeError(
                        f"row invariance is impossible here: this machine's {self.dtype} RMSNorm on {self.device} "
                        "rounds a row by the call's row count or its place in it; use lossless=numerical, and "
                        "report the machine")
            if not self.kernel_decode and not _attention_rows_match_ar(layer.attention, self.dtype, self.device, rows):
                raise RuntimeError(
                    f"row invariance is impossible here: this machine's {self.dtype} attention on {self.device} "
                    "gives a tree row other bits than AR gives the same token (its batched products round a matrix "
                    "by the batch count); use lossless=numerical, and report the machine")
        self.invariant_rows = rows

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
        caches = self._layer_caches
        x = self._run_layers(x, n, lambda i, layer, x: layer.forward_invariant(x, cos, sin, caches[i], plan))
        hidden = self.norm(x)
        # the lm_head too sees blocks of `rows` rows, so a token's logits do not depend on n
        if last_only:  # only the block holding the last token goes through the lm_head
            first = (n - 1) // rows * rows
            out = self.output(hidden[first:first + rows])[n - 1 - first:n - first].float()
        else:
            out = by_row_blocks(self.output, hidden, rows)[:n].float()
        self._cache_len = start + n
        return out.unsqueeze(0), hidden[:n].unsqueeze(0)
