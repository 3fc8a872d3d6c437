"""The evaluate stage's batched evaluation: every method at every batch size, every sequence equal
to that prompt decoded alone by AR (ragged prompts, sequences leaving the batch on EOS), the bank's
per-batch-size choice read from its serving schedule, and the files written. No timing assertions."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.evaluate.batch import BATCH_AR, ONE_TREE, PER_BATCH, batch_choice, compare_batches, evaluate_batches
from runtime.bank import TopologyBank
from runtime.ar import ar_generate
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_NEW = 24
SIZES = [1, 2, 3]
POLICY = "EntMTPτ (default policy)"  # the tiny bank's default policy is the hysteresis


@pytest.fixture(scope="module")
def runtime(bundle):  # noqa: ANN001, ANN201 - the tiny bundle; (model, heads, rows)
    """The tiny bundle's model (row-invariant, its EOS set to a token one prompt's AR output reaches
    early, so that sequence leaves the batch first), its heads, and three ragged prompts."""
    model = load_model(bundle.model_dir, max_seq_len=256)
    model.set_row_invariance(4)
    heads = load_heads(bundle.heads_dir, model=model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, model.args.vocab_size, (n,), generator=g).tolist() for n in (7, 19, 12)]
    free = [ar_generate(model, p, N_NEW, eos_ids=()) for p in prompts]
    eos = next(t for t in free[1][3:8] if t not in free[0] + free[2])  # ends prompt 1 after 4 to 8 tokens
    model.args.eos_token_ids = (eos,)
    return model, heads, [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(prompts)]


def _bank(bundle, batch_schedule=None) -> TopologyBank:  # noqa: ANN001 - the tiny bundle
    """The tiny bundle's bank (timed at batch size 1 only), or with `batch_schedule` as its record."""
    bank = TopologyBank.load(bundle.bank_dir)
    if batch_schedule is not None:
        bank.batch_schedule = batch_schedule
    return bank


def _entry(best: int | None, n_trees: int) -> dict:
    return {"best_static": best, "best_chain": None, "ar_step_ms": 2.0, "step_ms": [3.0] * n_trees,
            "tok_per_s": [400.0] * n_trees}


def _check_table(df, per_label: str) -> None:  # noqa: ANN001 - the table
    methods = [BATCH_AR, per_label, ONE_TREE, POLICY]
    assert {(m, b) for m in methods for b in SIZES} == set(zip(df.method, df.batch_size))
    assert len(df) == len(methods) * len(SIZES)
    assert (df.identical == df.compared).all() and (df.compared == 3).all()
    assert (df.identical_to_ar == 1.0).all()
    assert (df.loc[df.method == BATCH_AR, "vs_batched_ar"] == 1.0).all()
    assert (df.loc[df.method == BATCH_AR, "decode_vs_batched_ar"] == 1.0).all()
    # every method prefills each prompt once: decoding alone is faster than the whole run
    assert (df.prefill_seconds > 0).all() and (df.prefill_seconds < df.seconds).all()
    assert (df.decode_tok_per_s > df.tok_per_s * (df.new_tokens - df.sequences) / df.new_tokens).all()
    assert (df.tokens_per_step >= 1.0).all() and (df.loc[df.method == BATCH_AR, "tokens_per_step"] == 1.0).all()


def test_a_bank_timed_at_batch_size_1_decodes_larger_batches_by_batched_ar(bundle, runtime) -> None:  # noqa: ANN001
    model, heads, rows = runtime
    bank = _bank(bundle)
    assert [batch_choice(bank, b) for b in SIZES] == [bank.best_static, None, None]
    df, recs = compare_batches(model, heads, bank, rows, N_NEW, SIZES)
    _check_table(df, PER_BATCH)
    # ragged: the EOS sequence stopped early, the others ran to the limit
    lengths = [len(r["tokens"]) for r in recs[BATCH_AR, 3]]
    assert lengths[1] < N_NEW and lengths[0] == lengths[2] == N_NEW
    assert all(r["tokens"] == a["tokens"] for (m, b), rs in recs.items() for r, a in zip(rs, recs[BATCH_AR, 1]))
    # the speculative rows accepted drafts somewhere (not just bonus tokens)
    assert df.loc[df.method != BATCH_AR, "tokens_per_step"].max() > 1.0


