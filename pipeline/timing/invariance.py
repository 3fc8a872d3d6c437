"""Row invariance, checked: does a position's logits row depend on how many tokens the forward holds,
and where they sit? The correctness checks of `lossless: exact` (`Transformer.set_row_invariance`),
shared by the row-invariance benchmark, the GPU check and the tests.

* `compare(model, ids, sizes)`: for a real prompt, AR decoding feeds the greedy continuation
  t_0, t_1, ... one token per forward; a tree verify feeds the same tokens as one chain of N nodes,
  and a *branchy* verify interleaves a distractor sibling after every chain node. Each chain node's
  logits row against AR's row for the same position: max |difference| and whether bit-identical,
  per depth.
* `invariance_probe(device, dtype)`: random-weight models with the attention shapes of Vicuna-7B and
  Llama-3-8B (`PROBE_SHAPES`) at ~200 / 700 / 1500 positions (`PROBE_CONTEXTS`), every row of two
  verified trees (`probe_trees`) against AR's row for the same token; `attend` plugs in another
  attention, so a test can show that the probe sees a faulty one.

`python -m pipeline.benchmarks.row_invariance` reports both, with the cost of invariance.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from runtime.model import invariant
from runtime.model.invariant import RowPlan
from runtime.model.llama import Attention, ModelArgs, Transformer

PROMPT = ("Write a Python function that returns the longest common prefix of a list of strings, "
          "with a docstring and two doctests. Explain the edge cases: an empty list, a list with one "
          "string, strings that share nothing, and strings where one is a prefix of all others.")


def ar_rows(model: Transformer, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy AR continuation t_0..t_steps-1 and the logits row of every fed token ([steps, V])."""
    model.reset_cache()
    logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)
    tokens = [int(logits[0, -1].argmax())]
    rows = []
    for _ in range(steps):
        logits, _ = model(torch.tensor([[tokens[-1]]]), torch.tensor([model.cache_len]))
        rows.append(logits[0, -1])
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[:steps], torch.stack(rows)


def chain_and_branchy(tokens: list[int], distractor: int) -> dict[str, tuple[list[int], list[int], torch.Tensor, list[int]]]:
    """{name: (node tokens, node depths, ancestor mask, slot of chain node d)} for a chain of the
    tokens and for the same chain with a distractor leaf after every chain node."""
    n = len(tokens)
    chain_mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = {"chain": (tokens, list(range(n)), chain_mask, list(range(n)))}
    toks, depths, parents, slots = [], [], [], []
    for d, t in enumerate(tokens):
        toks.append(t)
        depths.append(d)
        parents.append(slots[-1] if slots else -1)
        slots.append(len(toks) - 1)
        if d + 1 < n:  # a sibling of the next chain node: same parent, another token
            toks.append(distractor)
            depths.append(d + 1)
            parents.append(slots[-1])
    m = len(toks)
    mask = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    out["branchy"] = (toks, depths, mask, slots)
    return out


def verify_rows(model: Transformer, ids: list[int], nodes: list[int], depths: list[int], mask: torch.Tensor) -> torch.Tensor:
    model.reset_cache()
    model(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)
    start = model.cache_len
    logits, _ = model(torch.tensor([nodes]), start + torch.tensor(depths), mask)
    return logits[0]


def compare(model: Transformer, ids: list[int], sizes: Sequence[int]) -> list[dict[str, Any]]:
    steps = max(sizes)
    tokens, ref = ar_rows(model, ids, steps)
    results = []
    for n in sizes:
        for name, (nodes, depths, mask, slots) in chain_and_branchy(tokens[:n], distractor=tokens[0] + 1).items():
            rows = verify_rows(model, ids, nodes, depths, mask)[slots]
            diff = (rows - ref[:n]).abs().amax(dim=-1)
            same = (rows == ref[:n]).all(dim=-1)
            results.append({"layout": name, "nodes": len(nodes), "depths": n,
                            "max_abs_diff_by_depth": [float(f"{x:.3g}") for x in diff.tolist()],
                            "identical_depths": int(same.sum()), "root_identical": bool(same[0])})
    return results


