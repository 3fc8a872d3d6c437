"""Every decoding method side by side, the paper's Table 1 on our model and machine, on the held-out `eval` split.

Every prompt is decoded by every method in turn (interleaved, so drift of a shared machine hits
all methods alike). Besides the bank's methods, EAGLE-2's dynamic tree (runtime/eagle2.py, the
field's default: SGLang's settings) drafted by the bank's own drafter is a baseline row.
Figures: tok/s with and without prefill, tokens per step, speedups against AR and against
Hydra's default tree, the share of outputs token-identical to AR, continuation
perplexity under the base model, and the oracle's replayed figure (best tree per step in
hindsight over the bank, an upper bound for any policy over it).

At `sampling.temperature` > 0 every method decodes with the run's seeded sampler and the
reference is seeded AR; typical acceptance is added, and every method gets the distance of its
output from the model's sampling distribution (pipeline/evaluate/sampling.py). transformers'
generate is left out there (its sampler draws other noise, so it cannot match seeded AR).

The batch axis: `pipeline.evaluate.batch`.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from pipeline.artifacts import atomic_write_bytes, atomic_write_json, machine_info, save_figure
from pipeline.evaluate.batch import evaluate_batches
from pipeline.evaluate.labels import DYNAMIC_LABEL, EAGLE2_LABEL, POLICY_LABELS, decoding_words
from pipeline.loaders import RuntimeSpec
from runtime.device import clock
from runtime.eagle2 import Eagle2Policy, Eagle2Settings

Decode = Callable[[list[int], int], dict[str, Any]]


log = logging.getLogger(__name__)


def _spec_method(decoder, choose, sampler=None) -> Decode:
    def run(ids: list[int], n: int) -> dict[str, Any]:
        r = decoder.generate(ids, n, choose=choose if isinstance(choose, int) else choose(), sampler=sampler)
        return {"tokens": r.tokens, "prefill_s": r.prefill_seconds, "decode_s": r.decode_seconds, "steps": len(r.steps),
                "trees": [s.tree for s in r.steps], "signals": [s.signal for s in r.steps],
                "accepted": [s.accepted for s in r.steps],
                # nodes verified per step: a dynamic step's tree is no bank index (tree == DYNAMIC_TREE)
                "nodes": [s.nodes for s in r.steps]}
    return run


def _ar_method(model, sampler=None) -> Decode:
    from runtime.ar import ar_generate

    def run(ids: list[int], n: int) -> dict[str, Any]:
        # each streamed token has been read on the host, so these clock reads follow a synchronisation
        marks: list[float] = []
        t0 = clock(model.device)
        toks = ar_generate(model, ids, n, stream=lambda _tok: marks.append(time.perf_counter()), sampler=sampler)
        t1 = clock(model.device)
        pre = marks[0] - t0 if marks else t1 - t0
        return {"tokens": toks, "prefill_s": pre, "decode_s": t1 - t0 - pre, "steps": max(len(toks) - 1, 0)}
    return run


def _hf_method(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Decode:
    """transformers' own greedy generate on the same device and dtype as our runtime's model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def run(ids: list[int], n: int) -> dict[str, Any]:
        x = torch.tensor([ids], device=device)
        t0 = clock(device)
        hf(x)  # prefill alone, to split prefill from decode time
        pre = clock(device) - t0
        t0 = clock(device)
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
        total = clock(device) - t0
        toks = out[0, len(ids):].tolist()
        eos = hf.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for j, t in enumerate(toks):
            if t in eos:
                toks = toks[: j + 1]
                break
        return {"tokens": toks, "prefill_s": pre, "decode_s": max(total - pre, 1e-9), "steps": max(len(toks) - 1, 0)}
    return run


def _ordinary_ar_method(model, sampler=None) -> Decode:
    """AR with the ordinary arithmetic on the row-invariant model (`lossless: exact`): the speed
    that invariance is paid against, side by side."""
    ar = _ar_method(model, sampler)

    def run(ids: list[int], n: int) -> dict[str, Any]:
        rows = model.invariant_rows
        model.set_row_invariance(None)
        try:
            return ar(ids, n)
        finally:
            model.set_row_invariance(rows)
    return run


