"""Draft trees and the tensors they compile to.

A tree is a set of *paths*; a path is a tuple of ranks ``(c1, ..., cd)``: take the c1-th most likely
token of head 1, then the c2-th of head 2 given that token, and so on. The root (the base model's
own next token) is implicit. Invariants (checked by `Tree`):

* every path is a non-empty tuple of non-negative ints, listed once;
* every prefix of a path is in the tree (prefix-closed);
* the children of a node have ranks 0..n-1 with no gap (so a head proposes its top-n);
* depth <= max_depth when one is given (the number of draft heads).

Node order everywhere: index 0 is the root, then the paths sorted by (depth, lexicographic), so
nodes are grouped by depth, shallow first, and a parent always comes before its children.
`TreeBuffers` holds what the decoder and the heads need at each step, computed once per tree.
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

Path_ = tuple[int, ...]  # one tree path (not a filesystem path)

TREES_DIR = Path(__file__).resolve().parent / "trees"
_CHAIN_NAME = re.compile(r"chain(\d+)")


class TreeError(ValueError):
    """An invalid tree, tree file or tree buffers. The message names what is wrong and how to fix it."""


class TreeTypeError(TreeError, TypeError):
    """A tree given as the wrong kind of object (catchable as TreeError, ValueError or TypeError)."""


def _fmt(path: Sequence[int]) -> str:
    return "the root" if len(path) == 0 else str(tuple(path))


def _as_path(obj: object, where: str) -> Path_:
    """Check one path given as a list/tuple of ints and return it as a tuple."""
    if not isinstance(obj, (list, tuple)):
        raise TreeTypeError(f"{where} is {obj!r} ({type(obj).__name__}): a path must be a list or tuple of ranks")
    ranks = []
    for rank in obj:
        # bool is an int subclass but True is not a rank; numpy ints are fine.
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise TreeTypeError(f"{where} {obj!r} contains {rank!r} ({type(rank).__name__}): ranks must be ints")
        ranks.append(int(rank))
    path = tuple(ranks)
    if not path:
        raise TreeError(f"{where} is empty: the root is implicit, list only non-empty paths")
    if min(path) < 0:
        raise TreeError(f"{where} {path} has a negative rank {min(path)}: ranks are 0-based (0 = top-1)")
    return path


class Tree:
    """A validated draft tree. Immutable; equal trees compare and hash equal whatever the input order."""

    __slots__ = ("paths", "_index")

    def __init__(self, paths: Iterable[Sequence[int]], max_depth: int | None = None) -> None:
        if isinstance(paths, (str, bytes, Mapping)) or not isinstance(paths, Iterable):
            raise TreeTypeError(
                f"a tree is an iterable of paths (e.g. [[0], [0, 0], [1]]), got {type(paths).__name__}; "
                "use Tree.parse for JSON text or a .json file"
            )
        if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0):
            raise TreeError(f"max_depth must be a non-negative int or None, got {max_depth!r}")
        seen: set[Path_] = set()
        for i, obj in enumerate(paths):
            path = _as_path(obj, f"path #{i}")
            if path in seen:
                raise TreeError(f"path {path} is listed twice: each path must appear once")
            if max_depth is not None and len(path) > max_depth:
                raise TreeError(
                    f"path {path} has depth {len(path)} > max_depth {max_depth}: there are only {max_depth} draft heads"
                )
            seen.add(path)
        ordered = sorted(seen, key=lambda p: (len(p), p))  # report the shallowest problem first
        for path in ordered:
            parent = path[:-1]
            if parent and parent not in seen:
                raise TreeError(f"path {path} lacks its prefix {parent}: every prefix of a path must be in the tree")
            if path[-1] > 0 and parent + (path[-1] - 1,) not in seen:
                raise TreeError(
                    f"path {path} has no sibling with rank {path[-1] - 1}: "
                    f"children of {_fmt(parent)} must have ranks 0..n-1"
                )
        self.paths: tuple[Path_, ...] = tuple(ordered)
        self._index: dict[Path_, int] = {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """The linear tree (0,), (0, 0), ...: top-1 of every head (depth 0 = root only, plain AR)."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise TreeError(f"chain depth must be a non-negative int, got {depth!r}")
        return cls((0,) * d for d in range(1, depth + 1))

    @classmethod
    def known_names(cls) -> list[str]:
        return sorted(p.stem for p in TREES_DIR.glob("*.json")) + ["chain<D>"]

    @classmethod
    def named(cls, name: str) -> Tree:
        """A shipped tree (``mc_sim_7b_63``: Medusa's and Hydra's default) or ``chainD`` (e.g. ``chain4``)."""
        if not isinstance(name, str):
            raise TreeTypeError(f"tree name must be a str, got {type(name).__name__}")
        if match := _CHAIN_NAME.fullmatch(name):
            return cls.chain(int(match.group(1)))
        if re.fullmatch(r"[A-Za-z0-9_.-]+", name) and (TREES_DIR / f"{name}.json").is_file():
            return cls.parse(TREES_DIR / f"{name}.json")
        raise TreeError(f"unknown tree name {name!r}; known names: {', '.join(cls.known_names())}")

    @classmethod
    def parse(cls, obj: object, max_depth: int | None = None) -> Tree:
        """A tree from a Tree, a list of paths, JSON text (a list of lists) or a path to a .json file."""
        if isinstance(obj, Tree):
            return cls(obj.paths, max_depth)
        if isinstance(obj, Path) or (isinstance(obj, str) and not obj.lstrip().startswith("[")):
            try:
                text = Path(obj).read_text(encoding="utf-8")
            except (OSError, ValueError) as e:  # ValueError: embedded NUL or undecodable bytes
                raise TreeError(
                    f"cannot read tree file {str(obj)[:200]!r} ({e}); pass JSON text like '[[0], [1]]', "
                    "a list of paths, or the path of an existing .json file"
                ) from None
            return cls.from_json(text, max_depth)
        if isinstance(obj, str):
            return cls.from_json(obj, max_depth)
        return cls(obj, max_depth)  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, text: str, max_depth: int | None = None) -> Tree:
        """A tree from JSON text: a list of paths, each a list of ints (the Medusa 'choices' format)."""
        if not isinstance(text, str):
            raise TreeTypeError(f"tree JSON must be a str, got {type(text).__name__}")
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; huge ints too
            raise TreeError(f"tree JSON does not parse ({str(e)[:200]}); expected a list of lists of ints") from None
        if not isinstance(obj, list):
            raise TreeTypeError(f"tree JSON must be a list of paths, got a JSON {type(obj).__name__}")
        return cls(obj, max_depth)

    def to_json(self) -> str:
        """JSON list of lists in canonical node order; `Tree.from_json` / `Tree.parse` read it back."""
        return json.dumps([list(p) for p in self.paths])

    # --- queries ------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes including the root (= tokens verified per step)."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return len(self.paths[-1]) if self.paths else 0

    @property
    def leaves(self) -> tuple[Path_, ...]:
        """Paths with no children, in node order (empty for the root-only tree)."""
        parents = {p[:-1] for p in self.paths}
        return tuple(p for p in self.paths if p not in parents)

    @property
    def rank_sums(self) -> tuple[int, ...]:
        """Sum of ranks of each path, in node order (a cheap proxy of how unlikely a path is)."""
        return tuple(sum(p) for p in self.paths)

    def depth_counts(self) -> tuple[int, ...]:
        """Number of nodes at depth 1..depth."""
        counts = [0] * self.depth
        for p in self.paths:
            counts[len(p) - 1] += 1
        return tuple(counts)

    def node_index(self, path: Sequence[int]) -> int:
        """Index of a path in node order (0 = root = the empty path)."""
        try:
            return self._index[tuple(path)]
        except (KeyError, TypeError):
            raise TreeError(f"path {path!r} is not in this tree") from None

    def accept_length(self, rank_path: Sequence[int]) -> int:
        """Length of the longest prefix of a rank path that is a node (greedy accepted draft tokens)."""
        ranks = [int(r) for r in rank_path]  # plain ints: tensor elements would hash by identity
        length = 0
        while length < len(ranks) and tuple(ranks[: length + 1]) in self._index:
            length += 1
        return length

    def expansions(self, max_depth: int | None = None) -> tuple[Path_, ...]:
        """Every path that can be added alone and keep the tree valid: for each node, its next-rank child."""
        children = {p: 0 for p in ((),) + self.paths}
        for p in self.paths:
            children[p[:-1]] += 1
        return tuple(
            p + (n,) for p, n in children.items() if max_depth is None or len(p) < max_depth
        )

    def with_paths(self, *paths: Sequence[int]) -> Tree:
        return Tree(self.paths + tuple(tuple(p) for p in paths))

    def __contains__(self, path: object) -> bool:
        try:
            return len(path) > 0 and tuple(path) in self._index  # type: ignore[arg-type]
        except TypeError:
            return False

    def __iter__(self):
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Tree({len(self.paths)} paths, depth {self.depth}, depth counts {list(self.depth_counts())})"