def test_a_batch_axis_picks_the_tree_of_the_smallest_measured_batch_size_at_least_b(bundle, runtime) -> None:  # noqa: ANN001
    model, heads, rows = runtime
    n = len(_bank(bundle).trees)
    # batch 1: tree 2; batch 2: tree 0; nothing measured above 2: batched AR at 3
    bank = _bank(bundle, {"1": _entry(2, n), "2": _entry(0, n)})
    assert [batch_choice(bank, b) for b in SIZES] == [2, 0, None]
    df, _ = compare_batches(model, heads, bank, rows, N_NEW, SIZES)
    _check_table(df, PER_BATCH)
    used = df[df.method == PER_BATCH].set_index("batch_size").decoded_with
    assert used[1].startswith("tree 2") and used[2].startswith("tree 0") and used[3] == "AR"
    # the same decode measured under two labels is one measurement (pooled runs), not two that differ by noise
    at3 = df[df.batch_size == 3].set_index("method")
    assert at3.loc[PER_BATCH, "seconds"] == at3.loc[BATCH_AR, "seconds"] and at3.loc[PER_BATCH, "vs_batched_ar"] == 1.0
    assert (df[df.method == ONE_TREE].decoded_with == f"tree {bank.best_static} "
            f"({bank.trees[bank.best_static].num_nodes} nodes)").all()
    # a measured "no tree" also means batched AR
    assert batch_choice(_bank(bundle, {"4": _entry(None, n)}), 3) is None


def test_the_per_batch_rows_are_checked_against_the_banks_paired_interval(bundle, runtime) -> None:  # noqa: ANN001
    """Where the bank timed its choice paired, the PER_BATCH row carries that interval and the
    measured decode ratio at the bank's tokens/step; where it chose AR the row is AR at ratio 1."""
    model, heads, rows = runtime
    n = len(_bank(bundle).trees)
    entry = _entry(1, n)
    entry["paired"] = {"candidates": [{"tree": 1, "median": 1.1, "low": 0.01, "high": 100.0, "rounds": 4},
                                      {"tree": 2, "median": 1.0, "low": 0.9, "high": 1.1, "rounds": 4}]}
    narrow = _entry(1, n)
    narrow["paired"] = {"candidates": [{"tree": 1, "median": 50.0, "low": 49.0, "high": 51.0, "rounds": 4}]}
    bank = _bank(bundle, {"1": entry, "2": narrow, "3": _entry(None, n)})
    df, _ = compare_batches(model, heads, bank, rows, N_NEW, SIZES)
    per = df[df.method == PER_BATCH].set_index("batch_size")
    assert per.loc[1, "bank_ratio"] == 1.1 and per.loc[1, "inside_bank_interval"] is True
    want = per.loc[1, "decode_vs_batched_ar"] * bank.figures[1]["tokens_per_step"] / per.loc[1, "tokens_per_step"]
    assert per.loc[1, "at_bank_tokens_per_step"] == pytest.approx(want)
    assert per.loc[2, "inside_bank_interval"] is False     # a ratio of 50x is not what this run measures
    assert per.loc[3, "bank_ratio"] == 1.0 and per.loc[3, "inside_bank_interval"] is True
    assert df[df.method != PER_BATCH].bank_ratio.isna().all()


def test_evaluate_batches_writes_the_table_and_plot(bundle, runtime, tmp_path) -> None:  # noqa: ANN001
    model, heads, rows = runtime
    cfg = OmegaConf.create({"task": {"name": "tiny"}, "model": {"name": "tiny-llama"}, "heads": {"name": "hydra"},
                            "sampling": {"temperature": 0.0}, "acceptance": {"kind": "exact"},
                            "evaluate": {"max_new_tokens": N_NEW, "batch_sizes": SIZES, "batch_prompts": 8,
                                         "batch_repeats": 2}})
    out = evaluate_batches(cfg, tmp_path, model, heads, _bank(bundle), rows)
    assert len(out) == 4 * len(SIZES) and all(r["identical"] == r["compared"] == 3 for r in out)
    for name in ("batch_table.csv", "batch_table.md", "batch_throughput.png"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "batch_table.md").read_text()
    assert md.startswith("### tiny: tiny-llama + hydra heads, greedy, batch sizes 1, 2, 3")
    assert md.count("| 3/3 |") == 4 * len(SIZES) and f"| {PER_BATCH} |" in md
    assert "median of 2 interleaved rounds" in md


def test_batch_sizes_beyond_the_prompts_are_refused(bundle, runtime) -> None:  # noqa: ANN001
    model, heads, rows = runtime
    with pytest.raises(ValueError, match="at least as many prompts"):
        compare_batches(model, heads, _bank(bundle), rows, N_NEW, [1, 4])