# unit roundoff u = 2^-p of each dtype (p: significand bits, the implicit one included)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


@torch.inference_mode()
def _ar_reference_row(model, ids: list[int], ar_tokens: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits row [V] (float32) and final-normed hidden state [dim] with which AR chose its
    token t: the same prefill, then AR's one-token forwards (in the model's current arithmetic)."""
    dev = model.device
    model.reset_cache()
    logits, hidden = model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev), last_only=True)
    for tok in ar_tokens[:t]:
        logits, hidden = model(torch.tensor([[tok]], device=dev), torch.tensor([model.cache_len], device=dev))
    return logits[0, -1], hidden[0, -1]


def list_divergences(model, rows: list[dict], recs: dict[str, list[dict]], dtype: str) -> list[dict[str, Any]]:
    """Every output that leaves AR's: where (prompt, first differing position, method), AR's top-2
    logit gap there, and whether that gap lies within the rounding bound of `dtype`.

    The bound. Two arithmetics of the same forward (AR's one-token product, a tree verify's N-row
    one) compute logit j = sum_i h_i w_ji from final hidden states that agree to within the
    dtype's rounding; with u the unit roundoff and S_j = sum_i |h_i w_ji| (the dot product's
    accumulated magnitude) a relative difference of at most 2u in h (both sides rounded once
    each) moves logit j by at most 2u S_j, and rounding the result in each arithmetic by at most
    2u |z_j| <= 2u S_j more: |dz_j| <= 4u S_j. The argmax can move from AR's token a to b only if
    z_a - z_b <= |dz_a| + |dz_b|, so a divergence that rounding explains has
    gap(a, b) <= bound = 4u (S_a + S_b); AR's top-2 gap is at most gap(a, b). A divergence
    outside the bound is not rounding of this kind (a bug, or a method with other arithmetic
    altogether, like transformers' generate)."""
    u = UNIT_ROUNDOFF[dtype]
    out: list[dict[str, Any]] = []
    ar = {r["id"]: r["tokens"] for r in recs["AR"]}
    weight = model.output.weight
    for method, rs in recs.items():
        if method == "AR":
            continue
        for row, r in zip(rows, rs):
            ref, got = ar[r["id"]], r["tokens"]
            if got == ref:
                continue
            t = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))
            if t >= min(len(ref), len(got)):  # one stopped early (EOS): no position where both chose
                out.append({"prompt": r["id"], "method": method, "position": t, "kind": "length"})
                continue
            logits, h = _ar_reference_row(model, row["input_ids"], ref, t)
            a, b = ref[t], got[t]
            top2 = logits.topk(2).values
            s = (h.float().abs()[None] * weight[[a, b]].float().abs()).sum(-1)
            bound = 4 * u * float(s.sum())
            gap_ab = float(logits[a] - logits[b])
            out.append({"prompt": r["id"], "method": method, "position": t, "ar_token": a, "method_token": b,
                        "top2_gap": round(float(top2[0] - top2[1]), 6), "gap_ar_vs_method_token": round(gap_ab, 6),
                        "bound": round(bound, 6), "within_bound": gap_ab <= bound, "kind": "token"})
    return out


@torch.inference_mode()
def continuation_nll(model, prompt: list[int], cont: list[int]) -> float:
    """Mean negative log-likelihood (nats) of `cont` after `prompt` under the base model."""
    if not cont:
        return float("nan")
    dev = model.device
    seq = torch.tensor([prompt + cont[:-1]], device=dev)
    model.reset_cache()
    logits, _ = model(seq, torch.arange(seq.shape[1], device=dev))
    logp = torch.log_softmax(logits[0, len(prompt) - 1:].float(), -1)
    return float(-logp.gather(-1, torch.tensor(cont, device=dev)[:, None]).mean())


