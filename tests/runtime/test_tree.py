"""Trees: validation, the shipped default tree, compiled buffers (property tests) and the parser fuzz."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from runtime.tree import Tree, TreeBuffers, TreeError, TreeTypeError
from tests.helpers import REPO, trees

SHIPPED = REPO / "runtime" / "trees" / "mc_sim_7b_63.json"
# Medusa's default tree as its authors publish it: `mc_sim_7b_63` in medusa/model/medusa_choices.py of
# github.com/FasterDecoding/Medusa (the list Hydra reuses), in its file order, written out here so
# that the check below runs in every clone
MEDUSA_MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
    [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
    [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
    [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def node_paths(tree: Tree) -> list[tuple[int, ...]]:
    return [(), *tree.paths]


# --- the shipped default tree ------------------------------------------------------------------


def test_mc_sim_7b_63_golden_figures() -> None:
    tree = Tree.named("mc_sim_7b_63")
    assert len(tree) == 63
    assert tree.num_nodes == 64
    assert len(tree.leaves) == 42
    assert tree.depth_counts() == (10, 28, 23, 2)
    assert tree.depth == 4
    buffers = TreeBuffers.compile(tree)
    assert buffers.retrieve_indices.shape == (42, 5)
    assert buffers.topk == [10, 10, 10, 2]
    assert buffers.depth_slices == [(1, 11), (11, 39), (39, 62), (62, 64)]


def test_shipped_tree_is_the_reference_copy() -> None:
    assert json.loads(SHIPPED.read_text()) == MEDUSA_MC_SIM_7B_63  # same paths, same order
    assert Tree(MEDUSA_MC_SIM_7B_63) == Tree.parse(SHIPPED) == Tree.named("mc_sim_7b_63")


def test_named_chain_and_unknown_names() -> None:
    assert Tree.named("chain4") == Tree.chain(4) == Tree([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    assert Tree.named("chain0") == Tree([]) and Tree([]).num_nodes == 1
    with pytest.raises(TreeError, match="mc_sim_7b_63"):  # the message lists the known names
        Tree.named("mc_sim_7b_64")
    with pytest.raises(TreeError, match="unknown tree name"):
        Tree.named("../trees/mc_sim_7b_63")


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([(0,), (0, 2), (0, 0)], r"path \(0, 2\) has no sibling with rank 1: children of \(0,\)"),
        ([(1,)], r"path \(1,\) has no sibling with rank 0: children of the root"),
        ([(0,), (0, 0, 0)], r"path \(0, 0, 0\) lacks its prefix \(0, 0\)"),
        ([(0,), (0,)], r"path \(0,\) is listed twice"),
        ([(0,), (-1,)], r"negative rank -1"),
        ([()], r"empty: the root is implicit"),
    ],
)
def test_invalid_trees_name_the_path_and_rule(paths: list, message: str) -> None:
    with pytest.raises(TreeError, match=message):
        Tree(paths)


def test_max_depth_and_types() -> None:
    Tree.chain(4)  # fine without a limit
    with pytest.raises(TreeError, match=r"depth 4 > max_depth 3"):
        Tree(Tree.chain(4).paths, max_depth=3)
    for bad in ([[0.0]], [[True]], [["0"]], [0], [{"a": 1}], "[[0]]", {(0,): 1}, 7, None):
        with pytest.raises(TreeTypeError):
            Tree(bad)  # type: ignore[arg-type]
    assert issubclass(TreeTypeError, TypeError) and issubclass(TreeTypeError, ValueError)


def test_parse_accepts_lists_json_text_and_files(tmp_path: Path) -> None:
    tree = Tree([(0,), (1,), (0, 0)])
    assert Tree.parse([[0], [1], [0, 0]]) == tree
    assert Tree.parse("[[0, 0], [1], [0]]") == tree
    file = tmp_path / "t.json"
    file.write_text(tree.to_json())
    assert Tree.parse(file) == tree and Tree.parse(str(file)) == tree
    assert Tree.parse(tree) == tree
    with pytest.raises(TreeError, match="cannot read tree file"):
        Tree.parse(str(tmp_path / "missing.json"))
    with pytest.raises(TreeError, match="does not parse"):
        Tree.parse("[[0], [1]")
    with pytest.raises(TreeError, match="does not parse"):
        Tree.parse("[" * 100_000)  # nesting deep enough to overflow the JSON decoder's recursion
    with pytest.raises(TreeError, match=r"max_depth 1"):
        Tree.parse("[[0], [0, 0]]", max_depth=1)


def test_tree_queries() -> None:
    tree = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.leaves == ((0, 1), (1, 0), (0, 0, 0))
    assert tree.rank_sums == (0, 1, 0, 1, 1, 0)
    assert (0, 1) in tree and (1, 1) not in tree and () not in tree and "x" not in tree
    assert tree.node_index(()) == 0 and tree.node_index((1, 0)) == 5
    assert tree.accept_length([0, 0, 0, 3]) == 3
    assert tree.accept_length([0, 1, 0]) == 2
    assert tree.accept_length([2, 0]) == 0
    assert tree.accept_length(torch.tensor([1, 0, 5])) == 2
    assert set(tree.expansions()) == {(2,), (0, 2), (1, 1), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)}
    assert set(tree.expansions(max_depth=2)) == {(2,), (0, 2), (1, 1)}
    assert hash(tree) == hash(Tree(reversed(tree.paths))) and tree == Tree(reversed(tree.paths))


# --- properties over random trees --------------------------------------------------------------


@PROPERTY
@given(trees())
def test_buffers_are_consistent(tree: Tree) -> None:
    buffers = TreeBuffers.compile(tree)
    nodes = node_paths(tree)
    n = len(nodes)
    mask, parents = buffers.attn_mask, buffers.parents.tolist()
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    # mask: j visible from i exactly when j's path is a prefix of i's (self and root included)
    for i, pi in enumerate(nodes):
        for j, pj in enumerate(nodes):
            assert bool(mask[i, j]) == (pi[: len(pj)] == pj)
    assert bool(mask.diagonal().all()) and bool(mask[:, 0].all())
    assert parents[0] == -1 and buffers.depths[0] == 0 and buffers.ranks[0] == 0
    for i in range(1, n):
        p = parents[i]
        assert nodes[p] == nodes[i][:-1]
        assert buffers.depths[p] == buffers.depths[i] - 1 == len(nodes[i]) - 1
        assert buffers.ranks[i] == nodes[i][-1]
        assert bool((mask[i] >= mask[p]).all())  # ancestor-closed: i sees everything its parent sees
    # retrieve rows: root-to-leaf chains, one per leaf, padded with -1
    leaves = {tree.node_index(leaf) for leaf in tree.leaves} or {0}
    assert buffers.retrieve_indices.shape == (len(leaves), tree.depth + 1)
    ends = set()
    for row in buffers.retrieve_indices.tolist():
        chain = [k for k in row if k >= 0]
        assert row == chain + [-1] * (len(row) - len(chain))
        assert chain[0] == 0
        assert all(parents[b] == a for a, b in zip(chain, chain[1:]))
        ends.add(chain[-1])
    assert ends == leaves
    # per-depth ranges, parent slots and top-k
    assert len(buffers.depth_slices) == tree.depth == len(buffers.parent_slots) == len(buffers.topk)
    ranges = [(0, 1), *buffers.depth_slices]
    assert ranges[-1][1] == n
    for d in range(1, tree.depth + 1):
        start, end = ranges[d]
        assert start == ranges[d - 1][1] and start < end
        assert all(len(nodes[i]) == d for i in range(start, end))
        slots = buffers.parent_slots[d - 1].tolist()
        assert [ranges[d - 1][0] + s for s in slots] == parents[start:end]
        assert buffers.topk[d - 1] == max(nodes[i][-1] for i in range(start, end)) + 1
    buffers.validate()


@PROPERTY
@given(trees(), st.sampled_from(["", "tree3."]))
def test_tensors_round_trip(tree: Tree, prefix: str) -> None:
    buffers = TreeBuffers.compile(tree)
    tensors = buffers.to_tensors(prefix)
    assert all(k.startswith(prefix) for k in tensors)
    back = TreeBuffers.from_tensors(tensors, prefix)
    assert back.to_tree() == tree
    for key in ("attn_mask", "depths", "parents", "ranks", "retrieve_indices"):
        assert torch.equal(getattr(back, key), getattr(buffers, key))
    assert back.depth_slices == buffers.depth_slices and back.topk == buffers.topk
    assert all(torch.equal(a, b) for a, b in zip(back.parent_slots, buffers.parent_slots))


def test_tensors_survive_safetensors_with_several_trees(tmp_path: Path) -> None:
    bank = [Tree.named("mc_sim_7b_63"), Tree.chain(3), Tree([])]
    flat: dict[str, torch.Tensor] = {}
    for k, tree in enumerate(bank):
        flat.update(TreeBuffers.compile(tree).to_tensors(f"tree{k}."))
    save_file(flat, tmp_path / "bank.safetensors")
    loaded = load_file(tmp_path / "bank.safetensors")
    assert [TreeBuffers.from_tensors(loaded, f"tree{k}.").to_tree() for k in range(3)] == bank


def test_from_tensors_rejects_corruption() -> None:
    good = TreeBuffers.compile(Tree([(0,), (1,), (0, 0), (1, 0), (0, 1)])).to_tensors()

    def broken(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**good, key: value}

    cases = {
        "missing tensor 'ranks'": {k: v for k, v in good.items() if k != "ranks"},
        "dtype": broken("depths", good["depths"].int()),
        "shape": broken("attn_mask", good["attn_mask"][:, :-1]),
        "attn_mask is inconsistent": broken("attn_mask", torch.ones_like(good["attn_mask"])),
        "retrieve_indices": broken("retrieve_indices", good["retrieve_indices"].flip(0)),
        "must precede": broken("parents", torch.tensor([-1, 0, 0, 5, 2, 1])),
        "canonical order": broken("ranks", torch.tensor([0, 1, 0, 0, 1, 0])),
        "no sibling with rank": broken("ranks", torch.tensor([0, 0, 1, 0, 2, 0])),
        "topk": broken("topk", torch.tensor([2, 3])),
        "parent_slots": broken("parent_slots", torch.tensor([0, 0, 0, 0, 0])),
        "depth_slices": broken("depth_slices", torch.tensor([[1, 4], [4, 6]])),
    }
    for message, tensors in cases.items():
        with pytest.raises(TreeError, match=message):
            TreeBuffers.from_tensors(tensors)
    with pytest.raises(TreeError, match="missing tensor 'x.attn_mask'"):
        TreeBuffers.from_tensors(good, prefix="x.")


@PROPERTY
@given(trees(), st.data())
def test_invalid_mutations_are_rejected(tree: Tree, data: st.DataObject) -> None:
    paths = list(tree.paths)
    children: dict[tuple[int, ...], int] = {}
    for p in paths:
        children[p[:-1]] = children.get(p[:-1], 0) + 1
    mutations = ["rank_gap", "negative", "empty", "float"]
    if paths:
        mutations += ["duplicate", "too_deep"]
    # a path whose removal breaks the tree: it has children, or a sibling ranked after it
    removable_wrongly = [p for p in paths if p in children or children[p[:-1]] - 1 > p[-1]]
    if removable_wrongly:
        mutations.append("remove_inner")
    kind = data.draw(st.sampled_from(mutations))
    max_depth = None
    if kind == "rank_gap":
        parent = data.draw(st.sampled_from([(), *paths]))
        paths.append(parent + (children.get(parent, 0) + data.draw(st.integers(1, 3)),))
    elif kind == "negative":
        parent = data.draw(st.sampled_from([(), *paths]))
        paths.append(parent + (-data.draw(st.integers(1, 5)),))
    elif kind == "empty":
        paths.append(())
    elif kind == "float":
        paths.append((0.0,))
    elif kind == "duplicate":
        paths.append(data.draw(st.sampled_from(paths)))
    elif kind == "too_deep":
        max_depth = tree.depth - 1
    else:
        paths.remove(data.draw(st.sampled_from(removable_wrongly)))
    shuffled = data.draw(st.permutations(paths))
    with pytest.raises(TreeError):
        Tree(shuffled, max_depth=max_depth)
    # and the unmutated tree is still accepted with its own depth as the limit
    assert Tree(tree.paths, max_depth=tree.depth) == tree


@PROPERTY
@given(trees())
def test_valid_removal_of_a_last_leaf_keeps_a_valid_tree(tree: Tree) -> None:
    assume(len(tree.leaves) > 0)
    # removing the highest-ranked leaf among its siblings keeps prefix closure and ranks gap-free
    leaf = max(tree.leaves, key=lambda p: (p[:-1], p[-1]))
    siblings = [p for p in tree.paths if p[:-1] == leaf[:-1]]
    assume(leaf[-1] == max(p[-1] for p in siblings))
    smaller = Tree([p for p in tree.paths if p != leaf])
    assert len(smaller) == len(tree) - 1 and leaf in smaller.expansions()


@PROPERTY
@given(trees())
def test_expansions_keep_the_tree_valid(tree: Tree) -> None:
    for path in tree.expansions():
        bigger = tree.with_paths(path)
        assert len(bigger) == len(tree) + 1


@PROPERTY
@given(trees())
def test_json_round_trip(tree: Tree) -> None:
    assert Tree.parse(tree.to_json()) == tree
    assert Tree.from_json(tree.to_json()) == tree
    assert Tree.parse([list(p) for p in tree.paths]) == tree


# --- fuzzing the parser ------------------------------------------------------------------------

_json_scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.integers() | st.floats() | st.text(max_size=5)
_junk = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=6)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=30,
)
# mostly near-miss trees: lists of short lists of small ints
_near_trees = st.lists(st.lists(st.integers(-1, 3), max_size=4), max_size=12)


def _json_text(obj: object) -> str:
    return json.dumps(obj, default=str)


_parser_inputs = st.one_of(
    _junk,
    _near_trees,
    _near_trees.map(_json_text),
    _junk.map(_json_text),
    st.text(max_size=40).map(lambda s: "[" + s),
    st.binary(max_size=10),
)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(_parser_inputs)
def test_parser_fuzz_raises_only_tree_errors(obj: object) -> None:
    try:
        tree = Tree.parse(obj)
    except TreeError:  # includes TreeTypeError; any other exception fails the test
        return
    assert Tree.parse(tree.to_json()) == tree
    TreeBuffers.compile(tree).validate()
