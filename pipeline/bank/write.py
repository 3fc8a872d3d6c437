"""Building a TopologyBank: its trees (`pipeline.bank.selection`), fitted policies, oracle bound, plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from pipeline.artifacts import save_figure  # noqa: E402
from pipeline.replay.accept import prompt_replays  # noqa: E402
from pipeline.rollout.record import load_rollout  # noqa: E402
from pipeline.bank.selection import (apply_paired, bank_members, batch_choices, batch_replays,  # noqa: E402
                                     paired_candidates, throughput_hull)
from pipeline.timing.paired import (  # noqa: E402
    PairedRun, acceptance_draws, dynamic_blocks, measure_choices, measure_dynamic,
)
from runtime.bank import TopologyBank  # noqa: E402
from runtime.decoder import HEAD_SIGNALS  # noqa: E402
from runtime.tree import Tree  # noqa: E402


def build_bank(
    out: Path, timing: dict, recal: dict, frontier: dict, rollout_dir: Path, policy_cfg: dict, provenance: dict,
    members: str = "oracle", min_oracle_share: float = 0.02, tie_tolerance: float = 0.0,
    dynamic: dict[str, Any] | None = None, paired: PairedRun | None = None,
) -> dict[str, Any]:
    """Write the bank into `out`. `paired` (None: the step-cost model alone chooses per batch size,
    `batch_choices`): how to time the bank's candidate trees against batched AR, which then choose
    (`pipeline.timing.paired`). `dynamic` (None: no EntMTP-dyn): {"scores_dir": the head scores of
    the calibration rollout (`pipeline.rollout.load_scores`), "cost_model": the time stage's
    `StepCostModel`, "calibrate": bool, "stop_below": thresholds}; EntMTP-dyn is fitted on them (`pipeline.bank.dynamic`)."""
    from pipeline.bank.policies import fit_all_policies

    # pruned trees cannot pay for their cost (most were not checked by a timed decode either)
    kept = [i for i, c in enumerate(timing["trees"]) if c.get("tok_per_s") is not None and "pruned" not in c]
    cands = [timing["trees"][i] for i in kept]
    recal_by_paths = {Tree(r["paths"]): r for r in recal["trees"]}
    rollouts = load_rollout(rollout_dir)
    hull = throughput_hull([c["nodes"] for c in cands], [c["tok_per_s"] for c in cands])
    chosen = bank_members(cands, rollouts, members, min_oracle_share)
    trees, figures = [], []
    for k in chosen:
        c = cands[k]
        t = Tree(c["paths"])
        r = recal_by_paths.get(t, {})
        trees.append(t)
        figures.append({
            "nodes": t.num_nodes, "depth": t.depth, "tokens_per_step": c["tokens_per_step"], "step_ms": c["step_ms"],
            "tok_per_s": c["tok_per_s"], "real_tokens_per_step": r.get("real_tokens_per_step"),
            "step_agreement": r.get("step_agreement"),
            # the step-cost model's components (ms) and the timed decode that checked it
            **{f"{part}_ms": ms for part, ms in c.get("cost_ms", {}).items()},
            **{k: c[k] for k in ("measured_step_ms", "phase_corrected_step_ms", "model_error_pct", "raw_model_error_pct")
               if k in c},
        })
    step_costs = [f["step_ms"] / 1000 for f in figures]
    # only what the decoder pays: a signal it computes without the head chain costs nothing extra
    signal_costs = {name: ms / 1000 for name, ms in timing.get("signal_ms", {}).items() if name in HEAD_SIGNALS}
    fitted = fit_all_policies(rollouts, [t.paths for t in trees], step_costs, policy_cfg, signal_costs=signal_costs,
                               tie_tolerance=tie_tolerance)
    policies = {name: f["policy"] for name, f in fitted["policies"].items()}
    # EntMTP* is the fitted static policy: the smallest tree within `tie_tolerance` of the best
    # replayed decode rate, the objective of every other policy and of the oracle (a tolerance on
    # the end-to-end figures, whose prefill is the same for every tree, would be a looser one)
    best = int(policies["static"]["index"])
    default = policy_cfg.get("name", "static")
    if default not in policies:
        default = "static"
    # the trees chosen at each batch size
    batch = batch_choices(timing["batch"], [kept[k] for k in chosen], [t.num_nodes for t in trees], best, tie_tolerance)
    decoder = None if paired is None else paired.decoder(trees)
    # each tree's tokens and steps per calibration prompt: the paired intervals resample the prompts
    prompt_tokens, prompt_steps = prompt_replays(rollouts, trees)
    if paired is not None:
        nodes, tps = [t.num_nodes for t in trees], [f["tokens_per_step"] for f in figures]
        cells = measure_choices(decoder, paired.prompts,
                                paired_candidates(batch, nodes, tps, paired.settings), tps, paired.settings,
                                paired.sampler, paired.progress, acceptance_draws(prompt_tokens, prompt_steps))
        apply_paired(batch, cells, nodes, tps, paired.settings)
        # one convention at batch size 1: EntMTP* is the tree the paired rounds chose there (where
        # they chose one), so `generate` and `generate_batch` of one prompt decode alike
        measured = batch.get("1", {}).get("best_static")
        if measured is not None and measured != best:
            fitted = fit_all_policies(rollouts, [t.paths for t in trees], step_costs, policy_cfg,
                                      signal_costs=signal_costs, static_index=measured)
            policies = {name: f["policy"] for name, f in fitted["policies"].items()}
            best = measured
    fitted["oracle"]["batch"] = batch_replays(rollouts, trees, policies, best, batch)
    # the runtime's AR step at the step-cost model's speed: what the replayed figures, priced by the
    # same model, compare with (the root-only tree's step also pays the drafter every step)
    if timing.get("ar_token_ms"):
        fitted["oracle"]["ar_step_ms"] = float(timing["ar_token_ms"])
    dyn = None
    if dynamic is not None:
        from pipeline.bank.dynamic import build_dynamic
        from pipeline.rollout.scores import load_scores

        price = None
        if paired is not None:  # dyn timed against EntMTP* (the static tree) at batch size 1

            def price(policy: Any, replay_ratio: float, acceptance: Any = None) -> Any:
                run = dynamic_blocks(decoder, paired.prompts[:paired.settings.prompts], best, figures[best]["step_ms"],
                                     policy, paired.settings.new_tokens, paired.sampler)
                return measure_dynamic(run, replay_ratio, paired.settings, paired.progress, acceptance)

        dyn = build_dynamic(rollouts, load_scores(dynamic["scores_dir"], rollouts), dynamic["cost_model"],
                            timing["cost_model"]["reference_context"], fitted["oracle"].get("tokens_per_second"),
                            calibrate=bool(dynamic.get("calibrate", True)), stop_below=dynamic.get("stop_below", (0.0,)),
                            price=price, static_tok_per_s=fitted["policies"]["static"]["replay"]["tokens_per_second"],
                            static_prompt_seconds=prompt_steps[best] * step_costs[best])
    bank = TopologyBank(trees=trees, figures=figures, best_static=best, policies=policies, default_policy=default,
                        oracle=fitted["oracle"], provenance={**provenance, "fit": {n: f.get("replay") for n, f in fitted["policies"].items()},
                                                              "ar_tok_per_s": timing["ar_tok_per_s"]},
                        batch_schedule=batch, dynamic=dyn)
    bank.save(out)
    plot_batch_throughput(trees, batch, out / "batch_throughput.png", provenance)
    plot_acceptance_frontier(frontier, out / "acceptance_frontier.png", provenance.get("task", ""))
    pruned = [c["nodes"] for c in timing["trees"] if c.get("tok_per_s") is None or "pruned" in c]
    plot_throughput_frontier(cands, hull, chosen, pruned, timing["ar_tok_per_s"], out / "throughput_frontier.png", provenance)
    plot_step_latency(cands, timing["ar_token_ms"], out / "step_latency.png", provenance, set(chosen))
    return {"trees": len(trees), "best_static_nodes": trees[best].num_nodes, "best_static_depth": trees[best].depth,
            "best_tok_per_s": figures[best]["tok_per_s"], "ar_tok_per_s": timing["ar_tok_per_s"],
            "dynamic_tok_per_s": dyn["replay"]["tokens_per_second"] if dyn else None,
            # what `make bank` prints, kept so an up-to-date run prints it without loading the bank (torch)
            "table": bank.summary().splitlines()[1:]}


def _machine_line(provenance: dict) -> str:
    m = provenance.get("machine", {})
    return f"{m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, {provenance.get('dtype', '?')}"


def plot_acceptance_frontier(frontier: dict, path: Path, task: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for depth, entries in sorted(frontier["frontier"].items()):
        xs = [len(e["paths"]) + 1 for e in entries]
        ax.plot(xs, [e["tokens_per_step"] for e in entries], label=f"greedy growth, max depth {depth}")
    for name, e in frontier.get("reference", {}).items():
        ax.scatter([len(e["paths"]) + 1], [e["tokens_per_step"]], marker="*" if name == "mc_sim_7b_63" else "x", s=90,
                   zorder=5, label=name)
    ax.set_xlabel("tree nodes (with root)")
    ax.set_ylabel("tokens per step (replayed, exact)")
    ax.set_title(f"Acceptance frontier: {task}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_throughput_frontier(cands: list[dict], hull: list[int], members: list[int], pruned: list[int], ar_tok_s: float,
                             path: Path, provenance: dict) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for depth in sorted({c["depth"] for c in cands}):
        sel = [c for c in cands if c["depth"] == depth]
        ax.scatter([c["nodes"] for c in sel], [c["tok_per_s"] for c in sel], s=18, label=f"depth {depth}")
    hx = [cands[k]["nodes"] for k in hull]
    ax.plot(hx, [cands[k]["tok_per_s"] for k in hull], "k-", lw=1, label="throughput hull")
    ax.scatter([cands[k]["nodes"] for k in members], [cands[k]["tok_per_s"] for k in members], s=110, facecolors="none",
               edgecolors="k", label="in the bank")
    ax.axhline(ar_tok_s, color="gray", ls="--", label=f"AR {ar_tok_s:.1f} tok/s")
    if pruned:
        ax.text(0.99, 0.98, f"pruned (cannot pay for their cost): {', '.join(map(str, pruned))} nodes",
                transform=ax.transAxes, ha="right", va="top", fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("tree nodes (with root)")
    ax.set_ylabel("end-to-end tok/s")
    ax.set_title(f"Throughput frontier: {provenance.get('task', '')}\n{_machine_line(provenance)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_step_latency(cands: list[dict], ar_ms: float, path: Path, provenance: dict, members: set[int] = frozenset()) -> None:
    """Per candidate tree (ordered by size), its modeled step cost stacked as draft / verify / fixed
    where the time stage recorded the components, with the timed decodes' medians overlaid, plain
    and brought to the model's speed by their phase probes (they ran at a slightly shorter context
    than the bank's reference, see timing.json). Trees in the bank are marked with *."""
    order = sorted(range(len(cands)), key=lambda k: (cands[k]["nodes"], cands[k]["depth"]))
    xs = list(range(len(order)))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.55 * len(order) + 2), 4.5))
    if all("cost_ms" in cands[k] for k in order):
        bottom = [0.0] * len(order)
        for part, color in (("verify", "tab:blue"), ("draft", "tab:orange"), ("fixed", "tab:gray")):
            h = [cands[k]["cost_ms"][part] for k in order]
            ax.bar(xs, h, bottom=bottom, color=color, alpha=0.8, label=f"{part} (modeled)")
            bottom = [b + v for b, v in zip(bottom, h)]
    else:
        ax.bar(xs, [cands[k]["step_ms"] for k in order], color="tab:blue", alpha=0.8, label="step (timed)")
    mx = [x for x, k in zip(xs, order) if cands[k].get("measured_step_ms") is not None]
    if mx:
        ax.scatter(mx, [cands[order[x]]["measured_step_ms"] for x in mx], color="k", marker="x", zorder=5, s=22,
                   label="timed decode (median step)")
    px = [x for x in mx if cands[order[x]].get("phase_corrected_step_ms") is not None]
    if px:  # what the model's error is measured against
        ax.scatter(px, [cands[order[x]]["phase_corrected_step_ms"] for x in px], color="k", zorder=6, s=22,
                   label="timed decode at the model's speed (phase probes)")
    ax.axhline(ar_ms, color="gray", ls="--", label=f"AR token {ar_ms:.1f} ms")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{cands[k]['nodes']}/d{cands[k]['depth']}{'*' if k in members else ''}" for k in order],
                       rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("tree: nodes (with root) / depth; * in the bank")
    ax.set_ylabel("step latency, ms")
    ax.set_title(f"Step cost on this machine: {provenance.get('task', '')}\n{_machine_line(provenance)}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_batch_throughput(trees: list[Tree], batch: dict[str, dict[str, Any]], path: Path, provenance: dict) -> None:
    """Batch throughput (modeled, tokens/s summed over the batch) against batch size, for AR and
    every bank tree, the best tree at each batch size marked: where the lines cross, a smaller tree
    (or no speculation) takes over. Where the bank timed its choices paired against batched AR, a
    second panel shows each candidate's measured ratio to AR (median and interval) beside the
    step-cost model's predicted ratio, and the choice."""
    sizes = sorted(int(b) for b in batch)
    has_paired = any(batch[str(b)].get("paired") for b in sizes)
    fig, axes = plt.subplots(1, 2 if has_paired else 1, figsize=(13 if has_paired else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for k, t in enumerate(trees):
        ys = [batch[str(b)]["tok_per_s"][k] for b in sizes]
        label = "AR (root only)" if t.num_nodes == 1 else f"{t.num_nodes} nodes, depth {t.depth}"
        ax.plot(sizes, ys, marker="o", lw=2.5 if t.num_nodes == 1 else 1.5, label=label,
                color="black" if t.num_nodes == 1 else None)
    best = [(b, batch[str(b)]["tok_per_s"][batch[str(b)]["best_static"]]) for b in sizes
            if batch[str(b)]["best_static"] is not None]
    if best:
        ax.scatter(*zip(*best), s=160, facecolors="none", edgecolors="red", zorder=5, label="bank's choice")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("modeled tok/s, summed over the batch")
    ax.set_title(f"Batch throughput: {provenance.get('task', '')} ({_machine_line(provenance)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_paired:
        plot_paired_ratios(axes[0][1], trees, batch, sizes)
    fig.tight_layout()
    save_figure(fig, path)


def plot_paired_ratios(ax: Any, trees: list[Tree], batch: dict[str, dict[str, Any]], sizes: list[int]) -> None:
    """Per batch size, each timed candidate's paired ratio to batched AR: median with its interval
    (bars), the step-cost model's predicted ratio (x), the choice circled; AR at 1."""
    timed = sorted({c["tree"] for b in sizes for c in (batch[str(b)].get("paired") or {}).get("candidates", [])})
    width = 0.6 / max(len(timed), 1)
    for j, k in enumerate(timed):
        xs, med, lo, hi, mx, my = [], [], [], [], [], []
        for i, b in enumerate(sizes):
            cand = next((c for c in (batch[str(b)].get("paired") or {}).get("candidates", []) if c["tree"] == k), None)
            if cand is None:
                continue
            x = i + (j - (len(timed) - 1) / 2) * width
            xs.append(x)
            med.append(cand["median"])
            lo.append(cand["median"] - cand["low"])
            hi.append(cand["high"] - cand["median"])
            if cand.get("model_ratio") is not None:
                mx.append(x)
                my.append(cand["model_ratio"])
            if batch[str(b)]["best_static"] == k:
                ax.scatter([x], [cand["median"]], s=160, facecolors="none", edgecolors="red", zorder=6)
        line = ax.errorbar(xs, med, yerr=[lo, hi], fmt="o", capsize=3,
                           label=f"[{k}] {trees[k].num_nodes} nodes, depth {trees[k].depth}")
        if mx:
            ax.scatter(mx, my, marker="x", color=line[0].get_color(), zorder=5)
    ax.axhline(1.0, color="black", lw=1.5, label="batched AR")
    gain = next((batch[str(b)]["paired"].get("min_gain") for b in sizes if batch[str(b)].get("paired")), None)
    if gain:  # a tree is chosen only where its whole interval clears this line
        ax.axhline(1.0 + gain, color="black", lw=1, ls="--", label=f"AR + {100 * gain:.0f}% (minimum gain)")
    ax.scatter([], [], marker="x", color="gray", label="step-cost model's ratio")
    ax.scatter([], [], s=160, facecolors="none", edgecolors="red", label="bank's choice")
    ax.set_xticks(range(len(sizes)), [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    level = next((batch[str(b)]["paired"].get("level") for b in sizes if batch[str(b)].get("paired")), None)
    ax.set_ylabel(f"decode rate / batched AR (median, {100 * (level or 0):.0f}% interval)")
    ax.set_title("Paired, interleaved timing against the runtime's batched AR", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
