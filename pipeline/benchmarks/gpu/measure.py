"""The measurements of `pipeline.benchmarks.gpu.check`, on a random-weight model of a given shape.

No checkpoint, no tokenizer, no data: every figure here depends on the shapes and the arithmetic
only (timings), or compares two computations of the same random model bit for bit (row
agreement), so random weights and random token ids serve as well as real ones and the check runs
on a machine that reaches no registry and holds no model.

Sections (each a function returning a JSON-ready dict):
* `row_agreement`: a tree verify's rows against AR's rows for the same positions, bit for bit;
* `verify_cost`: one verify forward by new rows and context;
* `draft_cost`: the heads' drafting (`propose`) by depth and level width;
* `step_model`: the time stage's step-cost model and its check against timed decodes of trees;
* `graph_timing`: eager verify forwards against CUDA-graph replays (`pipeline.benchmarks.gpu.cuda_graphs`);
* `decode_identity`: the decodes users run (a fixed tree, batches of 2 and 4, EntMTP-dyn, seeded
  sampling, an EAGLE-3 drafter) token for token against AR, in `lossless: exact` on torch's path.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.paths import REPO_ROOT
from runtime.device import clock
from runtime.heads import DraftHeads, HeadsConfig
from runtime.config import ModelArgs
from runtime.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids
from runtime.model.llama import Linear, Transformer
from runtime.tree import Tree, TreeBuffers

# The shapes the check runs at. vicuna-7b: Vicuna-7B v1.3 (Llama-1 7B), the paper's model. The
# others exist to run the same code on a CPU: cpu-small in a minute or two on 2 cores, tiny in
# seconds (the tests).
SHAPES: dict[str, ModelArgs] = {
    "vicuna-7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                           intermediate_size=11008, norm_eps=1e-6, max_position_embeddings=2048),
    "cpu-small": ModelArgs(vocab_size=32000, dim=512, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=64,
                           intermediate_size=1376, norm_eps=1e-6, max_position_embeddings=2048),
    "tiny": ModelArgs(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=172, norm_eps=1e-6, max_position_embeddings=2048),
}
NUM_HEADS = 4  # Hydra heads: the depth of Medusa's default tree and of every shipped bank tree


def sig(x: float, digits: int = 4) -> float | None:
    """x rounded to `digits` significant digits for the report (None for NaN / inf)."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