# The attention shapes (query heads, KV heads, head_dim) of the models whose CUDA fault the probe
# was written for: with 32 heads at ~500 keys, flash attention summed one row's keys in 4 splits,
# 4 rows' in 2 and 7 or more rows' in 1.
PROBE_SHAPES: dict[str, tuple[int, int, int]] = {"vicuna-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128)}
# ~200 / 700 / 1500 positions, each 60 past a multiple of KEY_CHUNK (64), so that the probe trees'
# rows have heads (see runtime.model.invariant.KEY_CHUNK) ending on both sides of a chunk boundary
PROBE_CONTEXTS = (188, 700, 1468)
# an attention to plug into the probe's models in place of `Attention._attend` (as a method)
Attend = Callable[[Attention, Tensor, Tensor, RowPlan], Tensor]


def probe_trees() -> dict[str, list[int]]:
    """{name: parent of each node (-1: the root)}: a 4-node chain (few rows: each row's keys gathered
    whole) and a 7-deep chain with a sibling beside each node (13 rows: the head read in place)."""
    branchy = [-1]
    for d in range(1, 7):
        chain_parent = 0 if d == 1 else len(branchy) - 2  # the previous chain node
        branchy += [chain_parent, chain_parent]  # the next chain node, then its sibling
    return {"chain4": [-1, 0, 1, 2], "branchy13": branchy}


def probe_model(heads: int, kv_heads: int, head_dim: int, max_seq_len: int, device: torch.device | str,
                dtype: torch.dtype, layers: int = 1, dim: int = 128, vocab: int = 256, seed: int = 0,
                intermediate: int | None = None) -> Transformer:
    """A random-weight Llama with these attention shapes and small everything else by default (dim,
    FFN (`intermediate`, default 2 x dim), vocabulary: they only feed the attention), its cache
    allocated. Weights ~ N(0, 1/fan_in), so that the attention's scores have unit scale."""
    args = ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=intermediate or 2 * dim, max_position_embeddings=max_seq_len)
    model = Transformer(args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / (1.0 if "embeddings" in name else p.shape[1] ** 0.5))
    model.to(device=device, dtype=dtype).eval()
    model.setup_cache(max_seq_len)
    return model


@torch.inference_mode()
def _tree_against_ar(model: Transformer, context: int, parents: list[int], g: torch.Generator) -> tuple[int, float]:
    """Verify the tree of `parents` (random tokens) after a random `context`-token prompt, then decode
    every root-to-node path by AR, one token per forward; (rows bit-identical to AR's, max |diff|)."""
    dev, vocab, n = model.device, model.args.vocab_size, len(parents)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(dev)
    tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
    ancestors: list[list[int]] = []
    for i, par in enumerate(parents):
        ancestors.append((ancestors[par] if par >= 0 else []) + [i])
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, anc in enumerate(ancestors):
        mask[i, anc] = True
    model.reset_cache()
    model(prompt, torch.arange(context, device=dev), last_only=True)
    depths = torch.tensor([len(a) - 1 for a in ancestors], device=dev)
    tree, _ = model(torch.tensor([tokens], device=dev), context + depths, mask.to(dev), ancestors=ancestors)
    ar = [None] * n

    def walk(node: int, depth: int) -> None:  # AR along the tree, depth first: one forward per node
        logits, _ = model(torch.tensor([[tokens[node]]], device=dev), torch.tensor([context + depth], device=dev))
        ar[node] = logits[0, -1]
        for child in (c for c, par in enumerate(parents) if par == node):
            walk(child, depth + 1)
            model.truncate_cache(context + depth + 1)

    model.truncate_cache(context)
    walk(0, 0)
    ar_rows = torch.stack(ar)  # type: ignore[arg-type]
    same = (tree[0] == ar_rows).all(dim=-1)
    return int(same.sum()), float((tree[0] - ar_rows).abs().amax())


def invariance_probe(device: torch.device | str, dtype: torch.dtype, rows: int = 8,
                     shapes: dict[str, tuple[int, int, int]] | None = None,
                     contexts: Sequence[int] = PROBE_CONTEXTS, layers: int = 1,
                     attend: Attend | None = None, seed: int = 0) -> dict[str, Any]:
    """Whether every row of a tree verify is bit-identical to AR's row for the same token, at
    these attention shapes (default PROBE_SHAPES) and contexts, under `set_row_invariance(rows)` on
    this device and dtype: attention and the whole forward, on random-weight models (`probe_model`)
    and both `probe_trees`. `attend` replaces the models' attention (after `set_row_invariance`,
    whose own attention check would refuse a faulty one): a test plugs in a deliberately faulty one
    to show that the probe sees it. Returns {"device", "dtype", "rows", "rows_per_attention_product",
    "ok", "results": [{"shape", "context", "tree", "nodes", "identical_rows", "max_abs_diff"}]}."""
    device = torch.device(device)
    shapes = PROBE_SHAPES if shapes is None else shapes
    results, ok = [], True
    longest = max(len(p) for p in probe_trees().values())
    for name, (heads, kv_heads, head_dim) in shapes.items():
        model = probe_model(heads, kv_heads, head_dim, max(contexts) + longest + 8, device, dtype, layers=layers,
                            seed=seed)
        model.set_row_invariance(rows)
        if attend is not None:
            for layer in model.layers:
                layer.attention._attend = types.MethodType(attend, layer.attention)
        g = torch.Generator().manual_seed(seed)
        for context in contexts:
            for tree, parents in probe_trees().items():
                same, diff = _tree_against_ar(model, context, parents, g)
                ok = ok and same == len(parents)
                results.append({"shape": name, "context": context, "tree": tree, "nodes": len(parents),
                                "identical_rows": same, "max_abs_diff": float(f"{diff:.3g}")})
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "rows": rows,
            "rows_per_attention_product": invariant.ATTENTION_ROWS.get(device.type, rows), "ok": ok,
            "results": results}
