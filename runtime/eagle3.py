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

In the decoder (`runtime.decoder.TreeDecoder`, its `Drafter` protocol): the target model hands
over the features from the forward that verifies (`Transformer.capture_aux`, on every forward
path), and `observe(hidden, positions, next_tokens, features)` is the `extend` above; `propose`,
`propose_scored` (EntMTP-dyn) and `propose_batch` draft (a batch's sequences together: the draft
layer's products over all their rows, the attention over each one's own cache); `greedy_top1`
serves the signals that read the drafter. The pipeline's rollout reads rank paths along the true continuation from one
pass over the whole sequence (`rank_paths`, `rollout_arrays`).

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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import ModelArgs, _read_rope
from runtime.device import torch_dtype
from runtime.io import check_config_keys, read_weights_config, save_weights_folder
from runtime.model.llama import (
    FeedForward,
    Linear,
    RMSNorm,
    Transformer,
    qkv_into_cache,
)
from runtime.model.rope import apply_rope, rope_inv_freq
from runtime.tree import Tree, TreeBuffers

FORMAT = "entmtp-eagle3"
# the deepest tree a drafter drafts unless told otherwise (`Eagle3Drafter.max_depth`): the depth of
# the greedy chain the drafter-reading signals score and of the rollout's rank paths
DEFAULT_MAX_DEPTH = 8
# drafter cache rows past the target's (`Eagle3Drafter.bind`): the scratch rows of a greedy chain
# (`greedy_top1`, up to this deep) at the end of a decode that fills the target's cache
SCRATCH_ROOM = 64
# query rows per draft-layer call in `rank_paths` (bounds the attention scores' memory on long sequences)
RANK_CHUNK = 256
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
    # "own": lm_head is the drafter's (EAGLE-3's published layout, stored); "shared": lm_head is the
    # target's output rows of the draft ids, taken at `bind` and never stored (EAGLE-1's frozen
    # head: the drafter learns to produce target-like final states, and ships no vocabulary matrix)
    output: str = "own"

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
        if self.output not in ("own", "shared"):
            raise Eagle3Error(f"output must be 'own' or 'shared', got {self.output!r}")
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
        try:
            check_config_keys(cls, d, "EAGLE-3 drafter config")
        except ValueError as e:
            raise Eagle3Error(str(e)) from e
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
        end = start + n
        q = qkv_into_cache(self.wqkv, x, cos, sin, kv, start, h, kvh, hd).transpose(0, 1)[None]  # [1, h, n, hd]
        out = F.scaled_dot_product_attention(q, kv[None, 0, :, :end], kv[None, 1, :, :end], attn_mask=mask,
                                             enable_gqa=h != kvh)
        return self.wo(out[0].transpose(0, 1).reshape(n, h * hd))

    def forward_many(self, x: Tensor, cos: Tensor, sin: Tensor, kvs: Sequence[Tensor], starts: Sequence[int],
                     masks: Sequence[Tensor]) -> Tensor:
        """`forward` for the rows of B sequences at once, x [B*u, 2*dim] (sequence i's u rows
        together): the products run over all rows; sequence i writes its rows' K/V at slots
        starts[i].. of its own cache kvs[i] and attends over it with masks[i] [u, starts[i]+u]."""
        rows, b = x.shape[0], len(kvs)
        u = rows // b
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(rows, h + 2 * kvh, hd)
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(x.dtype)
        out = qk.new_empty(rows, h, hd)
        for i, (kv, start, mask) in enumerate(zip(kvs, starts, masks)):
            a, end = i * u, start + u
            kv[0, :, start:end] = qk[a:a + u, h:].transpose(0, 1)
            kv[1, :, start:end] = qkv[a:a + u, h + kvh:].transpose(0, 1)
            q = qk[a:a + u, :h].transpose(0, 1)[None]
            att = F.scaled_dot_product_attention(q, kv[None, 0, :, :end], kv[None, 1, :, :end], attn_mask=mask,
                                                 enable_gqa=h != kvh)
            out[a:a + u] = att[0].transpose(0, 1)
        return self.wo(out.reshape(rows, h * hd))


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

    def forward_many(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, kvs: Sequence[Tensor],
                     starts: Sequence[int], masks: Sequence[Tensor]) -> Tensor:
        """`forward` for the rows of B sequences, each over its own cache (`Eagle3Attention.forward_many`)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        x = residual + self.attention.forward_many(x, cos, sin, kvs, starts, masks)
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
    """A target module (its token embedding or output layer), held outside the module tree (never
    saved, moved or cast with the drafter)."""

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
        self._output: _Embedding | None = None  # the target's output layer (output="shared")
        self._inv_freq: Tensor | None = None  # float32 RoPE frequencies, a plain attribute (never cast)
        self.state: Eagle3State | None = None
        # the deepest tree it drafts for a decoder (any depth works; see DEFAULT_MAX_DEPTH)
        self.max_depth = DEFAULT_MAX_DEPTH
        self._chains: dict[tuple[int, str], TreeBuffers] = {}

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
        cache of `capacity` rows (default: the model's max_seq_len plus SCRATCH_ROOM rows, so that
        a decode that fills the model's cache still has room to draft a greedy chain: its trees'
        rows are within the model's own room, `TreeDecoder.check_fits`)."""
        self.config.check_target(model.args)
        self._embed = _Embedding(model.tok_embeddings)
        self._output = _Embedding(model.output)
        if self.config.output == "shared":
            self._tie_output()
        slots = capacity or (getattr(model, "max_seq_len", 0) or model.args.max_position_embeddings) + SCRATCH_ROOM
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
        if self.config.output == "shared" and self._output is not None:
            self._tie_output()

    def _tie_output(self) -> None:
        """output="shared": lm_head takes the target's output rows of the draft ids (a frozen copy in
        the drafter's dtype and device; never saved)."""
        assert self._output is not None
        with torch.no_grad():
            rows = self._output.table.weight.detach()[self.target_ids().to(self._output.table.weight.device)]
            self.lm_head.weight = nn.Parameter(rows.to(device=self.device, dtype=self.dtype), requires_grad=False)
        head = self.lm_head
        if head.weight_packed is not None or head.weight_t is not None:  # refresh the fast paths' copy
            head.add_fast_paths(kernel=head.weight_packed is not None)

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
        if self.lm_head.weight.is_meta:
            raise RuntimeError("this drafter's lm_head is the target's (output='shared'): bind(model) first")
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

    # -- the decoder's drafter protocol (runtime.decoder.Drafter) ---------------------------------

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose inputs this drafter reads (`Transformer.capture_aux`)."""
        return self.config.aux_layer_ids

    def observe(self, hidden: Tensor, positions: Tensor, next_tokens: Tensor | None = None,
                features: Tensor | None = None) -> Tensor:
        """The decoder's call after its prefill and after each step: commit the target positions
        `positions` [n] (the prompt, or a step's root and accepted drafts) from the target's
        `features` [n, k*hidden] of those positions (read from the verify forward) paired with
        `next_tokens` [n], the tokens at the next positions (the accepted drafts and the next
        root): `extend(features, next_tokens, positions)`. `hidden` (the target's final states) is
        not read. Returns the draft state g [1, hidden] that drafts below the next root."""
        if features is None or next_tokens is None:
            raise Eagle3Error("an EAGLE-3 drafter observes the target's features and the next tokens: turn the "
                              "features on with model.capture_aux(drafter.aux_layer_ids) (TreeDecoder does)")
        return self.extend(features, next_tokens.reshape(-1), positions)

    @torch.no_grad()
    def propose_batch(self, h: Tensor, root_tokens: Tensor | Sequence[int], buffers: TreeBuffers,
                      states: Sequence[Eagle3State | None] | None = None) -> Tensor:
        """`propose` for B sequences drafting one tree: draft states h [B, hidden] (each one's
        `observe` result), roots [B] and each sequence's state (`save_state`) give tokens [B, N].
        One draft-layer call per depth for all B sequences: its products (and the lm_head's) run
        over every sequence's rows together, so the weights are read once per depth; only the
        attention runs per sequence, each over its own cache. The current state stays loaded."""
        if h.dim() != 2 or h.shape[1] != self.config.hidden_size:
            raise Eagle3Error(f"h must be [B, {self.config.hidden_size}], got {tuple(h.shape)}")
        b = h.shape[0]
        if states is None:
            if b != 1:
                raise Eagle3Error("propose_batch of an EAGLE-3 drafter needs each sequence's state (save_state()): "
                                  "the sequences draft over their own caches")
            states = [self.state]
        if len(states) != b:
            raise Eagle3Error(f"{b} draft states h but {len(states)} sequence states")
        roots = torch.as_tensor(root_tokens, dtype=torch.long).reshape(-1).to(self.device)
        if roots.shape != (b,):
            raise Eagle3Error(f"{b} draft states h but root tokens of shape {tuple(roots.shape)}")
        if any(not isinstance(state, Eagle3State) for state in states):
            raise Eagle3Error("propose_batch takes each sequence's Eagle3State (save_state())")
        return self._draft(h, roots, self._as_buffers(buffers), None, None, list(states))

    def greedy_top1(self, h: Tensor, root: int | Tensor, depth: int | None = None) -> list[float]:
        """p_1..p_D (D = `depth`, default `max_depth`): the top-1 draft probability at each depth
        of the drafter's own greedy chain below `root` (what the signals that read the drafter see;
        `DraftHeads.greedy_top1` for heads). One host transfer."""
        _, prob = self.propose_scored(h, root, self._chain(depth or self.max_depth))
        return prob[1:].tolist()

    def _chain(self, depth: int) -> TreeBuffers:
        key = (depth, str(self.device))
        if key not in self._chains:
            self._chains[key] = TreeBuffers.compile(Tree([(0,) * d for d in range(1, depth + 1)])).to(self.device)
        return self._chains[key]

    # -- drafting ---------------------------------------------------------------------------------

    @torch.no_grad()
    def propose_tree(self, h_last: Tensor, root_token: int | Tensor, buffers: TreeBuffers | Tree | Sequence) -> Tensor:
        """Draft a tree: target token ids [N] in node order (index 0 = root_token), the same
        format as `DraftHeads.propose`. h_last [1, hidden] (or [hidden]) is what `extend` returned
        for the last committed row; a depth-d node takes the ranks[node]-th most likely draft id
        at its parent's state, mapped by d2t. `buffers`: compiled TreeBuffers on the drafter's
        device (the fast path), or a Tree / list of rank paths (compiled on every call)."""
        return self._draft(h_last, root_token, self._as_buffers(buffers), None)[0]

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
        tokens = self._draft(h_last, root_token, buf, node_prob, stop_after)[0]
        return tokens, node_prob

    def _as_buffers(self, buffers: TreeBuffers | Tree | Sequence) -> TreeBuffers:
        if isinstance(buffers, TreeBuffers):
            return buffers
        tree = buffers if isinstance(buffers, Tree) else Tree(buffers)
        return TreeBuffers.compile(tree).to(self.device)

    def _draft(self, h_last: Tensor, root_token: int | Tensor, buf: TreeBuffers, node_prob: Tensor | None,
               stop_after: Callable[[int, Tensor], bool] | None = None,
               states: list[Eagle3State] | None = None) -> Tensor:
        """The drafting behind the `propose*` methods, for B sequences drafting one tree: h_last
        [B, hidden] (or [hidden] for one), roots (an int or [B]), `states` each sequence's (default:
        the current one) give tokens [B, N]; node_prob [N] (B = 1) is filled when given."""
        c = self.config
        states = [self._state()] if states is None else states
        b = len(states)
        if buf.depths.device != self.device:
            raise Eagle3Error(f"the tree buffers live on {buf.depths.device} but the drafter on {self.device}: move "
                              "them with buffers.to(device) once, not per step")
        if h_last.numel() != b * c.hidden_size:
            raise Eagle3Error(f"h_last must be {b} draft state(s) [{b}, {c.hidden_size}], got {tuple(h_last.shape)}")
        tokens = torch.empty(b, buf.num_nodes, dtype=torch.long, device=self.device)
        tokens[:, 0] = root_token
        depth = buf.depth
        if depth == 0:
            return tokens
        if max(buf.topk) > c.draft_vocab_size:
            raise Eagle3Error(f"the tree asks for rank {max(buf.topk) - 1} but the draft vocabulary has "
                              f"{c.draft_vocab_size} ids")
        scratch = sum(int(buf.unique_parents[d].numel()) for d in range(1, depth))
        for s in states:
            if s.kv.dtype != self.dtype or s.kv.device != self.device:   # moved or cast after bind()
                s.kv = s.kv.to(device=self.device, dtype=self.dtype)
            if s.length == 0:
                raise Eagle3Error("the drafter has no committed row: extend() it with the prompt's features first")
            if s.length + scratch > s.capacity:
                raise Eagle3Error(f"drafting this tree needs {scratch} scratch rows after the {s.length} committed "
                                  f"ones, but the drafter cache holds {s.capacity}")
        committed = [s.length for s in states]
        last = torch.tensor(committed, device=self.device) - 1                  # each one's last committed position
        ranks = buf.ranks
        # scratch slot (after the committed rows) of each drafted node that ran the layer, -1 otherwise
        slot_of = torch.full((buf.num_nodes,), -1, dtype=torch.long, device=self.device)
        states_g = h_last.reshape(b, c.hidden_size).to(self.dtype)   # draft states of the depth d-1 parents [B*u, H]
        u = 1
        written = 0
        for d, (start, end) in enumerate(buf.depth_slices, start=1):
            logits = self.logits(states_g)                                        # [B*u_{d-1}, V_d]
            top = logits.topk(buf.topk[d - 1], dim=-1).indices.view(b, u, -1)
            inverse = buf.parent_inverse[d - 1]
            picked = top[:, inverse, ranks[start:end]]                            # draft ids [B, n_d]
            tokens[:, start:end] = picked + self.d2t[picked]
            if node_prob is not None:
                node_prob[start:end] = torch.softmax(logits, dim=-1)[inverse, picked[0]]
            if d == depth:
                break
            if stop_after is not None and node_prob is not None and stop_after(d, node_prob):
                node_prob[end:] = 0.0
                break
            # the frontier: depth-d nodes with children, one row each, fed (their parent's state, their token)
            frontier = buf.unique_parents[d]                                      # offsets within depth d
            nodes = frontier + start
            width = int(frontier.numel())
            slot_of[nodes] = torch.arange(written, written + width, device=self.device)
            # its drafted ancestors and itself, among the scratch rows
            own = torch.zeros(width, written + width, dtype=torch.bool, device=self.device)
            own.scatter_(1, slot_of[buf.node_paths[nodes, 1:d + 1]], True)
            parents = inverse.index_select(0, frontier)
            parent_states = states_g.view(b, u, -1).index_select(1, parents).reshape(b * width, -1)
            emb = self.embed(tokens[:, nodes].reshape(-1))
            masks = [torch.cat([own.new_ones(width, k), own], dim=1) for k in committed]   # every committed row too
            positions = last.repeat_interleave(width) + d
            cos, sin = self._rope(positions)
            if b == 1:
                states_g = self.layer(emb, parent_states, cos, sin, states[0].kv, committed[0] + written, masks[0])
            else:
                states_g = self.layer.forward_many(emb, parent_states, cos, sin, [s.kv for s in states],
                                                   [k + written for k in committed], masks)
            written += width
            u = width
        return tokens

    # -- rank paths along a known continuation (the pipeline's rollout) -------------------------

    @torch.no_grad()
    def rank_paths(self, features: Tensor, next_tokens: Tensor, depth: int | None = None, first: int = 0,
                   rank_cap: int | None = None, greedy: bool = False) -> tuple[Tensor, Tensor]:
        """For a whole sequence x_0..x_n of which the target gave `features` [n, k*hidden] of
        positions 0..n-1, with `next_tokens` [n] = x_1..x_n (each position's next token, as
        `extend` takes them): for every position t = first..n-1 (the last committed position of a
        decoding step whose root is x_{t+1}) and depth d = 1..D (D = `depth`, default `max_depth`),
        (ranks [m, D] int64, top1 [m, D] float32), m = n - first:

        * ranks[t - first, d-1]: the rank of the true token x_{t+1+d} among the depth-d candidates
          below the true path x_{t+1}, ..., x_{t+d}, exactly as `propose` ranks a node's children
          (the number of draft ids with a larger logit); the draft vocabulary's size V_d where the
          token is not in it (never drafted); -1 where t + 1 + d > n (past the sequence). With
          `rank_cap`: clamped to it, and rank_cap past the sequence (the rollout's convention);
        * top1[t - first, d-1]: the top-1 draft probability at that node (`propose_scored`'s
          probability of its rank-0 child).

        The drafter's own cache is left alone: the committed rows (fc(f_s), x_{s+1}) at positions
        s are built causally from scratch, then one draft-layer pass per depth over all positions
        at once: position t's depth-d row reads (its depth-d draft state, x_{t+1+d}) at position
        t + d and attends to the committed rows 0..t and its own chain (its depth-1..d rows), as a
        drafted tree node attends to the cache and its ancestors. With `greedy`, each position's
        chain follows the drafter's own top-1 tokens instead of the true ones (top1 is then what a
        decoder sees before verifying; ranks still compare against the true tokens)."""
        kv, g = self._sequence_rows(features, next_tokens, depth, first)
        return self._chain_ranks(kv, g, next_tokens, depth or self.max_depth, first, rank_cap, greedy)

    @torch.no_grad()
    def rollout_arrays(self, features: Tensor, next_tokens: Tensor, first: int, depth: int,
                       rank_cap: int) -> tuple[Tensor, Tensor, Tensor]:
        """The rollout's drafter arrays from one committed pass (`pipeline.rollout.record`): (rank
        paths [m, D] along the true path, clamped to rank_cap and rank_cap past the sequence; the
        top-1 probabilities along the true path [m, D]; those along the drafter's own greedy chain
        [m, D]), for positions first..n-1 (see `rank_paths`)."""
        kv, g = self._sequence_rows(features, next_tokens, depth, first)
        ranks, head_top1 = self._chain_ranks(kv, g, next_tokens, depth, first, rank_cap, False)
        _, greedy_top1 = self._chain_ranks(kv, g, next_tokens, depth, first, rank_cap, True)
        return ranks, head_top1, greedy_top1

    def _sequence_rows(self, features: Tensor, next_tokens: Tensor, depth: int | None,
                       first: int) -> tuple[Tensor, Tensor]:
        """A scratch cache [2, kv_heads, n + (D-1)*m, head_dim] holding every committed row of the
        sequence (slots 0..n-1, room for the chains after them), and the committed rows' draft
        states g [m, hidden] at positions first..n-1."""
        c = self.config
        if features.dim() != 2 or features.shape[1] != c.feature_size or features.shape[0] == 0:
            raise Eagle3Error(f"features must be [n >= 1, {c.feature_size}], got {tuple(features.shape)}")
        n = features.shape[0]
        if next_tokens.shape != (n,):
            raise Eagle3Error(f"next_tokens must be [n={n}] (x_1..x_n), got {tuple(next_tokens.shape)}")
        d = depth or self.max_depth
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise Eagle3Error(f"depth must be an int >= 1, got {depth!r}")
        if not 0 <= first < n:
            raise Eagle3Error(f"first must lie in [0, {n}), got {first}")
        m, dev = n - first, self.device
        kv = torch.zeros(2, c.num_kv_heads, n + (d - 1) * m, c.head_dim, dtype=self.dtype, device=dev)
        x = self.fc(features.to(device=dev, dtype=self.dtype))
        emb = self.embed(next_tokens)
        positions = torch.arange(n, device=dev)
        states = []
        for r0 in range(0, n, RANK_CHUNK):   # causal, a chunk of rows at a time (as `extend` in pieces)
            r1 = min(n, r0 + RANK_CHUNK)
            cos, sin = self._rope(positions[r0:r1])
            mask = torch.ones(r1 - r0, r1, dtype=torch.bool, device=dev).tril_(r0)
            out = self.layer(emb[r0:r1], x[r0:r1], cos, sin, kv, r0, mask)
            if r1 > first:
                states.append(out[max(first - r0, 0):])
        return kv, torch.cat(states)

    def _chain_ranks(self, kv: Tensor, g: Tensor, next_tokens: Tensor, depth: int, first: int,
                     rank_cap: int | None, greedy: bool) -> tuple[Tensor, Tensor]:
        """`rank_paths` from `_sequence_rows`' cache and draft states (the chains' slots are
        overwritten)."""
        c, dev = self.config, self.device
        m = g.shape[0]
        n = first + m
        nxt = next_tokens.to(dev)
        t = torch.arange(first, n, device=dev)
        rows = torch.arange(m, device=dev)
        draft_of = torch.full((c.vocab_size,), -1, dtype=torch.long, device=dev)
        draft_of[self.target_ids().to(dev)] = torch.arange(c.draft_vocab_size, device=dev)
        ranks = torch.empty(m, depth, dtype=torch.long, device=dev)
        top1 = torch.empty(m, depth, dtype=torch.float32, device=dev)
        committed = torch.arange(n, device=dev)[None, :] <= t[:, None]       # [m, n]: slots 0..t
        for d in range(1, depth + 1):
            logits = self.logits(g)                                             # [m, V_d]
            probs = torch.softmax(logits, dim=-1)
            top1[:, d - 1] = probs.max(dim=-1).values
            inside = t + d < n                                                  # x_{t+1+d} exists
            true = nxt[(t + d).clamp(max=n - 1)]
            did = draft_of[true]
            mine = logits.gather(1, did.clamp(min=0)[:, None])
            rank = torch.where(did < 0, c.draft_vocab_size, (logits > mine).sum(dim=-1))
            ranks[:, d - 1] = torch.where(inside, rank, -1)
            if d == depth:
                break
            # the depth-d node's row: (g, its token) at position t + d, in slots n + (d-1)*m + row
            if greedy:
                top = logits.argmax(dim=-1)
                token = top + self.d2t[top]
            else:
                token = true
            emb = self.embed(token)
            slot = n + (d - 1) * m
            positions = t + d
            out = []
            for r0 in range(0, m, RANK_CHUNK):
                r1 = min(m, r0 + RANK_CHUNK)
                k, start = r1 - r0, slot + r0
                local = rows[: k]
                mask = torch.zeros(k, start + k, dtype=torch.bool, device=dev)
                mask[:, :n] = committed[r0:r1]
                for j in range(1, d + 1):   # its rows at depths 1..d-1 and itself
                    mask[local, n + (j - 1) * m + r0 + local] = True
                cos, sin = self._rope(positions[r0:r1])
                out.append(self.layer(emb[r0:r1], g[r0:r1], cos, sin, kv, start, mask))
            g = torch.cat(out)
        if rank_cap is not None:
            ranks = torch.where(ranks < 0, rank_cap, ranks.clamp(max=rank_cap))
        return ranks, top1


# ----------------------------------------------------------------------------------------------
# Target features


def target_forward(model: Transformer, tokens: Tensor, input_pos: Tensor, aux_layer_ids: Sequence[int],
                   **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
    """`model(tokens, input_pos, **kwargs)` that also returns the drafter's features: (logits,
    hidden, features [n, k*dim]), features = the residual streams entering the target's layers
    `aux_layer_ids` (our convention), concatenated in that order, read from that same forward
    (`Transformer.capture_aux`, on any of its paths: plain, row-invariant, small-row kernel). The
    model's own capture setting is restored afterwards."""
    ids = tuple(aux_layer_ids)
    if any(not 0 <= i < model.args.n_layers for i in ids):
        raise Eagle3Error(f"aux_layer_ids {list(ids)}: the target has layers 0..{model.args.n_layers - 1}")
    before = model.aux_layer_ids
    model.capture_aux(ids)
    try:
        logits, hidden = model(tokens, input_pos, **kwargs)
        features = model.aux_features
    finally:
        model.capture_aux(before)
    assert features is not None
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
    try:
        return save_weights_folder(drafter, {"format": FORMAT, "format_version": FORMAT_VERSION,
                                             **drafter.config.to_dict()},
                                   folder, WEIGHTS_FILE, CONFIG_FILE, dtype, what="drafter weights",
                                   exclude=_not_stored(drafter.config))
    except ValueError as err:
        raise Eagle3Error(str(err)) from err