def evaluate(cfg: DictConfig, out: Path, bank_dir: Path, rows: list[dict], spec: RuntimeSpec, medusa_dir: Path,
             batch_rows: list[dict] | None = None) -> dict[str, Any]:
    """Every method on the eval prompts `rows`, decoded with the runtime `spec` (the bank's model
    and heads); the Medusa baseline row uses the heads in `medusa_dir` when they exist. Writes the
    table, traces, divergences and plots into `out`. Then, given `batch_rows` (the eval split's
    first `evaluate.batch_prompts`) and `evaluate.batch_sizes`, the batched evaluation
    (`evaluate_batches`: batch_table.csv / .md, batch_throughput.png; under lossless=exact only)."""
    from pipeline.loaders import acceptance_from_cfg, load_runtime, sampler_from_cfg
    from runtime.bank import TopologyBank
    from runtime.fingerprint import heads_fingerprint, weights_fingerprint
    from runtime.heads import load_heads

    model, hydra = load_runtime(spec)
    bank = TopologyBank.load(bank_dir, model_fingerprint=weights_fingerprint(spec.model_dir),
                             heads_fingerprint=heads_fingerprint(spec.heads_dir), max_depth=hydra.max_depth)
    sampler = sampler_from_cfg(cfg.sampling)
    sizes = [int(b) for b in cfg.evaluate.get("batch_sizes") or []] if batch_rows else []
    if sizes and model.invariant_rows is None and not model.kernel_decode:
        log.info("[evaluate] no batched evaluation under lossless=numerical: batched decoding needs the row-invariant "
                 "arithmetic (lossless=exact)")
        sizes = []
    if sizes and (min(sizes) < 1 or len(set(sizes)) != len(sizes) or max(sizes) > len(batch_rows)):
        # checked before the single-sequence table, not after it
        raise ValueError(f"evaluate.batch_sizes={sizes} must be distinct ints >= 1 and at most the "
                         f"{len(batch_rows)} batch prompts (evaluate.batch_prompts, and the eval split's size)")
    hf = None
    if cfg.evaluate.hf_generate and sampler.greedy:
        hf = _hf_method(spec.model_dir, model.device, model.dtype)
    elif cfg.evaluate.hf_generate:
        log.info("[evaluate] transformers generate left out at temperature > 0: its sampler cannot match seeded AR")
    medusa = None
    try:
        # bound to the base model loaded above: one copy of its weights serves every method
        medusa = load_heads(medusa_dir, model=model)
    except FileNotFoundError as e:
        log.info("%s", f"[evaluate] Medusa heads not available ({e}); skipping the Medusa row")
    df, recs = compare_methods(model, hydra, bank, rows, int(cfg.evaluate.max_new_tokens), int(cfg.profile.rank_cap),
                               sampler, medusa=medusa, hf=hf, acceptance=acceptance_from_cfg(cfg.acceptance),
                               desc=f"evaluate {cfg.task.name}", eagle2=eagle2_settings(cfg))
    if sampler.greedy:
        divergences = list_divergences(model, rows, recs, str(model.dtype).removeprefix("torch."))
        atomic_write_json(out / "divergences.json", {"lossless": str(cfg.lossless), "dtype": str(model.dtype),
                                                      "invariant_rows": model.invariant_rows, "divergences": divergences})
        for d in divergences:
            log.info("%s", f"[evaluate] divergence from AR: {d}")
    df["task"] = cfg.task.name
    rows_out = df[df.method != "oracle (replayed)"].drop(columns=["task", "speedup_vs_ar", "vs_hydra_default"]).to_dict("records")
    table = table_markdown(df, cfg, spec.dtype)
    check = df.attrs.get("dynamic_check")
    if check is not None and "ceiling_tok_per_s" in check:
        table += (f"\nEntMTP-dyn's super-tree with hindsight (each step verifying just its accepted chain): "
                  f"{check['ceiling_tok_per_s']:.1f} tok/s replayed; EntMTP-dyn replays "
                  f"{check['replayed_tok_per_s']:.1f}, {100 * check['share_of_ceiling']:.0f}% of it.\n")
    atomic_write_bytes(out / "table.csv", df.to_csv(index=False).encode())
    atomic_write_bytes(out / "table.md", table.encode())
    atomic_write_json(out / "traces.json", {m: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for m, rs in recs.items()})
    plot_methods(df, out / "methods.png", cfg.task.name)
    dyn = [label for label in (DYNAMIC_LABEL, *POLICY_LABELS.values()) if label in recs]
    if dyn:
        plot_schedule(recs[dyn[0]][0], bank, out / "schedule.png", dyn[0])
    if check is not None:
        atomic_write_json(out / "dynamic_check.json", check)
        log.info("%s", f"[evaluate] EntMTP-dyn replay vs real decodes: {check['steps_agree']} of "
                       f"{check['steps_compared']} steps agree")
    log.info("%s", table)
    oracle_dec = df.loc[df.method == "oracle (replayed)", "decode_tok_per_s"].item()
    summary = {"table": rows_out, "oracle_decode_tok_per_s": oracle_dec, "machine": machine_info()}
    if check is not None:
        summary["dynamic_check"] = {k: check[k] for k in ("steps_compared", "steps_agree", "prompts_compared",
                                                          "ceiling_tok_per_s", "share_of_ceiling") if k in check}
    if sizes:
        summary["batch_table"] = evaluate_batches(cfg, out, model, hydra, bank, batch_rows, sampler,
                                                  acceptance_from_cfg(cfg.acceptance))
    return summary




