"""Multi-token-prediction draft heads: Medusa, Hydra and Hydra++.

Head d (1-based, d = 1..D) reads the context vector h_t of a committed position t, whose base
argmax is the root token x_{t+1}, and predicts x_{t+1+d}:

* Medusa: head d sees h_t only: ResBlock^L(h_t) -> output layer.
* Hydra: head d also sees the tokens on its path: its first ResBlock maps
  concat(h_t, e(x_{t+1}), ..., e(x_{t+d})) [(d+1)*dim] -> dim with a learned linear residual,
  then L-1 ResBlock(dim) -> output layer. e is the base model's token embedding.
* Hydra++ (`prefix_layer`): h_t is not the base hidden state itself but the output of one extra
  Llama decoder layer (+ final RMSNorm) run causally over the base hidden states, with its own
  KV cache of committed positions.

ResBlock(x) = residual(x) + SiLU(W x + b), W zero-initialised, so a fresh block is its residual
map. The output layer is `shared` (the base lm_head, frozen and never saved: keeps the heads
small enough to ship in git), `own` (Linear dim->V per head, initialised from the base lm_head)
or `draft` (Linear dim->V_draft per head plus an id map to base ids, EAGLE-3 style). `shared`
with a `draft_vocab_size` uses only the base lm_head rows of the V_draft ids in the saved id map
(FR-Spec style: a frequency-ranked draft vocabulary needs no retraining and adds only the ids to
the folder).

Drafting need not be exact (verification keeps decoding lossless), so at inference the output
product may run in cheaper arithmetic than the base model (`draft_dtype`: bfloat16, or int8 with
dynamic activation quantisation); training always uses the exact product.

The heads' own files are `config.json` + `heads.safetensors` (see `save_heads`/`load_heads`), or,
for heads derived from others with the same weights (a draft vocabulary), `config.json` + the new
tensors + a reference to the other folder's weights (`runtime.heads_ref`); published Hydra/Medusa
checkpoints are read by `pipeline.heads.published.read`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import (  # noqa: F401 - re-exported
    CONFIG_FILE,
    DRAFT_DTYPES,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    KINDS,
    OUTPUTS,
    WEIGHTS_FILE,
    HeadsConfig,
    _args_to_dict,
)
from runtime.device import torch_dtype
from runtime.io import atomic_write_bytes, read_weights_config, save_weights_folder
from runtime.model.llama import (
    Linear,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
)
from runtime.model.rope import rope_inv_freq
from runtime.tree import TreeBuffers

if TYPE_CHECKING:
    from runtime.eagle3 import Eagle3Drafter



# ----------------------------------------------------------------------------------------------
# Building blocks


class ResBlock(nn.Module):
    """x -> residual(x) + SiLU(W x + b). W and b start at zero, so a fresh block is its residual map.

    With in_dim == dim the residual is the identity (Medusa, and Hydra's later blocks). Hydra's
    first block shrinks (d+1)*dim to dim with a learned linear residual; we initialise that one
    to pass h_t through (identity on the first dim inputs, zero on the token embeddings), so an
    untrained Hydra head starts as the base lm_head applied to h_t rather than as noise.
    """

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        # runtime.model.Linear: exactly nn.Linear until `add_fast_paths` (load_heads on a CPU in
        # float32), then the small-row products the base model drafts and verifies with
        self.linear = Linear(in_dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # (Medusa zeroes only W; SiLU(b) != 0 would shift h)
        self.residual: nn.Linear | None = None
        if in_dim != dim:
            self.residual = Linear(in_dim, dim)
            with torch.no_grad():
                self.residual.weight.zero_()
                self.residual.weight[:, :dim] = torch.eye(dim)
                self.residual.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        skip = x if self.residual is None else self.residual(x)
        return skip + F.silu(self.linear(x))


class Head(nn.Module):
    """One draft head: L ResBlocks and, unless the output layer is shared, its own projection."""

    def __init__(self, in_dim: int, dim: int, num_layers: int, out_dim: int | None, out_bias: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(in_dim, dim)] + [ResBlock(dim, dim) for _ in range(num_layers - 1)])
        self.out = Linear(dim, out_dim, bias=out_bias) if out_dim is not None else None


class PrefixLayer(nn.Module):
    """Hydra++'s extra decoder layer: one Llama block + final RMSNorm over the base hidden states.

    Uses runtime.model's TransformerBlock (2-D activations [n, dim], a KV cache tensor
    [2, kv_heads, slots, head_dim] written at `start`). Two modes: `step` appends committed
    positions to its own preallocated cache (decoding); `full` runs a whole sequence from an empty
    scratch cache without touching the decoding cache (rollout, training; differentiable).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.block = TransformerBlock(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # a plain attribute, not a buffer: module.to(bfloat16) must not round the RoPE frequencies
        self._inv_freq: Tensor | None = None
        self.kv: Tensor | None = None
        self.cache_len = 0

    def setup_cache(self, max_seq_len: int) -> None:
        a, w = self.args, self.norm.weight
        self.kv = torch.zeros(2, a.n_kv_heads, max_seq_len, a.head_dim, dtype=w.dtype, device=w.device)
        self.cache_len = 0

    def _rope(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        # same float32 recipe as runtime.model.rope.rope_tables, computed for just these positions
        device = self.norm.weight.device
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = rope_inv_freq(self.args, device)
        freqs = torch.outer(input_pos.to(device, torch.float32), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    def _mask(self, start: int, n: int, device: torch.device) -> Tensor | None:
        # the [groups*n, start+n] group-major layout runtime.model's Attention expects
        if n == 1:
            return None
        full = torch.ones(n, start + n, dtype=torch.bool, device=device)
        full[:, start:] = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        return full.repeat(self.args.n_groups, 1)

    def step(self, x: Tensor, input_pos: Tensor) -> Tensor:
        """Append n committed positions x [n, dim] to the cache; return their outputs [n, dim]."""
        if self.kv is None:
            raise RuntimeError("the prefix layer has no cache: call DraftHeads.bind(model) first")
        w = self.norm.weight
        if self.kv.dtype != w.dtype or self.kv.device != w.device:  # heads moved/cast after bind()
            self.kv = self.kv.to(w)
        n, start = x.shape[0], self.cache_len
        if start + n > self.kv.shape[2]:
            raise ValueError(f"the prefix layer's cache holds {self.kv.shape[2]} positions; {start} are used "
                             f"and {n} more do not fit (call reset(), or bind a model with a larger max_seq_len)")
        cos, sin = self._rope(input_pos)
        out = self.norm(self.block(x, cos, sin, self.kv, start, self._mask(start, n, x.device)))
        self.cache_len = start + n
        return out

    def full(self, x: Tensor, input_pos: Tensor) -> Tensor:
        """Causal pass over a whole sequence x [n, dim] (from an empty context); [n, dim]."""
        a, n = self.args, x.shape[0]
        kv = torch.zeros(2, a.n_kv_heads, n, a.head_dim, dtype=x.dtype, device=x.device)
        cos, sin = self._rope(input_pos)
        return self.norm(self.block(x, cos, sin, kv, 0, self._mask(0, n, x.device)))


class _BaseRefs:
    """Holds the bound base model's embedding and lm_head outside the module tree, so they are
    never saved, moved, cast or trained along with the heads."""

    def __init__(self, embed: nn.Embedding, lm_head: nn.Linear) -> None:
        self.embed = embed
        self.lm_head = lm_head


# ----------------------------------------------------------------------------------------------
# The heads


class DraftHeads(nn.Module):
    """D draft heads over a base model (see the module docstring). Call `bind(model)` first."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = c = config
        dim = c.hidden_size
        out_dim = {"shared": None, "own": c.vocab_size, "draft": c.draft_vocab_size}[c.output]
        self.prefix = PrefixLayer(c.prefix_args()) if c.prefix_layer else None
        self.heads = nn.ModuleList(
            Head((d + 1) * dim if c.kind == "hydra" else dim, dim, c.num_layers, out_dim, bool(c.output_bias))
            for d in range(1, c.num_heads + 1)
        )
        if c.draft_vocab_size is not None:
            # base id of each draft-vocabulary entry (filled by training or by loading)
            self.register_buffer("draft_ids", torch.arange(c.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_ids = None
        self.dropout = nn.Dropout(c.dropout)
        self._base: _BaseRefs | None = None
        # the drafting output product, built on first use (see `draft_output`): not a submodule,
        # so it is never saved, cast or trained
        self._draft_out: _DraftOutput | None = None

    # -- binding and state ----------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0].blocks[0].linear.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.heads[0].blocks[0].linear.weight.device

    @property
    def is_bound(self) -> bool:
        return self._base is not None

    @property
    def max_depth(self) -> int:
        """The deepest tree the heads draft: one token per head (runtime.decoder's `Drafter`)."""
        return self.config.num_heads

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the drafter reads (`Transformer.capture_aux`): none, heads
        read the final hidden states."""
        return ()

    def add_fast_paths(self) -> None:
        """For inference only (load_heads calls it): every runtime.model.Linear of the heads takes
        the CPU float32 product paths the base model uses (see `Linear`); a no-op elsewhere.
        Call again after changing the weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.add_fast_paths()

    def bind(self, model: Transformer) -> None:
        """Use `model`'s token embeddings (Hydra) and lm_head (shared output); size the prefix cache."""
        a, c = model.args, self.config
        if a.dim != c.hidden_size or a.vocab_size != c.vocab_size:
            raise ValueError(f"heads were built for hidden_size={c.hidden_size}, vocab_size={c.vocab_size} but the "
                             f"model has dim={a.dim}, vocab_size={a.vocab_size}: these heads belong to another model")
        self._base = _BaseRefs(model.tok_embeddings, model.output)
        self._draft_out = None
        if self.prefix is not None:
            slots = getattr(model, "max_seq_len", 0) or a.max_position_embeddings
            self.prefix.setup_cache(int(slots))

    def init_output_from_base(self) -> None:
        """Copy the bound lm_head into own/draft output layers (Hydra and Medusa do this before training)."""
        if self.config.output == "shared":
            return
        w = self._refs().lm_head.weight
        rows = w if self.draft_ids is None else w[self.draft_ids.to(w.device)]
        with torch.no_grad():
            for head in self.heads:
                head.out.weight.copy_(rows.to(head.out.weight))
                if head.out.bias is not None:
                    head.out.bias.zero_()

    def set_draft_vocab(self, base_ids: Tensor) -> None:
        """Set the draft vocabulary (distinct base ids, length draft_vocab_size)."""
        if self.draft_ids is None:
            raise ValueError("set_draft_vocab needs output='draft'")
        ids = base_ids.to(torch.long).flatten()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, the config says {self.config.draft_vocab_size}")
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft ids must be distinct base ids in [0, {self.config.vocab_size})")
        self.draft_ids.copy_(ids.to(self.draft_ids.device))
        self._draft_out = None

    def reset(self) -> None:
        """Forget every observed position (start of a new sequence)."""
        if self.prefix is not None:
            self.prefix.cache_len = 0

    # -- one decoding state per sequence (a batch decodes several) --------------------------------

    def new_state(self) -> tuple[Tensor, int] | None:
        """An empty decoding state for another sequence: the Hydra++ prefix layer's cache and its
        length (None for heads without a prefix layer, which keep no state)."""
        if self.prefix is None or self.prefix.kv is None:
            return None
        return torch.zeros_like(self.prefix.kv), 0

    def save_state(self) -> tuple[Tensor, int] | None:
        """The current sequence's decoding state (see `new_state`), to `load_state` later."""
        return None if self.prefix is None or self.prefix.kv is None else (self.prefix.kv, self.prefix.cache_len)

    def load_state(self, state: tuple[Tensor, int] | None) -> None:
        """Continue the sequence whose state `save_state` (or `new_state`) returned."""
        if state is not None:
            assert self.prefix is not None, "a decoding state of heads with a prefix layer"
            self.prefix.kv, self.prefix.cache_len = state

    def _refs(self) -> _BaseRefs:
        if self._base is None:
            raise RuntimeError("the heads are not bound to a base model: call heads.bind(model) first")
        return self._base

    # -- context vectors -------------------------------------------------------------------------

    def observe(self, hidden: Tensor, input_pos: Tensor, next_tokens: Tensor | None = None,
                features: Tensor | None = None) -> Tensor:
        """Feed the base hidden states [1, n, dim] of n newly committed positions (absolute
        positions input_pos [n]); return the context vector [1, dim] of the last one.

        Without a prefix layer this is the last hidden state itself; Hydra++ appends the positions
        to its prefix layer's cache first. `next_tokens` (the tokens after those positions) and
        `features` (the target's aux features) are what an EAGLE-3 drafter observes
        (runtime.decoder's `Drafter` protocol); heads ignore them."""
        _check_hidden(hidden, input_pos, self.config.hidden_size)
        if self.prefix is None:
            return hidden[:, -1]
        with torch.no_grad():
            out = self.prefix.step(hidden[0].to(self.dtype), input_pos)
        return out[-1:]

    def context(self, hidden: Tensor, input_pos: Tensor | None = None) -> Tensor:
        """Context vectors [n, dim] for a whole sequence of base hidden states ([1, n, dim] or
        [n, dim], positions default 0..n-1), computed from scratch: the decoding cache is left
        alone. This is what `teacher_forced_logits` expects as `h`. Differentiable (training)."""
        x = hidden[0] if hidden.dim() == 3 else hidden
        if x.dim() != 2 or (hidden.dim() == 3 and hidden.shape[0] != 1):
            raise ValueError(f"hidden must be [1, n, dim] or [n, dim], got {tuple(hidden.shape)}")
        if input_pos is None:
            input_pos = torch.arange(x.shape[0], device=x.device)
        _check_hidden(x[None], input_pos, self.config.hidden_size)
        if self.prefix is None:
            return x
        return self.prefix.full(x.to(self.dtype), input_pos)

    # -- head computations (shared by drafting, rollout and training) ---------------------------

    def embed(self, tokens: Tensor) -> Tensor:
        emb = self._refs().embed.weight
        return F.embedding(tokens.to(emb.device), emb).to(self.dtype)

    def head_states(self, h: Tensor, next_tokens: Tensor | None, heads: int | None = None) -> Tensor:
        """Last ResBlock outputs [M, D', dim] of heads 1..D' (D' = heads or num_heads) for context
        vectors h [M, dim]; Hydra head d reads next_tokens[:, :d] (the root and the tokens before
        its target). Dropout applies in training mode."""
        n = heads or self.config.num_heads
        x0 = self.dropout(h.to(self.dtype))
        states = []
        if self.config.kind == "hydra":
            if next_tokens is None or next_tokens.dim() != 2 or next_tokens.shape[0] != h.shape[0] or next_tokens.shape[1] < n:
                raise ValueError(f"Hydra heads need next_tokens [M={h.shape[0]}, >= {n}], got "
                                 f"{None if next_tokens is None else tuple(next_tokens.shape)}")
            emb = self.dropout(self.embed(next_tokens[:, :n]))            # [M, n, dim]
            parts = [x0]
            for d in range(1, n + 1):
                parts.append(emb[:, d - 1])
                states.append(self._blocks(d, torch.cat(parts, dim=-1)))
        else:
            states = [self._blocks(d, x0) for d in range(1, n + 1)]
        return torch.stack(states, dim=1)

    def _blocks(self, d: int, x: Tensor) -> Tensor:
        for i, block in enumerate(self.heads[d - 1].blocks):
            x = block(x if i == 0 else self.dropout(x))
        return x

    def output_logits(self, states: Tensor, first_head: int = 1) -> Tensor:
        """Output-layer logits [..., k, V_out] for head states [..., k, dim] of heads
        first_head..first_head+k-1 (V_out = draft_vocab_size for output='draft')."""
        x = self.dropout(states)
        if self.config.output == "shared":
            lm_head = self._refs().lm_head
            if self.training or torch.is_grad_enabled() or (self.draft_ids is None and self.config.draft_dtype is None):
                # exact product through the module, on 2-D rows: the base model's CPU fast paths
                # (runtime.model.Linear) then apply to drafting too, where it is most of a head's cost
                flat = x.to(lm_head.weight.dtype).reshape(-1, x.shape[-1])
                logits = lm_head(flat).reshape(*x.shape[:-1], -1)
                if self.draft_ids is not None:
                    logits = logits.index_select(-1, self.draft_ids.to(logits.device))
                return logits
            return self.draft_output()(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        k = states.shape[-2]
        return torch.stack([self.heads[first_head - 1 + j].out(x[..., j, :]) for j in range(k)], dim=-2)

    def candidate_logits(self, states: Tensor, candidates: Tensor) -> Tensor:
        """Logits [M, D, C] of heads 1..D (states [M, D, dim]) for output ids `candidates` [C] only
        (output-vocabulary ids: draft ids for output='draft'). Training's sampled softmax."""
        x = self.dropout(states)
        if self.config.output == "shared":
            w = self._refs().lm_head.weight
            rows = candidates.to(w.device)
            if self.draft_ids is not None:
                rows = self.draft_ids.to(w.device)[rows]
            return x.to(w.dtype) @ w[rows].T
        outs = []
        for j in range(states.shape[-2]):
            out = self.heads[j].out
            b = None if out.bias is None else out.bias[candidates]
            outs.append(F.linear(x[..., j, :], out.weight[candidates], b))
        return torch.stack(outs, dim=-2)

    def draft_output(self) -> _DraftOutput:
        """The inference-time output product of a shared output layer: the base lm_head rows of
        the draft vocabulary (all rows without one) in the arithmetic `config.draft_dtype` names,
        built on first use and rebuilt when the heads or the bound model move or change dtype."""
        lm_head = self._refs().lm_head
        w = lm_head.weight
        key = (w.data_ptr(), w.dtype, w.device, self.dtype, self.config.draft_dtype,
               None if self.draft_ids is None else self.draft_ids.data_ptr())
        if self._draft_out is None or self._draft_out.key != key:
            rows = w.detach() if self.draft_ids is None else w.detach()[self.draft_ids.to(w.device)]
            arith = self.config.draft_dtype
            if arith == "auto":
                arith = choose_draft_dtype(rows.shape[0], rows.shape[1], w.device, w.dtype)
            self._draft_out = _DraftOutput(rows, arith, key)
        return self._draft_out

    def to_base_logits(self, logits: Tensor) -> Tensor:
        """Map draft-vocabulary logits [..., V_draft] to base-vocabulary ones (-inf elsewhere)."""
        if self.draft_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), -math.inf)
        return full.index_copy_(-1, self.draft_ids.to(logits.device), logits)

    def teacher_forced_logits(self, h: Tensor, next_tokens: Tensor) -> Tensor:
        """Float32 logits [T, D, V] of every head at every position, given the true tokens.

        h [T, dim] are context vectors (`context()` of the base hidden states; for heads without a
        prefix layer that is the hidden states themselves); next_tokens [T, D] holds
        x_{t+1..t+D} (root first); head d reads next_tokens[t, :d]. Medusa ignores next_tokens."""
        if h.dim() != 2 or h.shape[1] != self.config.hidden_size:
            raise ValueError(f"h must be [T, {self.config.hidden_size}], got {tuple(h.shape)}")
        states = self.head_states(h, next_tokens)
        return self.to_base_logits(self.output_logits(states).float())

    # -- drafting ------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, h: Tensor, root_token: int | Tensor, buffers: TreeBuffers) -> Tensor:
        """Draft a tree: LongTensor [N] of tokens in node order, index 0 = root_token.

        A depth-d node takes the ranks[node]-th most likely token of head d. Medusa runs all heads
        once from h; Hydra runs head d on the distinct parents at depth d-1 (their path embeddings
        batched), so the work is one small batch per depth, with topk only as wide as the tree
        needs there (`buffers.topk`). Every index comes precomputed with the buffers, which must
        live on the heads' device: no host synchronisation happens here."""
        return self._draft_tree(h.reshape(1, -1), root_token, buffers, None)[0]

    @torch.no_grad()
    def propose_batch(self, h: Tensor, root_tokens: Tensor | Sequence[int], buffers: TreeBuffers,
                      states: Sequence[Any] | None = None) -> Tensor:
        """`propose` for B sequences that draft the same tree: context vectors h [B, dim] and their
        roots [B] give tokens [B, N]. One head product per depth over the B sequences' rows
        together: the heads' weights are read once per level rather than once per sequence, which
        is most of a level's cost while the rows are few (a batched decode's drafting). `states`
        (each sequence's `save_state()`, runtime.decoder's `Drafter` protocol) is not needed:
        drafting reads h alone."""
        if h.dim() != 2:
            raise ValueError(f"h must be [B, dim] for a batch of context vectors, got {tuple(h.shape)}")
        roots = torch.as_tensor(root_tokens, dtype=torch.long, device=h.device)
        if roots.shape != (h.shape[0],):
            raise ValueError(f"{h.shape[0]} context vectors but root tokens of shape {tuple(roots.shape)}")
        return self._draft_tree(h, roots, buffers, None)

    @torch.no_grad()
    def propose_scored(self, h: Tensor, root_token: int | Tensor, buffers: TreeBuffers,
                       stop_after: Callable[[int, Tensor], bool] | None = None) -> tuple[Tensor, Tensor]:
        """`propose`, plus each node's head probability: (tokens [N], node_prob [N] float32), where
        node_prob[i] is softmax of the logits of the head that drafted node i (at its parent, as
        `propose` runs it) at node i's token, over the head's output vocabulary; the root's is 1.

        A dynamic tree policy multiplies these along each path (EAGLE-2's path value) to choose,
        every step, which nodes of a super-tree to verify (`runtime.dynamic`). Same work as
        `propose` plus one softmax pass over each head's logits; no host synchronisation unless
        `stop_after` synchronises.

        `stop_after(d, node_prob)`, when given, is asked after each depth d < the tree's depth, with
        node_prob [N] filled down to depth d; True ends the drafting there: deeper nodes are not
        drafted (their node_prob is 0 and their tokens are undefined). Hydra heads then skip the
        deeper heads' work; Medusa heads draft every depth in one product, so only the answer is
        the same."""
        node_prob = torch.ones(1, buffers.num_nodes, dtype=torch.float32, device=h.device)
        tokens = self._draft_tree(h.reshape(1, -1), root_token, buffers, node_prob, stop_after)[0]
        return tokens, node_prob[0]

    def greedy_top1(self, h: Tensor, root: int | Tensor) -> list[float]:
        """p_1..p_D: each head's top-1 probability along the heads' own greedy chain from `root`
        (the chain's tokens stay on the device; the D probabilities come back in one transfer)."""
        D = self.config.num_heads
        h = h.reshape(1, -1)
        tokens = torch.full((1, D), int(root), dtype=torch.long, device=h.device)
        probs = torch.empty(D, dtype=torch.float32, device=h.device)
        for d in range(1, D + 1):
            states = self.head_states(h, tokens, heads=d)[:, -1:]          # head d only
            top = torch.softmax(self.output_logits(states, first_head=d)[0, 0].float(), -1).max(-1)
            probs[d - 1] = top.values
            if d < D:
                tokens[0, d] = top.indices if self.draft_ids is None else self.draft_ids[top.indices]
        return probs.tolist()

    def _draft_tree(self, h: Tensor, root_token: int | Tensor, buffers: TreeBuffers,
                    node_prob: Tensor | None, stop_after: Callable[[int, Tensor], bool] | None = None) -> Tensor:
        """The drafting behind the `propose*` methods, for B sequences (h [B, dim], roots an int or
        [B]) drafting one tree: tokens [B, N]; fills node_prob[:, 1:] ([B, N]) when given. The
        rows of all B sequences go through each head product together. `stop_after` (B = 1 and
        node_prob given): see `propose_scored`."""
        depth = len(buffers.depth_slices)
        if depth > self.config.num_heads:
            raise ValueError(f"the tree has depth {depth} but the heads draft only {self.config.num_heads} tokens")
        if buffers.depths.device != h.device:
            raise ValueError(f"the tree buffers live on {buffers.depths.device} but the context vector on {h.device}: "
                             "move them with buffers.to(device) once, not per step")
        h = h.to(self.dtype)
        b = h.shape[0]
        tokens = torch.empty(b, buffers.num_nodes, dtype=torch.long, device=h.device)
        tokens[:, 0] = root_token
        if depth == 0:
            return tokens
        v_out = self.config.draft_vocab_size or self.config.vocab_size
        if max(buffers.topk) > v_out:
            raise ValueError(f"the tree asks for rank {max(buffers.topk) - 1} but a head has only {v_out} candidates")
        ranks = buffers.ranks
        seqs = torch.arange(b, device=h.device)[:, None] if node_prob is not None else None

        if self.config.kind == "medusa":
            states = self.head_states(h, None, heads=depth)                 # [B, depth, dim]
            logits = self.output_logits(states)                            # [B, depth, V_out]
            picked = logits.topk(max(buffers.topk), dim=-1).indices[:, buffers.draft_heads, ranks[1:]]
            tokens[:, 1:] = picked if self.draft_ids is None else self.draft_ids[picked]
            if node_prob is not None:  # one fused softmax pass (about half of a log-sum-exp's cost)
                node_prob[:, 1:] = torch.softmax(logits.float(), dim=-1)[seqs, buffers.draft_heads, picked]
                for d in range(1, depth) if stop_after is not None else ():
                    if stop_after(d, node_prob[0]):
                        node_prob[:, buffers.depth_slices[d][0]:] = 0.0
                        break
            return tokens

        # Hydra: inputs[s, i] = concat(h_s, e(root_s), e(tokens on node i's path)) for nodes of depth d-1
        inputs = torch.cat([h, self.embed(tokens[:, 0])], dim=-1)[:, None]   # [B, 1, 2*dim]
        for d, (start, end) in enumerate(buffers.depth_slices, start=1):
            rows = inputs.index_select(1, buffers.unique_parents[d - 1])      # parents with children [B, u, .]
            u = rows.shape[1]
            x = self._blocks(d, rows.reshape(b * u, -1))
            logits = self.output_logits(x[:, None, :], first_head=d)[:, 0]  # [B*u, V_out]
            top = logits.topk(buffers.topk[d - 1], dim=-1).indices.view(b, u, -1)
            picked = top[:, buffers.parent_inverse[d - 1], ranks[start:end]]  # [B, n_d]
            tok = picked if self.draft_ids is None else self.draft_ids[picked]
            tokens[:, start:end] = tok
            if node_prob is not None:  # one fused softmax pass (about half of a log-sum-exp's cost)
                probs = torch.softmax(logits.float(), dim=-1).view(b, u, -1)
                node_prob[:, start:end] = probs[seqs, buffers.parent_inverse[d - 1], picked]
            if d < depth:
                if stop_after is not None and stop_after(d, node_prob[0]):
                    node_prob[:, end:] = 0.0
                    break
                inputs = torch.cat([inputs.index_select(1, buffers.parent_slots[d - 1]), self.embed(tok)], dim=-1)
        return tokens


class _DraftOutput:
    """The drafting output product y = x W^T for output rows W [V_out, dim] in one arithmetic:

    * None: W's own dtype, with runtime.model.Linear's CPU float32 fast paths;
    * "float32": the same in float32;
    * "bfloat16": W in bfloat16, activations cast (exact to ~3 significant digits);
    * "int8": W quantised per output row to int8, activations quantised per call (torch's dynamic
      quantised Linear, fbgemm/x86 kernels; CPU only).
    Logits come back as float32 except for None, which keeps W's dtype (as the base lm_head does)."""

    def __init__(self, rows: Tensor, arithmetic: str | None, key: tuple[Any, ...]) -> None:
        self.key = key
        self.arithmetic = arithmetic
        dim = rows.shape[1]
        if arithmetic == "int8":
            if rows.device.type != "cpu":
                raise ValueError(f"draft_dtype='int8' runs on the CPU only (heads are on {rows.device}); "
                                 "use 'bfloat16', 'float32' or 'auto'")
            self.layer = _int8_linear(rows)
        elif arithmetic == "bfloat16":
            self.weight = rows.to(torch.bfloat16).contiguous()
        else:
            dtype = rows.dtype if arithmetic is None else torch.float32
            with torch.device("meta"):  # no throw-away random init of a V_out x dim matrix
                self.layer = Linear(dim, rows.shape[0], bias=False)
            self.layer.weight = nn.Parameter(rows.to(dtype).contiguous(), requires_grad=False)
            if rows.device.type == "cpu" and dtype == torch.float32:
                self.layer.add_fast_paths()
            self.layer.requires_grad_(False)

    def __call__(self, x: Tensor) -> Tensor:
        """Logits [n, V_out] for rows x [n, dim]."""
        if self.arithmetic == "bfloat16":
            return F.linear(x.to(torch.bfloat16), self.weight).float()
        if self.arithmetic == "int8":
            return self.layer(x.float())
        return self.layer(x.to(self.layer.weight.dtype))


def _int8_linear(rows: Tensor) -> nn.Module:
    """torch's dynamic int8 Linear over rows [V_out, dim] (per-row weight scales)."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with torch.device("meta"):
        lin = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    lin.weight = nn.Parameter(rows.detach().float().contiguous(), requires_grad=False)
    with warnings.catch_warnings():  # torch announces the eager API's move to torchao on every call
        warnings.simplefilter("ignore")
        q = quantize_dynamic(nn.Sequential(lin), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    return q.eval()


def draft_arithmetics(device: torch.device) -> list[str]:
    """The drafting arithmetics that run on `device` here (int8 needs torch's x86/fbgemm CPU kernels)."""
    out = ["float32", "bfloat16"]
    if device.type == "cpu" and {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        out.append("int8")
    return out


_DRAFT_DTYPE_CHOICE: dict[tuple[Any, ...], str] = {}


def choose_draft_dtype(v_out: int, dim: int, device: torch.device, base_dtype: torch.dtype,
                       repeats: int = 15) -> str:
    """`draft_dtype: auto`: the fastest drafting arithmetic for a [v_out, dim] output product on
    this machine, timed on random weights at 1 and 4 rows (a Hydra depth with one parent, a
    Medusa tree's heads) with interleaved repeats, medians; measured once per process and shape.
    Any choice keeps decoding lossless; only the drafts, and so the acceptance, can change."""
    import time

    key = (v_out, dim, str(device), base_dtype)
    if key in _DRAFT_DTYPE_CHOICE:
        return _DRAFT_DTYPE_CHOICE[key]
    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(v_out, dim, generator=gen) / math.sqrt(dim)).to(device=device, dtype=base_dtype)
    layers = {a: _DraftOutput(rows, a, ()) for a in draft_arithmetics(device)}
    inputs = [torch.randn(n, dim, generator=gen).to(device=device, dtype=base_dtype) for n in (1, 4)]
    times: dict[str, list[float]] = {a: [] for a in layers}
    with torch.inference_mode():
        for layer in layers.values():  # warm-up (first calls allocate and pick kernels)
            for x in inputs:
                layer(x)
        for _ in range(repeats):
            for a, layer in layers.items():
                t0 = time.perf_counter()
                for x in inputs:
                    layer(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[a].append(time.perf_counter() - t0)
    best = min(times, key=lambda a: sorted(times[a])[len(times[a]) // 2])
    _DRAFT_DTYPE_CHOICE[key] = best
    return best


def _check_hidden(hidden: Tensor, input_pos: Tensor, dim: int) -> None:
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != dim or hidden.shape[1] == 0:
        raise ValueError(f"hidden must be [1, n >= 1, {dim}], got {tuple(hidden.shape)}")
    if input_pos.shape != (hidden.shape[1],):
        raise ValueError(f"input_pos must have shape [{hidden.shape[1]}], got {tuple(input_pos.shape)}")


# ----------------------------------------------------------------------------------------------
# Our own format: config.json + heads.safetensors, or a reference to another folder's (no pickle)


def check_base_fingerprint(config: HeadsConfig, expected: str | None, where: str = "heads") -> None:
    """Refuse heads trained on another base model (fingerprints differ). None skips the check."""
    if expected is None:
        return
    if config.base_fingerprint is None:
        raise ValueError(f"{where} record no base_fingerprint, so they cannot be checked against base model "
                         f"{expected}; retrain them (or load without a fingerprint to skip the check)")
    if config.base_fingerprint != expected:
        raise ValueError(f"{where} were trained on base model {config.base_fingerprint} but the model in use is "
                         f"{expected}: retrain the heads for this model (e.g. `make heads`)")


def save_heads(heads: DraftHeads, folder: str | Path, dtype: torch.dtype | None = None,
               weights_from: str | Path | None = None) -> Path:
    """Write config.json + heads.safetensors (the heads' own weights only, never the shared
    lm_head or the embeddings), each atomically. `dtype` casts the floating weights (bf16 halves
    the size of shipped heads).

    `weights_from`: a heads folder whose heads.safetensors holds, bit for bit, every tensor of
    these heads it names (the heads these were derived from, e.g. by adding a draft vocabulary).
    Then `folder` refers to those instead of copying them (`runtime.heads_ref`): it holds
    config.json, the other tensors and the reference; `load_heads` gives the same heads, and
    `heads_fingerprint` the same fingerprint, as the self-contained folder would."""
    from runtime.heads_ref import OWN_FILE, REF_FILE

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **heads.config.to_dict()}
    if weights_from is None:
        save_weights_folder(heads, meta, folder, WEIGHTS_FILE, CONFIG_FILE, dtype, what="heads weights")
        for stale in (REF_FILE, OWN_FILE):  # a referring save this one replaces
            (Path(folder) / stale).unlink(missing_ok=True)
        return Path(folder)
    return _save_referring(heads, meta, Path(folder), Path(weights_from), dtype)


def _save_referring(heads: DraftHeads, meta: dict[str, Any], folder: Path, base: Path,
                    dtype: torch.dtype | None) -> Path:
    """`save_heads(..., weights_from=base)`: the self-contained folder is written aside first, so
    that what is referred to is checked against exactly the tensors `save_heads` writes, and the
    fingerprint of its weights file (header in canonical order, `canonical_safetensors`) is the
    one recorded."""
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save

    from runtime.fingerprint import files_fingerprint
    from runtime.heads_ref import OWN_FILE, canonical_safetensors, write_weights_ref

    base_file = base / WEIGHTS_FILE
    if not base_file.is_file():
        raise FileNotFoundError(f"{base_file} not found: weights_from must be a heads folder that holds its own "
                                f"{WEIGHTS_FILE}")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".self-contained-", dir=folder) as scratch:
        whole = Path(scratch)
        save_weights_folder(heads, meta, whole, WEIGHTS_FILE, CONFIG_FILE, dtype, what="heads weights")
        wfile = whole / WEIGHTS_FILE
        wfile.write_bytes(canonical_safetensors(wfile.read_bytes()))
        fingerprint = files_fingerprint([wfile], cache=None)
        with safe_open(str(whole / WEIGHTS_FILE), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        shutil.copyfile(whole / CONFIG_FILE, folder / CONFIG_FILE)
    own = {}
    with safe_open(str(base_file), framework="pt") as f:
        base_keys = set(f.keys())  # noqa: SIM118
        for k, v in state.items():
            if k not in base_keys:
                own[k] = v
                continue
            b = f.get_tensor(k)
            if b.dtype != v.dtype or b.shape != v.shape or not torch.equal(_bits(b), _bits(v)):
                raise ValueError(f"tensor {k} of these heads differs from the one in {base_file} ({v.dtype} "
                                 f"{tuple(v.shape)} vs {b.dtype} {tuple(b.shape)}, or other values): they cannot "
                                 "refer to it; save them without weights_from")
    extra = sorted(base_keys - set(state))
    if extra:
        raise ValueError(f"{base_file} holds tensors these heads do not have ({extra[:5]}): it is not the folder "
                         "they were derived from")
    atomic_write_bytes(folder / OWN_FILE, save(own, metadata={"format": "pt", "entmtp": f"{FORMAT}-own"}))
    write_weights_ref(folder, base, fingerprint)
    (folder / WEIGHTS_FILE).unlink(missing_ok=True)  # a self-contained save this one replaces
    return folder


def _bits(t: Tensor) -> Tensor:
    """A tensor's bytes (bitwise comparison: torch.equal calls -0.0 and 0.0 equal)."""
    return t.contiguous().flatten().view(torch.uint8)


def read_heads_config(folder: str | Path) -> tuple[HeadsConfig, str]:
    """(config, stored dtype name) of a heads folder, validated."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a heads folder holds {CONFIG_FILE} + {WEIGHTS_FILE} "
                                "(train them with `make heads`; published checkpoints load with pipeline.heads.published.read)")
    raw, dtype = read_weights_config(path, FORMAT, FORMAT_VERSION, "heads", "published Hydra/Medusa folders load "
                                     "with pipeline.heads.published.read.load_published")
    try:
        return HeadsConfig.from_dict(raw), dtype
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def load_state_strict(module: nn.Module, state: dict[str, Tensor], where: str, assign: bool = False) -> None:
    """load_state_dict that names every missing / unexpected key and every shape mismatch.

    assign=True hands the given tensors to the module as they are (their dtype and device; for a
    module built on the `meta` device, which has no storage to copy into)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k in sorted(set(expected) & set(state)):
        if tuple(state[k].shape) != tuple(expected[k].shape):
            problems.append(f"{k}: shape {tuple(state[k].shape)}, expected {tuple(expected[k].shape)}")
        elif state[k].is_floating_point() != expected[k].is_floating_point():
            problems.append(f"{k}: dtype {state[k].dtype}, expected a {'float' if expected[k].is_floating_point() else 'integer'} tensor")
    if problems:
        raise ValueError(f"{where} does not match the heads config: " + "; ".join(problems))
    if assign:
        module.load_state_dict(state, strict=True, assign=True)
    else:
        module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def build_heads(config: HeadsConfig, state: dict[str, Tensor], where: str, dtype: torch.dtype,
                device: torch.device | str) -> DraftHeads:
    """DraftHeads built on the `meta` device (no memory, no random init) that take `state`'s
    tensors, each cast to `dtype` (floating ones) and placed on `device` as it goes."""
    device = torch.device(device)
    with torch.device("meta"):
        heads = DraftHeads(config)
    expected = heads.state_dict()
    placed = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else expected[k].dtype
                      if k in expected else v.dtype) for k, v in state.items()}
    load_state_strict(heads, placed, where, assign=True)
    return heads


def load_heads(folder: str | Path, model: Transformer | None = None, dtype: torch.dtype | None = None,
               base_fingerprint: str | None = None) -> DraftHeads | Eagle3Drafter:
    """Load heads saved by `save_heads`. With `model` they are bound to it (and cast to its dtype
    unless `dtype` is given); with `base_fingerprint` heads trained on another model are refused.

    A folder written by `runtime.eagle3.save_drafter` (its config.json's format tag) loads as an
    `Eagle3Drafter` instead, checked against and bound to `model` (the decoder drives either; see
    runtime.decoder's `Drafter`). A drafter records no base fingerprint, so `base_fingerprint` is
    not checked for it (a bank's heads fingerprint still ties it to its drafter file)."""
    from safetensors import safe_open

    folder = Path(folder)
    if is_drafter_folder(folder):
        from runtime.eagle3 import load_drafter

        return load_drafter(folder, model=model, dtype=dtype)
    config, stored = read_heads_config(folder)
    check_base_fingerprint(config, base_fingerprint, where=f"heads in {folder}")
    files = heads_weight_files(folder)
    state: dict[str, Tensor] = {}
    for wfile in files:
        with safe_open(str(wfile), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if k in state:
                    raise ValueError(f"{files[0]} and {wfile} both hold {k}: a referring folder's own tensors "
                                     "are the ones its base lacks; rebuild it")
                state[k] = f.get_tensor(k)
        bad = sorted(k for k, v in state.items() if v.is_floating_point() and v.dtype != torch_dtype(stored))
        if bad:
            raise ValueError(f"{wfile}: tensors {bad[:5]} are not {stored} as {folder / CONFIG_FILE} says; the files "
                             "do not belong together")
    where = str(files[0]) if len(files) == 1 else f"{folder} (with the weights of {files[0]})"
    target = dtype or (model.dtype if model is not None else torch_dtype(stored))
    heads = build_heads(config, state, where, target, model.device if model is not None else "cpu")
    if model is not None:
        heads.bind(model)
    heads = heads.eval().requires_grad_(False)
    heads.add_fast_paths()
    return heads


def heads_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files whose tensors together make the heads of `folder`: its
    heads.safetensors, or, for a folder that refers to another's weights (`runtime.heads_ref`),
    that folder's heads.safetensors and its own tensors, after checking both checksums."""
    from runtime.heads_ref import REF_FILE, checked_files, is_referring_folder

    folder = Path(folder)
    if is_referring_folder(folder):
        _, base_file, own_file = checked_files(folder)
        return [base_file, own_file]
    wfile = folder / WEIGHTS_FILE
    if not wfile.is_file():
        raise FileNotFoundError(f"{wfile} not found next to {CONFIG_FILE} (nor a {REF_FILE} naming the folder that "
                                "holds the weights)")
    return [wfile]


def is_drafter_folder(folder: str | Path) -> bool:
    """Whether `folder` holds an EAGLE-3 drafter of ours (config.json tagged by
    `runtime.eagle3.save_drafter`) rather than heads."""
    from runtime.eagle3 import FORMAT as DRAFTER_FORMAT

    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == DRAFTER_FORMAT