def read_drafter_config(folder: str | Path) -> tuple[Eagle3Config, str]:
    """(config, stored dtype name) of a drafter folder, validated."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an EAGLE-3 drafter folder holds {CONFIG_FILE} + {WEIGHTS_FILE} "
                                "(published EAGLE-3 / speculators folders load with pipeline.heads.eagle3_import)")
    try:
        raw, dtype = read_weights_config(path, FORMAT, FORMAT_VERSION, "EAGLE-3 drafter", "published EAGLE-3 / "
                                         "speculators folders load with pipeline.heads.eagle3_import")
    except ValueError as e:
        raise Eagle3Error(str(e)) from e
    try:
        return Eagle3Config.from_dict(raw), dtype
    except (TypeError, ValueError) as e:
        raise Eagle3Error(f"{path}: {e}") from e


def _not_stored(config: Eagle3Config) -> tuple[str, ...]:
    """State-dict keys a drafter file leaves out: the target's output rows of a shared lm_head."""
    return ("lm_head.weight",) if config.output == "shared" else ()


def build_drafter(config: Eagle3Config, state: dict[str, Tensor], where: str, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> Eagle3Drafter:
    """An Eagle3Drafter, built on the meta device (no random init), that takes `state`'s tensors:
    every missing / unexpected key and every shape or kind mismatch is named, and d2t / t2d must
    describe one draft vocabulary. Floating tensors are cast to `dtype` and placed on `device`."""
    with torch.device("meta"):
        drafter = Eagle3Drafter(config)
    expected = {k: v for k, v in drafter.state_dict().items() if k not in _not_stored(config)}
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
    missing = drafter.load_state_dict(placed, strict=False, assign=True).missing_keys
    assert sorted(missing) == sorted(_not_stored(config)), missing  # every other key was checked above
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