def eagle2_settings(cfg: DictConfig) -> Eagle2Settings | None:
    """The EAGLE-2 row's settings from `evaluate.eagle2` (None: the row is left out)."""
    e = cfg.evaluate.get("eagle2")
    if e is None:
        return Eagle2Settings()
    if not e.enabled:
        return None
    return Eagle2Settings(int(e.depth), int(e.topk), int(e.total_tokens))


def compare_methods(model, hydra, bank, rows: list[dict], n_new: int, rank_cap: int, sampler=None, medusa=None,
                    hf: Decode | None = None, acceptance="exact", desc: str = "evaluate",
                    eagle2: Eagle2Settings | None = Eagle2Settings()) -> tuple[pd.DataFrame, dict[str, list[dict]]]:
    """Decode every prompt of `rows` ({"id", "input_ids"}) with every method, interleaved, and
    tabulate (one row per method, then the replayed oracle); also return each method's records.

    `eagle2`: the `runtime.eagle2.Eagle2Settings` of the EAGLE-2 row (drafted by `hydra`, the bank's
    drafter, its depth capped to the drafter's; default: SGLang's settings; None: no such row).
    It decodes with exact acceptance only, and has no replayed figure (its tree is not one of the
    bank's, nor a subset of a fixed super-tree that a rollout scores).

    `sampler` (default greedy) is the one every exact method and AR decode with; at temperature
    > 0 typical acceptance rows and the distance columns of pipeline/evaluate/sampling.py are added.
    `acceptance` is the rule of every speculative row ("exact", or the run's typical acceptance).
    On a row-invariant model (`lossless: exact`) AR is also timed in the ordinary arithmetic, the
    speed that invariance is paid against."""
    from pipeline.evaluate.sampling import distribution_columns, typical_decoders
    from pipeline.replay.accept import accept_lengths, replay_tree
    from pipeline.replay.dynamic import dynamic_ceiling, replay_dynamic
    from pipeline.replay.oracle import oracle_schedule
    from pipeline.rollout.record import rollout_prompt
    from pipeline.rollout.scores import score_prompt
    from runtime.decoder import TreeDecoder
    from runtime.policy import Scheduler, policy_from_dict
    from runtime.sampling import Sampler
    from runtime.tree import Tree, TreeBuffers

    sampler = sampler if sampler is not None else Sampler()
    mc = TreeBuffers.compile(Tree.named("mc_sim_7b_63"))
    methods: dict[str, Decode] = {"AR": _ar_method(model, sampler)}
    if model.invariant_rows is not None:
        methods["AR (ordinary arithmetic)"] = _ordinary_ar_method(model, sampler)
    if hf is not None:
        methods["HF generate"] = hf
    if medusa is not None:
        methods["Medusa default"] = _spec_method(TreeDecoder(model, medusa, [mc], acceptance=acceptance), 0, sampler)
    hydra_mc = TreeDecoder(model, hydra, [mc], acceptance=acceptance)
    methods["Hydra default"] = _spec_method(hydra_mc, 0, sampler)
    bank_dec = TreeDecoder(model, hydra, bank.buffers, acceptance=acceptance)
    methods["EntMTP*"] = _spec_method(bank_dec, bank.best_static, sampler)
    for name, label in POLICY_LABELS.items():
        if name in bank.policies:
            pol = bank.policies[name]
            methods[label] = _spec_method(bank_dec, lambda pol=pol: Scheduler(policy_from_dict(pol), len(bank.trees)), sampler)
    dynamic = bank.dynamic_policy() if bank.dynamic else None
    if dynamic is not None:
        # one policy for every prompt, as a server keeps it: its subset cache stays warm
        methods[DYNAMIC_LABEL] = _spec_method(bank_dec, lambda: dynamic, sampler)
    eagle2_policy = _eagle2_policy(eagle2, hydra) if acceptance == "exact" else None
    if eagle2_policy is not None:
        # as EntMTP-dyn: one policy for every prompt (its cache of compiled tree shapes stays warm)
        methods[EAGLE2_LABEL] = _spec_method(bank_dec, lambda: eagle2_policy, sampler)
    if not sampler.greedy:
        for label, dec in typical_decoders(model, hydra, mc, bank.buffers[bank.best_static], sampler.config).items():
            methods[label] = _spec_method(dec, 0)  # typical acceptance draws with its own temperature

    names = list(methods)
    recs: dict[str, list[dict]] = {m: [] for m in names}
    # warm-up: one short run of every method (allocator, kernels)
    for m in names:
        methods[m](rows[0]["input_ids"], 8)
    for row in tqdm(rows, desc=desc, unit="prompt"):
        for m in names:
            r = methods[m](row["input_ids"], n_new)
            r["id"] = row["id"]
            recs[m].append(r)
    # the oracle over the bank, replayed on the AR continuations of the eval prompts
    costs = [f["step_ms"] / 1000 for f in bank.figures]
    oracle_time, oracle_tokens, oracle_steps = 0.0, 0, 0
    ar_tokens = {r["id"]: r["tokens"] for r in recs["AR"]}
    rollouts, dyn_scores = [], []
    for row in rows:
        ro = rollout_prompt(model, hydra, row["input_ids"], n_new, rank_cap, sampler=sampler)
        rollouts.append(ro)
        if dynamic is not None:  # the heads' scores of EntMTP-dyn's super-tree at every step index
            dyn_scores.append(score_prompt(model, hydra, row["input_ids"], ro["tokens"], [dynamic.super_tree])[0])
        acc = np.stack([accept_lengths(ro["rank_paths"], t.paths, rank_cap=rank_cap) for t in bank.trees])
        t_min, sched = oracle_schedule(acc, np.asarray(costs))
        oracle_time += t_min
        oracle_tokens += len(ro["tokens"]) - 1
        oracle_steps += len(sched)
        if ro["tokens"].tolist() != ar_tokens[row["id"]]:
            log.info("%s", f"[evaluate] note: rollout and AR differ on {row['id']} (float tie)")

    ar = recs["AR"]
    rows_out = []
    for m in names:
        rs = recs[m]
        toks = sum(len(r["tokens"]) for r in rs)
        dec_toks = sum(max(len(r["tokens"]) - 1, 0) for r in rs)
        total_s = sum(r["prefill_s"] + r["decode_s"] for r in rs)
        dec_s = sum(r["decode_s"] for r in rs)
        identical = sum(r["tokens"] == a["tokens"] for r, a in zip(rs, ar))
        nll = statistics.mean(continuation_nll(model, row["input_ids"], r["tokens"]) for row, r in zip(rows, rs))
        rows_out.append({
            "method": m, "tok_per_s": toks / total_s, "decode_tok_per_s": dec_toks / dec_s if dec_s else math.nan,
            "tokens_per_step": dec_toks / max(sum(r["steps"] for r in rs), 1),
            "identical_to_ar": identical / len(rs), "ppl": math.exp(nll), "prompts": len(rs), "new_tokens": toks,
        })
        if not sampler.greedy:
            rows_out[-1].update(distribution_columns(model, [row["input_ids"] for row in rows], [r["tokens"] for r in rs],
                                                     sampler.config))
    df = pd.DataFrame(rows_out)
    ar_speed = df.loc[df.method == "AR", "tok_per_s"].item()
    hyd = df.loc[df.method == "Hydra default", "tok_per_s"].item()
    df["speedup_vs_ar"] = df.tok_per_s / ar_speed
    df["vs_hydra_default"] = df.tok_per_s / hyd
    ordinary = df.loc[df.method == "AR (ordinary arithmetic)", "tok_per_s"]
    if len(ordinary):  # under lossless=exact: against the fastest AR, which a user would otherwise run
        df["vs_ordinary_ar"] = df.tok_per_s / ordinary.item()
    ar_dec = df.loc[df.method == "AR", "decode_tok_per_s"].item()
    oracle_dec = oracle_tokens / oracle_time if oracle_time else math.nan
    # The oracle is replayed with the bank's step costs, measured by the time stage, not in this
    # run: compare it with AR priced by the same model (the bank's `ar_step_ms`; a bank without it:
    # the root-only tree, which also pays the drafter every step), or a drift of the machine between
    # the two runs would show up as speedup.
    root = [f["step_ms"] for t, f in zip(bank.trees, bank.figures) if t.num_nodes == 1]
    ar_ms = bank.oracle.get("ar_step_ms") if isinstance(bank.oracle, dict) else None
    ar_ref = 1000 / ar_ms if ar_ms else 1000 / root[0] if root else ar_dec
    oracle_row = {"method": "oracle (replayed)", "decode_tok_per_s": oracle_dec,
                  "tokens_per_step": oracle_tokens / max(oracle_steps, 1), "speedup_vs_ar": oracle_dec / ar_ref,
                  "replayed_tok_per_s": oracle_dec, "replayed_share_of_oracle": 1.0}
    df = pd.concat([df, pd.DataFrame([oracle_row])], ignore_index=True)
    if acceptance == "exact":  # (the rank paths replay exact acceptance, greedy or seeded sampling)
        # the bank's methods replayed on the same continuations at the same costs as the oracle:
        # their share of it compares like with like (the timed figures above and the replayed
        # oracle come from different runs of the machine)
        replayed = replayed_methods(bank, rollouts, costs, rank_cap)
        if dynamic is not None:
            # a fresh policy on the host for the replay: the decodes above bound `dynamic` to the
            # model's device, and the recorded scores are host arrays
            host_policy = bank.dynamic_policy()
            dyn_replay = replay_dynamic(rollouts, dyn_scores, host_policy, rank_cap)
            replayed[DYNAMIC_LABEL] = dyn_replay.tokens_per_second
            check = dynamic_check(dyn_replay, rollouts, recs[DYNAMIC_LABEL], ar_tokens)
            # what EntMTP-dyn's super-tree allows with hindsight, at the same costs as its replay
            ceiling = dynamic_ceiling(rollouts, host_policy, rank_cap)["tokens_per_second"]
            check.update(replayed_tok_per_s=dyn_replay.tokens_per_second, ceiling_tok_per_s=ceiling,
                         share_of_ceiling=dyn_replay.tokens_per_second / ceiling)
            df.attrs["dynamic_check"] = check
        df["replayed_tok_per_s"] = df.method.map(replayed).fillna(df.get("replayed_tok_per_s"))
        df["replayed_share_of_oracle"] = df.replayed_tok_per_s / oracle_dec
        # replayed and measured as ratios to AR, each at its own run's speed: where they part, the
        # replay misprices a method (its decode ratio is decode_tok_per_s over AR's)
        df["replayed_vs_ar"] = df.replayed_tok_per_s / ar_ref
        df["decode_vs_ar"] = df.decode_tok_per_s / ar_dec
        # the bank's prediction: EntMTP*'s step against the runtime's AR as its paired rounds timed it
        # at batch size 1, times each method's replay relative to EntMTP*'s on these prompts, so the
        # step-cost model prices methods only against EntMTP* (where most of its error cancels)
        step_ratio = paired_step_ratio(bank)
        if step_ratio is not None and replayed.get("EntMTP*"):
            star_tps = replay_tree(rollouts, bank.trees[bank.best_static], rank_cap).tokens_per_step
            df["predicted_vs_ar"] = df.replayed_tok_per_s / replayed["EntMTP*"] * star_tps * step_ratio
    if eagle2_policy is not None:   # (after the concatenations, which drop a frame's attrs)
        df.attrs["eagle2"] = eagle2_policy.settings.to_dict()
    return df, recs


