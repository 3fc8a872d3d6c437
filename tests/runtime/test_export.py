"""Exports for serving engines, read back by the parsers of tests/helpers/engine_parsers.py.

Single trees (the legacy formats: vLLM's former speculative_token_tree, TensorRT-LLM's medusa_choices,
tree JSON), and per-batch-size serving schedules (vLLM num_speculative_tokens_per_batch_size,
TensorRT-LLM draft_len_schedule, SGLang flags and --speculative-adaptive config, JSON). Each engine
export is also read back with the engine's own lookup rule, reimplemented here from its code's
documented behaviour, and compared with the schedule's rule at every load.
"""

from __future__ import annotations

import ast
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shutil
from pathlib import Path

from runtime.bank import TopologyBank
from runtime.cli import main
from runtime.bank import BankError
from runtime.export.engines import (
    EXPORTERS,
    SCHEDULE_FORMATS,
    TREE_FORMATS,
    export_schedule,
    export_tree,
    sglang_adaptive_config,
    to_json,
    to_trtllm,
    to_vllm,
)
from runtime.export.schedule import (
    ScheduleError,
    ServingChoice,
    ServingSchedule,
    eagle_pool,
    tree_topk,
)
from runtime.tree import Tree, TreeError
from tests.helpers import SIX_NODE_TREE, TinyBundle, make_bank, reseal, trees
from tests.helpers.engine_parsers import (chain_in_tree, from_json, from_trtllm, from_vllm, parse_schedule, parse_tree,
                                          strip_record)

SMALL = Tree([(1,), (0, 0), (0,)])


def test_vllm_format() -> None:
    text = to_vllm(SMALL)
    assert text == "[(0,), (1,), (0, 0)]"
    value = ast.literal_eval(text)  # what vLLM does with the string
    assert value == [(0,), (1,), (0, 0)] and all(isinstance(p, tuple) for p in value)
    assert from_vllm(text) == SMALL
    assert from_vllm(value) == SMALL
    assert from_vllm("[(0,),(0,0),(0,1)]") == Tree([(0,), (0, 0), (0, 1)])
    assert to_vllm(Tree([])) == "[]" and from_vllm("[]") == Tree([])


def test_trtllm_format() -> None:
    choices = to_trtllm(SMALL)
    assert choices == [[0], [1], [0, 0]]
    assert all(type(c) is list for c in choices)
    assert from_trtllm(choices) == SMALL
    assert from_trtllm(str(choices)) == SMALL  # command-line tools take the string form
    mc = Tree.named("mc_sim_7b_63")
    assert from_trtllm(to_trtllm(mc)) == mc


def test_json_format() -> None:
    text = to_json(SMALL)
    assert json.loads(text) == [[0], [1], [0, 0]]
    assert from_json(text) == SMALL == Tree.parse(text)


def test_parsers_reject_bad_input_with_tree_errors() -> None:
    for bad in ["[(0,), (2,)]", "[(0,), (0, 0, 0)]", "__import__('os')", "[(0,)", "{(0,)}", "[(0.5,)]", "7", "((" * 300]:
        with pytest.raises(TreeError):
            from_vllm(bad)
    for bad in [[[0], [2]], "[[0], [0, 0, 0]]", {0: 1}, [[0], "x"]]:
        with pytest.raises(TreeError):
            from_trtllm(bad)  # type: ignore[arg-type]
    with pytest.raises(TreeError, match=r"max_depth 1"):
        from_vllm("[(0,), (0, 0)]", max_depth=1)
    with pytest.raises(ValueError, match="unknown export format"):
        export_tree(SMALL, "onnx")
    with pytest.raises(ValueError, match="unknown tree format"):
        parse_tree("[]", "onnx")
    # the short names are the per-batch-size exports, no tree formats
    for name in ("vllm", "trtllm", "json"):
        with pytest.raises(ValueError, match="unknown export format"):
            export_tree(SMALL, name)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.sampled_from(sorted(EXPORTERS)))
def test_every_format_round_trips(tree: Tree, fmt: str) -> None:
    exported = export_tree(tree, fmt)
    assert parse_tree(exported, fmt) == tree
    # exports list paths in canonical node order, so exporting is deterministic
    assert export_tree(parse_tree(exported, fmt), fmt) == exported


_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="[](), 0123-.{}'\"xj", max_size=40),
    st.lists(st.tuples(st.integers(-1, 3)) | st.tuples(st.integers(0, 2), st.integers(-1, 3)), max_size=8).map(str),
)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(_text, st.sampled_from(["legacy-vllm-tree", "legacy-trtllm-medusa", "tree-json"]))
def test_text_parsers_fuzz_raise_only_tree_errors(text: str, fmt: str) -> None:
    try:
        tree = parse_tree(text, fmt)
    except TreeError:
        return
    assert parse_tree(export_tree(tree, fmt), fmt) == tree


