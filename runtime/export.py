"""Export a tree to the formats other serving stacks read, and parse those formats back.

* vLLM: ``speculative_config={"speculative_token_tree": "[(0,), (1,), (0, 0)]", "num_speculative_tokens": 3}``
  -- a *string* holding a Python list of rank tuples; vLLM expects num_speculative_tokens == number of paths.
* TensorRT-LLM: ``medusa_choices`` -- a list of lists of ranks, e.g. ``[[0], [0, 0], [1]]``
  (its command-line tools take the same thing as a string).
* JSON: a list of lists of ranks (the Medusa/Hydra "choices" files, and what `Tree.parse` reads).

Every export lists the paths in canonical node order (by depth, then lexicographic), which is also the
order vLLM lays tree nodes out in. Every parser raises `TreeError` (a ValueError) on bad input.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from runtime.tree import Tree, TreeError, TreeTypeError


def to_vllm(tree: Tree) -> str:
    """vLLM's ``speculative_token_tree`` string, e.g. ``"[(0,), (1,), (0, 0)]"``."""
    return "[" + ", ".join(str(tuple(p)) for p in tree.paths) + "]"


def from_vllm(text: str | list | tuple, max_depth: int | None = None) -> Tree:
    """Parse a ``speculative_token_tree`` value (the string, or the list of tuples it denotes)."""
    if isinstance(text, str):
        try:
            # literal_eval only builds literals, never runs code.
            obj = ast.literal_eval(text.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
            raise TreeError(
                f"speculative_token_tree {text[:200]!r} is not a Python literal ({type(e).__name__}); "
                "expected something like '[(0,), (1,), (0, 0)]'"
            ) from None
    else:
        obj = text
    if not isinstance(obj, (list, tuple)):
        raise TreeTypeError(f"speculative_token_tree must be a list of tuples of ranks, got {type(obj).__name__}")
    return Tree(obj, max_depth)


def to_trtllm(tree: Tree) -> list[list[int]]:
    """TensorRT-LLM's ``medusa_choices``, e.g. ``[[0], [0, 0], [1]]`` (pass ``str()`` of it on a command line)."""
    return [list(p) for p in tree.paths]


def from_trtllm(choices: str | list | tuple, max_depth: int | None = None) -> Tree:
    """Parse ``medusa_choices``, given as the list of lists or as its string form."""
    if isinstance(choices, str):
        return from_vllm(choices, max_depth)  # same Python-literal syntax, lists instead of tuples
    if not isinstance(choices, (list, tuple)):
        raise TreeTypeError(f"medusa_choices must be a list of lists of ranks, got {type(choices).__name__}")
    return Tree(choices, max_depth)


def to_json(tree: Tree) -> str:
    """A JSON list of lists of ranks."""
    return tree.to_json()


def from_json(text: str, max_depth: int | None = None) -> Tree:
    return Tree.from_json(text, max_depth)


EXPORTERS: dict[str, Callable[[Tree], object]] = {"vllm": to_vllm, "trtllm": to_trtllm, "json": to_json}
PARSERS: dict[str, Callable[..., Tree]] = {"vllm": from_vllm, "trtllm": from_trtllm, "json": from_json}


def export_tree(tree: Tree, fmt: str) -> object:
    """Export `tree` in one of the formats of `EXPORTERS` ("vllm", "trtllm", "json")."""
    if fmt not in EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {sorted(EXPORTERS)}")
    return EXPORTERS[fmt](tree)


def parse_tree(obj: object, fmt: str, max_depth: int | None = None) -> Tree:
    """Inverse of `export_tree`: ``parse_tree(export_tree(t, fmt), fmt) == t``."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown tree format {fmt!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[fmt](obj, max_depth)