def _eagle2_policy(settings: Eagle2Settings | None, drafter: Any) -> Eagle2Policy | None:
    """The EAGLE-2 row's policy for `drafter`: `settings` with the depth capped to what the
    drafter drafts; None for no row."""
    if settings is None:
        return None
    capped = settings.capped(drafter.max_depth)
    if capped != settings:
        log.info("%s", f"[evaluate] EAGLE-2 settings {settings} capped to {capped}: the drafter drafts "
                       f"{drafter.max_depth} tokens")
    return Eagle2Policy(capped)


def dynamic_check(replay, rollouts: list[dict], recs: list[dict], ar_tokens: dict[str, list[int]]) -> dict[str, Any]:
    """Recalibrate's check for EntMTP-dyn on the eval prompts: each real decode against the replay of
    the same policy on that prompt's rollout, step by step (accepted length and subset size;
    `pipeline.replay.compare_dynamic_steps`). Prompts whose rollout left AR's text (a float tie of
    the teacher-forced pass) have no replay to compare with and are counted apart."""
    from pipeline.replay.dynamic import compare_dynamic_steps

    out: dict[str, Any] = {"steps_compared": 0, "steps_agree": 0, "prompts_compared": 0, "prompts_skipped": [],
                           "disagreements": []}
    for n, (ro, rec) in enumerate(zip(rollouts, recs)):
        if ro["tokens"].tolist() != ar_tokens[rec["id"]] or rec["tokens"] != ar_tokens[rec["id"]]:
            out["prompts_skipped"].append(rec["id"])
            continue
        cmp = compare_dynamic_steps(replay, n, rec["accepted"], rec["nodes"], len(ro["tokens"]))
        out["steps_compared"] += cmp["steps_compared"]
        out["steps_agree"] += cmp["steps_agree"]
        out["prompts_compared"] += 1
        out["disagreements"] += [{"prompt": rec["id"], **d} for d in cmp["disagreements"]][: 10 - len(out["disagreements"])]
    return out