# ================================================================ per-batch-size serving schedules
#
# The engines' lookup rules, written from their code's documented behaviour (see runtime/export/engines.py
# for the files and PRs): what each engine does with an exported config at a given load.


def vllm_k(cfg: dict, load: int) -> int:
    """vLLM build_dynamic_sd_schedule_lookup: inclusive ranges, a gap keeps the previous k, the last k
    carries on up to max_num_seqs, every k clamped to num_speculative_tokens."""
    top, k = cfg["num_speculative_tokens"], None
    for lo, hi, kk in sorted(cfg["num_speculative_tokens_per_batch_size"]):
        if lo <= load <= hi:
            return min(top, kk)
        if lo > load:
            return min(top, k)
        k = kk
    return min(top, k)


def trtllm_len(cfg: dict, load: int) -> int:
    """TensorRT-LLM get_draft_len_for_batch_size: the first key >= the batch size, 0 above the last key."""
    schedule = {int(key): v for key, v in cfg["draft_len_schedule"].items()}
    return next((schedule[key] for key in sorted(schedule) if key >= load), 0)


def sglang_steps(text: str, load: int, cuda_graph_bs: list[int] | None = None) -> int:
    """SGLang AdaptiveStepRouter: pad the load up to a CUDA-graph batch size, then the largest key <= it
    (the smallest key below all of them); the export gives every slot one candidate."""
    configs = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    if not configs:
        return 0
    keys = sorted(int(k) for k in configs[0] if k.isdigit())
    if cuda_graph_bs:
        load = next((b for b in sorted(cuda_graph_bs) if b >= load), load)
    slot = max((k for k in keys if k <= load), default=keys[0])
    steps = configs[0][str(slot)]["candidate_steps"]
    assert len(steps) == 1
    return steps[0]


def normalized(out: object) -> object:
    """What a reader of the printed export gets (JSON turns int keys into strings, tuples into lists)."""
    return out if isinstance(out, str) else json.loads(json.dumps(out))


MC = Tree.named("mc_sim_7b_63")
SCHEDULE_TREES = (Tree.chain(2), SIX_NODE_TREE, MC)
# four batch sizes: the big tree alone, a small tree under load, a chain only, then no speculation
SCHEDULE = ServingSchedule(choices=(
    ServingChoice(1, tree=MC, tree_index=2, chain_len=4, tokens_per_step=2.9, step_ms=9.0, tok_per_s=322.0,
                  chain_tokens_per_step=2.2, chain_step_ms=6.1, chain_tok_per_s=360.5, ar_step_ms=5.0,
                  tree_step_ms=(6.0, 6.5, 9.0), tree_tok_per_s=(300.0, 310.0, 322.0)),
    ServingChoice(4, tree=SIX_NODE_TREE, tree_index=1, chain_len=2, tokens_per_step=2.0, step_ms=8.0, tok_per_s=1000.0,
                  chain_tokens_per_step=1.8, chain_step_ms=7.0, chain_tok_per_s=1028.0, ar_step_ms=6.0,
                  tree_step_ms=(7.0, 8.0, 20.0), tree_tok_per_s=(900.0, 1000.0, 580.0)),
    ServingChoice(16, chain_len=1, chain_tokens_per_step=1.5, chain_step_ms=10.0, chain_tok_per_s=2400.0, ar_step_ms=8.0,
                  tree_step_ms=(12.0, 16.0, None), tree_tok_per_s=(2200.0, 2100.0, None)),
    ServingChoice(64, ar_step_ms=14.0, tree_step_ms=(30.0, 40.0, None), tree_tok_per_s=(3500.0, 3000.0, None)),
), trees=SCHEDULE_TREES, source="banks/tiny")
# a zero between speculating batch sizes, and a smallest batch size above 1
GAPPY = ServingSchedule(choices=(ServingChoice(2, tree=SIX_NODE_TREE, chain_len=3), ServingChoice(8, chain_len=0),
                                 ServingChoice(32, tree=Tree.chain(2), chain_len=2)))


