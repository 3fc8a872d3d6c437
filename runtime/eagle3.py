"""EAGLE-3 drafter: one decoder layer over fused target features, with its own KV cache.

What it computes (the design's section 9; the published EAGLE-3 / speculators / vLLM layer):

* the target model's residual stream at a few layers (`Eagle3Config.aux_layer_ids`, low, mid and
  high by default) is concatenated per position and fused by `fc` (a bias-free Linear,
  k*hidden -> hidden) into a feature f_t;
* the draft layer reads two inputs per row: a "hidden" input h (the fused feature fc(f_t) for a
  committed row, or for a drafted row the draft layer's own output at the row's parent) and the
  token embedding e of the row's token (the TARGET's embedding table, shared, never stored here).
  Its attention input is concat(input_layernorm(e), hidden_norm(h)) [2*hidden] (so q/k/v take
  2*hidden inputs), its residual is h (or hidden_norm(h) with `norm_before_residual`), then a
  post-attention RMSNorm and a SwiGLU MLP with their residual as in Llama;
* the layer's output (before any norm) is the row's draft state g; `norm` + `lm_head` turn g
  into logits over a reduced draft vocabulary of V_d ids, mapped to target ids by
  `d2t` (target id = draft id + d2t[draft id]); `t2d` is the boolean mask of the target ids that
  are in the draft vocabulary.

Pairing and positions (as EAGLE trains and runs it): the committed row i of the draft cache
pairs the target's features of position i with the TRUE token at position i + 1, and sits at
RoPE position i. So after a prompt x_0..x_{P-1} whose next token (the root) is x_P,
`extend(f_0..f_{P-1}, [x_1, ..., x_P])` writes rows 0..P-1 and returns g_{P-1}, whose logits
propose x_{P+1} (depth 1 of the tree below root x_P). After a verify step that started at root
position s and accepted a drafts, the target's features of positions s..s+a (the root and the
accepted nodes, from the verify forward) pair with the tokens at s+1..s+a+1 (the accepted drafts
and the bonus token, the next root): `extend(f_s..f_{s+a}, [d_1, ..., d_a, bonus])`. The draft
cache then holds exactly one row per committed target position, and its rows are functions of
the true prefix only: drafted rows are never kept (they are written past the committed length
and overwritten by the next draft), which is what makes depth-d candidates along the accepted
path depend on the true prefix alone (EAGLE rebuilds its cache the same way). A constant offset
of every position (speculators trains at i + 1) changes nothing: RoPE attention depends on
position differences only.

Drafting a tree (`propose_tree`): depth-1 candidates come from g of the last committed row (what
`extend` returned); for each depth d >= 1, the depth-d nodes that have children (the frontier)
run ONE forward of the draft layer together: node i's row reads (g of its parent, its own token)
at position (last committed position + d) and attends to every committed row plus its own
ancestors among the drafted rows (and itself); each frontier row's top-k (k = the tree's widest
rank at depth d + 1) gives its children by rank. One layer forward per depth, no host
synchronisation, indices precomputed in `runtime.tree.TreeBuffers`; the output is target token
ids per node in `TreeBuffers` order, exactly as `runtime.heads.DraftHeads.propose` returns them.

Which target hidden states (`aux_layer_ids`): id i names the residual stream ENTERING decoder
layer i (0-based): the token embeddings for i = 0, the output of layer i - 1 otherwise, i.e.
Hugging Face's `output_hidden_states[i]`. This is vLLM's convention for
`eagle_aux_hidden_state_layer_ids` and what EAGLE's own code captures (the inputs of layers
2, L//2 and L-3 by default); SGLang and SpecForge name the same state i - 1 ("the output of layer
i - 1") and add one when capturing. Ids are strictly increasing: both engines concatenate the
captured states in layer order. `pipeline.heads.eagle3_import` converts the published layouts.

Our own files: `config.json` + `drafter.safetensors` (`save_drafter` / `load_drafter`), read
with safetensors only and checked against the config and the target model before use.

Only torch, safetensors and the runtime are imported here (the runtime's dependency rule).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import DTYPES, ModelArgs, _read_rope
from runtime.device import torch_dtype
from runtime.io import atomic_write_bytes
from runtime.model.llama import FeedForward, Linear, RMSNorm, Transformer
from runtime.model.rope import apply_rope, rope_inv_freq
from runtime.tree import Tree, TreeBuffers

FORMAT = "entmtp-eagle3"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "drafter.safetensors"


class Eagle3Error(ValueError):
    """A drafter config, file or input that does not fit; the message names what is wrong."""


def default_aux_layer_ids(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers (2, L//2, L-3) for an L-layer target, in our convention
    (the input of each layer); refused where they would not be three distinct layers (L < 7)."""
    ids = (2, n_layers // 2, n_layers - 3)
    if not ids[0] < ids[1] < ids[2]:
        raise Eagle3Error(f"EAGLE-3's default layers (2, L//2, L-3) are not three distinct layers for a "
                          f"{n_layers}-layer target: give aux_layer_ids explicitly")
    return ids


# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class Eagle3Config:
    """The drafter's shape. `vocab_size` is the TARGET vocabulary (t2d's length), `draft_vocab_size`
    the lm_head's rows; `aux_layer_ids` in our convention (see the module docstring), strictly
    increasing, each the input of a target layer; the RoPE settings are the drafter's own (as its
    checkpoint says: EAGLE-3's training config leaves rope_theta at LlamaConfig's 10000 even for
    Llama 3 targets), in runtime.config's form."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_before_residual: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise Eagle3Error(f"Eagle3Config.{name} must be a positive int, got {value!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise Eagle3Error(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary "
                              f"{self.vocab_size}")
        ids = self.aux_layer_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
            raise Eagle3Error(f"aux_layer_ids must be a non-empty list of layer ids, got {ids!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise Eagle3Error(f"aux_layer_ids must be non-negative ints, got {list(ids)}")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise Eagle3Error(f"aux_layer_ids must be strictly increasing (the engines concatenate the captured "
                              f"states in layer order), got {list(ids)}")
        self.aux_layer_ids = tuple(int(i) for i in ids)
        if not isinstance(self.norm_before_residual, bool):
            raise Eagle3Error(f"norm_before_residual must be a bool, got {self.norm_before_residual!r}")
        eps = self.rms_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise Eagle3Error(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        self.rms_norm_eps = float(self.rms_norm_eps)
        self.rope_theta = float(self.rope_theta)
        try:
            self.layer_args()  # checks heads/kv heads, head_dim parity and the RoPE scaling
        except ValueError as e:
            raise Eagle3Error(f"Eagle3Config: {e}") from e

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of one position's concatenated target features (fc's input)."""
        return self.num_aux * self.hidden_size

    def layer_args(self) -> ModelArgs:
        """The runtime's ModelArgs of the draft layer (for FeedForward and the RoPE tables)."""
        return ModelArgs(vocab_size=self.vocab_size, dim=self.hidden_size, n_layers=1, n_heads=self.num_heads,
                         n_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, norm_eps=self.rms_norm_eps,
                         rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                         max_position_embeddings=self.max_position_embeddings)

    @classmethod
    def for_model(cls, args: ModelArgs, draft_vocab_size: int | None = None,
                  aux_layer_ids: Sequence[int] | None = None, **overrides: Any) -> Eagle3Config:
        """A drafter shaped like one layer of the target `args` (EAGLE-3's usual choice), with
        EAGLE's default layers unless `aux_layer_ids` is given."""
        ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(args.n_layers)
        fields = dict(hidden_size=args.dim, num_heads=args.n_heads, num_kv_heads=args.n_kv_heads,
                      head_dim=args.head_dim, intermediate_size=args.intermediate_size,
                      vocab_size=args.vocab_size, draft_vocab_size=draft_vocab_size or args.vocab_size,
                      aux_layer_ids=ids,
                      rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, rope_scaling=args.rope_scaling,
                      max_position_embeddings=args.max_position_embeddings)
        fields.update(overrides)
        return cls(**fields)

    def check_target(self, args: ModelArgs, where: str = "the drafter") -> None:
        """Refuse a target model this drafter cannot run against (hidden size, vocabulary, layers)."""
        problems = []
        if args.dim != self.hidden_size:
            problems.append(f"hidden size {self.hidden_size} but the target's is {args.dim} (the drafter shares the "
                            "target's token embeddings, so they must match)")
        if args.vocab_size != self.vocab_size:
            problems.append(f"target vocabulary {self.vocab_size} but the target model has {args.vocab_size}")
        if max(self.aux_layer_ids) >= args.n_layers:
            problems.append(f"aux_layer_ids {list(self.aux_layer_ids)} but the target has only {args.n_layers} layers "
                            f"(ids name a layer's input: 0..{args.n_layers - 1})")
        if problems:
            raise Eagle3Error(f"{where} does not fit the target model: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise Eagle3Error(f"unknown EAGLE-3 drafter config keys {unknown}; known keys: {sorted(fields)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise Eagle3Error(f"EAGLE-3 drafter config lacks required keys {missing}")
        d = dict(d)
        if isinstance(d["aux_layer_ids"], list):
            d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a Hugging Face config dict, in runtime.config's form."""
    return _read_rope(cfg)


# ----------------------------------------------------------------------------------------------
# The module


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the 2*hidden input concat(norm(embedding), norm(hidden)), fused
    into one product (`wqkv`: q rows, then k, then v, as runtime.model's Attention); GQA as in
    Llama (query head j reads KV head j // (heads / kv_heads))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = Linear(2 * args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, start: int, mask: Tensor | None) -> Tensor:
        """x [n, 2*dim]; writes the rows' K/V at cache slots start..start+n-1 of kv [2, kv_heads, slots,
        head_dim]; mask [n, start+n] bool (True = may attend) or None (every slot up to start+n)."""
        n = x.shape[0]
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(n, h + 2 * kvh, hd)
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(x.dtype)
        end = start + n
        kv[0, :, start:end] = qk[:, h:].transpose(0, 1)
        kv[1, :, start:end] = qkv[:, h + kvh:].transpose(0, 1)
        q = qk[:, :h].transpose(0, 1)[None]                                   # [1, h, n, hd]
        out = F.scaled_dot_product_attention(q, kv[None, 0, :, :end], kv[None, 1, :, :end], attn_mask=mask,
                                             enable_gqa=h != kvh)
        return self.wo(out[0].transpose(0, 1).reshape(n, h * hd))


class Eagle3Layer(nn.Module):
    """The draft decoder layer (see the module docstring)."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)   # on the token embedding
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)       # on the hidden input
        self.attention = Eagle3Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)                      # w13 = [gate; up], w2 = down

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, start: int,
                mask: Tensor | None) -> Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        x = residual + self.attention(x, cos, sin, kv, start, mask)
        return x + self.feed_forward(self.post_attention_layernorm(x))


@dataclass
class Eagle3State:
    """One sequence's drafter state: its cache kv [2, kv_heads, capacity, head_dim] and the number
    of committed rows (row i at RoPE position i). Rows past `length` are scratch (drafting)."""

    kv: Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[2])

    def clone(self) -> Eagle3State:
        return Eagle3State(self.kv.clone(), self.length)


class _Embedding:
    """The target's token embedding, held outside the module tree (never saved, moved or cast)."""

    def __init__(self, table: nn.Embedding) -> None:
        self.table = table


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter (see the module docstring). `bind(model)` to the target first."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = c = config
        args = c.layer_args()
        self.fc = Linear(c.feature_size, c.hidden_size, bias=False)
        self.layer = Eagle3Layer(args, c.norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # a fresh drafter maps draft id i to target id i (d2t = 0, t2d = the first V_d ids)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)
        self._embed: _Embedding | None = None
        self._inv_freq: Tensor | None = None  # float32 RoPE frequencies, a plain attribute (never cast)
        self.state: Eagle3State | None = None

    # -- target, vocabulary and state ---------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def is_bound(self) -> bool:
        return self._embed is not None

    def bind(self, model: Transformer, capacity: int | None = None) -> None:
        """Use `model`'s token embeddings (checking that this drafter fits it) and set up an empty
        cache of `capacity` rows (default: the model's max_seq_len)."""
        self.config.check_target(model.args)
        self._embed = _Embedding(model.tok_embeddings)
        slots = capacity or getattr(model, "max_seq_len", 0) or model.args.max_position_embeddings
        self.setup_cache(int(slots))

    def add_fast_paths(self) -> None:
        """Inference only: every Linear takes the runtime's CPU float32 product paths (a no-op elsewhere)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.add_fast_paths()

    def target_ids(self) -> Tensor:
        """The target id of every draft id [V_d] (draft id + d2t)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Set the draft vocabulary: distinct target ids [V_d], draft id i -> target_ids[i] (fills d2t
        and t2d). EAGLE-3 lists them by increasing target id; any order is accepted."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten().cpu()
        v, vd = self.config.vocab_size, self.config.draft_vocab_size
        if ids.numel() != vd:
            raise Eagle3Error(f"the draft vocabulary has {ids.numel()} ids, the config says {vd}")
        if ids.unique().numel() != vd or int(ids.min()) < 0 or int(ids.max()) >= v:
            raise Eagle3Error(f"draft vocabulary ids must be distinct target ids in [0, {v})")
        with torch.no_grad():
            self.d2t.copy_((ids - torch.arange(vd)).to(self.d2t.device))
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[ids] = True
            self.t2d.copy_(t2d.to(self.t2d.device))

    def setup_cache(self, capacity: int) -> None:
        """An empty cache of `capacity` rows for the current sequence."""
        self.state = self.new_state(capacity)

    def new_state(self, capacity: int | None = None) -> Eagle3State:
        """An empty state for another sequence (a batch keeps one per sequence), `capacity` rows
        (default: the current state's)."""
        if capacity is None:
            if self.state is None:
                raise RuntimeError("the drafter has no cache: call bind(model) or setup_cache(capacity) first")
            capacity = self.state.capacity
        if not isinstance(capacity, int) or capacity <= 0:
            raise Eagle3Error(f"a drafter cache needs a positive capacity, got {capacity!r}")
        c = self.config
        return Eagle3State(torch.zeros(2, c.num_kv_heads, capacity, c.head_dim, dtype=self.dtype, device=self.device))

    def save_state(self) -> Eagle3State | None:
        """The current sequence's state (the object itself, not a copy), to `load_state` later."""
        return self.state

    def load_state(self, state: Eagle3State | None) -> None:
        """Continue the sequence whose state `save_state` (or `new_state`) returned."""
        if state is not None and not isinstance(state, Eagle3State):
            raise Eagle3Error(f"load_state takes an Eagle3State, got {type(state).__name__}")
        self.state = state

    @property
    def length(self) -> int:
        """Committed rows (= target positions whose features were fed)."""
        return 0 if self.state is None else self.state.length

    def reset(self) -> None:
        """Forget every committed row (start of a new sequence)."""
        if self.state is not None:
            self.state.length = 0

    def truncate(self, length: int) -> None:
        """Forget the committed rows from `length` on."""
        if not 0 <= length <= self.length:
            raise Eagle3Error(f"cannot truncate the drafter cache to {length}: it holds {self.length} rows")
        self._state().length = int(length)

    def _state(self) -> Eagle3State:
        if self.state is None:
            raise RuntimeError("the drafter has no cache: call bind(model) or setup_cache(capacity) first")
        s = self.state
        if s.kv.dtype != self.dtype or s.kv.device != self.device:  # moved or cast after bind()
            s.kv = s.kv.to(device=self.device, dtype=self.dtype)
        return s

    # -- pieces ----------------------------------------------------------------------------------

    def embed(self, tokens: Tensor) -> Tensor:
        """Target token embeddings [n, hidden] of target ids."""
        if self._embed is None:
            raise RuntimeError("the drafter is not bound to a target model: call drafter.bind(model) first")
        table = self._embed.table.weight
        return F.embedding(tokens.to(table.device), table).to(device=self.device, dtype=self.dtype)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # runtime.model.rope_tables' float32 recipe for just these positions
        if self._inv_freq is None or self._inv_freq.device != self.device:
            self._inv_freq = rope_inv_freq(self.config.layer_args(), self.device)
        freqs = torch.outer(positions.to(self.device, torch.float32), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    def logits(self, g: Tensor) -> Tensor:
        """Draft-vocabulary logits [n, V_d] (float32) of draft states g [n, hidden]."""
        return self.lm_head(self.norm(g.to(self.dtype))).float()

    def to_target_logits(self, logits: Tensor) -> Tensor:
        """Map draft-vocabulary logits [..., V_d] to the target vocabulary (-inf off the draft vocabulary)."""
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), -math.inf)
        return full.index_copy_(-1, self.target_ids().to(logits.device), logits)

    # -- committing rows --------------------------------------------------------------------------

    @torch.no_grad()
    def extend(self, features: Tensor, tokens: Tensor, positions: Tensor | None = None,
               return_all: bool = False) -> Tensor:
        """Commit n rows built from the TARGET's features: features [n, k*hidden] of target
        positions t..t+n-1 (t = `length`), each paired with the true token at the NEXT position,
        tokens [n] = x_{t+1..t+n} (see the module docstring for the decoder's calls). Row i sits at
        RoPE position t+i unless `positions` [n] says otherwise (give the target's positions, which
        are the same in the decoder; they are trusted, not read). Returns the last row's draft
        state g [1, hidden] (its logits propose the token after tokens[-1]); all rows' [n, hidden]
        with return_all."""
        c, s = self.config, self._state()
        if features.dim() != 2 or features.shape[1] != c.feature_size or features.shape[0] == 0:
            raise Eagle3Error(f"features must be [n >= 1, {c.num_aux} x {c.hidden_size} = {c.feature_size}] (the "
                              f"target's layers {list(c.aux_layer_ids)} concatenated), got {tuple(features.shape)}")
        n = features.shape[0]
        if tokens.dim() != 1 or tokens.shape[0] != n:
            raise Eagle3Error(f"tokens must be [n={n}] (the token after each feature's position), got "
                              f"{tuple(tokens.shape)}")
        start = s.length
        if start + n > s.capacity:
            raise Eagle3Error(f"the drafter cache holds {s.capacity} rows; {start} are used and {n} more do not fit "
                              "(bind a model with a larger max_seq_len, or reset)")
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        elif positions.shape != (n,):
            raise Eagle3Error(f"positions must be [n={n}], got {tuple(positions.shape)}")
        cos, sin = self._rope(positions)
        mask = None
        if n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
            mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        x = self.fc(features.to(device=self.device, dtype=self.dtype))
        out = self.layer(self.embed(tokens), x, cos, sin, s.kv, start, mask)
        s.length = start + n
        return out if return_all else out[-1:]

    # -- drafting ---------------------------------------------------------------------------------

    @torch.no_grad()
    def propose_tree(self, h_last: Tensor, root_token: int | Tensor, buffers: TreeBuffers | Tree | Sequence) -> Tensor:
        """Draft a tree: target token ids [N] in node order (index 0 = root_token), the same
        format as `DraftHeads.propose`. h_last [1, hidden] (or [hidden]) is what `extend` returned
        for the last committed row; a depth-d node takes the ranks[node]-th most likely draft id
        at its parent's state, mapped by d2t. `buffers`: compiled TreeBuffers on the drafter's
        device (the fast path), or a Tree / list of rank paths (compiled on every call)."""
        return self._draft(h_last, root_token, self._as_buffers(buffers), None)

    def propose(self, h: Tensor, root_token: int | Tensor, buffers: TreeBuffers) -> Tensor:
        """`propose_tree` under `DraftHeads.propose`'s name, so a decoder can call either."""
        return self.propose_tree(h, root_token, buffers)

    @torch.no_grad()
    def propose_scored(self, h_last: Tensor, root_token: int | Tensor, buffers: TreeBuffers | Tree | Sequence,
                       stop_after: Callable[[int, Tensor], bool] | None = None) -> tuple[Tensor, Tensor]:
        """`propose_tree` plus each node's draft probability: (tokens [N], node_prob [N] float32),
        node_prob[i] = softmax over the draft vocabulary of the logits at node i's parent, at node
        i's draft id (the root's is 1): EntMTP-dyn multiplies them along paths. `stop_after(d,
        node_prob)`, asked after each depth d below the tree's depth, ends the drafting there when
        it returns True (deeper nodes keep probability 0 and undefined tokens), as in
        `DraftHeads.propose_scored`."""
        buf = self._as_buffers(buffers)
        node_prob = torch.ones(buf.num_nodes, dtype=torch.float32, device=self.device)
        tokens = self._draft(h_last, root_token, buf, node_prob, stop_after)
        return tokens, node_prob

    def _as_buffers(self, buffers: TreeBuffers | Tree | Sequence) -> TreeBuffers:
        if isinstance(buffers, TreeBuffers):
            return buffers
        tree = buffers if isinstance(buffers, Tree) else Tree(buffers)
        return TreeBuffers.compile(tree).to(self.device)

    def _draft(self, h_last: Tensor, root_token: int | Tensor, buf: TreeBuffers, node_prob: Tensor | None,
               stop_after: Callable[[int, Tensor], bool] | None = None) -> Tensor:
        c, s = self.config, self._state()
        if buf.depths.device != self.device:
            raise Eagle3Error(f"the tree buffers live on {buf.depths.device} but the drafter on {self.device}: move "
                              "them with buffers.to(device) once, not per step")
        if h_last.numel() != c.hidden_size:
            raise Eagle3Error(f"h_last must be one draft state [1, {c.hidden_size}], got {tuple(h_last.shape)}")
        g = h_last.reshape(1, c.hidden_size)
        tokens = torch.empty(buf.num_nodes, dtype=torch.long, device=self.device)
        tokens[0] = root_token
        depth = buf.depth
        if depth == 0:
            return tokens
        if max(buf.topk) > c.draft_vocab_size:
            raise Eagle3Error(f"the tree asks for rank {max(buf.topk) - 1} but the draft vocabulary has "
                              f"{c.draft_vocab_size} ids")
        committed = s.length
        if committed == 0:
            raise Eagle3Error("the drafter has no committed row: extend() it with the prompt's features first")
        scratch = sum(int(buf.unique_parents[d].numel()) for d in range(1, depth))
        if committed + scratch > s.capacity:
            raise Eagle3Error(f"drafting this tree needs {scratch} scratch rows after the {committed} committed ones, "
                              f"but the drafter cache holds {s.capacity}")
        ranks = buf.ranks
        # cache slot of each drafted node that ran the layer (those with children), -1 otherwise
        slot_of = torch.full((buf.num_nodes,), -1, dtype=torch.long, device=self.device)
        states = g.to(self.dtype)                     # draft states of the parents at depth d-1 with children
        written = 0
        for d, (start, end) in enumerate(buf.depth_slices, start=1):
            logits = self.logits(states)                                          # [u_{d-1}, V_d]
            top = logits.topk(buf.topk[d - 1], dim=-1).indices
            inverse = buf.parent_inverse[d - 1]
            picked = top[inverse, ranks[start:end]]                               # draft ids [n_d]
            tokens[start:end] = picked + self.d2t[picked]
            if node_prob is not None:
                node_prob[start:end] = torch.softmax(logits, dim=-1)[inverse, picked]
            if d == depth:
                break
            if stop_after is not None and node_prob is not None and stop_after(d, node_prob):
                node_prob[end:] = 0.0
                break
            # the frontier: depth-d nodes with children, one row each, fed (their parent's state, their token)
            frontier = buf.unique_parents[d]                                      # offsets within depth d
            nodes = frontier + start
            u = int(frontier.numel())
            at = committed + written
            slot_of[nodes] = torch.arange(at, at + u, device=self.device)
            mask = torch.zeros(u, at + u, dtype=torch.bool, device=self.device)
            mask[:, :committed] = True
            mask.scatter_(1, slot_of[buf.node_paths[nodes, 1:d + 1]], True)        # its drafted ancestors and itself
            positions = torch.full((u,), committed - 1 + d, dtype=torch.long, device=self.device)
            cos, sin = self._rope(positions)
            parent_states = states.index_select(0, inverse.index_select(0, frontier))
            states = self.layer(self.embed(tokens[nodes]), parent_states, cos, sin, s.kv, at, mask)
            written += u
        return tokens


# ----------------------------------------------------------------------------------------------
# Target features


def target_forward(model: Transformer, tokens: Tensor, input_pos: Tensor, aux_layer_ids: Sequence[int],
                   **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
    """`model(tokens, input_pos, **kwargs)` that also returns the drafter's features: (logits,
    hidden, features [n, k*dim]), features = the residual streams entering the target's layers
    `aux_layer_ids` (our convention), concatenated in that order.

    Captured with forward hooks on the layers, so it needs the model's ordinary forward path: the
    row-invariant and small-row-kernel paths (`set_row_invariance`, CPU float32 after
    `add_fast_paths`) call the layers' methods directly and are refused here (RuntimeError)."""
    ids = list(aux_layer_ids)
    if any(not 0 <= i < model.args.n_layers for i in ids):
        raise Eagle3Error(f"aux_layer_ids {ids}: the target has layers 0..{model.args.n_layers - 1}")
    captured: dict[int, Tensor] = {}
    handles = []

    def hook(i: int) -> Callable[..., None]:
        def save(_module: nn.Module, inputs: tuple) -> None:
            captured[i] = inputs[0]   # what enters layer i: the embeddings for i = 0
        return save

    for i in ids:
        handles.append(model.layers[i].register_forward_pre_hook(hook(i)))
    try:
        logits, hidden = model(tokens, input_pos, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in ids if i not in captured]
    if missing:
        raise RuntimeError(f"the target's layers {missing} were not called as modules: this forward took the "
                           "row-invariant or small-row-kernel path, which the feature hooks cannot see")
    n = tokens.shape[-1]
    features = torch.cat([captured[i][:n] for i in ids], dim=-1)
    return logits, hidden, features


# ----------------------------------------------------------------------------------------------
# Our own format: config.json + drafter.safetensors (no pickle)


def check_vocab_maps(d2t: Tensor, t2d: Tensor, vocab_size: int, draft_vocab_size: int, where: str) -> None:
    """Refuse d2t / t2d that do not describe one draft vocabulary of distinct target ids."""
    if d2t.dtype != torch.long or tuple(d2t.shape) != (draft_vocab_size,):
        raise Eagle3Error(f"{where}: d2t must be int64 [{draft_vocab_size}], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise Eagle3Error(f"{where}: t2d must be bool [{vocab_size}], got {t2d.dtype} {tuple(t2d.shape)}")
    ids = torch.arange(draft_vocab_size) + d2t.cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise Eagle3Error(f"{where}: d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    if ids.unique().numel() != draft_vocab_size:
        raise Eagle3Error(f"{where}: d2t maps two draft ids to one target id")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(mask, t2d.cpu()):
        raise Eagle3Error(f"{where}: t2d does not mark exactly the target ids that d2t maps to "
                          f"({int(t2d.sum())} marked, {draft_vocab_size} mapped)")


def save_drafter(drafter: Eagle3Drafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + drafter.safetensors (the drafter's own weights, never the target's
    embeddings), each atomically; `dtype` casts the floating weights."""
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in drafter.state_dict().items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous().cpu()
    float_dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(float_dtypes) != 1:
        raise Eagle3Error(f"drafter weights mix dtypes {float_dtypes}; cast the drafter to one dtype before saving")
    dtype_name = next(k for k in DTYPES if torch_dtype(k) in float_dtypes)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype_name, **drafter.config.to_dict()}
    atomic_write_bytes(folder / WEIGHTS_FILE, save(state, metadata={"format": "pt", "entmtp": FORMAT}))
    atomic_write_bytes(folder / CONFIG_FILE, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    return folder


def read_drafter_config(folder: str | Path) -> tuple[Eagle3Config, str]:
    """(config, stored dtype name) of a drafter folder, validated."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an EAGLE-3 drafter folder holds {CONFIG_FILE} + {WEIGHTS_FILE} "
                                "(published EAGLE-3 / speculators folders load with pipeline.heads.eagle3_import)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3Error(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT:
        raise Eagle3Error(f"{path} is not an EntMTP EAGLE-3 drafter config (its 'format' is not {FORMAT!r}); "
                          "published EAGLE-3 / speculators folders load with pipeline.heads.eagle3_import")
    version = raw.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise Eagle3Error(f"{path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
    dtype = raw.pop("dtype", None)
    if dtype not in DTYPES:
        raise Eagle3Error(f"{path}: 'dtype' must be one of {list(DTYPES)}, got {dtype!r}")
    try:
        return Eagle3Config.from_dict(raw), dtype
    except (TypeError, ValueError) as e:
        raise Eagle3Error(f"{path}: {e}") from e


def build_drafter(config: Eagle3Config, state: dict[str, Tensor], where: str, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> Eagle3Drafter:
    """An Eagle3Drafter, built on the meta device (no random init), that takes `state`'s tensors:
    every missing / unexpected key and every shape or kind mismatch is named, and d2t / t2d must
    describe one draft vocabulary. Floating tensors are cast to `dtype` and placed on `device`."""
    with torch.device("meta"):
        drafter = Eagle3Drafter(config)
    expected = drafter.state_dict()
    problems = []
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k in sorted(set(expected) & set(state)):
        got, want = state[k], expected[k]
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{k}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        elif want.is_floating_point() != got.is_floating_point() or (
                not want.is_floating_point() and got.dtype != want.dtype):
            kind = "a floating" if want.is_floating_point() else want.dtype
            problems.append(f"{k}: dtype {got.dtype}, expected {kind} tensor")
    if problems:
        raise Eagle3Error(f"{where} does not match the EAGLE-3 drafter config: " + "; ".join(problems))
    check_vocab_maps(state["d2t"], state["t2d"], config.vocab_size, config.draft_vocab_size, where)
    device = torch.device(device)
    placed = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    drafter.load_state_dict(placed, strict=True, assign=True)
    return drafter


def load_drafter(folder: str | Path, model: Transformer | None = None, dtype: torch.dtype | None = None,
                 fast_paths: bool = True) -> Eagle3Drafter:
    """Load a drafter saved by `save_drafter`. With `model` it is checked against it, bound to it and
    cast to its dtype (unless `dtype` is given); refused with a message naming what is wrong when
    any shape, key or the vocabulary maps do not fit."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    config, stored = read_drafter_config(folder)
    if model is not None:
        config.check_target(model.args, where=f"the drafter in {folder}")
    wfile = folder / WEIGHTS_FILE
    if not wfile.is_file():
        raise FileNotFoundError(f"{wfile} not found next to {CONFIG_FILE}")
    state = {}
    try:
        with safe_open(str(wfile), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                state[k] = f.get_tensor(k)
    except (SafetensorError, OSError) as e:
        raise Eagle3Error(f"{wfile} is not a readable safetensors file: {e}") from e
    bad = sorted(k for k, v in state.items() if v.is_floating_point() and v.dtype != torch_dtype(stored))
    if bad:
        raise Eagle3Error(f"{wfile}: tensors {bad[:5]} are not {stored} as config.json says; the files do not "
                          "belong together")
    target = dtype or (model.dtype if model is not None else torch_dtype(stored))
    drafter = build_drafter(config, state, str(wfile), target, model.device if model is not None else "cpu")
    drafter = drafter.eval().requires_grad_(False)
    if model is not None:
        drafter.bind(model)
    if fast_paths:
        drafter.add_fast_paths()
    return drafter
