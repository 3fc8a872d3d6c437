"""Tree speculative decoding with draft heads: draft a tree, verify it in one forward, accept.

One step, with the KV cache holding every committed position before `pos` and the root token
(the last emitted token, not yet in the cache) known:

1. pick a tree (an index into precompiled `TreeBuffers`: switching costs nothing),
2. the heads draft the tree's tokens from the context vector `h` of the previous position,
3. the base model verifies all nodes in one call with the tree's ancestor mask,
4. accept the longest path whose every token the base model agrees with (exact: equal to the
   parent's next token as the `Sampler` picks it, argmax at temperature 0, a sample keyed on the
   output position above; typical: probable enough under the parent's distribution),
5. emit the accepted drafts plus one bonus token from the last accepted node, and compact the
   KV cache to the accepted path (one gather over all layers).

Under exact acceptance (the default; "greedy" is its older name) the output is token-identical to
autoregressive decoding with the same sampler (greedy, or seeded sampling at temperature > 0: see
runtime/sampling.py), for any tree and any per-step choice of tree (up to floating-point ties in an
argmax). Typical acceptance (`TypicalAcceptance`) is the paper's and published Medusa/Hydra's rule:
it accepts more, and changes the output distribution.

The drafter is anything that follows the `Drafter` protocol below: Medusa/Hydra/Hydra++ heads
(`runtime.heads.DraftHeads`) or an EAGLE-3 drafter (`runtime.eagle3.Eagle3Drafter`), which reads
the target's intermediate features: the decoder turns their capture on for the forwards it runs
(`Transformer.capture_aux`) and hands each observation the features of the accepted rows of the
very forward that verified them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from runtime.device import clock
from runtime.dynamic import DYNAMIC_TREE, StepTreePolicy
from runtime.model.batch import BatchItem
from runtime.model.cache import KVCache
from runtime.model.llama import Transformer
from runtime.policy import SIGNALS, BatchScheduler, Scheduler
from runtime.sampling import RowPositions, Sampler
from runtime.tree import TreeBuffers

# names of the signals for which the decoder runs the heads' greedy chain every step (see
# `Signal.reads_heads`; the paper's signal is not one of them, see `PaperSignal`)
HEAD_SIGNALS = tuple(name for name, cls in SIGNALS.items() if cls.reads_heads)


class Drafter(Protocol):
    """What `TreeDecoder` drives: `runtime.heads.DraftHeads` (Medusa, Hydra, Hydra++) or
    `runtime.eagle3.Eagle3Drafter` (EAGLE-3). One decode, as the decoder calls it:

    * `bind(model)` once (the decoder's constructor); `reset()` at the start of a sequence;
      `new_state()` / `save_state()` / `load_state(state)`: a batch keeps one state per sequence
      (heads without a prefix layer keep none: None);
    * `aux_layer_ids`: the target layers whose inputs it reads (() for heads); when not empty the
      decoder turns `model.capture_aux(aux_layer_ids)` on for its forwards;
    * `observe(hidden [1, n, dim], positions [n], next_tokens [n], features [n, k*dim] | None) -> h`,
      after the prefill (the prompt's positions) and after every step (the root and the accepted
      drafts, rows of the verify forward gathered along the accepted path): `hidden` the target's
      final states there; for a drafter with `aux_layer_ids` (None otherwise: heads read neither)
      `features` the target's aux features there and `next_tokens` the tokens at the next
      positions (the prompt's tokens after the first, then the first root; the accepted drafts,
      then the bonus token, which is the next root). Returns the context `h` that drafts below the
      next root. Only committed positions are observed, so its state is a function of the true
      prefix alone (drafted rows never stay);
    * `propose(h, root, buffers) -> tokens [N]` (node order, tokens[0] = root);
      `propose_scored(h, root, buffers, stop_after) -> (tokens [N], node_prob [N])` (EntMTP-dyn,
      `runtime.dynamic`); `propose_batch(h [B, .], roots [B], buffers, states) -> tokens [B, N]`
      for the sequences of a batch that draft one tree, `states` their `save_state()`s;
    * `max_depth`: the deepest tree it drafts; `greedy_top1(h, root) -> [p_1..p_D]`, the top-1
      probabilities along its own greedy chain (the signals that read the drafter, `HEAD_SIGNALS`).
    """

    @property
    def max_depth(self) -> int: ...

    @property
    def aux_layer_ids(self) -> tuple[int, ...]: ...

    def bind(self, model: Transformer) -> None: ...

    def reset(self) -> None: ...

    def new_state(self) -> Any: ...

    def save_state(self) -> Any: ...

    def load_state(self, state: Any) -> None: ...

    def observe(self, hidden: torch.Tensor, positions: torch.Tensor, next_tokens: torch.Tensor | None = None,
                features: torch.Tensor | None = None) -> torch.Tensor: ...

    def propose(self, h: torch.Tensor, root_token: int | torch.Tensor, buffers: TreeBuffers) -> torch.Tensor: ...

    def propose_scored(self, h: torch.Tensor, root_token: int | torch.Tensor, buffers: TreeBuffers,
                       stop_after: Callable[[int, torch.Tensor], bool] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def propose_batch(self, h: torch.Tensor, root_tokens: torch.Tensor | Sequence[int], buffers: TreeBuffers,
                      states: Sequence[Any] | None = None) -> torch.Tensor: ...

    def greedy_top1(self, h: torch.Tensor, root: int | torch.Tensor) -> list[float]: ...


ACCEPTANCE_KINDS = ("exact", "typical")


@dataclass
class TypicalAcceptance:
    """Medusa/Hydra typical acceptance, as the published code does it (Medusa's
    `evaluate_posterior` with `sampling='typical', fast=True`, which Hydra's `hydra/model/utils.py`
    copies, and its `generate_candidates`):

    * a drafted child is accepted when its probability under the parent's tempered distribution
      p = softmax(logits / temperature) exceeds min(epsilon, alpha * exp(-H)), with the entropy
      H = -sum(p * log(p + 1e-5)) (the published constant inside the log);
    * a path counts only while every node on it is accepted; the step keeps the longest accepted
      length and, among the paths that reach it, the one with the largest summed log-probability of
      its accepted tokens (published: `best_candidates[argmax(likelihood)]`, the first on exact ties);
      when no draft is accepted, the root alone;
    * the next root (the step's bonus token) is the base model's argmax after the accepted node
      (published `generate_candidates` with fast=True: not sampled).

    The published code compares leaf paths (`retrieve_indices`); paths that share their accepted
    prefix have the same likelihood, so choosing among the deepest accepted *nodes* by the summed
    log-probability of their root paths is the same choice."""

    temperature: float = 0.7
    epsilon: float = 0.09
    alpha: float = 0.3
    seed: int = 0  # unused since the next root is the argmax (as published Hydra); kept for saved configs

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("typical acceptance needs temperature > 0; use acceptance='exact' for temperature 0")
        if not 0 <= self.epsilon <= 1 or self.alpha < 0:
            raise ValueError(f"typical acceptance needs epsilon in [0, 1] and alpha >= 0, got epsilon={self.epsilon}, "
                             f"alpha={self.alpha}")

    def to_dict(self) -> dict[str, float | str]:
        return {"kind": "typical", "temperature": self.temperature, "epsilon": self.epsilon, "alpha": self.alpha}


Acceptance = str | TypicalAcceptance   # "exact" (lossless) or the paper's typical acceptance


def make_acceptance(spec: Acceptance | dict | None) -> Acceptance:
    """"exact" or a `TypicalAcceptance` from a name ("exact", "greedy" = exact, "typical" = the
    paper's settings), a dict {kind, temperature, epsilon, alpha} (the pipeline's `acceptance`
    block, or what a bank records), an instance, or None (exact)."""
    if spec is None or isinstance(spec, TypicalAcceptance):
        return spec if spec is not None else "exact"
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"acceptance must be 'exact', 'typical', a dict or a TypicalAcceptance, got {spec!r}")
    kind = "exact" if spec.get("kind", "exact") == "greedy" else spec.get("kind", "exact")
    if kind not in ACCEPTANCE_KINDS:
        raise ValueError(f"acceptance kind {kind!r}: choose one of {', '.join(ACCEPTANCE_KINDS)}")
    if kind == "exact":
        return "exact"
    known = {"temperature", "epsilon", "alpha"}
    return TypicalAcceptance(**{k: float(v) for k, v in spec.items() if k in known})


def acceptance_dict(acceptance: Acceptance) -> dict[str, float | str]:
    """The JSON form of an acceptance (inverse of `make_acceptance`)."""
    return acceptance.to_dict() if isinstance(acceptance, TypicalAcceptance) else {"kind": "exact"}


@dataclass
class StepRecord:
    tree: int          # index of the tree used in this step; DYNAMIC_TREE (-1): a StepTreePolicy's own tree
    accepted: int      # accepted draft tokens (tokens emitted this step = accepted + 1)
    seconds: float     # wall time of the whole step (choose + draft + verify + accept)
    signal: float      # the value the policy saw (nan for a fixed schedule and a DynamicPolicy)
    nodes: int = 0     # nodes verified in this step (the tree's size)
    depth: int = -1    # the depth a StepTreePolicy drafted to (-1: a bank tree's step)


@dataclass
class GenerationResult:
    tokens: list[int]                       # new tokens (EOS included when it stopped on one)
    steps: list[StepRecord] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per decoding step (accepted drafts + the bonus token); AR = 1.0.

        The first token comes from the prefill and is not counted in any step."""
        if not self.steps:
            return float("nan")
        return (len(self.tokens) - 1) / len(self.steps)

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per second, prefill included."""
        total = self.prefill_seconds + self.decode_seconds
        return len(self.tokens) / total if total > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        return (len(self.tokens) - 1) / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def stats(self) -> dict[str, float | int | dict[int, int]]:
        used: dict[int, int] = {}
        dynamic: dict[int, int] = {}
        drafted: dict[int, int] = {}
        for s in self.steps:
            if s.tree == DYNAMIC_TREE:
                dynamic[s.nodes] = dynamic.get(s.nodes, 0) + 1
                drafted[s.depth] = drafted.get(s.depth, 0) + 1
            else:
                used[s.tree] = used.get(s.tree, 0) + 1
        extra = ({"dynamic_nodes": dict(sorted(dynamic.items())), "dynamic_drafted_depths": dict(sorted(drafted.items()))}
                 if dynamic else {})
        return {
            "new_tokens": len(self.tokens),
            "steps": len(self.steps),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "tok_per_s": round(self.tokens_per_second, 2),
            "decode_tok_per_s": round(self.decode_tokens_per_second, 2),
            "prefill_s": round(self.prefill_seconds, 4),
            "trees_used": used,
            **extra,
        }


class TreeDecoder:
    """Exact (greedy or seeded-sampling) or typical tree speculative decoding over a fixed list of
    compiled trees."""

    def __init__(
        self,
        model: Transformer,
        heads: Drafter,
        trees: Sequence[TreeBuffers],
        acceptance: Acceptance | dict = "exact",
    ) -> None:
        """`heads`: a `Drafter` (Medusa/Hydra heads or an EAGLE-3 drafter)."""
        if not trees:
            raise ValueError("TreeDecoder needs at least one tree")
        acceptance = make_acceptance(acceptance)
        max_depth = max(len(t.depth_slices) for t in trees)
        if max_depth > heads.max_depth:
            raise ValueError(f"a tree has depth {max_depth} but the heads draft only {heads.max_depth} tokens")
        self.model = model
        self.heads = heads
        self.trees = [t.to(model.device) for t in trees]  # buffers live where the model computes
        self.acceptance = acceptance
        self._max_nodes = max(t.num_nodes for t in self.trees)
        # positions 0..max depth: the offsets of an accepted path's slots after compaction
        self._offsets = torch.arange(max(t.depth for t in self.trees) + 1, device=model.device)
        heads.bind(model)

    @contextmanager
    def _features(self) -> Iterator[None]:
        """The drafter's aux features captured by every forward of a decode (none for heads),
        the model's own setting restored afterwards."""
        ids = tuple(self.heads.aux_layer_ids)
        if not ids:
            yield
            return
        before = self.model.aux_layer_ids
        self.model.capture_aux(ids)
        try:
            yield
        finally:
            self.model.capture_aux(before)

    def _aux(self) -> torch.Tensor | None:
        """The last forward's aux features (None unless the drafter reads them)."""
        return self.model.aux_features if self.heads.aux_layer_ids else None

    # ----------------------------------------------------------------------------------------
    def _accept(self, buf: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor,
                sampler: Sampler, first_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The deepest node whose whole path the base model accepts, and the bonus token after it,
        both as int64 [1] tensors on the device (nothing is read on the host here).

        tokens [N] are the drafted tokens (index 0 the root), logits [N, V] the verify forward's;
        `first_position` is the output position the root's row predicts (tokens emitted so far)."""
        if self.acceptance == "exact":
            # [N]: the base model's token after each node (argmax, or its keyed sample); a depth-d
            # node predicts output position first_position + d
            next_tokens = sampler.next_tokens(logits, RowPositions(first_position, buf.depths, buf.depth + 1))
            ok = tokens == next_tokens[buf.parent_index]
            ok[0] = True
            # a node counts only when it and every ancestor are accepted: its mask row lists exactly those
            accepted = ~(buf.attn_mask & ~ok).any(dim=-1)
            # at most one child of a node equals its next token, so the deepest accepted node is unique
            # (up to repeated drafts of one token, which carry the same path)
            best = torch.where(accepted, buf.depths, -1).argmax(dim=0, keepdim=True)
            return best, next_tokens.index_select(0, best)
        cfg = self.acceptance
        probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
        entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
        threshold = torch.clamp(cfg.alpha * torch.exp(-entropy), max=cfg.epsilon)
        node_prob = probs[buf.parent_index, tokens]          # [N]: p(token | parent), tempered
        ok = node_prob > threshold[buf.parent_index]
        ok[0] = True
        accepted = ~(buf.attn_mask & ~ok).any(dim=-1)
        # the likelihood of each node's path: summed log-probabilities of its tokens (root excluded);
        # `where`, not a product with the mask, because a rejected node's log-probability may be -inf
        node_logp = torch.log(node_prob)
        node_logp[0] = 0.0
        path_logp = torch.where(buf.attn_mask, node_logp[None, :], 0.0).sum(-1)
        accepted_depth = torch.where(accepted, buf.depths, -1)
        deepest = accepted_depth == accepted_depth.max()
        best = torch.where(deepest, path_logp, -math.inf).argmax(dim=0, keepdim=True)   # first on exact ties
        # the next root is the base model's argmax after the accepted node, as the published
        # Hydra/Medusa code chooses it under typical acceptance (it is not sampled)
        return best, logits.argmax(dim=-1).index_select(0, best)


    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        choose: Scheduler | StepTreePolicy | int = 0,
        eos_ids: Sequence[int] | None = None,
        stream: Callable[[list[int]], None] | None = None,
        sampler: Sampler | None = None,
    ) -> GenerationResult:
        """Decode up to `max_new_tokens` new tokens after `input_ids`.

        `choose` is a fixed tree index, a `Scheduler` (a policy and its signal) that picks the
        tree before every step, or a `runtime.dynamic.StepTreePolicy` that builds each step's tree (EntMTP-dyn's
        `DynamicPolicy`, EAGLE-2's `runtime.eagle2.Eagle2Policy`). `stream` receives each step's emitted tokens. `sampler` picks
        every emitted token (default: greedy); the output equals `ar_generate` with the same sampler.

        A step waits for the device once: when its emitted tokens (and, for signals that read the
        base logits, two statistics of the last accepted row) come to the host in one transfer.
        Signals that read the heads (`HEAD_SIGNALS`) add one more, before the tree is chosen.
        """
        seq = self._open(input_ids, max_new_tokens, choose, eos_ids, stream, sampler)
        self.model.reset_cache()
        self.heads.reset()
        with self._features():
            self._prefill(seq)
            t_dec = time.perf_counter()
            while not seq.done:
                buf, tokens, start = self._draft(seq)
                logits, hidden = self.model(tokens[None], start + buf.depths, buf.attn_mask, check_mask=False,
                                            ancestors=buf.ancestor_lists)
                self._finish(seq, logits[0], hidden[0], self._aux())
        seq.result.decode_seconds = clock(self.model.device) - t_dec
        return seq.result

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        choose: Scheduler | StepTreePolicy | int | Sequence[Scheduler | StepTreePolicy | int] = 0,
        eos_ids: Sequence[int] | None = None,
        sampler: Sampler | None = None,
        on_step: Callable[[], None] | None = None,
        batch_policy: BatchScheduler | None = None,
    ) -> list[GenerationResult]:
        """Decode several prompts together: every step verifies the tree rows of every live
        sequence in one forward (`Transformer.forward_batch`), each sequence with its own KV cache,
        positions and tree (`choose`: one for all, or one per prompt; a `Scheduler` is stateful, so
        give each prompt its own). A sequence leaves the batch when it emits EOS or reaches its
        token limit, and the step shrinks with it.

        Lossless per sequence: in the row-invariant arithmetic (`lossless: exact`) each sequence's
        tokens are exactly what `generate` (and so AR) gives that prompt alone, whatever else is in
        the batch. A prompt that repeats the one before it (`n` samples of one prompt) shares that
        prompt's prefill forward: its cache positions are copied, not computed again.
        Each result's `decode_seconds` is the batch's time until that sequence finished.
        `on_step` is called after every batch step (e.g. to time the steps). With `batch_policy` (a
        `runtime.policy.BatchScheduler`; each prompt's `choose` is then a Scheduler of its
        expected-throughput policy, which only supplies the signal), every step chooses all the
        sequences' trees at once from their signals."""
        if not prompts:
            raise ValueError("no prompts to decode")
        n = len(prompts)
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        chooses = list(choose) if isinstance(choose, (list, tuple)) else [choose] * n
        if len(limits) != n or len(chooses) != n:
            raise ValueError(f"{n} prompts but {len(limits)} token limits and {len(chooses)} tree choices")
        schedulers = [c for c in chooses if isinstance(c, Scheduler)]
        if len({id(c) for c in schedulers}) < len(schedulers):
            raise ValueError("a Scheduler keeps per-sequence state: give each prompt its own")
        model, heads = self.model, self.heads
        seqs = [self._open(p, m, c, eos_ids, None, sampler) for p, m, c in zip(prompts, limits, chooses)]
        own, own_heads = model.cache, heads.save_state()
        with self._features():
            self._decode_batch(seqs, batch_policy, on_step, own, own_heads)
        return [s.result for s in seqs]

    def _decode_batch(self, seqs: list[_Sequence], batch_policy: BatchScheduler | None,
                      on_step: Callable[[], None] | None, own: KVCache | None, own_heads: Any) -> None:
        """`generate_batch`'s loop over the opened sequences; restores the model's cache `own` and
        the drafter's state `own_heads` at the end."""
        model, heads = self.model, self.heads
        try:
            shared: _PromptForward | None = None
            for seq in seqs:
                seq.cache = model.new_cache(min(model.max_seq_len, len(seq.input_ids) + seq.max_new_tokens + (
                    seq.choose.num_nodes if isinstance(seq.choose, StepTreePolicy) else self._max_nodes)))
                seq.heads_state = heads.new_state()
                self._enter(seq)
                shared = self._prefill(seq, shared)
                self._leave(seq)
            t_dec = time.perf_counter()
            live = [s for s in seqs if not s.done]
            while live:
                picks: list[int | None] = [None] * len(live)
                if batch_policy is not None:
                    for seq in live:
                        self._enter(seq)
                        seq.signal = self._observe(seq)
                        self._leave(seq)
                    picks = batch_policy.choose([seq.signal for seq in live])
                same_tree: dict[int, list[_Sequence]] = {}
                for seq, pick in zip(live, picks):
                    self._enter(seq)
                    if self._choose(seq, pick):
                        same_tree.setdefault(seq.tree, []).append(seq)
                    self._leave(seq)
                for group in same_tree.values():
                    self._draft_together(group)
                outs = model.forward_batch([BatchItem(seq.cache, seq.drafted, seq.start + seq.buf.depths,
                                                      seq.buf.ancestor_lists) for seq in live])
                aux = self._aux()   # the items' rows one after the other
                feats = aux.split([seq.buf.num_nodes for seq in live]) if aux is not None else [None] * len(live)
                for seq, (logits, hidden), features in zip(live, outs, feats):
                    self._enter(seq)
                    self._finish(seq, logits, hidden, features)
                    self._leave(seq)
                    if seq.done:
                        seq.result.decode_seconds = clock(model.device) - t_dec
                live = [s for s in live if not s.done]
                if on_step:
                    on_step()
        finally:
            if own is not None:
                model.use_cache(own)
            heads.load_state(own_heads)

    # -- one sequence's decode, in phases that `generate` and `generate_batch` share ---------------

    def _open(self, input_ids: Sequence[int], max_new_tokens: int, choose: Scheduler | StepTreePolicy | int,
              eos_ids: Sequence[int] | None, stream: Callable[[list[int]], None] | None,
              sampler: Sampler | None) -> _Sequence:
        sampler = sampler if sampler is not None else Sampler()
        if not sampler.greedy and self.acceptance != "exact":
            raise ValueError("typical acceptance decides with its own temperature (TypicalAcceptance.temperature); "
                             "give a sampler only with acceptance='exact'")
        if len(input_ids) == 0:
            raise ValueError("empty prompt: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if isinstance(choose, StepTreePolicy):
            choose.prepare(self.model.device, self.heads.max_depth)
            if choose.depth >= len(self._offsets):   # slots of an accepted path after compaction
                self._offsets = torch.arange(choose.depth + 1, device=self.model.device)
        self.check_fits(len(input_ids), max_new_tokens,
                        choose.num_nodes if isinstance(choose, StepTreePolicy) else None)
        eos = set(eos_ids if eos_ids is not None else self.model.args.eos_token_ids)
        fixed = isinstance(choose, int)
        if fixed and not 0 <= choose < len(self.trees):
            raise ValueError(f"tree index {choose} out of range: the decoder has {len(self.trees)} trees")
        if isinstance(choose, Scheduler):
            choose.policy.check_bank(len(self.trees))
            choose.reset()
        elif not fixed and not isinstance(choose, StepTreePolicy):
            raise ValueError(f"choose must be a tree index, a runtime.policy.Scheduler or a runtime.dynamic."
                             f"StepTreePolicy (DynamicPolicy, runtime.eagle2.Eagle2Policy), got {type(choose).__name__}")
        return _Sequence(list(input_ids), max_new_tokens, choose, eos, stream, sampler)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, tree_nodes: int | None = None) -> None:
        """Raise ValueError, with the numbers, when a prompt of `prompt_tokens` plus `max_new_tokens`
        plus the largest tree (of the bank, or `tree_nodes`: a DynamicPolicy's super-tree) does
        not fit the KV cache."""
        capacity = self.model.max_seq_len
        largest = self._max_nodes if tree_nodes is None else tree_nodes
        need = prompt_tokens + max_new_tokens + largest
        if need > capacity:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) + largest tree "
                f"({largest} nodes) = {need} exceeds the KV cache capacity {capacity}; "
                "shorten the prompt, lower max_new_tokens or load the model with a larger max_seq_len"
            )

    def _enter(self, seq: _Sequence) -> None:
        """Point the model and heads at this sequence's caches (a batch keeps one per sequence)."""
        self.model.use_cache(seq.cache)
        self.heads.load_state(seq.heads_state)

    def _leave(self, seq: _Sequence) -> None:
        seq.heads_state = self.heads.save_state()

    def _prefill(self, seq: _Sequence, shared: _PromptForward | None = None) -> _PromptForward:
        """The prompt's forward into the sequence's cache, its first token and the drafter's view of
        the prompt. Where `shared` ran the same prompt (the batch's previous sequence: copies of one
        prompt, as `n` samples of it or a timed batch), its cache positions are copied instead of
        computed again; sampling the first token and the drafter's observation stay per sequence
        (they depend on its sampler). Returns the forward, for the next sequence to share."""
        model, heads, dev = self.model, self.heads, self.model.device
        t0 = clock(dev)
        ids = torch.tensor([seq.input_ids], dtype=torch.long, device=dev)
        prompt_pos = torch.arange(ids.shape[1], device=dev)
        if shared is not None and shared.input_ids == seq.input_ids and model.cache is not shared.cache:
            model.cache.copy_prefix(shared.cache, len(seq.input_ids))
        else:
            logits, hidden = model(ids, prompt_pos, last_only=True)
            shared = _PromptForward(seq.input_ids, model.cache, logits[0, -1], hidden, self._aux())
        last, hidden, features = shared.last, shared.hidden, shared.features
        root = seq.sampler.next_tokens(last[None], RowPositions(0, self._offsets[:1], 1))
        # the prompt's positions (with their features: each one's next token, the last one's the root)
        seq.h = heads.observe(hidden, prompt_pos) if features is None else \
            heads.observe(hidden, prompt_pos, torch.cat([ids[0, 1:], root]), features)
        seq.root = int(root[0])
        if seq.reads_logits:
            seq.p0, seq.entropy = _top1_and_entropy(last)
        seq.result.tokens.append(seq.root)
        seq.result.prefill_seconds = clock(dev) - t0
        if seq.stream:
            seq.stream([seq.root])
        seq.done = seq.root in seq.eos or len(seq.result.tokens) >= seq.max_new_tokens
        return shared

    def _observe(self, seq: _Sequence) -> float:
        """The sequence's signal before this step (its scheduler's)."""
        if not seq.scheduled:
            raise ValueError("a batch policy chooses from the sequences' Scheduler signals; a DynamicPolicy chooses "
                             "its own tree: decode it without batch_policy")
        chain = greedy_chain_top1(self.heads, seq.h, seq.root) if seq.reads_heads else ()
        return seq.choose.signal.observe(seq.p0, chain, seq.entropy)

    def _draft(self, seq: _Sequence) -> tuple[TreeBuffers, torch.Tensor, int]:
        """Choose the step's tree and draft it: (its buffers, the drafted tokens [N], the cache
        slot of its root)."""
        if self._choose(seq):
            seq.drafted = self.heads.propose(seq.h, seq.root, seq.buf)
        return seq.buf, seq.drafted, seq.start

    def _choose(self, seq: _Sequence, tree: int | None = None) -> bool:
        """Choose the step's tree (or take `tree`, chosen for the whole batch from the signal
        `_observe` gave). True when it is a bank tree, left to draft; a DynamicPolicy drafts its
        super-tree here and keeps the subset it chose (`runtime.dynamic`)."""
        # No synchronisation for this clock read: the previous step ended with one (its token
        # transfer); device work queued after it (the heads' observation) counts in this step.
        seq.step_t0 = time.perf_counter()
        seq.start = self.model.cache_len
        if tree is None and isinstance(seq.choose, StepTreePolicy):
            seq.tree, seq.signal = DYNAMIC_TREE, math.nan
            seq.buf, seq.drafted, seq.depth = seq.choose.draft(self.heads, seq.h, seq.root)
            return False
        if tree is not None:
            seq.tree = tree
        elif seq.fixed:
            seq.tree, seq.signal = seq.choose, math.nan
        else:
            seq.signal = self._observe(seq)
            seq.tree = seq.choose.policy.choose(seq.signal)
        seq.buf = self.trees[seq.tree]
        return True

    def _draft_together(self, group: list[_Sequence]) -> None:
        """Draft the step's tree of sequences that chose the same one, in one `propose_batch`: each
        head product then reads its weights once for the whole group. Drafting only proposes, so
        whatever it drafts, each sequence's output stays its own AR output."""
        if len(group) == 1:
            seq = group[0]
            seq.drafted = self.heads.propose(seq.h, seq.root, seq.buf)
            return
        h = torch.cat([seq.h.reshape(1, -1) for seq in group])
        drafted = self.heads.propose_batch(h, [seq.root for seq in group], group[0].buf,
                                           [seq.heads_state for seq in group])
        for seq, tokens in zip(group, drafted):
            seq.drafted = tokens

    def _finish(self, seq: _Sequence, logits: torch.Tensor, hidden: torch.Tensor,
                features: torch.Tensor | None = None) -> None:
        """Accept, compact the cache, observe the accepted positions and emit, from the verify
        forward's logits [N, V], hidden states [N, dim] and (for a drafter that reads them) aux
        features [N, k*dim] of the tree drafted by `_draft`."""
        model, heads = self.model, self.heads
        buf, start, k = seq.buf, seq.start, seq.tree
        tokens = seq.drafted
        best, bonus = self._accept(buf, tokens, logits, seq.sampler, len(seq.result.tokens))
        path = buf.node_paths.index_select(0, best)[0]      # [D+1] root..best, padded with best
        # move the path's K/V to the front now (all D+1 slots; the padding is cut below)
        model.compact_cache(start, path)
        parts = [buf.depths.index_select(0, best), tokens.index_select(0, path[1:]), bonus]
        if seq.reads_logits:
            parts.append(_logit_sums(logits.index_select(0, best)[0]))
        # the step's one host synchronisation: everything the host needs, in one transfer
        host = torch.cat([x.to(torch.float64) for x in parts]).tolist()
        accepted = int(host[0])
        model.truncate_cache(start + accepted + 1)
        rows = path[: accepted + 1]
        if features is None:   # heads: the hidden states are all they read
            seq.h = heads.observe(hidden[None, rows], start + self._offsets[: accepted + 1])
        else:
            # the accepted positions' features, each with its next token: the accepted drafts, then
            # the bonus (the next root)
            next_tokens = torch.cat([tokens.index_select(0, path[1: accepted + 1]), bonus])
            seq.h = heads.observe(hidden[None, rows], start + self._offsets[: accepted + 1], next_tokens,
                                  features.index_select(0, rows))
        emitted = [int(t) for t in host[1: 1 + accepted]] + [int(host[1 + buf.depth])]
        # stop at EOS / the token budget, mid-step if need be
        room = seq.max_new_tokens - len(seq.result.tokens)
        out: list[int] = []
        for tok in emitted[:room]:
            out.append(tok)
            if tok in seq.eos:
                break
        seq.result.tokens.extend(out)
        seq.root = out[-1]
        if seq.scheduled:
            seq.choose.update(accepted)
            if seq.reads_logits:
                seq.p0, seq.entropy = _p0_and_entropy(*host[-2:])
        seq.result.steps.append(StepRecord(k, accepted, time.perf_counter() - seq.step_t0, seq.signal,
                                           buf.num_nodes, seq.depth if k == DYNAMIC_TREE else -1))
        if seq.stream:
            seq.stream(out)
        seq.done = seq.root in seq.eos or len(seq.result.tokens) >= seq.max_new_tokens


