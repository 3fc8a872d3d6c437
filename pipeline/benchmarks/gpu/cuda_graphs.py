"""CUDA graphs of tree verify steps: every tree of a bank captured once, replayed by index.

Why: at batch size 1 a 7B model's verify forward on a GPU is bound by kernel launches as much as
by memory: some 30 kernels a layer, each launched from Python, where the GPU needs microseconds
for most of them. A captured graph replays all of a forward's kernels in one launch. A bank holds
a handful of trees and a policy switches between them every step, so each tree's verify forward
is captured once, up front, and a step replays the one its tree index names: switching trees
costs nothing (the paper's O(1) switch), and no step captures anything.

What changes between steps lives in static buffers that a step writes before the replay: the
drafted tokens (one [N] buffer per tree) and the committed cache length (one int64 scalar shared
by all graphs). Inside a graph runs `static_verify`, a fixed-shape form of
`runtime.model.Transformer.forward` over the same modules, weights and KV cache: it writes the N
new keys and values at cache slots start..start+N-1 (`index_copy_` with a device index), reads
RoPE rows at start + depth, and attends over the whole cache (max_seq_len keys) with a mask that
admits the committed slots and each node's ancestors. So the graph's cost follows the cache's
capacity, not the context: size the cache to what a generation needs.

Arithmetic: the ordinary one (`lossless: numerical`). The row-invariant forward (`lossless: exact`,
`Transformer.set_row_invariance`) splits attention into pieces whose number grows with the context,
which no single graph can hold, so `VerifyGraphs` refuses a model that decodes row-invariantly
rather than replaying other bits than its AR steps compute.

Limits: one sequence (the KV cache in use when the graphs are captured; `forward_batch` keeps one
cache per sequence and stays eager), the trees given at capture (a dynamic policy's per-step
subsets stay eager), CUDA only (`unavailable_reason` says why not elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.model.cache import KVCache
from runtime.model.llama import Transformer
from runtime.model.rope import apply_rope
from runtime.tree import TreeBuffers


class GraphsUnavailable(RuntimeError):
    """CUDA graphs cannot be used here; the message says why and what to do instead."""


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why verify steps cannot be captured as CUDA graphs on `device` (None: they can)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"CUDA graphs need a CUDA device; the model is on {dev.type!r}: decode eagerly "
                "(the eager forward is what the CPU runs anyway)")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda is not None}); "
                "run with a CUDA build of torch on a GPU machine")
    return None


def static_verify(model: Transformer, tokens: Tensor, depths: Tensor, tree_mask: Tensor, start: Tensor,
                  keys: Tensor) -> tuple[Tensor, Tensor]:
    """One verify forward whose every shape and address is fixed by the tree (N nodes) and the
    cache's capacity S, so that it can be captured: tokens [N] int64, depths [N] int64 (a node's
    RoPE position is start + depth), tree_mask [N, N] bool (a node sees itself and its
    ancestors), start a one-element int64 tensor (the committed cache length), keys the int64
    [S] range 0..S-1. Writes the nodes' K/V at slots start..start+N-1 of the model's cache in use
    and returns (logits [N, V] float32, hidden [N, dim]) as `Transformer.forward` does. Leaves
    the cache length alone (the caller advances it).

    It never reads a device value on the host, so it also runs eagerly on any device (which is
    how the CPU tests check it against `Transformer.forward`)."""
    n = tokens.shape[0]
    cache = model.cache
    if cache is None:
        raise RuntimeError("the KV cache is not allocated: call model.setup_cache(max_seq_len) first")
    a = model.args
    h, kvh, hd, groups = a.n_heads, a.n_kv_heads, a.head_dim, a.n_groups
    slots = start + torch.arange(n, device=tokens.device)                       # [N] cache slots of the nodes
    positions = start + depths
    cos = model.rope_cos[positions].unsqueeze(1)
    sin = model.rope_sin[positions].unsqueeze(1)
    # committed slots for every node, then each node's ancestors among the new slots
    mask = (keys < start).expand(n, keys.shape[0]).clone()
    mask.scatter_(1, slots.expand(n, n), tree_mask)
    if groups > 1:  # query rows are stacked KV-head-group-major, as in runtime.model.Attention
        mask = mask.repeat(groups, 1)
    x = model.tok_embeddings(tokens)
    for layer, kv in zip(model.layers, cache.layers):
        attn = layer.attention
        qkv = attn.wqkv(layer.attention_norm(x)).view(n, h + 2 * kvh, hd)
        qk = apply_rope(qkv[:, : h + kvh], cos, sin).to(x.dtype)
        kv[0].index_copy_(1, slots, qk[:, h:].transpose(0, 1))
        kv[1].index_copy_(1, slots, qkv[:, h + kvh:].transpose(0, 1))
        q = qk[:, :h].view(n, kvh, groups, hd).permute(1, 2, 0, 3).reshape(1, kvh, groups * n, hd)
        out = F.scaled_dot_product_attention(q, kv[None, 0], kv[None, 1], attn_mask=mask)
        out = out.view(kvh, groups, n, hd).permute(2, 0, 1, 3).reshape(n, h * hd)
        x = x + attn.wo(out)
        x = x + layer.feed_forward(layer.ffn_norm(x))
    hidden = model.norm(x)
    return model.output(hidden).float(), hidden


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor      # [N] the drafted tokens: written before each replay
    logits: Tensor      # [N, V] float32, rewritten by each replay
    hidden: Tensor      # [N, dim]
    nodes: int


class VerifyGraphs:
    """Each tree's verify forward captured once as a CUDA graph over the model's KV cache in use;
    `verify(k, tokens)` replays tree k's. Capture needs the cache to have room for the largest
    tree after its current length (the warm-up runs write there, never into committed slots).

    The graphs share one memory pool (they never run at the same time); each keeps its own static
    input and output buffers, so switching trees copies nothing."""

    def __init__(self, model: Transformer, trees: Sequence[TreeBuffers], warmup: int = 2) -> None:
        reason = unavailable_reason(model.device)
        if reason:
            raise GraphsUnavailable(reason)
        if model.invariant_rows is not None or model.kernel_decode:
            raise ValueError("this model decodes row-invariantly (lossless: exact), whose forward depends on the context "
                             "and cannot be captured once per tree; call model.set_row_invariance(None) "
                             "(lossless: numerical) before capturing, or decode without graphs")
        if not trees:
            raise ValueError("VerifyGraphs needs at least one tree")
        cache = model.cache
        if cache is None:
            raise RuntimeError("the KV cache is not allocated: call model.setup_cache(max_seq_len) first")
        dev = model.device
        largest = max(t.num_nodes for t in trees)
        at = cache.length
        if at + largest > model.max_seq_len:
            raise ValueError(f"capturing writes the largest tree ({largest} nodes) after the {at} committed slots, "
                             f"beyond the cache's {model.max_seq_len}: capture with a shorter cache length "
                             "(e.g. right after setup_cache)")
        self.model = model
        self.cache: KVCache = cache
        self.trees = [t.to(dev) for t in trees]
        self._keys = torch.arange(model.max_seq_len, device=dev)
        self._start = torch.full((1,), at, dtype=torch.long, device=dev)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: list[_Captured] = []
        with torch.inference_mode():
            for buf in self.trees:
                self._graphs.append(self._capture(buf, warmup))
        torch.cuda.synchronize(dev)

    def _capture(self, buf: TreeBuffers, warmup: int) -> _Captured:
        model = self.model
        tokens = torch.zeros(buf.num_nodes, dtype=torch.long, device=model.device)

        def run() -> tuple[Tensor, Tensor]:
            return static_verify(model, tokens, buf.depths, buf.attn_mask, self._start, self._keys)

        # warm-up on a side stream (cuBLAS workspaces, SDPA's kernel choice), as capture requires
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                run()
        torch.cuda.current_stream(model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = run()
        return _Captured(graph, tokens, logits, hidden, buf.num_nodes)

    def __len__(self) -> int:
        return len(self._graphs)

    def verify(self, index: int, tokens: Tensor, start: int | None = None) -> tuple[Tensor, Tensor]:
        """Replay tree `index`'s verify forward for drafted tokens [N] (on the model's device) after
        `start` committed positions (default: the cache's length), which must be the cache's
        length as the decoder keeps it; advances the cache length by N like `Transformer.forward`.

        Returns (logits [1, N, V] float32, hidden [1, N, dim]): views of the graph's static
        output buffers, which the next replay of the same tree overwrites (clone what must outlive it)."""
        if not 0 <= index < len(self._graphs):
            raise IndexError(f"tree index {index} out of range: {len(self._graphs)} trees were captured")
        model = self.model
        if model.cache is not self.cache:
            raise RuntimeError("the model now decodes into another KV cache than the graphs were captured on; "
                               "capture a VerifyGraphs for that cache (graphs hold the cache's addresses)")
        if model.invariant_rows is not None or model.kernel_decode:
            raise RuntimeError("the model now decodes row-invariantly (lossless: exact); the graphs replay the ordinary "
                               "arithmetic, which would break the AR identity: decode eagerly or set_row_invariance(None)")
        g = self._graphs[index]
        start = self.cache.length if start is None else int(start)
        if start + g.nodes > model.max_seq_len:
            raise ValueError(f"the KV cache holds {model.max_seq_len} positions; {start} are used and the tree's "
                             f"{g.nodes} nodes do not fit")
        if tokens.shape != (g.nodes,):
            raise ValueError(f"tree {index} has {g.nodes} nodes; got tokens of shape {tuple(tokens.shape)}")
        self._start.fill_(start)  # a kernel argument: no host-device synchronisation
        g.tokens.copy_(tokens, non_blocking=True)
        g.graph.replay()
        self.cache.length = start + g.nodes
        return g.logits.unsqueeze(0), g.hidden.unsqueeze(0)