class Budget:
    """A wall-clock allowance for the whole check, so that it ends inside one device call."""

    def __init__(self, seconds: float, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0  # perf_counter at the check's start
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def until(self, share: float) -> float:
        """A deadline (perf_counter) `share` of the time left from now."""
        return time.perf_counter() + max(0.0, self.left()) * share


# -- the model, the heads, the trees --------------------------------------------------------------


def random_model(args: ModelArgs, dtype: torch.dtype, device: torch.device | str, max_seq_len: int,
                 seed: int = 0) -> Transformer:
    """A runtime Transformer of shape `args` with N(0, 0.02) weights and unit norms, made directly
    in `dtype` on `device` (no float32 copy of a 7B model on the way), prepared as `load_model`
    prepares a checkpoint (CPU float32: the small-row fast paths)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.requires_grad_(False)
    model.eval()
    if dtype == torch.float32 and device.type == "cpu":
        model.add_fast_paths()
    model.setup_cache(max_seq_len)
    return model


def random_heads(model: Transformer, seed: int = 1, num_heads: int = NUM_HEADS) -> DraftHeads:
    """Hydra heads (one ResBlock each, the base lm_head shared) bound to `model`, in its dtype and
    on its device, with small random ResBlock weights (drafting costs what trained heads cost)."""
    cfg = HeadsConfig.for_model(model.args, kind="hydra", num_heads=num_heads)
    with torch.device(model.device):
        heads = DraftHeads(cfg)
    heads = heads.to(model.dtype)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for head in heads.heads:
            for block in head.blocks:
                block.linear.weight.normal_(0.0, 0.02, generator=gen)
    heads.bind(model)
    heads = heads.eval().requires_grad_(False)
    heads.add_fast_paths()
    return heads


def check_trees(num_heads: int = NUM_HEADS, banks_dir: Path | None = None) -> dict[str, Tree]:
    """The trees the check verifies: a chain, Medusa's (and Hydra's) default `mc_sim_7b_63`, and
    every distinct tree of the shipped banks found under `banks_dir` (artifacts/banks: built by
    `make bank`, not in git, so present only where it was built or carried), named
    `<task>#<index>`. Trees deeper than the heads are left out."""
    trees: dict[str, Tree] = {"chain4": Tree.chain(4), "mc_sim_7b_63": Tree.named("mc_sim_7b_63")}
    seen = set(trees.values())
    banks_dir = REPO_ROOT / "artifacts" / "banks" if banks_dir is None else banks_dir
    for bank in sorted(banks_dir.glob("*/*/*/bank.json")):
        try:
            doc = json.loads(bank.read_text())
            bank_trees = [Tree(t["paths"]) for t in doc["trees"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged or foreign file: the check does not depend on banks
        for k, tree in enumerate(bank_trees):
            if tree not in seen and 0 < tree.depth <= num_heads:
                seen.add(tree)
                trees[f"{bank.parent.name}#{k}"] = tree
    return {name: t for name, t in trees.items() if t.depth <= num_heads}


def wide_tree(nodes: int, depth: int = 4) -> Tree:
    """A tree of exactly `nodes` nodes: chains of `depth` under the root ((c,), (c, 0), ...), the
    last one shorter. A verify of N rows at bank-tree depths (the row-invariant forward takes
    tokens at most 63 deep, so a 128-row chain is no verify shape)."""
    paths = []
    for i in range(nodes - 1):
        c, d = divmod(i, depth)
        paths.append((c,) + (0,) * d)
    return Tree(paths)


def branchy_tree(depth: int) -> Tree:
    """The chain of `depth` with a rank-1 sibling beside every chain node: the chain's nodes sit
    in every other slot, with masked slots between a node and its ancestors."""
    paths = []
    for d in range(1, depth + 1):
        paths += [(0,) * d, (0,) * (d - 1) + (1,)]
    return Tree(paths)


def random_ids(n: int, vocab: int, seed: int, device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).to(device)


def set_arithmetic(model: Transformer, arithmetic: str, rows: int) -> str | None:
    """Switch the model to `exact` (row-invariant, padded to `rows`) or `numerical`; returns why
    `exact` is refused on this machine (the model then stays numerical), else None."""
    if arithmetic == "numerical":
        model.set_row_invariance(None)
        return None
    try:
        model.set_row_invariance(rows)
    except RuntimeError as e:
        model.set_row_invariance(None)
        return str(e)
    return None


# -- row agreement --------------------------------------------------------------------------------


@torch.inference_mode()
def row_agreement(model: Transformer, context: int, layouts: dict[str, Tree], seed: int = 0) -> list[dict[str, Any]]:
    """Per layout: after `context` random committed tokens, AR feeds the greedy continuation
    t_0, t_1, ... one token per forward; a verify of the layout's tree holds the same tokens on its
    all-rank-0 path (node at depth d = t_d; every other node a random distractor). Each path
    node's logits row is compared with AR's row for the same position: bit-identical or not, the
    largest difference, and whether the argmax agrees."""
    dev, vocab = model.device, model.args.vocab_size
    depth = max(t.depth for t in layouts.values())
    prefix = random_ids(context, vocab, seed, dev)
    model.reset_cache()
    logits, _ = model(prefix[None], torch.arange(context, device=dev), last_only=True)
    tokens = [int(logits[0, -1].argmax())]
    rows = []
    for d in range(depth + 1):
        lg, _ = model(torch.tensor([[tokens[-1]]], device=dev), torch.tensor([context + d], device=dev))
        rows.append(lg[0, -1])
        tokens.append(int(lg[0, -1].argmax()))
    ar = torch.stack(rows)
    out = []
    gen = torch.Generator().manual_seed(seed + 1)
    for name, tree in layouts.items():
        model.truncate_cache(context)
        buf = TreeBuffers.compile(tree).to(dev)
        node_tokens = torch.randint(0, vocab, (tree.num_nodes,), generator=gen)
        path = [tree.node_index((0,) * d) for d in range(tree.depth + 1)]
        node_tokens[path] = torch.tensor(tokens[: tree.depth + 1])
        lg, _ = model(node_tokens.to(dev)[None], context + buf.depths, buf.attn_mask, check_mask=False,
                      ancestors=buf.ancestor_lists)
        got, ref = lg[0, path], ar[: tree.depth + 1]
        same = (got == ref).all(dim=-1)
        out.append({"layout": name, "nodes": tree.num_nodes, "compared": len(path), "identical": int(same.sum()),
                    "argmax_same": int((got.argmax(-1) == ref.argmax(-1)).sum()),
                    "max_abs_diff": sig(float((got - ref).abs().max()), 3)})
    model.reset_cache()
    return out


# -- costs ----------------------------------------------------------------------------------------


def fill_random(model: Transformer, length: int, seed: int = 0) -> None:
    """The committed cache made exactly `length` random tokens long (chunks of 256)."""
    from pipeline.timing.step_cost import fill_cache

    fill_cache(model, length, torch.Generator().manual_seed(seed))


def _time_verify(model: Transformer, context: int, buf: TreeBuffers, tokens: Tensor) -> float:
    """Seconds of one verify forward of `buf` after `context` committed slots; the cache is cut back."""
    model.truncate_cache(context)
    t0 = clock(model.device)
    model(tokens[None], context + buf.depths, buf.attn_mask, check_mask=False, ancestors=buf.ancestor_lists)
    t = clock(model.device) - t0
    model.truncate_cache(context)
    return t


@torch.inference_mode()
def verify_cost(model: Transformer, rows: Sequence[int], contexts: Sequence[int], repeats: int,
                deadline: float) -> dict[str, Any]:
    """Median ms of one verify forward of a `wide_tree` of N rows after L committed tokens, for
    every (L, N); passes interleave all cells (one warm-up pass first). Stops after the pass that
    crosses `deadline` (perf_counter), saying so."""
    dev = model.device
    bufs = {n: TreeBuffers.compile(wide_tree(n)).to(dev) for n in rows}
    toks = {n: random_ids(n, model.args.vocab_size, n, dev) for n in rows}
    times: dict[tuple[int, int], list[float]] = {(c, n): [] for c in contexts for n in rows}
    done = 0
    for r in range(repeats + 1):
        model.reset_cache()
        for c in contexts:
            fill_random(model, c)
            for n in rows:
                t = _time_verify(model, c, bufs[n], toks[n])
                if r:
                    times[(c, n)].append(t)
        done = r
        if r and time.perf_counter() > deadline:
            break
    model.reset_cache()
    return {"rows": list(rows), "contexts": list(contexts), "repeats": done, "truncated": done < repeats,
            "ms": [[sig(1e3 * statistics.median(times[(c, n)])) for n in rows] for c in contexts]}


@torch.inference_mode()
def draft_cost(model: Transformer, heads: DraftHeads, context: int, widths: Sequence[int], repeats: int,
               deadline: float) -> dict[str, Any]:
    """Median ms of the heads' `propose` for `chains_tree(w, d)` (w chains of depth d under the
    root: every Hydra level below the first is w rows wide), per depth d = 1..D and width w, from
    the context vector after `context` random tokens; and each level's own cost (the difference
    of consecutive depths)."""
    from pipeline.timing.step_cost import chains_tree

    dev = model.device
    depths = list(range(1, heads.config.num_heads + 1))
    bufs = {(d, w): TreeBuffers.compile(chains_tree(w, d)).to(dev) for d in depths for w in widths}
    ids = random_ids(context, model.args.vocab_size, 3, dev)
    model.reset_cache()
    heads.reset()
    pos = torch.arange(context, device=dev)
    logits, hidden = model(ids[None], pos, last_only=True)
    h = heads.observe(hidden, pos)
    root = int(logits[0, -1].argmax())
    times: dict[tuple[int, int], list[float]] = {k: [] for k in bufs}
    done = 0
    for r in range(repeats + 1):
        for key, buf in bufs.items():
            t0 = clock(dev)
            heads.propose(h, root, buf)
            if r:
                times[key].append(clock(dev) - t0)
        done = r
        if r and time.perf_counter() > deadline:
            break
    model.reset_cache()
    heads.reset()
    ms = [[1e3 * statistics.median(times[(d, w)]) for w in widths] for d in depths]
    level = [[ms[0][j] if i == 0 else ms[i][j] - ms[i - 1][j] for j in range(len(widths))] for i in range(len(depths))]
    return {"depths": depths, "widths": list(widths), "context": context, "repeats": done, "truncated": done < repeats,
            "ms": [[sig(x) for x in r] for r in ms], "level_ms": [[sig(x) for x in r] for r in level]}


@torch.inference_mode()
def step_model(model: Transformer, heads: DraftHeads, trees: dict[str, Tree], prompt_tokens: int,
               rows: Sequence[int], repeats: int, rounds: int, new_tokens: int, dtype: str,
               machine: dict[str, Any]) -> dict[str, Any]:
    """The time stage's own measurement (`pipeline.timing.checks.measure_and_check`): the step-cost
    model (verify grid, draft tables, fixed part, phase probes) over `repeats` probe rounds, with
    `rounds` rounds of timed decodes of every tree between them; then per tree the model's step
    at the decodes' mean context against the timed step (raw, and brought to the model's speed by
    the phase probes, which is what the time stage checks). Random heads accept what they accept:
    the step's cost does not depend on it."""
    from pipeline.timing.checks import measure_and_check
    from pipeline.timing.step_cost import phase_corrected
    from runtime.decoder import TreeDecoder

    names = list(trees)
    decoder = TreeDecoder(model, heads, [TreeBuffers.compile(trees[n]) for n in names])
    prompt = random_ids(prompt_tokens, model.args.vocab_size, 5, torch.device("cpu")).tolist()
    contexts = [prompt_tokens, prompt_tokens + new_tokens + max(t.num_nodes for t in trees.values())]
    grid = sorted(set(rows) | {t.num_nodes for t in trees.values()})
    t0 = time.perf_counter()
    cost, timed = measure_and_check(
        decoder, [{"input_ids": prompt}], [trees[n] for n in names], [1.0] * len(names), contexts, contexts[0],
        repeats=repeats, rounds=rounds, fixed_tokens=12, new_tokens=new_tokens, prune_margin=None, sampler=None,
        clock_kind="wall", dtype=dtype, machine=machine)
    seconds = time.perf_counter() - t0
    at = prompt_tokens + new_tokens / 2  # the timed decodes' mean context
    entries = []
    for k, name in enumerate(names):
        tree = trees[name]
        pred = cost.predict(tree, at)
        measured = 1e3 * timed["step_s"][k]
        corrected = phase_corrected(timed, k, cost)
        entries.append({
            "tree": name, "nodes": tree.num_nodes, "depth": tree.depth,
            "predicted_ms": sig(pred["step_ms"]), "draft_ms": sig(pred["draft_ms"]), "verify_ms": sig(pred["verify_ms"]),
            "fixed_ms": sig(pred["fixed_ms"]), "measured_ms": sig(measured), "phase_corrected_ms": sig(corrected),
            "error_pct": sig(100 * (pred["step_ms"] - corrected) / corrected, 3) if corrected == corrected else None,
            "raw_error_pct": sig(100 * (pred["step_ms"] - measured) / measured, 3),
        })
    model_doc = asdict(cost)
    keep = ("verify_rows", "verify_contexts", "verify_ms", "draft_widths", "draft_ms", "fixed_coef", "phase_ms",
            "phase_context", "in_situ", "repeats")
    return {"seconds": sig(seconds, 3), "rows": grid, "contexts": contexts, "decode_context": at,
            "check_rounds": timed["rounds"], "ar_token_ms": sig(1e3 * timed["ar_token_s"]),
            "model": {k: model_doc[k] for k in keep}, "trees": entries}


