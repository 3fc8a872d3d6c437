"""`entmtp` command line: generate with a bank, inspect a bank, export its trees.

  entmtp generate --bank artifacts/banks/smollm2-135m-instruct/hydra-draft8192/humaneval --prompt "..." [--policy hysteresis|dynamic|eagle2] [--compare-ar]
  entmtp generate --bank ... --prompts-file prompts.txt --batch 4 [--compare-ar]
  entmtp inspect  artifacts/banks/smollm2-135m-instruct/hydra-draft8192/humaneval [--check]
  entmtp export   artifacts/banks/.../humaneval --format vllm|trtllm|sglang|json [--batch-size B] [--margin N]
                  [--drafter-out DIR] [--out FILE]   (header and caveats on stderr; FILE.entmtp.json beside FILE)
  entmtp export   artifacts/banks/.../humaneval --format legacy-vllm-tree|legacy-trtllm-medusa|tree-json [--tree best|K]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.bank import BankError, TopologyBank


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: JSON lines (a string, or an object with "prompt" or "text") when every
    non-empty line parses as JSON, else one prompt per non-empty line."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts: write one prompt per line, or JSON lines")
    try:
        docs = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        return lines
    prompts = []
    for n, doc in enumerate(docs, 1):
        value = doc if isinstance(doc, str) else doc.get("prompt", doc.get("text")) if isinstance(doc, dict) else None
        if not isinstance(value, str):
            raise ValueError(f"{path} line {n}: a JSON line must be a string or an object with a \"prompt\" string")
        prompts.append(value)
    return prompts


def _generate_batch(args: argparse.Namespace, engine, sampling: dict) -> int:
    """`--prompts-file`: decode every prompt, `--batch` at a time, and report per sequence."""
    try:
        prompts = read_prompts(args.prompts_file)
    except (OSError, ValueError) as err:
        print(f"entmtp: {err}", file=sys.stderr)
        return 2
    batch = args.batch or len(prompts)
    kw = dict(max_new_tokens=args.max_new_tokens, batch_size=batch, chat=not args.raw, truncate=args.truncate,
              **sampling)
    outs = engine.generate_batch(prompts, policy=args.policy, **kw)
    ars = engine.generate_batch(prompts, ar=True, **kw) if args.compare_ar else [None] * len(outs)
    for k, (out, ar) in enumerate(zip(outs, ars)):
        if out.error:
            print(json.dumps({"prompt": k, "error": out.error}))
            continue
        line = {"prompt": k, "new_tokens": len(out.tokens), "tokens_per_step": out.stats.get("tokens_per_step"),
                "text": out.text}
        if ar is not None:
            line["identical_to_ar"] = ar.tokens == out.tokens
        print(json.dumps(line, ensure_ascii=False))
    done = [o for o in outs if not o.error]
    if not done:
        print("[entmtp] no prompt could be decoded", file=sys.stderr)
        return 1
    # what decoded each batch size: the bank's choice for it (no --policy) or the named policy
    for size, choice in dict.fromkeys((o.stats["batch_size"], o.stats["choice"]) for o in done):
        print(f"[entmtp] batch of {size}: {choice}", file=sys.stderr)
    speed = _batch_speed(done)
    summary = f"[entmtp] {len(done)} prompts in batches of {batch}: EntMTP {speed:.1f} tok/s"
    if args.compare_ar:
        ar_speed = _batch_speed([a for a in ars if not a.error])
        same = sum(a.tokens == o.tokens for a, o in zip(ars, outs) if not o.error)
        summary += f" vs batched AR {ar_speed:.1f} tok/s ({speed / ar_speed:.2f}x); {same}/{len(done)} outputs identical"
    print(summary, file=sys.stderr)
    return 0


def _batch_speed(outs: list) -> float:
    """New tokens over wall time, summed over the batches (each batch's time counted once)."""
    batches: dict[tuple[float, int], int] = {}
    for o in outs:
        key = (o.stats["batch_seconds"], o.stats["batch_size"])
        batches[key] = batches.get(key, 0) + len(o.tokens)
    return sum(batches.values()) / sum(seconds for seconds, _ in batches)


def _generate(args: argparse.Namespace) -> int:
    from runtime.api import EntMTP

    if args.batch is not None and args.batch < 1:
        print(f"entmtp: --batch must be at least 1, got {args.batch}", file=sys.stderr)
        return 2
    if args.batch is not None and args.prompts_file is None:
        print("entmtp: --batch needs --prompts-file (one prompt per line, or JSON lines)", file=sys.stderr)
        return 2
    acceptance = None  # the bank's
    if args.acceptance is not None:
        acceptance = {"kind": args.acceptance, "temperature": args.typical_temperature, "epsilon": args.epsilon,
                      "alpha": args.alpha}
    engine = EntMTP.load(args.bank, model_dir=args.model, heads_dir=args.heads, dtype=args.dtype, force=args.force,
                         device=args.device, acceptance=acceptance, lossless=args.lossless)
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    if args.prompts_file is not None:
        return _generate_batch(args, engine, sampling)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
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


def _check(args: argparse.Namespace) -> int:
    """`inspect --check`: re-time the bank's choice at each batch size here; 0 when all hold, else 1."""
    from runtime.api import EntMTP
    from runtime.check import check_bank

    if args.seconds <= 0 or (args.new_tokens is not None and args.new_tokens < 1):
        print("entmtp: --seconds must be > 0 and --new-tokens at least 1", file=sys.stderr)
        return 2
    engine = EntMTP.load(args.bank)
    checks = check_bank(engine, seconds=args.seconds, new_tokens=args.new_tokens, report=lambda s: print(s, flush=True))
    failed = [c for c in checks if not c.holds]
    if failed:
        sizes = ", ".join(str(c.batch_size) for c in failed)
        print(f"{len(failed)} of {len(checks)} choices do not hold here (B = {sizes}): "
              "rebuild the bank on this machine (`make bank TASK=<task>`), or rerun with more --seconds where one is "
              "not confirmed")
        return 1
    print(f"all {len(checks)} choices hold here")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args)
    bank = TopologyBank.load(args.bank, force=True)
    print(bank.summary())
    for line in bank.paired_lines():  # each batch size's candidates timed against batched AR
        print(line)
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


