"""EAGLE-2's dynamic draft tree (arXiv 2406.16858) as a decode mode: the field's default baseline.

Every step the drafter grows a tree from its own confidence, and the target verifies it:

1. expand: the root's top-k children are the depth-1 candidates; for each depth d < `depth`, the
   k candidates of depth d with the highest cumulative log-probability (the sum of the draft
   log-probabilities along the path; the frontier) each get their top-k children as the
   depth-(d+1) candidates. That drafts k + (depth - 1) k^2 nodes, with one drafter pass per depth
   over k rows (EAGLE-3: one draft-layer forward over the frontier; Hydra: head d+1 over the
   frontier's paths; Medusa: every head once, its children the same for every parent);
2. rerank: of every drafted node, keep the `total_tokens - 1` with the highest cumulative
   log-probability (ties: the node drafted first, so a parent before its child and a sibling of
   lower rank first). A child's cumulative log-probability never exceeds its parent's, so the kept
   nodes and the root form a tree, and a kept node's lower-ranked siblings are kept too;
3. verify that tree with the ordinary tree decoder (`runtime.decoder.TreeDecoder`): lossless
   under exact acceptance (greedy or seeded sampling), as every tree is.

The settings are SGLang's `speculative_num_steps` (depth), `speculative_eagle_topk` (topk) and
`speculative_num_draft_tokens` (total_tokens: the nodes verified per step, the root included).
SGLang's defaults, (5, 4, 8), are this module's: they are the field's default, and 8 verified
nodes lie where the bank's fastest trees for the default 135M model on a CPU lie (a few to 16
nodes), whereas EAGLE's own (total 60, depth 6-7, top-10) price a 7B model on a GPU, where
verifying 60 tokens costs about as much as one. A drafter that drafts fewer than `depth` tokens
(the Hydra/Medusa heads shipped here have 4) drafts as deep as it can (`Eagle2Settings.capped`).

    policy = Eagle2Policy(Eagle2Settings(depth=4, topk=4, total_tokens=8))
    decoder.generate(prompt, 128, choose=policy)     # any TreeDecoder: its bank's trees are not read

The verified tree's buffers are compiled once per distinct shape and cached (the shape is read on
the host: one small transfer per step, like EntMTP-dyn's subset key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from runtime.dynamic import StepTreePolicy
from runtime.tree import Tree, TreeBuffers

EAGLE2 = "eagle2"   # the policy name (`EntMTP.scheduler`, `entmtp generate --policy eagle2`)


@dataclass(frozen=True)
class Eagle2Settings:
    """EAGLE-2's three settings (SGLang's names in brackets): `depth` [speculative_num_steps], the
    tree's depth below the root; `topk` [speculative_eagle_topk], the frontier's width and each
    expanded node's children; `total_tokens` [speculative_num_draft_tokens], the nodes verified
    per step, the root included (1: plain AR steps)."""

    depth: int = 5
    topk: int = 4
    total_tokens: int = 8

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Eagle2Settings.{name} must be an int >= 1, got {value!r}")
        if self.total_tokens > 1 + self.drafted_nodes:
            raise ValueError(f"Eagle2Settings: total_tokens {self.total_tokens} exceeds the root plus the "
                             f"{self.drafted_nodes} nodes that depth {self.depth} and topk {self.topk} draft "
                             f"(topk + (depth - 1) * topk^2); lower total_tokens or raise depth / topk")

    @property
    def drafted_nodes(self) -> int:
        """Nodes drafted per step: the root's topk children, then topk^2 per further depth."""
        return self.topk + (self.depth - 1) * self.topk ** 2

    def capped(self, max_depth: int) -> Eagle2Settings:
        """These settings for a drafter that drafts at most `max_depth` tokens: depth cut to it and
        total_tokens to what that depth drafts (unchanged when they fit)."""
        depth = min(self.depth, max_depth)
        nodes = self.topk + (depth - 1) * self.topk ** 2
        return Eagle2Settings(depth, self.topk, min(self.total_tokens, 1 + nodes))

    def to_dict(self) -> dict[str, int]:
        return {"depth": self.depth, "topk": self.topk, "total_tokens": self.total_tokens}

    def __str__(self) -> str:
        return f"depth {self.depth}, top-{self.topk}, {self.total_tokens} tokens"


# ----------------------------------------------------------------------------------------------
# One step's drafting, per drafter kind: the rows of the current frontier, their draft logits, and
# the next frontier's rows. Each reads the drafter's own pieces, so a step costs what EAGLE-2's
# drafting costs with that drafter (no node beyond the k + (depth-1) k^2 is drafted).