def test_schedule_rule_and_choices() -> None:
    assert SCHEDULE.batch_sizes == (1, 4, 16, 64) and SCHEDULE.max_chain_len == 4
    assert [SCHEDULE.chain_len_for(b) for b in (1, 2, 4, 5, 16, 17, 64, 65, 1000)] == [4, 2, 2, 1, 1, 0, 0, 0, 0]
    assert SCHEDULE.choice_for(3).batch_size == 4 and SCHEDULE.choice_for(65) is None
    c = SCHEDULE.choice(4)
    assert (c.nodes, c.depth, c.topk) == (6, 2, 2) and c.speculates
    assert (SCHEDULE.choice(16).nodes, SCHEDULE.choice(16).speculates) == (1, True)
    assert not SCHEDULE.choice(64).speculates and SCHEDULE.choice(64).tree is None
    assert SCHEDULE.restrict(16).choices == (SCHEDULE.choice(16),)
    assert [GAPPY.chain_len_for(b) for b in (1, 2, 3, 8, 9, 32, 33)] == [3, 3, 0, 0, 2, 2, 0]
    table = SCHEDULE.cost_table()
    assert table["batch_sizes"] == [1, 4, 16, 64] and table["ar_step_ms"] == [5.0, 6.0, 8.0, 14.0]
    assert table["tree_step_ms"][2] == [12.0, 16.0, None]
    assert table["chain"][0] == {"depth": 4, "step_ms": 6.1, "tok_per_s": 360.5} and table["chain"][3] is None
    with pytest.raises(ScheduleError, match=r"not measured; this schedule has \[1, 4, 16, 64\]"):
        SCHEDULE.choice(8)
    # a root-only tree is plain AR: stored as no tree
    assert ServingChoice(1, tree=Tree([])).tree is None


def test_schedule_types_reject_bad_values() -> None:
    bad = [
        (lambda: ServingChoice(0), "int >= 1"),
        (lambda: ServingChoice(1, chain_len=-1), "chain_len"),
        (lambda: ServingChoice(1, tree=SIX_NODE_TREE, nodes=5), "does not match its tree"),
        (lambda: ServingChoice(1, nodes=9, depth=1, topk=2), "no tree shape"),
        (lambda: ServingChoice(1, step_ms=0.0), "step_ms=0.0 must be > 0"),
        (lambda: ServingChoice(1, tokens_per_step=0.5), ">= 1"),
        (lambda: ServingChoice(1, ar_step_ms=float("nan")), "finite"),
        (lambda: ServingChoice(1, tree_step_ms=(1.0,), tree_tok_per_s=()), "one entry per bank tree"),
        (lambda: ServingSchedule(choices=()), "at least one"),
        (lambda: ServingSchedule(choices=(ServingChoice(4), ServingChoice(2))), "distinct and ascending"),
        (lambda: ServingSchedule(choices=(ServingChoice(1, tree=MC, tree_index=0),), trees=SCHEDULE_TREES),
         "tree_index 0 is not its tree"),
        (lambda: ServingSchedule(choices=(ServingChoice(1, tree_step_ms=(1.0,), tree_tok_per_s=(2.0,)),),
                                 trees=SCHEDULE_TREES), "1 entries for 3 trees"),
    ]
    for make, message in bad:
        with pytest.raises(ScheduleError, match=message):
            make()


def test_tree_shape_helpers() -> None:
    assert (tree_topk(Tree([])), tree_topk(Tree.chain(3)), tree_topk(SIX_NODE_TREE), tree_topk(MC)) == (0, 1, 2, 10)
    # four nodes with children at depth 1, each with one child: EAGLE needs 4 beams
    assert tree_topk(Tree([(0,), (1,), (2,), (3,), (0, 0), (1, 0), (2, 0), (3, 0)])) == 4
    assert (chain_in_tree(None), chain_in_tree(SIX_NODE_TREE), chain_in_tree(MC), chain_in_tree(Tree.chain(5))) == (0, 2, 4, 5)
    assert eagle_pool(3, 2) == 2 + 2 * 4 and eagle_pool(0, 2) == 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(max_depth=5, max_children=4))
def test_tree_topk_is_the_smallest_eagle_width_that_holds_the_tree(tree: Tree) -> None:
    def fits(k: int) -> bool:
        children: dict[tuple, int] = {}
        for p in tree.paths:
            children[p[:-1]] = children.get(p[:-1], 0) + 1
        per_depth: dict[int, int] = {}
        for parent in children:
            per_depth[len(parent)] = per_depth.get(len(parent), 0) + 1
        return all(n <= k for n in children.values()) and all(n <= k for n in per_depth.values())

    k = tree_topk(tree)
    assert fits(k) and (k == 0 or not fits(k - 1))
    assert len(tree) <= eagle_pool(tree.depth, k)