_BUFFER_KEYS = ("attn_mask", "depths", "parents", "ranks", "retrieve_indices", "depth_slices", "parent_slots", "topk")


@dataclass
class TreeBuffers:
    """What one tree compiles to. N = nodes incl. root, D = depth, L = leaves (1 for the root-only tree)."""

    attn_mask: torch.Tensor  # bool [N, N]: node i attends node j iff j is i or an ancestor of i
    depths: torch.Tensor  # int64 [N]: root 0; a node's RoPE position is cache_len + depth
    parents: torch.Tensor  # int64 [N]: root -1
    ranks: torch.Tensor  # int64 [N]: rank among siblings (last element of the path); root 0
    retrieve_indices: torch.Tensor  # int64 [L, D+1]: per leaf, node indices root..leaf, padded with -1
    depth_slices: list[tuple[int, int]]  # index d-1: [start, end) node range of depth d
    parent_slots: list[torch.Tensor]  # index d-1: int64 [n_d], parent's offset within depth d-1's range
    topk: list[int]  # index d-1: max rank + 1 at depth d (candidates head d must propose)
    # Derived from the fields above when the buffers are made (never stored), on their device, so
    # that a decoding step runs on precomputed indices with no per-node Python and no
    # data-dependent op:
    parent_index: torch.Tensor = field(init=False, repr=False)  # int64 [N]: parents, root -> 0
    node_paths: torch.Tensor = field(init=False, repr=False)  # int64 [N, D+1]: node i's path root..i, padded with i
    unique_parents: list[torch.Tensor] = field(init=False, repr=False)  # index d-1: distinct parent_slots
    parent_inverse: list[torch.Tensor] = field(init=False, repr=False)  # index d-1: parent_slots -> unique_parents row
    draft_heads: torch.Tensor = field(init=False, repr=False)  # int64 [N-1]: head (0-based) drafting node i+1
    ancestor_lists: list[list[int]] = field(init=False, repr=False)  # node i: its ancestors' indices, root first, i last

    def __post_init__(self) -> None:
        """Check the mask once (every node attends to itself and its ancestors only: the model's
        verify forward trusts it and never checks it again) and derive the step indices."""
        n = int(self.depths.shape[0])
        mask, parents = self.attn_mask.cpu(), self.parents.cpu()
        if mask.dtype != torch.bool or tuple(mask.shape) != (n, n):
            raise TreeError(f"tree buffers: attn_mask must be bool [{n}, {n}], got {mask.dtype} {tuple(mask.shape)}")
        if parents.shape != (n,) or n == 0 or int(parents[0]) != -1:
            raise TreeError("tree buffers: parents must be [N] with the root (-1) first")
        par = parents.tolist()
        paths: list[list[int]] = [[0]]
        for i in range(1, n):
            if not 0 <= par[i] < i:
                raise TreeError(f"tree buffers: node {i} has parent {par[i]}: parents must precede their children")
            paths.append(paths[par[i]] + [i])
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, path in enumerate(paths):
            ancestors[i, path] = True
        if not torch.equal(mask, ancestors):
            raise TreeError("tree buffers: attn_mask is inconsistent with the tree that parents describe (each node must "
                            "attend exactly to itself and its ancestors)")
        self.ancestor_lists = paths  # the mask as lists, for the row-invariant forward (no host read per step)
        width = len(self.depth_slices) + 1
        if any(len(p) > width for p in paths):
            raise TreeError(f"tree buffers: a node lies deeper than the {len(self.depth_slices)} depth slices")
        device = self.depths.device
        self.parent_index = parents.clamp(min=0).to(device)
        self.node_paths = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths], dtype=torch.long,
                                       device=device)
        uniques = [torch.unique(s.cpu(), return_inverse=True) for s in self.parent_slots]
        self.unique_parents = [u.to(device) for u, _ in uniques]
        self.parent_inverse = [inv.to(device) for _, inv in uniques]
        self.draft_heads = (self.depths.cpu()[1:] - 1).to(device)

    @classmethod
    def compile(cls, tree: Tree) -> TreeBuffers:
        nodes: list[Path_] = [(), *tree.paths]
        n, depth = len(nodes), tree.depth
        parents = [-1] + [tree.node_index(p[:-1]) for p in tree.paths]
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):  # parents precede children, so the parent's row is final already
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        depth_slices: list[tuple[int, int]] = []
        start = 1
        for count in tree.depth_counts():
            depth_slices.append((start, start + count))
            start += count
        ranges = [(0, 1)] + depth_slices
        parent_slots = [
            torch.tensor([parents[i] - ranges[d - 1][0] for i in range(*ranges[d])], dtype=torch.long)
            for d in range(1, depth + 1)
        ]
        topk = [max(nodes[i][-1] for i in range(*ranges[d])) + 1 for d in range(1, depth + 1)]
        leaves = tree.leaves or ((),)
        retrieve = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            for d in range(len(leaf) + 1):
                retrieve[row, d] = tree.node_index(leaf[:d])
        return cls(
            attn_mask=mask,
            depths=torch.tensor([len(p) for p in nodes], dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long),
            ranks=torch.tensor([p[-1] if p else 0 for p in nodes], dtype=torch.long),
            retrieve_indices=retrieve,
            depth_slices=depth_slices,
            parent_slots=parent_slots,
            topk=topk,
        )

    def subset(self, keep: torch.Tensor) -> TreeBuffers:
        """The buffers of the sub-tree made of the nodes `keep` (int64 node indices, increasing,
        root first, closed under taking a parent), on this tree's device.

        Built from this tree's own (already checked) tensors by indexing, with a full -> subset
        index map for the parents, so it skips `__post_init__`'s per-node checks; only the
        ancestor lists, which the verify forward reads on the host, come back as Python lists.
        A dynamic tree policy calls it once per distinct subset and caches the result
        (`runtime.dynamic.DynamicPolicy`). Raises TreeError when `keep` is not such a set."""
        idx = keep.to(device=self.depths.device, dtype=torch.long).flatten()
        n_full = self.num_nodes
        if idx.numel() == 0 or int(idx[0]) != 0 or bool((idx[1:] <= idx[:-1]).any()) or int(idx[-1]) >= n_full:
            raise TreeError(f"a subset of a {n_full}-node tree lists node indices increasing from the root (0), "
                            f"below {n_full}")
        n = idx.numel()
        remap = torch.full((n_full,), -1, dtype=torch.long, device=idx.device)
        remap[idx] = torch.arange(n, device=idx.device)
        parent_index = remap[self.parent_index[idx]]           # root -> remap[0] = 0
        if bool((parent_index[1:] < 0).any()):
            raise TreeError("a subset of tree nodes must hold every kept node's parent (be closed under ancestors)")
        parents = parent_index.clone()
        parents[0] = -1
        depths = self.depths[idx]
        ranks = self.ranks[idx]
        depth = int(depths.max())
        counts = torch.bincount(depths, minlength=depth + 1).tolist()
        depth_slices, start = [], 1
        for count in counts[1:]:
            depth_slices.append((start, start + count))
            start += count
        ranges = [(0, 1)] + depth_slices
        parent_slots = [parents[a:b] - ranges[d][0] for d, (a, b) in enumerate(depth_slices)]
        topk = (torch.zeros(depth + 1, dtype=torch.long, device=idx.device)
                .scatter_reduce(0, depths, ranks, "amax")[1:] + 1).tolist()
        # each node's path root..node, padded with the node itself, in subset indices
        node_paths = remap[self.node_paths[idx][:, : depth + 1]]
        has_child = torch.zeros(n, dtype=torch.bool, device=idx.device)
        has_child[parent_index[1:]] = True
        leaves = (~has_child).nonzero().flatten()
        width = torch.arange(depth + 1, device=idx.device)
        retrieve = torch.where(width[None, :] <= depths[leaves][:, None], node_paths[leaves], -1)
        out = object.__new__(TreeBuffers)
        out.attn_mask = self.attn_mask[idx][:, idx]
        out.depths, out.parents, out.ranks = depths, parents, ranks
        out.retrieve_indices = retrieve
        out.depth_slices, out.parent_slots, out.topk = depth_slices, parent_slots, topk
        out.parent_index, out.node_paths = parent_index, node_paths
        uniques = [torch.unique(s, return_inverse=True) for s in parent_slots]
        out.unique_parents = [u for u, _ in uniques]
        out.parent_inverse = [inv for _, inv in uniques]
        out.draft_heads = depths[1:] - 1
        out.ancestor_lists = [row[: d + 1] for row, d in zip(node_paths.tolist(), depths.tolist())]
        return out

    @property
    def num_nodes(self) -> int:
        return int(self.depths.shape[0])

    @property
    def depth(self) -> int:
        return len(self.depth_slices)

    def to(self, device: torch.device | str) -> TreeBuffers:
        """A copy with the tensors on `device` (the python-list fields stay as they are)."""
        return TreeBuffers(
            attn_mask=self.attn_mask.to(device),
            depths=self.depths.to(device),
            parents=self.parents.to(device),
            ranks=self.ranks.to(device),
            retrieve_indices=self.retrieve_indices.to(device),
            depth_slices=list(self.depth_slices),
            parent_slots=[s.to(device) for s in self.parent_slots],
            topk=list(self.topk),
        )

    def _node_paths(self) -> list[Path_]:
        """Each node's path, in buffer order, rebuilt from parents and ranks."""
        parents, ranks = self.parents.tolist(), self.ranks.tolist()
        if self.parents.dim() != 1 or len(parents) != len(ranks) or not parents or parents[0] != -1:
            raise TreeError("tree buffers: parents must be 1-D, as long as ranks, and start with -1 (the root)")
        paths: list[Path_] = [()]
        for i in range(1, len(parents)):
            if not 0 <= parents[i] < i:
                raise TreeError(f"tree buffers: node {i} has parent {parents[i]}: parents must precede their children")
            paths.append(paths[parents[i]] + (ranks[i],))
        return paths

    def to_tree(self) -> Tree:
        """Rebuild the tree from parents and ranks (raises TreeError if they do not form a valid tree)."""
        return Tree(self._node_paths()[1:])

    def validate(self) -> None:
        """Check that every field is exactly what compiling its own tree gives; raise TreeError if not."""
        nodes = self._node_paths()
        tree = Tree(nodes[1:])
        if tuple(nodes[1:]) != tree.paths:
            raise TreeError("tree buffers: nodes are not in canonical order (by depth, then lexicographic)")
        expected = TreeBuffers.compile(tree)
        for key in ("attn_mask", "depths", "parents", "ranks", "retrieve_indices"):
            mine, theirs = getattr(self, key), getattr(expected, key)
            if mine.dtype != theirs.dtype or mine.shape != theirs.shape or not torch.equal(mine.cpu(), theirs):
                raise TreeError(f"tree buffers: {key} is inconsistent with the tree that parents/ranks describe")
        if [tuple(s) for s in self.depth_slices] != expected.depth_slices:
            raise TreeError(f"tree buffers: depth_slices {self.depth_slices} should be {expected.depth_slices}")
        if len(self.parent_slots) != len(expected.parent_slots) or any(
            a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.cpu(), b)
            for a, b in zip(self.parent_slots, expected.parent_slots)
        ):
            raise TreeError("tree buffers: parent_slots are inconsistent with parents")
        if list(self.topk) != expected.topk:
            raise TreeError(f"tree buffers: topk {self.topk} should be {expected.topk}")

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """A flat dict of fresh CPU tensors (safetensors-ready); list fields become int64 tensors."""
        return {
            f"{prefix}attn_mask": self.attn_mask.cpu().clone(),
            f"{prefix}depths": self.depths.cpu().clone(),
            f"{prefix}parents": self.parents.cpu().clone(),
            f"{prefix}ranks": self.ranks.cpu().clone(),
            f"{prefix}retrieve_indices": self.retrieve_indices.cpu().clone(),
            f"{prefix}depth_slices": torch.tensor(self.depth_slices, dtype=torch.long).reshape(-1, 2),
            f"{prefix}parent_slots": torch.cat([torch.zeros(0, dtype=torch.long)] + [s.cpu() for s in self.parent_slots]),
            f"{prefix}topk": torch.tensor(self.topk, dtype=torch.long),
        }

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> TreeBuffers:
        """Inverse of `to_tensors`; checks keys, dtypes, shapes and consistency (raises TreeError)."""
        got: dict[str, torch.Tensor] = {}
        for key in _BUFFER_KEYS:
            t = tensors.get(prefix + key)
            if not isinstance(t, torch.Tensor):
                raise TreeError(
                    f"tree buffers: missing tensor {prefix + key!r} (prefix {prefix!r}); "
                    "were they written with TreeBuffers.to_tensors and the same prefix?"
                )
            want = torch.bool if key == "attn_mask" else torch.long
            if t.dtype != want:
                raise TreeError(f"tree buffers: {prefix + key!r} has dtype {t.dtype}, expected {want}")
            got[key] = t.cpu()
        n = got["depths"].numel()
        shapes = {
            "attn_mask": (n, n), "depths": (n,), "parents": (n,), "ranks": (n,),
            "depth_slices": (got["depth_slices"].shape[0], 2), "parent_slots": (n - 1,),
            "topk": (got["depth_slices"].shape[0],),
        }
        for key, shape in shapes.items():
            if tuple(got[key].shape) != shape:
                raise TreeError(f"tree buffers: {prefix + key!r} has shape {tuple(got[key].shape)}, expected {shape}")
        d = got["depth_slices"].shape[0]
        if got["retrieve_indices"].dim() != 2 or got["retrieve_indices"].shape[1] != d + 1:
            raise TreeError(
                f"tree buffers: {prefix}retrieve_indices has shape {tuple(got['retrieve_indices'].shape)}, "
                f"expected [leaves, {d + 1}]"
            )
        depth_slices = [(int(a), int(b)) for a, b in got["depth_slices"].tolist()]
        if n == 0 or any(not 1 <= a <= b <= n for a, b in depth_slices):
            raise TreeError(f"tree buffers: {prefix}depth_slices {depth_slices} do not fit {n} nodes")
        if sum(b - a for a, b in depth_slices) != n - 1:
            raise TreeError(f"tree buffers: {prefix}depth_slices {depth_slices} do not cover nodes 1..{n - 1}")
        parent_slots = list(torch.split(got["parent_slots"], [b - a for a, b in depth_slices]))
        buffers = cls(
            attn_mask=got["attn_mask"], depths=got["depths"], parents=got["parents"], ranks=got["ranks"],
            retrieve_indices=got["retrieve_indices"], depth_slices=depth_slices,
            parent_slots=[s.clone() for s in parent_slots], topk=[int(k) for k in got["topk"].tolist()],
        )
        buffers.validate()
        return buffers
