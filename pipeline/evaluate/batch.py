"""The evaluate stage's batch axis (`evaluate_batches`, under lossless=exact): the eval split's first
`evaluate.batch_prompts` prompts in groups of each of `evaluate.batch_sizes`, decoded by batched AR,
the bank's static tree per batch size (its serving schedule), its batch-1 tree at every batch size
and its default policy, interleaved per group; batch throughput against batched AR, and every
sequence checked against that prompt decoded alone by AR (batch_table.md, batch_throughput.png)."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, machine_info, save_figure
from pipeline.evaluate.labels import POLICY_LABELS, decoding_words
from runtime.device import clock

log = logging.getLogger(__name__)

BATCH_AR = "AR (batched)"


PER_BATCH = "EntMTP* static per batch size"


ONE_TREE = "EntMTP* one tree for all"


def batch_choice(bank, batch_size: int, schedule=None) -> int | None:
    """The bank's tree at `batch_size`, "static per batch size": the tree its `ServingSchedule`
    names at the smallest measured batch size >= `batch_size`; None where the schedule says no
    speculation (none measured that large, or no tree paid there): plain batched AR. `schedule`: the
    bank's (`TopologyBank.serving_schedule`), when already read."""
    sched = schedule if schedule is not None else bank.serving_schedule()
    c = sched.choice_for(batch_size)
    return None if c is None or c.tree is None else c.tree_index


def batch_methods(model, hydra, bank, sampler=None, acceptance="exact") -> tuple[dict[str, Callable], dict[str, str]]:
    """The batched methods, each `run(prompts, n, batch_size) -> (tokens per prompt, steps per
    prompt, what it decoded with, seconds of the prompts' prefills)`, keyed by label, and what
    each label means.

    * AR (batched): `ar_generate_batch`;
    * EntMTP* static per batch size: `batch_choice` at the batch size (batched AR where it is None);
    * EntMTP* one tree for all: the bank's batch-1 best static tree at every batch size;
    * the bank's default policy: one `Scheduler` per sequence."""
    from runtime.ar import ar_generate_batch
    from runtime.decoder import TreeDecoder
    from runtime.policy import Scheduler, policy_from_dict
    from runtime.sampling import Sampler

    sampler = sampler if sampler is not None else Sampler()
    dec = TreeDecoder(model, hydra, bank.buffers, acceptance=acceptance)
    schedule = bank.serving_schedule()

    def tree_words(k: int) -> str:
        return f"tree {k} ({bank.trees[k].num_nodes} nodes)"

    Run = tuple[list[list[int]], list[int], str, float]

    def ar(prompts: list[list[int]], n: int, _b: int) -> Run:
        prefills: list[float] = []
        toks = ar_generate_batch(model, prompts, n, sampler=sampler, prefill_seconds=prefills)
        return toks, [max(len(t) - 1, 0) for t in toks], "AR", sum(prefills)

    def spec(prompts: list[list[int]], n: int, choose: list, words: str) -> Run:
        rs = dec.generate_batch(prompts, n, choose=choose, sampler=sampler)
        return [r.tokens for r in rs], [len(r.steps) for r in rs], words, sum(r.prefill_seconds for r in rs)

    def per_batch(prompts: list[list[int]], n: int, b: int) -> Run:
        k = batch_choice(bank, b, schedule)
        if k is None:
            return ar(prompts, n, b)
        return spec(prompts, n, [k] * len(prompts), tree_words(k))

    def one_tree(prompts: list[list[int]], n: int, _b: int) -> Run:
        return spec(prompts, n, [bank.best_static] * len(prompts), tree_words(bank.best_static))

    methods: dict[str, Callable] = {BATCH_AR: ar, PER_BATCH: per_batch, ONE_TREE: one_tree}
    meaning = {BATCH_AR: "batched AR (runtime.ar.ar_generate_batch)",
               PER_BATCH: ("the tree the bank's serving schedule names at the smallest measured batch size >= B "
                           "(batched AR where it names none)"),
               ONE_TREE: "the bank's batch-1 best static tree at every batch size"}
    name = bank.default_policy
    pol = bank.policies.get(name)
    if pol is None:
        log.info("%s", f"[evaluate] the bank's default policy {name!r} is not stored: no policy row in the batch table")
    else:
        label = f"{POLICY_LABELS.get(name, name)} (default policy)"

        def policy(prompts: list[list[int]], n: int, _b: int) -> Run:
            return spec(prompts, n, [Scheduler(policy_from_dict(pol), len(bank.trees)) for _ in prompts], f"policy {name}")

        methods[label] = policy
        meaning[label] = f"the bank's default policy ({name}), one Scheduler per sequence"
    return methods, meaning