def test_vllm_schedule_export() -> None:
    out = export_schedule(SCHEDULE, "vllm")
    assert out == {"num_speculative_tokens": 4,
                   "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 4, 2], [5, 16, 1], [17, 64, 0]]}
    gappy = export_schedule(GAPPY, "vllm")
    # the largest batch size still speculates: a closing zero range, which vLLM carries to max_num_seqs
    assert gappy["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 8, 0], [9, 32, 2], [33, 33, 0]]
    for schedule, cfg in ((SCHEDULE, out), (GAPPY, gappy)):
        for load in range(1, 200):
            assert vllm_k(cfg, load) == schedule.chain_len_for(load), load
    # one batch size only: its choice for every load up to it
    assert export_schedule(SCHEDULE, "vllm", batch_size=4)["num_speculative_tokens_per_batch_size"] == [[1, 4, 2], [5, 5, 0]]


def test_trtllm_schedule_export() -> None:
    out = export_schedule(SCHEDULE, "trtllm")
    # keyed by the measured batch sizes; it ends before the batch size that does not speculate
    assert out == {"max_draft_len": 4, "draft_len_schedule": {1: 4, 4: 2, 16: 1}}
    gappy = export_schedule(GAPPY, "trtllm")
    assert gappy == {"max_draft_len": 3, "draft_len_schedule": {2: 3, 8: 0, 32: 2}}  # the zero in between is written
    for schedule, cfg in ((SCHEDULE, out), (GAPPY, gappy)):
        for load in range(1, 200):
            assert trtllm_len(normalized(cfg), load) == schedule.chain_len_for(load), load


def test_sglang_schedule_export() -> None:
    text = export_schedule(SCHEDULE, "sglang")
    lines = text.splitlines()
    assert "--speculative-num-steps 4 --speculative-eagle-topk 10 --speculative-num-draft-tokens 64  # batch_size=1" in lines
    assert "--speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 6  # batch_size=4" in lines
    assert "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2  # batch_size=16" in lines
    assert any(ln.startswith("# batch_size=64: no speculation") for ln in lines)
    assert ("--speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5 --speculative-adaptive "
            "--speculative-adaptive-config adaptive.json") in lines
    assert json.loads(lines[-1]) == sglang_adaptive_config(SCHEDULE) == {
        "1": {"candidate_steps": [4]}, "2": {"candidate_steps": [2]}, "5": {"candidate_steps": [1]},
        "17": {"candidate_steps": [0]}}
    gappy = export_schedule(GAPPY, "sglang")
    for schedule, out in ((SCHEDULE, text), (GAPPY, gappy)):
        for load in range(1, 200):
            assert sglang_steps(out, load) == schedule.chain_len_for(load), load
            # CUDA-graph padding keeps the routing when the measured batch sizes are graph sizes
            assert sglang_steps(out, load, [*schedule.batch_sizes, 256]) == schedule.chain_len_for(load), load
    nothing = ServingSchedule(choices=(ServingChoice(1), ServingChoice(8)))
    out = export_schedule(nothing, "sglang")
    assert "no --speculative-adaptive setup" in out and "{" not in out
    assert all(not c.speculates for c in parse_schedule(out, "sglang").choices)


def test_json_schedule_export() -> None:
    doc = export_schedule(SCHEDULE, "json")
    assert doc["format"] == "entmtp-serving-schedule" and doc["version"] == 1 and doc["source"] == "banks/tiny"
    assert doc["trees"] == [[list(p) for p in t.paths] for t in SCHEDULE_TREES]
    assert doc["cost_table"] == SCHEDULE.cost_table()
    assert [c["batch_size"] for c in doc["choices"]] == [1, 4, 16, 64]
    assert doc["choices"][1]["tree"] == [list(p) for p in SIX_NODE_TREE.paths] and doc["choices"][3]["tree"] is None
    assert parse_schedule(doc, "json") == SCHEDULE
    assert parse_schedule(json.dumps(doc), "json") == SCHEDULE


@pytest.mark.parametrize("fmt", SCHEDULE_FORMATS)
def test_every_schedule_format_round_trips(fmt: str) -> None:
    for schedule in (SCHEDULE, GAPPY):
        out = normalized(export_schedule(schedule, fmt))
        parsed = parse_schedule(out, fmt)
        assert normalized(export_schedule(parsed, fmt)) == out
        if fmt in TREE_FORMATS:  # the tree chosen at the smallest batch size that has one
            assert parsed.choices[0].tree == next(c.tree for c in schedule.choices if c.tree is not None)
        elif fmt == "json":
            assert parsed == schedule
        else:  # the draft length at every load survives
            assert all(parsed.chain_len_for(b) == schedule.chain_len_for(b) for b in range(1, 200))
        if fmt == "sglang":  # and the static flags of every batch size
            for c in schedule.choices:
                p = parsed.choice(c.batch_size)
                want = ((c.nodes, c.depth, c.topk) if c.nodes > 1 else
                        (c.chain_len + 1, c.chain_len, 1) if c.chain_len else (1, 0, 0))
                assert (p.nodes, p.depth, p.topk) == want
    for b in SCHEDULE.batch_sizes:
        if fmt in TREE_FORMATS:
            tree = SCHEDULE.choice(b).tree
            if tree is None:
                with pytest.raises(ScheduleError, match=f"no tree at batch size {b}"):
                    export_schedule(SCHEDULE, fmt, batch_size=b)
            else:
                assert parse_schedule(export_schedule(SCHEDULE, fmt, batch_size=b), fmt, batch_size=b).choice(b).tree == tree
        elif fmt == "json":
            assert parse_schedule(export_schedule(SCHEDULE, fmt, batch_size=b), fmt) == SCHEDULE.restrict(b)


@st.composite
def schedules(draw: st.DrawFn) -> ServingSchedule:
    sizes = sorted(draw(st.sets(st.integers(1, 300), min_size=1, max_size=6)))
    figure = st.none() | st.floats(0.01, 1e5)
    choices = [ServingChoice(b, tree=draw(st.none() | trees(max_depth=4, max_children=3, max_nodes=20)),
                             chain_len=draw(st.integers(0, 6)), step_ms=draw(figure), ar_step_ms=draw(figure),
                             tokens_per_step=draw(st.none() | st.floats(1.0, 8.0)))
               for b in sizes]
    return ServingSchedule(choices=tuple(choices), source=draw(st.none() | st.text("abc/_-", max_size=12)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(), st.sampled_from(["vllm", "trtllm", "sglang", "json"]))
def test_random_schedules_round_trip_under_the_engine_rules(schedule: ServingSchedule, fmt: str) -> None:
    lens = [c.chain_len for c in schedule.choices]
    try:
        out = normalized(export_schedule(schedule, fmt))
    except ScheduleError:
        # only the documented refusals: nothing to speculate (vLLM, TensorRT-LLM), or TensorRT-LLM's
        # rule that the smallest batch size drafts the most
        assert fmt in ("vllm", "trtllm") and (max(lens) == 0 or (fmt == "trtllm" and lens[0] != max(lens)))
        return
    parsed = parse_schedule(out, fmt)
    assert normalized(export_schedule(parsed, fmt)) == out
    if fmt == "json":
        assert parsed == schedule
        return
    engine = {"vllm": vllm_k, "trtllm": trtllm_len, "sglang": sglang_steps}[fmt]
    for load in range(1, schedule.batch_sizes[-1] + 3):
        assert engine(out, load) == schedule.chain_len_for(load) == parsed.chain_len_for(load), load


def test_schedule_exports_refuse_what_engines_cannot_take() -> None:
    nothing = ServingSchedule(choices=(ServingChoice(1, tree=SIX_NODE_TREE), ServingChoice(4)))
    with pytest.raises(ScheduleError, match="vLLM needs num_speculative_tokens > 0"):
        export_schedule(nothing, "vllm")
    with pytest.raises(ScheduleError, match="serve TensorRT-LLM without speculative decoding"):
        export_schedule(nothing, "trtllm")
    growing = ServingSchedule(choices=(ServingChoice(1, chain_len=1), ServingChoice(8, chain_len=3)))
    with pytest.raises(ScheduleError, match=r"smallest batch size's draft length to be the largest"):
        export_schedule(growing, "trtllm")
    assert export_schedule(growing, "vllm")["num_speculative_tokens"] == 3  # vLLM's max, clamping nothing
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export_schedule(SCHEDULE, "onnx")
    with pytest.raises(ValueError, match="unknown schedule format 'onnx'"):
        parse_schedule({}, "onnx")
    with pytest.raises(ValueError, match="needs a ServingSchedule"):
        export_schedule(SIX_NODE_TREE, "vllm")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="was not measured"):
        export_schedule(SCHEDULE, "vllm", batch_size=3)
    with pytest.raises(ScheduleError, match="no batch size has a tree"):
        export_schedule(ServingSchedule(choices=(ServingChoice(1, chain_len=2),)), "tree-json")


def test_schedule_parsers_reject_bad_input() -> None:
    ok_vllm = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 2]]}
    bad = {
        "vllm": [
            ("[", "not JSON"), ([1], "JSON object"),
            ({"num_speculative_tokens": 0, "num_speculative_tokens_per_batch_size": [[1, 1, 1]]}, "int >= 1"),
            ({"num_speculative_tokens": 2}, "is missing"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": []}, "non-empty list"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[1, 4, 1, 8192, 2]]}, "context-length"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[1, 4]]}, r"\[start, end, k\]"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[2, 4, 2]]}, "must start at 1"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[1, 4, 2], [3, 8, 1]]}, "overlap"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "k must be an int >= 0"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[4, 1, 2]]}, "end must be an int >= 4"),
            ({**ok_vllm, "num_speculative_tokens_per_batch_size": [[1, 4, True]]}, "k must be an int"),
        ],
        "trtllm": [
            ("{", "not JSON"), ({}, "empty"), ({"draft_len_schedule": [1, 2]}, "must be a mapping"),
            ({"0": 2}, "key '0'"), ({"1": -1}, ">= 0"), ({"x": 1}, "key 'x'"),
            ({"max_draft_len": 3, "draft_len_schedule": {"1": 2}}, "must equal max_draft_len=3"),
            ({"1": 1, "4": 2}, "<= the smallest key's"),
        ],
        "sglang": [
            (7, "is text"), ("--speculative-num-steps 2", "without '# batch_size=B'"),
            ("--speculative-num-steps 2 --speculative-eagle-topk 1  # batch_size=1", "expected"),
            ("--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5  # batch_size=1",
             r"num_steps \+ 1 = 3"),
            ("--speculative-num-steps 1 --speculative-eagle-topk 2 --speculative-num-draft-tokens 9  # batch_size=1",
             "no tree shape"),
            ("# nothing here", "not an EntMTP SGLang export"),
            ({"strategy": "ema"}, "no batch-size key"), ({"1": {"candidate_steps": []}}, "candidate_steps"),
            ({"1": {"candidate_steps": [-1]}}, "candidate_steps"), ('{"0": {"candidate_steps": [1]}}', "key '0'"),
        ],
        "json": [
            ("[]", "not an EntMTP serving schedule"), ({"format": "entmtp-serving-schedule", "version": 9}, "version 9"),
        ],
    }
    for fmt, cases in bad.items():
        for obj, message in cases:
            with pytest.raises(ScheduleError, match=message):
                parse_schedule(obj, fmt)
    doc = export_schedule(SCHEDULE, "json")
    edited = json.loads(json.dumps(doc))
    edited["cost_table"]["ar_step_ms"][0] = 1.0
    with pytest.raises(ScheduleError, match="cost_table does not match"):
        parse_schedule(edited, "json")
    edited = json.loads(json.dumps(doc))
    edited["choices"][0]["tree"] = [[0], [2]]
    with pytest.raises(ScheduleError, match="serving schedule JSON"):
        parse_schedule(edited, "json")
    edited = json.loads(json.dumps(doc))
    edited["choices"][1]["nodes"] = 7
    with pytest.raises(ScheduleError, match="does not match its tree"):
        parse_schedule(edited, "json")


def test_engine_configs_written_by_hand_parse_with_the_engine_rules() -> None:
    # vLLM: a gap keeps the previous k; k above num_speculative_tokens is clamped
    s = parse_schedule({"method": "eagle", "num_speculative_tokens": 3,
                        "num_speculative_tokens_per_batch_size": [[1, 16, 5], [64, 128, 2], [256, 4096, 0]]}, "vllm")
    assert [s.chain_len_for(b) for b in (1, 16, 17, 63, 64, 128, 129, 256, 4096)] == [3, 3, 3, 3, 2, 2, 2, 0, 0]
    # TensorRT-LLM's own example: {4: 4, 8: 2, 32: 1}, nothing above 32
    s = parse_schedule({"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 2, 32: 1}}, "trtllm")
    assert [s.chain_len_for(b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    # SGLang's default adaptive config (a slot with several candidates reads as its deepest)
    s = parse_schedule({"1": {"candidate_steps": [1, 3, 5, 7]}, "8": {"candidate_steps": [0, 1, 3]},
                        "32": {"candidate_steps": [0, 1]}, "64": {"candidate_steps": [0]}}, "sglang")
    assert [s.chain_len_for(b) for b in (1, 7, 8, 31, 32, 63, 64)] == [7, 7, 3, 3, 1, 1, 0]


# ------------------------------------------------------------------------------- from a bank


def _batch_axis(bank: TopologyBank) -> dict:
    """A "batch_sizes" record as the bank stage writes it (the contract in runtime/export/schedule.py)."""
    n = len(bank.trees)
    return {
        "1": {"best_static": bank.best_static, "best_chain": {"depth": 2, "tokens_per_step": 1.7, "step_ms": 5.5,
                                                              "tok_per_s": 309.0},
              "ar_step_ms": 5.0, "step_ms": [5.4 + k for k in range(n)], "tok_per_s": [300.0 + k for k in range(n)]},
        "8": {"best_static": 0, "best_chain": {"depth": 1, "tokens_per_step": 1.4, "step_ms": 7.0, "tok_per_s": 1600.0},
              "ar_step_ms": 6.0, "step_ms": [7.5] + [None] * (n - 1), "tok_per_s": [1500.0] + [None] * (n - 1)},
        "32": {"best_static": None, "best_chain": None, "ar_step_ms": 9.0, "step_ms": [None] * n, "tok_per_s": [None] * n},
    }


def _with_batch_axis(bundle: TinyBundle, folder: Path) -> Path:
    shutil.copytree(bundle.bank_dir, folder)
    doc = json.loads((folder / "bank.json").read_text())
    bank = TopologyBank.load(bundle.bank_dir)
    doc["batch_sizes"] = _batch_axis(bank)
    (folder / "bank.json").write_text(json.dumps(doc))
    reseal(folder)
    return folder


def test_schedule_from_a_bank_timed_at_batch_size_1(bundle: TinyBundle) -> None:
    bank = TopologyBank.load(bundle.bank_dir)  # its record: batch size 1 only (tests.helpers.banks.batch_one_record)
    s = bank.serving_schedule()
    assert s.batch_sizes == (1,) and s.trees == tuple(bank.trees) and s.source == str(bundle.bank_dir)
    c, best = s.choice(1), bank.best_static
    assert c.tree == bank.trees[best] == SIX_NODE_TREE and c.tree_index == best
    assert c.chain_len == 2  # (0,), (0, 0) inside the six-node tree
    fig, chain_fig = bank.figures[best], bank.figures[bank.trees.index(Tree.chain(2))]
    assert (c.tokens_per_step, c.step_ms, c.tok_per_s) == (fig["tokens_per_step"], fig["step_ms"], fig["tok_per_s"])
    assert (c.chain_tokens_per_step, c.chain_step_ms, c.chain_tok_per_s) == (
        chain_fig["tokens_per_step"], chain_fig["step_ms"], chain_fig["tok_per_s"])
    assert c.tree_step_ms == tuple(f["step_ms"] for f in bank.figures)
    assert c.ar_step_ms is None  # this bank records no AR speed
    assert export_schedule(s, "vllm") == {"num_speculative_tokens": 2,
                                          "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 2, 0]]}
    assert export_schedule(s, "trtllm") == {"max_draft_len": 2, "draft_len_schedule": {1: 2}}
    assert export_schedule(s, "legacy-vllm-tree") == to_vllm(bank.trees[best])


def test_schedule_from_an_in_memory_bank() -> None:
    bank = make_bank()
    s = bank.serving_schedule()
    c = s.choice(1)
    assert s.source is None and c.tree == Tree.named("mc_sim_7b_63") and c.chain_len == 4
    assert c.chain_step_ms == bank.figures[bank.trees.index(Tree.chain(4))]["step_ms"]
    # the loader's attribute, int keys allowed in memory
    record = _batch_axis(bank)
    bank.batch_schedule = {int(k): v for k, v in record.items()}
    s = bank.serving_schedule()
    assert s.batch_sizes == (1, 8, 32)
    assert s.choice(8).tree == bank.trees[0] and s.choice(8).chain_len == 1 and not s.choice(32).speculates


def test_schedule_from_a_bank_with_batch_axis(bundle: TinyBundle, tmp_path: Path) -> None:
    bank = TopologyBank.load(_with_batch_axis(bundle, tmp_path / "bank"))
    s = bank.serving_schedule()
    assert s.batch_sizes == (1, 8, 32)
    one, eight, many = s.choices
    assert one.tree == bank.trees[bank.best_static] and one.chain_len == 2 and one.step_ms == 5.4 + bank.best_static
    assert one.tokens_per_step == bank.figures[bank.best_static]["tokens_per_step"]
    assert (one.chain_tokens_per_step, one.chain_step_ms, one.chain_tok_per_s) == (1.7, 5.5, 309.0)
    assert eight.tree == bank.trees[0] and (eight.step_ms, eight.tok_per_s, eight.ar_step_ms) == (7.5, 1500.0, 6.0)
    assert many.tree is None and many.chain_len == 0 and many.ar_step_ms == 9.0
    assert s.cost_table()["tree_step_ms"][1] == [7.5, None, None]
    assert export_schedule(s, "vllm")["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 8, 1], [9, 32, 0]]
    assert export_schedule(s, "trtllm")["draft_len_schedule"] == {1: 2, 8: 1}
    assert parse_schedule(normalized(export_schedule(s, "json")), "json") == s


def test_batch_axis_contract_errors() -> None:
    bank = make_bank()
    n = len(bank.trees)
    good = _batch_axis(bank)["1"]
    for missing in (None, {}):  # a bank without a batch axis has no serving schedule: rebuild it
        bank.batch_schedule = missing
        with pytest.raises(BankError, match="has no 'batch_sizes' record.*make bank TASK=<task>"):
            bank.serving_schedule()
    cases = [
        ([], "non-empty object"),
        ({"0": good}, "batch size must be an int >= 1"),
        ({"x": good}, "batch size must be an int >= 1"),
        ({"1": good, 1: good}, "listed twice"),
        ({"1": 7}, "must be an object"),
        ({"1": {k: v for k, v in good.items() if k != "ar_step_ms"}}, r"lacks \['ar_step_ms'\]"),
        ({"1": {**good, "best_static": n}}, f"not a tree index in 0..{n - 1}"),
        ({"1": {**good, "step_ms": [1.0]}}, f"one entry per bank tree \\({n}\\)"),
        ({"1": {**good, "tok_per_s": [-1.0] * n}}, "must be > 0"),
        ({"1": {**good, "best_chain": {"depth": 0}}}, "int depth >= 1"),
        ({"1": {**good, "best_chain": {"depth": 2, "step_ms": 1.0, "tok_per_s": 2.0}}}, "lacks tokens_per_step"),
        ({"1": {**good, "best_chain": {**good["best_chain"], "tokens_per_step": 0.5}}}, ">= 1"),
        ({"1": {**good, "best_static": 0, "step_ms": [None] * n}}, "no measured step_ms"),
        ({"1": {**good, "ar_step_ms": "fast"}}, "ar_step_ms must be a finite number"),
    ]
    for record, message in cases:
        bank.batch_schedule = record
        with pytest.raises(ScheduleError, match=message):
            bank.serving_schedule()


def test_a_bank_without_a_batch_axis_is_refused_with_a_rebuild_message(bundle: TinyBundle, tmp_path: Path) -> None:
    """Banks built before the batch axis have no "batch_sizes": the loader refuses them (and `save`
    never writes one) rather than guessing a schedule."""
    folder = shutil.copytree(bundle.bank_dir, tmp_path / "old")
    doc = json.loads((folder / "bank.json").read_text())
    del doc["batch_sizes"]
    (folder / "bank.json").write_text(json.dumps(doc))
    reseal(folder)
    with pytest.raises(BankError, match="has no 'batch_sizes' record.*rebuild it with `make bank TASK=<task>`"):
        TopologyBank.load(folder)
    bank = make_bank()
    bank.batch_schedule = None
    with pytest.raises(BankError, match="has no 'batch_sizes' record"):
        bank.save(tmp_path / "new")


# ------------------------------------------------------------------------------------ the CLI


def _read_cli(out: str, fmt: str) -> object:
    """The printed export as the object `export_schedule` returns (after a JSON round trip)."""
    if fmt in ("sglang", "legacy-vllm-tree", "tree-json"):
        return out
    return json.loads(out)


@pytest.mark.parametrize("fmt", SCHEDULE_FORMATS)
def test_cli_export_every_format(bundle: TinyBundle, tmp_path: Path, fmt: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    for folder in (bundle.bank_dir, _with_batch_axis(bundle, tmp_path / "bank")):
        schedule = TopologyBank.load(folder).serving_schedule()
        assert main(["export", str(folder), "--format", fmt]) == 0
        out, err = capsys.readouterr()
        assert err.startswith("[entmtp] EntMTP export for ") and "drafter hydra" in err  # the record, on stderr
        want = normalized(export_schedule(schedule, fmt))
        printed = _read_cli(out if fmt == "sglang" else out.rstrip("\n"), fmt)
        assert strip_record(printed, fmt) == want  # the record is inside only where the engine ignores it
        assert (printed != want) == (fmt in ("sglang", "json"))
        parsed = parse_schedule(printed, fmt)
        assert normalized(export_schedule(parsed, fmt)) == want
        if fmt == "json":
            assert parsed == schedule
        for b in schedule.batch_sizes:
            if fmt in TREE_FORMATS and schedule.choice(b).tree is None:
                assert main(["export", str(folder), "--format", fmt, "--batch-size", str(b)]) == 2
                assert "no tree at batch size" in capsys.readouterr().err
                continue
            if fmt in ("vllm", "trtllm") and schedule.choice(b).chain_len == 0:
                assert main(["export", str(folder), "--format", fmt, "--batch-size", str(b)]) == 2
                assert capsys.readouterr().err.startswith("entmtp: error: no batch size speculates")
                continue
            assert main(["export", str(folder), "--format", fmt, "--batch-size", str(b)]) == 0
            out = capsys.readouterr().out
            assert strip_record(_read_cli(out if fmt == "sglang" else out.rstrip("\n"), fmt), fmt) == normalized(
                export_schedule(schedule, fmt, batch_size=b))


def test_cli_export_option_errors(bundle: TinyBundle, capsys: pytest.CaptureFixture[str]) -> None:
    bank = str(bundle.bank_dir)
    assert main(["export", bank, "--format", "vllm", "--tree", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entmtp: error: --tree picks one tree") and err.count("\n") == 1
    assert "--format legacy-vllm-tree --tree 1" in err  # names the fix
    assert main(["export", bank, "--format", "trtllm", "--tree", "best"]) == 2
    assert "--format legacy-trtllm-medusa --tree best" in capsys.readouterr().err
    assert main(["export", bank, "--format", "tree-json", "--tree", "1", "--batch-size", "1"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(["export", bank, "--format", "sglang", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "batch size 8 was not measured; this schedule has [1]" in err and err.count("\n") == 1
    # the default is the tree the bank picked: the legacy formats without --tree print the best static tree
    assert main(["export", bank, "--format", "legacy-trtllm-medusa"]) == 0
    assert parse_tree(json.loads(capsys.readouterr().out), "legacy-trtllm-medusa") == SIX_NODE_TREE