# the single-tree format of each engine, named when --tree comes with a per-batch-size format
_TREE_FORMAT_OF = {"vllm": "legacy-vllm-tree", "trtllm": "legacy-trtllm-medusa"}


def _export_drafter(args: argparse.Namespace, kind: str, heads_dir: Path | None):
    """The EngineDrafter an EAGLE-3 bank's engine export names (None for other banks and formats)."""
    from runtime.export.engines import DRAFTER_PLACEHOLDER, ENGINE_FORMATS, EngineDrafter

    asked = args.drafter_out or args.drafter_path
    if asked and kind != "eagle3":
        raise ValueError(f"--drafter-out / --drafter-path name an EAGLE-3 drafter, but this bank's heads are {kind}")
    if args.drafter_out and args.drafter_path:
        raise ValueError("--drafter-out writes the drafter and names it in the config; --drafter-path names one written "
                         "before: give one of them")
    if args.drafter_out and args.format not in (*ENGINE_FORMATS, "json"):
        raise ValueError(f"--drafter-out writes the drafter for an engine format (vllm, sglang, trtllm, json), not "
                         f"--format {args.format}")
    if kind != "eagle3" or args.format not in ENGINE_FORMATS:
        return None
    from runtime.eagle3 import read_drafter_config

    config, _ = read_drafter_config(heads_dir)
    path = args.drafter_path or (str(Path(args.drafter_out).resolve()) if args.drafter_out else DRAFTER_PLACEHOLDER)
    return EngineDrafter(path=path, aux_layer_ids=config.aux_layer_ids)


def _write_drafter(args: argparse.Namespace, bank: TopologyBank, heads_dir: Path, speculative_tokens: int) -> Path:
    """--drafter-out: the bank's drafter, bound to its target model, in the layout the engine loads."""
    from runtime.device import torch_dtype
    from runtime.eagle3 import load_drafter, read_drafter_config
    from runtime.export.drafters import write_for_engine
    from runtime.model.checkpoint import load_model

    model_dir = (Path(args.bank) / bank.provenance.get("model_dir", "(none recorded)")).resolve()
    if not model_dir.is_dir():
        raise BankError(f"the model folder {model_dir} of bank {args.bank} does not exist: --drafter-out needs the "
                        "target model (its token embeddings and, for speculators, its config)")
    _, stored = read_drafter_config(heads_dir)
    model = load_model(model_dir, max_seq_len=64)
    drafter = load_drafter(heads_dir, model=model, dtype=torch_dtype(stored))
    return write_for_engine(drafter, args.drafter_out, args.format, str(model_dir), speculative_tokens)