@dataclass(frozen=True)
class _PromptForward:
    """A prompt's prefill forward in a batch, for the next sequence of the same prompt to share."""

    input_ids: list[int]
    cache: KVCache                            # the sequence's cache that holds the prompt's positions
    last: torch.Tensor                        # logits of the prompt's last position [V]
    hidden: torch.Tensor                      # the prompt's hidden states
    features: torch.Tensor | None             # the drafter's aux features of the prompt (`_aux`)


@dataclass
class _Sequence:
    """One sequence's decoding state between the phases of a step."""

    input_ids: list[int]
    max_new_tokens: int
    choose: Scheduler | StepTreePolicy | int
    eos: set[int]
    stream: Callable[[list[int]], None] | None
    sampler: Sampler
    result: GenerationResult = field(default_factory=lambda: GenerationResult(tokens=[]))
    cache: KVCache | None = None              # its KV cache (a batch's own; `generate` uses the model's)
    heads_state: Any = None                   # its drafter's decoding state (`Drafter.save_state`)
    h: torch.Tensor | None = None             # context vector of the last committed position
    root: int = -1                            # last emitted token, not yet in the cache
    p0: float = math.nan
    entropy: float = math.nan
    done: bool = False
    # the current step, between `_draft` and `_finish`
    tree: int = 0
    buf: TreeBuffers | None = None            # the step's tree (a bank tree, or a DynamicPolicy's subset)
    signal: float = math.nan
    start: int = 0
    drafted: torch.Tensor | None = None
    depth: int = -1                           # the depth a DynamicPolicy drafted to this step
    step_t0: float = 0.0

    @property
    def fixed(self) -> bool:
        return isinstance(self.choose, int)

    @property
    def scheduled(self) -> bool:
        """Chosen by a Scheduler (a policy over a signal), which reads and updates per step."""
        return isinstance(self.choose, Scheduler)

    @property
    def reads_heads(self) -> bool:
        return self.scheduled and self.choose.signal.reads_heads

    @property
    def reads_logits(self) -> bool:
        return self.scheduled and self.choose.signal.reads_logits


