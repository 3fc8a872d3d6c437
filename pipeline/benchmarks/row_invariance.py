"""Does a position's logits row depend on how many tokens the forward holds, and where they sit?

    python -m pipeline.benchmarks.row_invariance [--dtypes bfloat16 float32] [--sizes 2 5 9 17] [--rows 8]

For a real prompt, AR decoding feeds the greedy continuation t_0, t_1, ... one token per forward;
a tree verify feeds the same tokens as one chain of N nodes (root t_0, node d at depth d), and a
*branchy* verify interleaves a distractor sibling after every chain node, so that node d sits in
slot 2d with masked slots between its ancestors. Each chain node's logits row is compared with
AR's row for the same position: max |difference| and whether the rows are bit-identical, per
depth, with the ordinary arithmetic and under `Transformer.set_row_invariance(rows)`.

Then the cost: CPU time (process_time, medians of interleaved repeats) of a one-token forward and of
n-token forwards at the prompt's context, with and without invariance, per dtype.

Writes artifacts/reports/benchmarks/row_invariance.json (machine, settings, results).

The correctness verdict (every chain node's row bit-identical to AR's under invariance, per dtype)
is asserted on the default model by the slow test
`tests/test_row_invariance.py::test_smollm2_rows_are_bit_identical_under_invariance` (which runs
`compare`); this script reports the differences of both arithmetics and the cost of invariance.

    python -m pipeline.benchmarks.row_invariance --probe [--device cuda] [--dtypes float16 bfloat16]

runs `invariance_probe` instead: random-weight models with the attention shapes of Vicuna-7B and
Llama-3-8B at ~200 / 700 / 1500 positions, every row of two verified trees against AR's row for the
same token (attention and the whole forward), and writes row_invariance_probe.json. A GPU check
script can call `invariance_probe(device, dtype)` itself.
"""

from __future__ import annotations

import argparse
import logging
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.artifacts import atomic_write_json, machine_info
from pipeline.benchmarks import DEFAULT_MODEL_DIR, REPORT_DIR, median
from runtime.model import llama as model_mod
from runtime.model.llama import Attention, ModelArgs, RowPlan, Transformer, load_model, load_tokenizer

log = logging.getLogger(__name__)

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


def cost(models: dict[str, Transformer], ids: list[int], sizes: Sequence[int], repeats: int) -> dict[str, float]:
    """Median CPU ms of an n-token forward after the prompt, per (model label, n); interleaved."""
    for m in models.values():
        m.reset_cache()
        m(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)
    start = len(ids)
    times: dict[str, list[float]] = {f"{k} n={n}": [] for k in models for n in sizes}
    for r in range(repeats + 1):
        for label, m in models.items():
            for n in sizes:
                mask = torch.ones(n, n, dtype=torch.bool).tril()
                t0 = time.process_time()
                m(torch.zeros(1, n, dtype=torch.long), start + torch.arange(n), mask, check_mask=False)
                dt = time.process_time() - t0
                m.truncate_cache(start)
                if r:  # the first round warms up
                    times[f"{label} n={n}"].append(dt * 1e3)
    return {k: round(median(v), 2) for k, v in times.items()}


# The attention shapes (query heads, KV heads, head_dim) of the models whose CUDA fault the probe
# was written for: with 32 heads at ~500 keys, flash attention summed one row's keys in 4 splits,
# 4 rows' in 2 and 7 or more rows' in 1.
PROBE_SHAPES: dict[str, tuple[int, int, int]] = {"vicuna-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128)}
# ~200 / 700 / 1500 positions, each 60 past a multiple of KEY_CHUNK (64), so that the probe trees'
# rows have heads (see runtime.model.KEY_CHUNK) ending on both sides of a chunk boundary
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
                dtype: torch.dtype, layers: int = 1, dim: int = 128, vocab: int = 256, seed: int = 0) -> Transformer:
    """A random-weight Llama with these attention shapes and small everything else (dim, FFN,
    vocabulary: they only feed the attention), its cache allocated. Weights ~ N(0, 1/fan_in), so
    that the attention's scores have unit scale."""
    args = ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=2 * dim, max_position_embeddings=max_seq_len)
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
            "rows_per_attention_product": model_mod.ATTENTION_ROWS.get(device.type, rows), "ok": ok,
            "results": results}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--sizes", nargs="+", type=int, default=[2, 5, 9, 17])
    p.add_argument("--rows", type=int, default=8, help="padded row count under invariance")
    p.add_argument("--cost-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--probe", action="store_true", help="run invariance_probe (random models) instead")
    p.add_argument("--device", default="cpu", help="the probe's device")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    if a.probe:
        probes = [invariance_probe(a.device, getattr(torch, name), rows=a.rows) for name in a.dtypes]
        for pr in probes:
            for r in pr["results"]:
                log.info("%s %s %-10s context %4d %-9s identical rows %2d/%d, max|diff| %s", pr["device"], pr["dtype"],
                         r["shape"], r["context"], r["tree"], r["identical_rows"], r["nodes"], r["max_abs_diff"])
            log.info("%s %s: %s", pr["device"], pr["dtype"], "row-invariant" if pr["ok"] else "NOT row-invariant")
        out = REPORT_DIR / "row_invariance_probe.json"
        atomic_write_json(out, {"machine": machine_info(), "probes": probes})
        log.info("wrote %s", out)
        return

    tok = load_tokenizer(a.model)
    ids = tok.encode(PROMPT * 3, add_special_tokens=False).ids
    report: dict[str, Any] = {"machine": machine_info(), "prompt_tokens": len(ids), "rows": a.rows,
                              "threads": a.threads, "compare": {}, "cost_ms": {}}
    models: dict[str, Transformer] = {}
    for name in a.dtypes:
        model = load_model(a.model, dtype=getattr(torch, name), max_seq_len=len(ids) + 64)
        torch.set_num_threads(a.threads)
        with torch.inference_mode():
            for inv in (None, a.rows):
                model.set_row_invariance(inv)
                key = f"{name} {'invariant P=' + str(inv) if inv else 'plain'}"
                report["compare"][key] = res = compare(model, ids, a.sizes)
                for r in res:
                    log.info("%-26s %-8s N=%-3d identical depths %d/%d, max|diff| by depth %s", key, r["layout"],
                             r["nodes"], r["identical_depths"], r["depths"], r["max_abs_diff_by_depth"])
        models[name] = model
    if not a.skip_cost:
        import copy

        timed: dict[str, Transformer] = {}
        for name, model in models.items():
            model.set_row_invariance(None)
            timed[f"{name} plain"] = model
            inv = copy.deepcopy(model)
            inv.set_row_invariance(a.rows)
            timed[f"{name} P={a.rows}"] = inv
        with torch.inference_mode():
            report["cost_ms"] = cost(timed, ids, a.cost_sizes, a.repeats)
        for k, v in report["cost_ms"].items():
            log.info("cost %-28s %8.2f ms", k, v)
    out = REPORT_DIR / "row_invariance.json"
    atomic_write_json(out, report)
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