@torch.inference_mode()
def graph_timing(model: Transformer, trees: dict[str, Tree], contexts: Sequence[int], repeats: int,
                 deadline: float, exact_rows: int | None) -> dict[str, Any]:
    """Per tree and context: the eager verify forward (ordinary arithmetic; and the row-invariant
    one when `exact_rows` is given) against the replay of the tree's CUDA graph, median ms; the
    graph's logits against the eager forward's (largest difference relative to the largest
    logit, argmax agreement). Where CUDA graphs are unavailable (a CPU), the graphs' forward
    (`pipeline.benchmarks.gpu.cuda_graphs.static_verify`) still runs eagerly against the model's forward, so its
    arithmetic is checked on every machine."""
    from pipeline.benchmarks.gpu.cuda_graphs import GraphsUnavailable, VerifyGraphs, static_verify, unavailable_reason

    dev = model.device
    names = list(trees)
    bufs = [TreeBuffers.compile(trees[n]).to(dev) for n in names]
    toks = [random_ids(b.num_nodes, model.args.vocab_size, 11 + i, dev) for i, b in enumerate(bufs)]
    model.set_row_invariance(None)
    model.reset_cache()
    reason = unavailable_reason(dev)
    graphs = None
    capture_s = None
    if reason is None:
        t0 = clock(dev)
        try:
            graphs = VerifyGraphs(model, bufs)
        except GraphsUnavailable as e:
            reason = str(e)
        capture_s = clock(dev) - t0
    keys = torch.arange(model.max_seq_len, device=dev)
    entries = []
    for c in contexts:
        if time.perf_counter() > deadline:
            break
        for k, name in enumerate(names):
            buf, tok = bufs[k], toks[k]
            model.set_row_invariance(None)
            fill_random(model, c)
            eager, _ = model(tok[None], c + buf.depths, buf.attn_mask, check_mask=False)
            eager = eager[0].clone()
            model.truncate_cache(c)
            if graphs is not None:
                logits, _ = graphs.verify(k, tok, c)
            else:
                logits, _ = static_verify(model, tok, buf.depths, buf.attn_mask, torch.full((1,), c, device=dev), keys)
                logits = logits[None]
            model.truncate_cache(c)
            rel = float((logits[0] - eager).abs().max() / eager.abs().max().clamp(min=1e-30))
            entry: dict[str, Any] = {"tree": name, "nodes": buf.num_nodes, "context": c, "max_rel_diff": sig(rel, 3),
                                     "argmax_same": int((logits[0].argmax(-1) == eager.argmax(-1)).sum())}
            eager_s, graph_s, exact_s = [], [], []
            for r in range(repeats + 1):
                te = _time_verify(model, c, buf, tok)
                if graphs is not None:
                    t0 = clock(dev)
                    graphs.verify(k, tok, c)
                    tg = clock(dev) - t0
                    model.truncate_cache(c)
                if r:
                    eager_s.append(te)
                    if graphs is not None:
                        graph_s.append(tg)
            if exact_rows is not None:
                model.set_row_invariance(exact_rows)
                for r in range(repeats + 1):
                    te = _time_verify(model, c, buf, tok)
                    if r:
                        exact_s.append(te)
                model.set_row_invariance(None)
            entry["eager_ms"] = sig(1e3 * statistics.median(eager_s))
            if exact_s:
                entry["eager_exact_ms"] = sig(1e3 * statistics.median(exact_s))
            if graph_s:
                entry["graph_ms"] = sig(1e3 * statistics.median(graph_s))
                entry["speedup"] = sig(statistics.median(eager_s) / statistics.median(graph_s), 3)
            entries.append(entry)
    model.reset_cache()
    out: dict[str, Any] = {"available": graphs is not None, "repeats": repeats, "entries": entries}
    if graphs is None:
        out["unavailable"] = reason
        out["note"] = "no graphs here: the graphs' static forward ran eagerly against the model's forward"
    else:
        out["capture_s"] = sig(capture_s, 3)
        out["trees_captured"] = len(graphs)
        out["memory_gib"] = sig(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
        del graphs
    return out


# -- decoding against AR ----------------------------------------------------------------------------

# a chain of 4 with a rank-1 sibling at each of the first three depths: 8 rows with the root, one
# padded block of the row-invariant forward (where a 63-row tree costs eight blocks' products a step)
CHAIN_SIBLINGS = Tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)])
# EntMTP-dyn's super-tree for the check: 10 rows with the root; each step verifies a subset of it
DYNAMIC_SUPER_TREE = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)])
DECODE_MODES = ("tree", "sampling", "dynamic", "eagle3", "batch2", "batch4", "ar_batch4")
DECODE_PROMPTS = 4   # prompts of prompt_tokens + 3k tokens, k = 0..3 (unequal lengths: a batch's rows differ)
SAMPLING_SEED = 3