class _Eagle3Rows:
    """An EAGLE-3 drafter's frontier rows: draft states g [r, hidden] (the root's: the state that
    `observe` returned); a frontier node's row reads (its parent's g, its own token) at position
    last committed + its depth, in a scratch slot after the committed rows, and attends to every
    committed row, its drafted ancestors and itself (as `Eagle3Drafter.propose` drafts a tree)."""

    def __init__(self, drafter: Any, h: Tensor, settings: Eagle2Settings) -> None:
        state = drafter._state()   # noqa: SLF001 - the drafter's cache, as its own drafting reads it
        if state.length == 0:
            raise ValueError("the EAGLE-3 drafter has no committed row: observe the prompt first")
        scratch = (settings.depth - 1) * settings.topk
        if state.length + scratch > state.capacity:
            raise ValueError(f"EAGLE-2 drafting needs {scratch} scratch rows after the {state.length} committed "
                             f"ones, but the drafter cache holds {state.capacity}: lower depth or topk, or bind a "
                             "model with a larger max_seq_len")
        self.drafter, self.state = drafter, state
        self.g = h.reshape(1, -1).to(drafter.dtype)
        self.own = torch.zeros(1, 0, dtype=torch.bool, device=drafter.device)   # scratch rows each row attends
        self.written = 0

    def logits(self) -> Tensor:
        return self.drafter.logits(self.g)                                      # [r, V_d] float32

    def targets(self, ids: Tensor) -> Tensor:
        return ids + self.drafter.d2t[ids]

    def advance(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> None:
        d, dev = self.drafter, self.drafter.device
        w, start = tokens.numel(), self.state.length
        own = torch.zeros(w, self.written + w, dtype=torch.bool, device=dev)
        own[:, : self.written] = self.own.index_select(0, parent_rows)
        own[:, self.written:] = torch.eye(w, dtype=torch.bool, device=dev)
        mask = torch.cat([own.new_ones(w, start), own], dim=1)
        cos, sin = d._rope(torch.full((w,), start - 1 + depth, device=dev))   # noqa: SLF001
        self.g = d.layer(d.embed(tokens), self.g.index_select(0, parent_rows), cos, sin, self.state.kv,
                         start + self.written, mask)
        self.own, self.written = own, self.written + w


class _HeadsRows:
    """Hydra (and Hydra++) heads' frontier rows: head d reads concat(h, e(root), e(the path's
    tokens)) of each depth-(d-1) frontier node, as `DraftHeads.propose` drafts. Medusa heads read h
    alone: every head runs once, and a depth's children are the same for every parent (one row)."""

    def __init__(self, heads: Any, h: Tensor, root: int, settings: Eagle2Settings) -> None:
        self.heads, self.head = heads, 1
        h = h.reshape(1, -1).to(heads.dtype)
        self.medusa = heads.config.kind == "medusa"
        if self.medusa:
            states = heads.head_states(h, None, heads=settings.depth)             # [1, depth, dim]
            self.all = heads.output_logits(states)[0].float()                   # [depth, V_out]
        else:
            root_t = torch.tensor([root], dtype=torch.long, device=h.device)
            self.inputs = torch.cat([h, heads.embed(root_t)], dim=-1)            # [1, 2*dim]

    def logits(self) -> Tensor:
        if self.medusa:
            return self.all[self.head - 1: self.head]                            # [1, V_out]: any parent's
        x = self.heads._blocks(self.head, self.inputs)   # noqa: SLF001 - one head's blocks, as its drafting runs them
        return self.heads.output_logits(x[:, None, :], first_head=self.head)[:, 0].float()

    def targets(self, ids: Tensor) -> Tensor:
        return ids if self.heads.draft_ids is None else self.heads.draft_ids[ids]

    def advance(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> None:
        self.head = depth + 1
        if not self.medusa:
            self.inputs = torch.cat([self.inputs.index_select(0, parent_rows), self.heads.embed(tokens)], dim=-1)


def _rows(heads: Any, h: Tensor, root: int, settings: Eagle2Settings) -> _Eagle3Rows | _HeadsRows:
    from runtime.eagle3 import Eagle3Drafter
    from runtime.heads import DraftHeads

    if isinstance(heads, Eagle3Drafter):
        return _Eagle3Rows(heads, h, settings)
    if isinstance(heads, DraftHeads):
        return _HeadsRows(heads, h, root, settings)
    raise TypeError(f"EAGLE-2 drafting knows EAGLE-3 drafters and Medusa/Hydra heads, got {type(heads).__name__}")


@torch.no_grad()
def draft_eagle2(heads: Any, h: Tensor, root: int, settings: Eagle2Settings) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-2's expansion (module docstring, step 1) from context h after token `root`: every
    drafted node's (target token [M], cumulative log-probability [M] float32, code [M] int64),
    M = `settings.drafted_nodes`, depth by depth and within a depth by frontier row, then rank.

    A node's code names its place in the tree: depth * K^D + sum_i rank_i * K^(D-i) (K = topk,
    D = depth, rank_i its path's rank at depth i), so sorting codes sorts nodes by depth, then by
    path: `runtime.tree`'s node order. No host synchronisation."""
    k, depth = settings.topk, settings.depth
    rows = _rows(heads, h, root, settings)
    dev = h.device
    top_code = k ** depth
    ranks = torch.arange(k, device=dev)
    cum = torch.zeros(1, device=dev)
    code = torch.zeros(1, dtype=torch.long, device=dev)
    tokens_out, cum_out, code_out = [], [], []
    for d in range(1, depth + 1):
        logp = torch.log_softmax(rows.logits(), dim=-1)
        top = logp.topk(k, dim=-1)                                               # [r, k], r = 1 or the frontier
        width = cum.numel()
        values = top.values.expand(width, k)
        ids = top.indices.expand(width, k)
        cand_cum = (cum[:, None] + values).reshape(-1)                           # [width * k], row-major
        cand_tok = rows.targets(ids.reshape(-1))
        cand_code = (code[:, None] + top_code + ranks[None, :] * k ** (depth - d)).reshape(-1)
        tokens_out.append(cand_tok)
        cum_out.append(cand_cum)
        code_out.append(cand_code)
        if d == depth:
            break
        # the next frontier: the k best of these candidates (ties: the first drafted)
        pick = torch.sort(cand_cum, descending=True, stable=True).indices[:k]
        cum, code = cand_cum[pick], cand_code[pick]
        rows.advance(torch.div(pick, k, rounding_mode="floor"), cand_tok[pick], d)
    return torch.cat(tokens_out), torch.cat(cum_out), torch.cat(code_out)


def tree_of_codes(codes: list[int], settings: Eagle2Settings) -> Tree:
    """The `Tree` whose nodes have these codes (`draft_eagle2`)."""
    k, depth = settings.topk, settings.depth
    top_code = k ** depth
    paths = []
    for c in codes:
        d, rest = divmod(c, top_code)
        paths.append(tuple((rest // k ** (depth - i)) % k for i in range(1, d + 1)))
    return Tree(paths)


class Eagle2Policy(StepTreePolicy):
    """Pass as `choose` to `TreeDecoder.generate` / `generate_batch`: every step drafts EAGLE-2's
    tree with the decoder's drafter and verifies its best `total_tokens` nodes (module docstring).
    Stateless between steps apart from the compiled trees' cache (`cache_size` shapes; the
    oldest dropped past it), so one policy may serve every sequence and decode; `hits` /
    `misses` count the cache's look-ups."""

    def __init__(self, settings: Eagle2Settings | None = None, cache_size: int = 4096) -> None:
        settings = settings if settings is not None else Eagle2Settings()
        if not isinstance(settings, Eagle2Settings):
            raise TypeError(f"settings must be an Eagle2Settings, got {type(settings).__name__}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be an int >= 1, got {cache_size!r}")
        self.settings = settings
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._device = torch.device("cpu")
        self._cache: dict[tuple[int, ...], TreeBuffers] = {}

    @property
    def num_nodes(self) -> int:
        return self.settings.total_tokens

    @property
    def depth(self) -> int:
        return self.settings.depth

    def prepare(self, device: torch.device | str, num_heads: int) -> None:
        if self.depth > num_heads:
            raise ValueError(f"EAGLE-2 depth {self.depth} but the drafter drafts only {num_heads} tokens: use "
                             f"Eagle2Settings(...).capped({num_heads})")
        if torch.device(device) != self._device:
            self._device = torch.device(device)
            self._cache.clear()

    def reset_stats(self) -> None:
        self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "cached": len(self._cache)}

    def draft(self, heads: Any, h: Tensor, root: int) -> tuple[TreeBuffers, Tensor, int]:
        """One step: EAGLE-2's tree drafted from context h after `root`, (its buffers, its tokens
        [n] in buffer order, the depth drafted). Reading the kept nodes' codes is the step's one
        host synchronisation here."""
        n = self.settings.total_tokens
        root_t = torch.tensor([int(root)], dtype=torch.long, device=h.device)
        if n == 1:
            return self._buffers(()), root_t, 0
        tokens, cum, code = draft_eagle2(heads, h, int(root), self.settings)
        kept = torch.sort(cum, descending=True, stable=True).indices[: n - 1]
        codes, order = torch.sort(code.index_select(0, kept))
        buf = self._buffers(tuple(codes.tolist()))
        return buf, torch.cat([root_t, tokens.index_select(0, kept.index_select(0, order))]), self.depth

    def _buffers(self, codes: tuple[int, ...]) -> TreeBuffers:
        buf = self._cache.get(codes)
        if buf is not None:
            self.hits += 1
            return buf
        self.misses += 1
        buf = TreeBuffers.compile(tree_of_codes(list(codes), self.settings)).to(self._device)
        if len(self._cache) >= self.cache_size:
            self._cache.pop(next(iter(self._cache)))
        self._cache[codes] = buf
        return buf

    def __repr__(self) -> str:
        return f"Eagle2Policy({self.settings}, cache {len(self._cache)}/{self.cache_size})"
