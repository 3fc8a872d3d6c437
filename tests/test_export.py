"""Tree exports (vLLM speculative_token_tree, TensorRT-LLM medusa_choices, JSON) and their parsers."""

from __future__ import annotations

import ast
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.export import (
    EXPORTERS,
    export_tree,
    from_json,
    from_trtllm,
    from_vllm,
    parse_tree,
    to_json,
    to_trtllm,
    to_vllm,
)
from runtime.tree import Tree, TreeError
from tests.helpers import trees

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
@given(_text, st.sampled_from(["vllm", "trtllm", "json"]))
def test_text_parsers_fuzz_raise_only_tree_errors(text: str, fmt: str) -> None:
    try:
        tree = parse_tree(text, fmt)
    except TreeError:
        return
    assert parse_tree(export_tree(tree, fmt), fmt) == tree