def compare_batches(model, hydra, bank, rows: list[dict], n_new: int, batch_sizes: list[int], sampler=None,
                    acceptance="exact", desc: str = "evaluate batches",
                    repeats: int = 1) -> tuple[pd.DataFrame, dict[tuple[str, int], list[dict]]]:
    """Decode the prompts of `rows` ({"id", "input_ids"}) at each batch size B of `batch_sizes`: in
    groups of B (in order; the last group holds the rest), every group by every method of
    `batch_methods` in turn (interleaved, so drift of the machine hits all alike), `repeats` rounds
    of that, each group's wall time (`runtime.device.clock`, prefill included) and its prefills'
    time taken as the median over the rounds (a shared machine's stalls last seconds: one short run
    per group can be off by 10%), pooled over the methods that decoded the group with the same
    thing (same code, one figure). Every sequence's tokens, in every round, are checked against
    that prompt's single-sequence AR output (`ar_generate`, once per prompt).

    Returns the table (one row per method x B: batch throughput = new tokens of all sequences /
    summed group wall time, and decode throughput = the tokens after each sequence's first / that
    time less the prefills (speculation changes decoding, not prefill: the figure a server's
    decode throughput compares), each with its ratio to batched AR at the same B, tokens per step,
    identical k/n)
    and the per-sequence records keyed by (method, B). Needs the row-invariant arithmetic
    (`lossless: exact`)."""
    from runtime.ar import ar_generate

    sizes = [int(b) for b in batch_sizes]
    if not rows:
        raise ValueError("no prompts for the batched evaluation")
    if not sizes or any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch sizes must be distinct ints >= 1, got {list(batch_sizes)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if max(sizes) > len(rows):
        raise ValueError(f"batch size {max(sizes)} needs at least as many prompts, got {len(rows)}")
    if model.invariant_rows is None and not model.kernel_decode:
        raise RuntimeError("the batched evaluation needs the row-invariant arithmetic (lossless: exact)")
    methods, meaning = batch_methods(model, hydra, bank, sampler, acceptance)
    names = list(methods)
    prompts = [[int(t) for t in r["input_ids"]] for r in rows]
    reference = [ar_generate(model, p, n_new, sampler=sampler) for p in prompts]
    dev = model.device
    # warm-up: one short run of every method at the largest batch size (allocator, kernels)
    for m in names:
        methods[m](prompts[: max(sizes)], 4, max(sizes))
    recs: dict[tuple[str, int], list[dict]] = {(m, b): [] for b in sizes for m in names}
    seconds = {(m, b): 0.0 for b in sizes for m in names}
    prefill = {(m, b): 0.0 for b in sizes for m in names}
    used: dict[tuple[str, int], str] = {}
    groups = [(b, i) for b in sizes for i in range(0, len(prompts), b)]
    for b, i in tqdm(groups, desc=desc, unit="group"):
        group = prompts[i:i + b]
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in names}
        for r in range(repeats):
            for m in names:
                t0 = clock(dev)
                toks, steps, words, pre = methods[m](group, n_new, b)
                runs[m].append((clock(dev) - t0, pre))
                used[m, b] = words
                for j, (t, s) in enumerate(zip(toks, steps)):
                    if r == 0:
                        recs[m, b].append({"id": rows[i + j]["id"], "tokens": t, "steps": s,
                                           "identical": t == reference[i + j]})
                    else:
                        recs[m, b][i + j]["identical"] &= t == reference[i + j]
        # methods that decoded this group with the same thing (static per batch size naming batched
        # AR, or the same tree as one tree for all) ran the same code: their runs are pooled, so that
        # one decode gets one figure (the median of all its runs) instead of two that differ by noise
        pooled: dict[str, list[tuple[float, float]]] = {}
        for m in names:
            pooled.setdefault(used[m, b], []).extend(runs[m])
        for m in names:
            seconds[m, b] += statistics.median(t for t, _ in pooled[used[m, b]])
            prefill[m, b] += statistics.median(p for _, p in pooled[used[m, b]])
    out = []
    for b in sizes:
        for m in names:
            rs = recs[m, b]
            toks = sum(len(r["tokens"]) for r in rs)
            dec_toks = sum(max(len(r["tokens"]) - 1, 0) for r in rs)
            same = sum(r["identical"] for r in rs)
            out.append({"method": m, "batch_size": b, "decoded_with": used[m, b], "sequences": len(rs),
                        "groups": -(-len(rs) // b), "new_tokens": toks, "seconds": seconds[m, b],
                        "tok_per_s": toks / seconds[m, b] if seconds[m, b] > 0 else math.nan,
                        "prefill_seconds": prefill[m, b],
                        "decode_tok_per_s": dec_toks / max(seconds[m, b] - prefill[m, b], 1e-9),
                        "tokens_per_step": dec_toks / max(sum(r["steps"] for r in rs), 1),
                        "identical": same, "compared": len(rs), "identical_to_ar": same / len(rs)})
            if same < len(rs):
                log.warning("%s", f"[evaluate] {m} at batch size {b}: {len(rs) - same} of {len(rs)} sequences differ "
                                  "from their single-sequence AR output")
    df = pd.DataFrame(out)
    ar_speed = df[df.method == BATCH_AR].set_index("batch_size").tok_per_s
    df["vs_batched_ar"] = df.tok_per_s / df.batch_size.map(ar_speed)
    ar_decode = df[df.method == BATCH_AR].set_index("batch_size").decode_tok_per_s
    df["decode_vs_batched_ar"] = df.decode_tok_per_s / df.batch_size.map(ar_decode)
    df.attrs["meaning"] = meaning  # what each method label decodes with
    add_bank_intervals(df, bank)
    return df, recs


def add_bank_intervals(df: pd.DataFrame, bank) -> None:
    """Check the bank's paired measurement against this evaluation, on the rows of the method that
    decodes as `generate_batch` does with no policy named (PER_BATCH): where the bank timed its
    choice at that batch size, its median ratio to batched AR and interval (`bank_ratio`,
    `bank_low`, `bank_high`), the measured decode ratio brought to the bank's replayed
    tokens/step (`at_bank_tokens_per_step`: the paired ratio is a decode rate at those, so this
    compares the step costs alone, not the eval prompts' own acceptance) and whether it lies inside
    (`inside_bank_interval`). Where the bank chose AR, the method is batched AR itself: ratio 1."""
    for c in ("bank_ratio", "bank_low", "bank_high", "at_bank_tokens_per_step"):
        df[c] = math.nan
    df["inside_bank_interval"] = pd.Series([None] * len(df), index=df.index, dtype=object)
    schedule = bank.serving_schedule()
    for i, r in df[df.method == PER_BATCH].iterrows():
        b = int(r.batch_size)
        k = batch_choice(bank, b, schedule)
        entry = bank.batch_schedule.get(str(b)) or {}
        paired = entry.get("paired") or {}
        cand = next((c for c in paired.get("candidates", []) if c["tree"] == k), None)
        if k is None:
            df.loc[i, ["bank_ratio", "bank_low", "bank_high", "at_bank_tokens_per_step"]] = [1.0, 1.0, 1.0, 1.0]
            df.at[i, "inside_bank_interval"] = True
        elif cand is not None:
            scale = bank.figures[k]["tokens_per_step"] / r.tokens_per_step if r.tokens_per_step > 0 else math.nan
            at_bank = r.decode_vs_batched_ar * scale
            df.loc[i, ["bank_ratio", "bank_low", "bank_high", "at_bank_tokens_per_step"]] = [
                cand["median"], cand["low"], cand["high"], at_bank]
            df.at[i, "inside_bank_interval"] = bool(cand["low"] <= at_bank <= cand["high"])


def batch_table_markdown(df: pd.DataFrame, cfg: DictConfig, dtype: str, meaning: dict[str, str] | None = None,
                         device: str = "cpu") -> str:
    """The batch table (rows: method x batch size), headed like `table_markdown`'s."""
    m = machine_info()
    acc = cfg.get("acceptance")
    how = decoding_words(cfg) if acc is None or acc.kind == "exact" else f"typical acceptance (T {acc.temperature:g})"
    where = m.get("cuda") if device.startswith("cuda") and m.get("cuda") else f"{m['cpu']} ({m['torch_threads']} threads)"
    sizes = sorted(int(b) for b in df.batch_size.unique())
    prompts = int(df.sequences.max()) if len(df) else 0
    head = (f"### {cfg.task.name}: {cfg.model.name} + {cfg.heads.name} heads, {how}, batch sizes "
            f"{', '.join(map(str, sizes))}, {dtype}, {where}, {prompts} eval prompts x "
            f"{int(cfg.evaluate.max_new_tokens)} new tokens\n\n"
            "tok/s: new tokens of all sequences / summed wall time of their groups (prefill included; each "
            f"group's time the median of {int(cfg.evaluate.get('batch_repeats', 1))} interleaved rounds); decode "
            "tok/s: the tokens after each sequence's first / that time less the prompts' prefills; x batched "
            "AR: against AR (batched) at the same batch size; identical: sequences token-identical to that "
            "prompt decoded alone by AR.\n\n")
    for label, words in (meaning or {}).items():
        head += f"- {label}: {words}\n"
    if meaning:
        head += "\n"
    if "bank_ratio" in df and df.bank_ratio.notna().any():
        head += (f"bank's interval ({PER_BATCH}): the bank's paired ratio to batched AR for its choice at that "
                 "batch size, median [interval]; measured: this run's decode ratio at the bank's replayed "
                 "tokens/step (the quantity the interval covers); in: inside the interval.\n\n")
    lines = ["| method | batch | decoded with | tok/s | x batched AR | decode tok/s | x batched AR (decode) | tokens/step "
             "| identical | bank's interval | measured | in |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.sort_values(["batch_size"], kind="stable").iterrows():
        bank = measured = inside = ""
        if not math.isnan(r.get("bank_ratio", math.nan)):
            bank = f"{r.bank_ratio:.2f} [{r.bank_low:.2f}, {r.bank_high:.2f}]"
            measured, inside = f"{r.at_bank_tokens_per_step:.2f}", "yes" if r.inside_bank_interval else "**no**"
        lines.append(f"| {r.method} | {int(r.batch_size)} | {r.decoded_with} | {r.tok_per_s:.1f} | {r.vs_batched_ar:.3f} | "
                     f"{r.decode_tok_per_s:.1f} | {r.decode_vs_batched_ar:.3f} | "
                     f"{r.tokens_per_step:.2f} | {int(r.identical)}/{int(r.compared)} | {bank} | {measured} | {inside} |")
    return head + "\n".join(lines) + "\n"


def plot_batches(df: pd.DataFrame, path: Path, task: str) -> None:
    """Batch throughput against batch size (log2 axis), one line per method: prefill included
    (left) and decode only (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted(int(b) for b in df.batch_size.unique())
    for ax, col, what in ((axes[0], "tok_per_s", "batch tok/s (prefill included)"),
                          (axes[1], "decode_tok_per_s", "batch decode tok/s (prefill excluded)")):
        for method, d in df.groupby("method", sort=False):
            d = d.sort_values("batch_size")
            ax.plot(d.batch_size, d[col], marker="o", label=method,
                    color="gray" if method == BATCH_AR else None, ls="--" if method == BATCH_AR else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
    axes[0].set_title(f"{task}: throughput by batch size")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def evaluate_batches(cfg: DictConfig, out: Path, model, hydra, bank, rows: list[dict], sampler=None,
                     acceptance="exact") -> list[dict[str, Any]]:
    """The batched evaluation of the evaluate stage: `compare_batches` at `evaluate.batch_sizes` on
    `rows` (the eval split's first `evaluate.batch_prompts`), written to `out` as batch_table.csv,
    batch_table.md and batch_throughput.png; returns the table's rows."""
    sizes = [int(b) for b in cfg.evaluate.batch_sizes]
    df, _ = compare_batches(model, hydra, bank, rows, int(cfg.evaluate.max_new_tokens), sizes, sampler, acceptance,
                            desc=f"evaluate {cfg.task.name} batches", repeats=int(cfg.evaluate.get("batch_repeats", 1)))
    table = batch_table_markdown(df, cfg, str(model.dtype).removeprefix("torch."), df.attrs.get("meaning"),
                                 str(model.device))
    atomic_write_bytes(out / "batch_table.csv", df.to_csv(index=False).encode())
    atomic_write_bytes(out / "batch_table.md", table.encode())
    plot_batches(df, out / "batch_throughput.png", cfg.task.name)
    log.info("%s", table)
    return df.to_dict("records")

