"""`entmtp` command line: generate with a bank, inspect a bank, export its trees.

  entmtp generate --bank artifacts/banks/smollm2-135m-instruct/hydra-draft8192/humaneval --prompt "..." [--policy hysteresis] [--compare-ar]
  entmtp inspect  artifacts/banks/smollm2-135m-instruct/hydra-draft8192/humaneval
  entmtp export   artifacts/banks/.../humaneval --format vllm|trtllm|sglang|json [--batch-size B]
  entmtp export   artifacts/banks/.../humaneval --format legacy-vllm-tree|legacy-trtllm-medusa|tree-json [--tree best|K]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.bank import BankError, TopologyBank


def _generate(args: argparse.Namespace) -> int:
    from runtime.api import EntMTP

    acceptance = None  # the bank's
    if args.acceptance is not None:
        acceptance = {"kind": args.acceptance, "temperature": args.typical_temperature, "epsilon": args.epsilon,
                      "alpha": args.alpha}
    engine = EntMTP.load(args.bank, model_dir=args.model, heads_dir=args.heads, dtype=args.dtype, force=args.force,
                         device=args.device, acceptance=acceptance, lossless=args.lossless)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    out = engine.generate(prompt, args.max_new_tokens, policy=args.policy, chat=not args.raw,
                          stream=lambda s: print(s, end="", flush=True), **sampling)
    print()
    print(f"\n[entmtp] {json.dumps(out.stats)}", file=sys.stderr)
    if args.compare_ar:
        ar = engine.generate_ar(prompt, args.max_new_tokens, chat=not args.raw, **sampling)
        mode = "exact" if engine.model.invariant_rows else "numerical"
        if engine.acceptance != "exact":
            same = "identical" if ar.tokens == out.tokens else "different (typical acceptance changes the output)"
        else:
            same = "identical" if ar.tokens == out.tokens else (
                "DIFFERENT (lossless numerical: a near-tied argmax rounded apart; see README)" if mode == "numerical"
                else "DIFFERENT under lossless exact: a bug, please report it")
        print(f"[entmtp] AR {ar.stats['tok_per_s']} tok/s vs EntMTP {out.stats['tok_per_s']} tok/s "
              f"({out.stats['tok_per_s'] / ar.stats['tok_per_s']:.2f}x); output {same}", file=sys.stderr)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    bank = TopologyBank.load(args.bank, force=True)
    print(bank.summary())
    prov = bank.provenance
    print(f"  built for model {prov.get('model_fingerprint')} / heads {prov.get('heads_fingerprint')}, "
          f"dtype {prov.get('dtype')}, torch {prov.get('machine', {}).get('torch')}, "
          f"acceptance {json.dumps(prov.get('acceptance') or {'kind': 'exact'})}")
    for name, pol in bank.policies.items():
        print(f"  policy {name}: {json.dumps(pol)}")
    if bank.oracle:
        print(f"  oracle: {json.dumps(bank.oracle)}")
    plots = sorted(Path(args.bank).glob("*.png"))
    for p in plots:
        print(f"  plot: {p}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from runtime.export import RENAMED, TREE_FORMATS, export_schedule, export_tree
    from runtime.schedule import schedule_from_bank

    legacy = args.format in TREE_FORMATS
    if args.tree is not None and not legacy:
        raise ValueError(f"--tree picks one tree, which only the tree formats take ({', '.join(TREE_FORMATS)}); "
                         f"--format {args.format} exports the bank's choice at every batch size: drop --tree, or pass "
                         f"--format {RENAMED.get(args.format, 'tree-json')} --tree {args.tree}")
    if args.tree is not None and args.batch_size is not None:
        raise ValueError("--tree and --batch-size both pick the tree to export: give one of them")
    bank = TopologyBank.load(args.bank, force=True)
    if legacy and args.batch_size is None:
        tree = args.tree or "best"
        if tree != "best" and not tree.lstrip("-").isdigit():
            raise ValueError(f"--tree must be 'best' or a tree index (0..{len(bank.trees) - 1}), got {tree!r}")
        k = bank.best_static if tree == "best" else int(tree)
        if not 0 <= k < len(bank.trees):
            raise BankError(f"tree {k} out of range: the bank has {len(bank.trees)} trees (0..{len(bank.trees) - 1})")
        out = export_tree(bank.trees[k], args.format)
    else:
        out = export_schedule(schedule_from_bank(bank), args.format, batch_size=args.batch_size)
    if isinstance(out, str):
        print(out, end="" if out.endswith("\n") else "\n")
    else:
        print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="entmtp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="decode a prompt with a bank, streaming text")
    g.add_argument("--bank", required=True, help="bank folder (artifacts/banks/<model>/<heads>/<task>)")
    g.add_argument("--prompt", help="prompt text (default: read stdin)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--policy", default=None, help="static | ladder | hysteresis | expected_throughput | a tree index")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 = seeded sampling, token-identical to seeded AR")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="then among the smallest set with this probability (1 = all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same output")
    g.add_argument("--acceptance", default=None, choices=["exact", "typical"],
                   help="exact = lossless (the default for banks built with it); typical = the paper's typical "
                        "acceptance (more tokens per step, different output; default: the bank's)")
    g.add_argument("--typical-temperature", type=float, default=0.7, help="typical acceptance: temperature")
    g.add_argument("--epsilon", type=float, default=0.09, help="typical acceptance: hard probability threshold")
    g.add_argument("--alpha", type=float, default=0.3, help="typical acceptance: factor of the entropy-scaled threshold")
    g.add_argument("--compare-ar", action="store_true", help="also run plain AR decoding and print both speeds")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--model", default=None, help="model folder (default: the bank's)")
    g.add_argument("--heads", default=None, help="heads folder (default: the bank's)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--lossless", default=None, choices=["exact", "numerical"],
                   help="exact: row-invariant forwards, output identical to AR in any dtype; numerical: the "
                        "fastest arithmetic (default: the bank's)")
    g.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:1, ... (default: the device the bank was built on, else the CPU)")
    g.add_argument("--force", action="store_true", help="use a bank built for other weights (still lossless)")
    g.set_defaults(fn=_generate)
    i = sub.add_parser("inspect", help="print a bank's trees, figures, policies, provenance and plots")
    i.add_argument("bank")
    i.set_defaults(fn=_inspect)
    e = sub.add_parser("export", help="print a bank's per-batch-size choices (or one tree) for a serving engine")
    e.add_argument("bank")
    e.add_argument("--format", default="vllm",
                   choices=["vllm", "trtllm", "sglang", "json", "legacy-vllm-tree", "legacy-trtllm-medusa", "tree-json"],
                   help="vllm: speculative_config draft length per batch size; trtllm: draft_len_schedule; sglang: "
                        "flag lines and the --speculative-adaptive config; json: choices and cost table; the legacy "
                        "and tree-json formats: one tree (default: vllm)")
    e.add_argument("--tree", default=None, help="tree formats only: 'best' (EntMTP*, the default) or a tree index")
    e.add_argument("--batch-size", type=int, default=None,
                   help="only the bank's choice at this measured batch size (tree formats: the tree chosen there)")
    e.set_defaults(fn=_export)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (BankError, ValueError, FileNotFoundError) as err:
        print(f"entmtp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