def decode_trees() -> dict[str, Tree]:
    """The fixed trees a decode check may name (`decode_identity`'s `tree`)."""
    return {"mc_sim_7b_63": Tree.named("mc_sim_7b_63"), "chain4+siblings": CHAIN_SIBLINGS}


@contextmanager
def torch_path(model: Transformer) -> Iterator[None]:
    """`model` on torch's own products while inside (no small-row kernel, no CPU float32 weight
    copies: the path a GPU runs), then back on the fast paths it had. A no-op where it had none."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kernel = model.kernel_decode
    had = any(m.weight_packed is not None or m.weight_t is not None for m in linears)
    if had:
        model.add_fast_paths(kernel=False)  # the kernel off everywhere (norms and attention too)
        for m in linears:
            m.weight_t = None  # and the products F.linear's, as without fast paths
    try:
        yield
    finally:
        if had:
            model.add_fast_paths(kernel=kernel)


def random_eagle3(model: Transformer, seed: int = 2, draft_vocab: int | None = None) -> Eagle3Drafter:
    """An EAGLE-3 drafter of one target-shaped layer with N(0, 0.02) weights (unit norms) and a random
    draft vocabulary (a quarter of the target's), in the model's dtype and device, bound to it. EAGLE's
    default aux layers where the target has 7 or more, else its first three (or two)."""
    n_layers = model.args.n_layers
    aux = default_aux_layer_ids(n_layers) if n_layers >= 7 else tuple(range(min(3, n_layers)))
    vocab = model.args.vocab_size
    cfg = Eagle3Config.for_model(model.args, draft_vocab_size=draft_vocab or max(1, vocab // 4), aux_layer_ids=aux)
    with torch.device(model.device):
        drafter = Eagle3Drafter(cfg)
    drafter = drafter.to(model.dtype)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size]
    drafter.set_draft_vocab(ids.sort().values)
    drafter.bind(model)
    return drafter.eval().requires_grad_(False)


def _first_mismatch(got: list[list[int]], want: list[list[int]]) -> dict[str, Any] | None:
    """Where the decoded sequences first leave AR's (None: every one is identical)."""
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            i = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return {"sequence": k, "position": i, "got": g[i] if i < len(g) else None,
                    "ar": w[i] if i < len(w) else None, "got_len": len(g), "ar_len": len(w)}
    return None


def decode_tokens_needed(prompt_tokens: int, new_tokens: int, tree: str) -> int:
    """KV-cache positions `decode_identity` needs (the longest prompt, its tokens, the largest tree)."""
    nodes = max(decode_trees()[tree].num_nodes, CHAIN_SIBLINGS.num_nodes, DYNAMIC_SUPER_TREE.num_nodes)
    return prompt_tokens + 3 * (DECODE_PROMPTS - 1) + new_tokens + nodes


@torch.inference_mode()
def decode_identity(model: Transformer, heads: DraftHeads, tree: str, prompt_tokens: int, new_tokens: int,
                    deadline: float, rows: int = 8, modes: Sequence[str] = DECODE_MODES,
                    acceptance: str | dict = "exact", into: dict[str, Any] | None = None) -> dict[str, Any]:
    """What users run, token for token against AR, in `lossless: exact` (row-invariant, padded to
    `rows`) on torch's path (`torch_path`: the small-row kernel off, as on a GPU): per mode, the
    decode of random prompts of ~`prompt_tokens` tokens, `new_tokens` new tokens each (no EOS), and
    whether every sequence equals its AR continuation:
    * tree: `TreeDecoder.generate` with the fixed tree `tree` (a `decode_trees` name);
    * sampling: seeded sampling (temperature 0.7) against seeded AR;
    * dynamic: EntMTP-dyn (`DynamicPolicy` over `DYNAMIC_SUPER_TREE`);
    * eagle3: a random EAGLE-3 drafter (`random_eagle3`);
    * batch2 / batch4: `generate_batch` of 2 and 4 prompts, each sequence against its own AR;
    * ar_batch4: the batched AR baseline (`ar_generate_batch`) against AR.
    The modes after `tree` decode with `CHAIN_SIBLINGS` (one 8-row block: a 63-row tree costs eight
    blocks' products per step in this arithmetic). Random drafters rarely hit: identity is what
    counts; tokens/step and wall seconds are recorded. Modes still to run past `deadline`
    (perf_counter) are listed in "skipped". `acceptance`: the decoder's (a lossy one is how a broken
    decode shows). `into`: the dict to fill as it goes (a run cut short keeps what it decoded);
    returned, {"refused": why} where this machine refuses the row-invariant arithmetic."""
    from runtime.ar import ar_generate, ar_generate_batch
    from runtime.config import SamplingConfig
    from runtime.decoder import TreeDecoder
    from runtime.dynamic import DynamicPolicy
    from runtime.sampling import Sampler

    unknown = [m for m in modes if m not in DECODE_MODES]
    if unknown:
        raise ValueError(f"unknown decode modes {unknown}: choose from {', '.join(DECODE_MODES)}")
    vocab = model.args.vocab_size
    prompts = [random_ids(prompt_tokens + 3 * k, vocab, 100 + k, torch.device("cpu")).tolist()
               for k in range(DECODE_PROMPTS)]
    small = "chain4+siblings"  # CHAIN_SIBLINGS, by its name in decode_trees
    bufs = [TreeBuffers.compile(decode_trees()[tree]), TreeBuffers.compile(CHAIN_SIBLINGS)]
    out = {} if into is None else into
    out.update({"arithmetic": f"exact (row-invariant, {rows}-row blocks; torch's products)", "tree": tree,
                "prompt_tokens": [len(p) for p in prompts], "new_tokens": new_tokens, "modes": [], "skipped": []})
    with torch_path(model):
        refused = set_arithmetic(model, "exact", rows)
        if refused:
            out.clear()
            out["refused"] = refused
            return out
        try:
            t0 = time.perf_counter()
            ar = [ar_generate(model, p, new_tokens, eos_ids=()) for p in prompts]
            out["ar_s"] = sig(time.perf_counter() - t0, 3)
            out["ar_token_ms"] = sig(1e3 * (time.perf_counter() - t0) / (len(prompts) * new_tokens), 3)
            decoder = TreeDecoder(model, heads, bufs, acceptance=acceptance)

            def sampler() -> Sampler:
                return Sampler(SamplingConfig(temperature=0.7, seed=SAMPLING_SEED))

            def run(mode: str) -> tuple[str | None, list[list[int]], list[list[int]], list[Any]]:
                """(the tree, decoded, AR's, generation results) of one mode."""
                if mode == "tree":
                    res = decoder.generate(prompts[0], new_tokens, choose=0, eos_ids=())
                    return tree, [res.tokens], ar[:1], [res]
                if mode == "sampling":
                    want = ar_generate(model, prompts[1], new_tokens, eos_ids=(), sampler=sampler())
                    res = decoder.generate(prompts[1], new_tokens, choose=1, eos_ids=(), sampler=sampler())
                    return small, [res.tokens], [want], [res]
                if mode == "dynamic":
                    costs = [1.0 + 0.05 * n for n in range(DYNAMIC_SUPER_TREE.num_nodes)]
                    res = decoder.generate(prompts[2], new_tokens, choose=DynamicPolicy(DYNAMIC_SUPER_TREE, costs),
                                           eos_ids=())
                    return f"{DYNAMIC_SUPER_TREE.num_nodes}-node super-tree", [res.tokens], ar[2:3], [res]
                if mode == "eagle3":
                    eagle = TreeDecoder(model, random_eagle3(model), bufs[1:], acceptance=acceptance)
                    res = eagle.generate(prompts[3], new_tokens, eos_ids=())
                    return small, [res.tokens], ar[3:4], [res]
                if mode in ("batch2", "batch4"):
                    n = int(mode[-1])
                    batch = decoder.generate_batch(prompts[:n], new_tokens, choose=1, eos_ids=())
                    return small, [r.tokens for r in batch], ar[:n], batch
                return None, ar_generate_batch(model, prompts, new_tokens, eos_ids=()), ar, []

            for mode in modes:
                if time.perf_counter() > deadline:
                    out["skipped"].append(mode)
                    continue
                t0 = time.perf_counter()
                tree_name, got, want, results = run(mode)
                seconds = time.perf_counter() - t0
                per_step = [r.tokens_per_step for r in results]
                mismatch = _first_mismatch(got, want)
                out["modes"].append({
                    "mode": mode, "tree": tree_name, "sequences": len(got), "identical": mismatch is None,
                    "first_mismatch": mismatch, "wall_s": sig(seconds, 3),
                    "tokens_per_step": sig(statistics.mean(per_step), 3) if per_step else None,
                    "steps": sum(len(r.steps) for r in results) if results else None})
        finally:
            model.set_row_invariance(None)
            model.reset_cache()
    return out


def graph_step_estimate(step: dict[str, Any] | None, graphs: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a decoding step would cost with its verify forward replayed as a CUDA graph, per tree:
    the timed step (`step_model`, in its arithmetic) minus that arithmetic's eager verify plus the
    graph's replay (`graph_timing`), both at the graph context nearest the decodes'. An estimate
    (the decoder does not replay graphs yet, and the graph computes the ordinary arithmetic):
    None where either section is missing or no graph ran."""
    if not step or not graphs or not graphs.get("available"):
        return None
    exact = step.get("arithmetic") == "exact"
    by_tree: dict[str, list[dict[str, Any]]] = {}
    for e in graphs["entries"]:
        by_tree.setdefault(e["tree"], []).append(e)
    rows = []
    for t in step["trees"]:
        cands = [e for e in by_tree.get(t["tree"], []) if "graph_ms" in e]
        if not cands or t["measured_ms"] is None:
            continue
        e = min(cands, key=lambda e: abs(e["context"] - step["decode_context"]))
        eager = e.get("eager_exact_ms") if exact else e["eager_ms"]
        if eager is None:
            continue
        with_graph = t["measured_ms"] - eager + e["graph_ms"]
        rows.append({"tree": t["tree"], "context": e["context"], "step_ms": t["measured_ms"], "verify_eager_ms": eager,
                     "verify_graph_ms": e["graph_ms"], "step_with_graph_ms": sig(with_graph),
                     "speedup": sig(t["measured_ms"] / with_graph, 3) if with_graph > 0 else None})
    return {"arithmetic_of_step": step.get("arithmetic"), "trees": rows} if rows else None


def failures_of(rows: dict[str, Any], graphs: dict[str, Any], dtype: torch.dtype,
                probe: dict[str, Any] | None = None, decode: dict[str, Any] | None = None) -> list[str]:
    """What in a dtype's results breaks a promise: the row-invariant arithmetic's rows must equal
    AR's bit for bit (what `lossless: exact` rests on), in the whole model and in the attention
    probe (`pipeline.timing.invariance.invariance_probe`); every decode mode must emit AR's tokens
    (`decode_identity`); the graphs' forward must compute what the eager forward computes up to
    rounding (a wrong mask or position gives differences of the logits' own size)."""
    bad = []
    for m in (decode or {}).get("modes", []):
        if not m["identical"]:
            w = m["first_mismatch"]
            bad.append(f"decode {m['mode']}: sequence {w['sequence']} leaves AR at new token {w['position']} "
                       f"(decoded {w['got']}, AR {w['ar']}; {w['got_len']} vs {w['ar_len']} tokens)")
    for r in (probe or {}).get("results", []):
        if r["identical_rows"] != r["nodes"]:
            bad.append(f"attention probe (exact): {r['shape']} {r['tree']} at context {r['context']}: only "
                       f"{r['identical_rows']}/{r['nodes']} rows bit-identical to AR (max |diff| {r['max_abs_diff']})")
    for ctx in rows.get("exact", {}).get("contexts", []):
        for r in ctx["layouts"]:
            if r["identical"] != r["compared"]:
                bad.append(f"exact arithmetic: {r['layout']} at context {ctx['context']}: only {r['identical']}/"
                           f"{r['compared']} rows bit-identical to AR (max |diff| {r['max_abs_diff']})")
    tol = 1e-3 if dtype == torch.float32 else 0.1
    for e in graphs.get("entries", []):
        if e["max_rel_diff"] is None or e["max_rel_diff"] > tol:
            bad.append(f"graph forward: {e['tree']} at context {e['context']}: logits differ from the eager forward's "
                       f"by {e['max_rel_diff']} of the largest logit (tolerance {tol})")
    return bad


def estimate_step_model_s(forward_ms: float, trees: int, rows: int, contexts: int, repeats: int, rounds: int,
                          new_tokens: int) -> float:
    """Rough seconds of `step_model`, from a one-row forward's ms (a step ~ 3 forwards' time:
    drafting, verifying, the rest): probe decodes, verify passes, draft probes and phase probes
    per probe round, and one AR run plus a decode per tree per check round."""
    step = 3e-3 * forward_ms
    probe_round = 5 * (12 + 2) * step + 3 * rows * contexts * 1e-3 * forward_ms * 1.5 + 30 * step + 6 * 3e-3 * forward_ms
    check_round = (trees + 1) * (new_tokens + 2) * step
    return 1.3 * (repeats * probe_round + rounds * check_round)