def _logit_sums(logits: torch.Tensor) -> torch.Tensor:
    """(s, d) = (sum(e), sum(e * z)) with z = x - max(x), e = exp(z), for one row of logits: the
    two numbers `_p0_and_entropy` needs, left on the device."""
    x = logits.float()
    z = x - x.max()
    e = z.exp()
    return torch.stack((e.sum(), torch.dot(e, z)))


def _p0_and_entropy(s: float, d: float) -> tuple[float, float]:
    """p0 = exp(0) / s = 1 / s and H = -sum(p log p) = log s - d / s (see `_logit_sums`)."""
    return 1.0 / s, math.log(s) - d / s


def _top1_and_entropy(logits: torch.Tensor) -> tuple[float, float]:
    """(p0, entropy in nats) of softmax(logits) for one row, with a single exp pass over the vocabulary.

    With m = max(x), z = x - m, e = exp(z), s = sum(e): p0 = exp(0) / s = 1 / s and
    H = -sum(p log p) = log s - sum(e * z) / s. Exact algebra (float32 rounding aside), and about
    2/3 of the cost of log_softmax followed by exp (two exp passes); on a 49,152-token vocabulary
    the exp pass is most of what is left (pipeline/benchmarks/policy_overhead.py)."""
    s, d = _logit_sums(logits).tolist()  # one conversion to Python floats
    return _p0_and_entropy(s, d)


def greedy_chain_top1(heads: Drafter, h: torch.Tensor, root: int) -> list[float]:
    """p_1..p_D: the drafter's top-1 probability at each depth along its own greedy chain from
    `root` (`Drafter.greedy_top1`: D = `max_depth`; the D probabilities come back in one transfer)."""
    return heads.greedy_top1(h, root)