def paired_step_ratio(bank) -> float | None:
    """AR's step time over EntMTP*'s tree step, as the bank's paired rounds at batch size 1 timed
    them against the runtime's AR (their median ratio over the tree's calibration tokens/step), or
    None where the bank has no such timing of EntMTP*'s tree."""
    from runtime.check import paired_candidate

    entry = (bank.batch_schedule or {}).get("1")
    c = paired_candidate(entry, bank.best_static) if isinstance(entry, dict) else None
    tps = bank.figures[bank.best_static].get("tokens_per_step")
    return c["median"] / tps if c and tps else None


def replayed_methods(bank, rollouts: list[dict], costs: list[float], rank_cap: int) -> dict[str, float]:
    """Replayed tokens/s of EntMTP* and of every fitted policy whose signal reads no heads (a head
    signal's per-step extra is not in the bank's step costs) on `rollouts`, keyed by method label."""
    from pipeline.replay.policy import BankReplay, replay_policy
    from runtime.decoder import HEAD_SIGNALS
    from runtime.policy import StaticPolicy

    data = BankReplay.build(rollouts, [t.paths for t in bank.trees], rank_cap)
    out = {"EntMTP*": replay_policy(data, None, StaticPolicy(bank.best_static), costs).tokens_per_second}
    for name, label in POLICY_LABELS.items():
        pol = bank.policies.get(name)
        if pol is not None and pol.get("signal") not in HEAD_SIGNALS:
            out[label] = replay_policy(data, None, pol, costs).tokens_per_second
    return out