def _export(args: argparse.Namespace) -> int:
    from runtime.export.engines import TREE_FORMATS, engine_schedule, export_schedule, export_tree
    from runtime.export.notes import (SIDECAR_SUFFIX, bank_facts, drafter_kind, embed_record, export_record, in_band,
                                      sidecar_path)
    from runtime.io import atomic_write_bytes

    legacy = args.format in TREE_FORMATS
    if args.tree is not None and not legacy:
        raise ValueError(f"--tree picks one tree, which only the tree formats take ({', '.join(TREE_FORMATS)}); "
                         f"--format {args.format} exports the bank's choice at every batch size: drop --tree, or pass "
                         f"--format {_TREE_FORMAT_OF.get(args.format, 'tree-json')} --tree {args.tree}")
    if args.tree is not None and args.batch_size is not None:
        raise ValueError("--tree and --batch-size both pick the tree to export: give one of them")
    if args.margin < 0:
        raise ValueError(f"--margin must be >= 0 (sequences), got {args.margin}")
    bank = TopologyBank.load(args.bank, force=True)
    prov = bank.provenance
    heads_dir = Path(args.bank) / prov["heads_dir"] if prov.get("heads_dir") else None
    kind = drafter_kind(heads_dir, prov)
    drafter = _export_drafter(args, kind, heads_dir)
    schedule = bank.serving_schedule()
    if legacy and args.batch_size is None:
        tree = args.tree or "best"
        if tree != "best" and not tree.lstrip("-").isdigit():
            raise ValueError(f"--tree must be 'best' or a tree index (0..{len(bank.trees) - 1}), got {tree!r}")
        k = bank.best_static if tree == "best" else int(tree)
        if not 0 <= k < len(bank.trees):
            raise BankError(f"tree {k} out of range: the bank has {len(bank.trees)} trees (0..{len(bank.trees) - 1})")
        out = export_tree(bank.trees[k], args.format)
    else:
        out = export_schedule(schedule, args.format, batch_size=args.batch_size, margin=args.margin,
                              keep_zeros=args.keep_zeros, drafter=drafter)
        if args.batch_size is not None:
            schedule = schedule.restrict(args.batch_size)
    record = export_record(schedule, args.format, bank_facts(prov, kind, str(args.bank)), margin=args.margin,
                           keep_zeros=args.keep_zeros, drafter_path=None if drafter is None else drafter.path)
    if args.drafter_out:
        served = engine_schedule(schedule, args.format, margin=args.margin, keep_zeros=args.keep_zeros)
        written = _write_drafter(args, bank, heads_dir, served.max_chain_len)
        print(f"[entmtp] wrote the drafter for {args.format} to {written}", file=sys.stderr)
    out = embed_record(out, args.format, record)
    text = out if isinstance(out, str) else json.dumps(out)
    text = text if text.endswith("\n") else text + "\n"
    for line in record.lines():
        print(f"[entmtp] {line}", file=sys.stderr)
    if args.out is None:
        print(text, end="")
        if not in_band(args.format):
            print("[entmtp] this format has no room for the lines above: --out FILE also writes them to "
                  f"FILE{SIDECAR_SUFFIX}", file=sys.stderr)
        return 0
    atomic_write_bytes(args.out, text.encode())
    side = sidecar_path(args.out)
    atomic_write_bytes(side, (json.dumps(record.to_dict(), indent=1) + "\n").encode())
    print(f"[entmtp] wrote {args.out} and its record {side}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="entmtp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="decode a prompt with a bank, streaming text")
    g.add_argument("--bank", required=True, help="bank folder (artifacts/banks/<model>/<heads>/<task>)")
    g.add_argument("--prompt", help="prompt text (default: read stdin)")
    g.add_argument("--prompts-file", default=None, help="decode many prompts: one per line, or JSON lines")
    g.add_argument("--batch", type=int, default=None, help="with --prompts-file: sequences decoded together "
                   "(default: all); without --policy each batch decodes with the bank's choice for its size")
    g.add_argument("--truncate", default=None, choices=["left"],
                   help="keep the end of a prompt too long for the KV cache (default: report it)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--policy", default=None,
                   help="static | ladder | hysteresis | expected_throughput | dynamic (EntMTP-dyn: a per-step subset "
                        "of the bank's super-tree; banks built with dynamic.enabled=true) | eagle2 (the EAGLE-2 "
                        "dynamic tree, SGLang's default settings: a baseline) | a tree index "
                        "(default: the bank's)")
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
    i.add_argument("--check", action="store_true",
                   help="re-time the bank's choice at each batch size on this machine (paired blocks AR, T, T, AR) and "
                        "say whether each still holds; exit code 0 when all hold, 1 otherwise")
    i.add_argument("--seconds", type=float, default=60.0, help="--check: about how long to time, overall")
    i.add_argument("--new-tokens", type=int, default=None,
                   help="--check: tokens per decode (default: as many as the bank's time stage used)")
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
    e.add_argument("--margin", type=int, default=0,
                   help="boundary margin in sequences (vllm, trtllm, sglang): each measured batch size's choice also "
                        "serves the next N loads, so prefills or one request arriving at a boundary (counted in the "
                        "engine's batch size, not in the bank's timed batches) do not flip the draft length; nothing "
                        "speculates above the largest measured batch size + N (default 0: the measured boundaries)")
    e.add_argument("--keep-zeros", action="store_true",
                   help="vllm: write the bank's draft length 0 as it is. By default a 0 is replaced by a chain the bank "
                        "measured at AR's speed or better there, as vLLM still runs the drafter at 0")
    e.add_argument("--drafter-out", default=None,
                   help="EAGLE-3 banks: write the bank's drafter to this folder in the layout the engine loads "
                        "(vllm/json: speculators; sglang/trtllm: EAGLE's own) and name it in the config")
    e.add_argument("--drafter-path", default=None,
                   help="EAGLE-3 banks: the drafter folder to name in the config (one written before by --drafter-out)")
    e.add_argument("--out", default=None,
                   help="write the export to this file (instead of stdout) and its record (header, caveats, warnings) "
                        "to FILE.entmtp.json beside it")
    e.set_defaults(fn=_export)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (BankError, ValueError, FileNotFoundError) as err:
        print(f"entmtp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