def table_markdown(df: pd.DataFrame, cfg: DictConfig, dtype: str) -> str:
    m = machine_info()
    acc = cfg.get("acceptance")
    how = decoding_words(cfg) if acc is None or acc.kind == "exact" else (
        f"typical acceptance (T {acc.temperature:g}, epsilon {acc.epsilon:g}, alpha {acc.alpha:g}; not lossless)")
    head = (f"### {cfg.task.name}: {cfg.model.name} + {cfg.heads.name} heads, {how}, batch 1, {dtype}, "
            f"{m['cpu']} ({m['torch_threads']} threads), {int(cfg.profile.eval_prompts)} eval prompts x "
            f"{int(cfg.evaluate.max_new_tokens)} new tokens\n\n")
    cols = ["method", "tok_per_s", "decode_tok_per_s", "tokens_per_step", "speedup_vs_ar", "vs_hydra_default", "identical_to_ar", "ppl"]
    if "replayed_share_of_oracle" in df.columns:
        cols += ["replayed_tok_per_s", "replayed_share_of_oracle", "replayed_vs_ar", "decode_vs_ar"]
        head += ("replayed_tok_per_s: the bank's methods replayed on the AR continuations of these prompts at the "
                 "bank's step costs, as the oracle is; replayed_share_of_oracle: its share of the oracle's; "
                 "replayed_vs_ar: the replay over AR priced by the same step-cost model; decode_vs_ar: the measured "
                 "decode tok/s over AR's (the two part where the replay misprices a method).\n\n")
    if "predicted_vs_ar" in df.columns:
        cols.append("predicted_vs_ar")
        head += ("predicted_vs_ar: the bank's prediction, EntMTP*'s step against AR's as the bank's paired rounds "
                 "timed it at batch size 1, times each method's replayed tok/s relative to EntMTP*'s on these "
                 "prompts.\n\n")
    e2 = df.attrs.get("eagle2")
    if e2 is not None:
        head += (f"{EAGLE2_LABEL}: EAGLE-2's dynamic tree (arXiv 2406.16858) drafted by the same drafter, depth "
                 f"{e2['depth']}, top-{e2['topk']}, {e2['total_tokens']} nodes verified per step (`evaluate.eagle2`: "
                 "SGLang's defaults, the depth capped to the drafter's); drafting costs one drafter pass per depth over the "
                 "top-k frontier, as EAGLE-2's does.\n\n")
    if "vs_ordinary_ar" in df.columns:
        cols.insert(5, "vs_ordinary_ar")
        head += ("speedup_vs_ar: against AR in the row-invariant arithmetic every exact method decodes in (the "
                 "output they equal); vs_ordinary_ar: against AR in the ordinary, fastest arithmetic.\n\n")
    if "nll_gap" in df.columns:
        cols += ["nll_T", "entropy_T", "nll_gap", "nll_gap_se"]
        head += ("identical_to_ar: share of outputs token-identical to seeded AR. nll_T / entropy_T: mean surprisal "
                 "-log p(y) and entropy of the model's tempered (processed) distribution p at each emitted token, "
                 "nats; nll_gap = nll_T - entropy_T, 0 in expectation for an exact sampler (nll_gap_se: its "
                 "standard error), negative when a method prefers probable tokens.\n\n")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(str(v) if isinstance(v, str) else ("" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def plot_methods(df: pd.DataFrame, path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = df[df.method != "oracle (replayed)"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(d.method, d.tok_per_s, color=["gray" if m in ("AR", "HF generate") else "tab:blue" for m in d.method])
    for x, (v, tps) in enumerate(zip(d.tok_per_s, d.tokens_per_step)):
        ax.text(x, v, f"{v:.1f}\n({tps:.2f}/step)", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("tok/s (prefill included)")
    ax.set_title(f"{task}: methods side by side")
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    save_figure(fig, path)


def plot_schedule(rec: dict, bank, path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(9, 3.5))
    steps = range(len(rec["trees"]))
    # a dynamic step (tree == DYNAMIC_TREE) is no bank tree: its record holds the nodes it verified
    nodes = rec.get("nodes") or [bank.trees[k].num_nodes for k in rec["trees"]]
    ax1.step(steps, nodes, where="post", color="tab:blue", label="tree nodes")
    ax1.set_xlabel("decoding step")
    ax1.set_ylabel("tree nodes", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(steps, rec["signals"], color="tab:orange", lw=0.8, label="signal")
    ax2.set_ylabel("signal", color="tab:orange")
    ax1.set_title(f"{label}: tree chosen along one generation ({rec['id']})")
    fig.tight_layout()
    save_figure(fig, path)

