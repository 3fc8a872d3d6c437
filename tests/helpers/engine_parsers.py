"""Parsers back from the engine formats `runtime.export.engines` writes, for the tests only.

The runtime writes serving schedules and trees for vLLM, TensorRT-LLM, SGLang and JSON and never
reads them back; the tests read every export back with each engine's own rules (see the formats in
`runtime.export.engines`' docstring) to check that ``export(parse(x)) == x``:

* `parse_tree` (`from_vllm`, `from_trtllm`, `from_json`): the single-tree formats, `TreeError` on bad input;
* `parse_schedule` (`from_vllm_schedule`, `from_trtllm_schedule`, `from_sglang_schedule`,
  `from_json_schedule`): the per-batch-size formats, `ScheduleError` on bad input. The engine formats
  carry only part of a schedule (chain lengths, or tree shapes): their parsers fill what the format
  holds. A tree format gives a one-choice schedule with that tree (its chain: `chain_in_tree`);
* `strip_record` takes out the record `runtime.export.notes.embed_record` puts in an export (SGLang
  comment lines and adaptive-config key, json notes), `sglang_drafter` reads the EAGLE-3 drafter an
  SGLang export names.

These are our readings of each engine's rule, a secondary check: where the engine's package
installs, its own code reads the exports too (tests/runtime/export/test_engines_sglang.py,
test_drafters_speculators.py).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from runtime.export.engines import (
    _CHOICE_FIELDS,
    _EAGLE3_FLAGS,
    _SGLANG_HEADER,
    _STATIC_FLAGS,
    JSON_FORMAT,
    JSON_VERSION,
    SCHEDULE_FORMATS,
    TREE_FORMATS,
)
from runtime.export.notes import COMMENT
from runtime.export.schedule import ScheduleError, ServingChoice, ServingSchedule
from runtime.tree import Tree, TreeError, TreeTypeError


def strip_record(out: Any, fmt: str) -> Any:
    """An export without the record `runtime.export.notes.embed_record` put in it: SGLang's
    ``# [entmtp]`` lines and its adaptive config's ``"_entmtp"`` key, json's ``"notes"``."""
    if fmt == "json":
        doc = _load(out, "serving schedule JSON")
        return {k: v for k, v in doc.items() if k != "notes"} if isinstance(doc, Mapping) else doc
    if fmt != "sglang" or not isinstance(out, str):
        return out
    lines = []
    for line in out.splitlines():
        if line.startswith(COMMENT):
            continue
        if line.startswith("{"):
            line = json.dumps({k: v for k, v in json.loads(line).items() if k != "_entmtp"})
        lines.append(line)
    return "\n".join(lines) + "\n"


def sglang_drafter(text: str) -> tuple[str, str] | None:
    """(algorithm, draft model path) named on an SGLang export's flag lines (all of them name the same),
    or None where no line names one."""
    found = set()
    for line in text.splitlines():
        tokens = line.partition("#")[0].split()
        if tokens[:1] == [_EAGLE3_FLAGS[0]]:
            if len(tokens) < 4 or tokens[2] != _EAGLE3_FLAGS[1]:
                raise ScheduleError(f"expected '{_EAGLE3_FLAGS[0]} A {_EAGLE3_FLAGS[1]} PATH' first, got {line[:120]!r}")
            found.add((tokens[1], tokens[3]))
    if len(found) > 1:
        raise ScheduleError(f"the flag lines name different drafters: {sorted(found)}")
    return next(iter(found), None)


def chain_in_tree(tree: Tree | None) -> int:
    """Depth of the longest all-top-1 path (0,), (0, 0), ... contained in `tree` (0 for None)."""
    if tree is None:
        return 0
    d = 0
    while (0,) * (d + 1) in tree:
        d += 1
    return d


# ------------------------------------------------------------------------------- single trees


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


def from_trtllm(choices: str | list | tuple, max_depth: int | None = None) -> Tree:
    """Parse ``medusa_choices``, given as the list of lists or as its string form."""
    if isinstance(choices, str):
        return from_vllm(choices, max_depth)  # same Python-literal syntax, lists instead of tuples
    if not isinstance(choices, (list, tuple)):
        raise TreeTypeError(f"medusa_choices must be a list of lists of ranks, got {type(choices).__name__}")
    return Tree(choices, max_depth)


def from_json(text: str, max_depth: int | None = None) -> Tree:
    return Tree.from_json(text, max_depth)


PARSERS: dict[str, Callable[..., Tree]] = {"legacy-vllm-tree": from_vllm, "legacy-trtllm-medusa": from_trtllm,
                                           "tree-json": from_json}


def parse_tree(obj: object, fmt: str, max_depth: int | None = None) -> Tree:
    """Inverse of `export_tree`: ``parse_tree(export_tree(t, fmt), fmt) == t``."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown tree format {fmt!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[fmt](obj, max_depth)


# ---------------------------------------------------------------------------- per batch size


def _int(x: Any, what: str, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ScheduleError(f"{what} must be an int >= {minimum}, got {x!r}")
    return x


def _load(obj: Any, what: str) -> Any:
    """JSON text to an object (what the CLI prints); other objects pass through."""
    if isinstance(obj, (str, bytes)):
        try:
            return json.loads(obj)
        except (ValueError, RecursionError) as e:
            raise ScheduleError(f"{what} is not JSON ({str(e)[:120]})") from None
    return obj


def _chain_schedule(points: list[tuple[int, int]], source: str | None = None) -> ServingSchedule:
    if not points:
        raise ScheduleError("the schedule lists no batch size")
    return ServingSchedule(choices=tuple(ServingChoice(batch_size=b, chain_len=k) for b, k in points), source=source)


# --- vLLM


def from_vllm_schedule(obj: Any) -> ServingSchedule:
    """Chain lengths per batch size from a vLLM ``speculative_config`` (dict or JSON text; other keys ignored).

    Read with vLLM's rules: a gap between ranges keeps the previous k, every k is clamped to
    ``num_speculative_tokens``. Each range end becomes a measured batch size. A last range that still
    speculates (vLLM keeps it up to ``max_num_seqs``) is read as ending at its end.
    """
    cfg = _load(obj, "vLLM speculative_config")
    if not isinstance(cfg, Mapping):
        raise ScheduleError(f"a vLLM speculative_config is a JSON object, got {type(cfg).__name__}")
    top = _int(cfg.get("num_speculative_tokens"), "num_speculative_tokens", 1)
    table = cfg.get("num_speculative_tokens_per_batch_size")
    if table is None:
        raise ScheduleError("num_speculative_tokens_per_batch_size is missing: a fixed num_speculative_tokens has no "
                            "per-batch-size schedule")
    if not isinstance(table, (list, tuple)) or not table:
        raise ScheduleError("num_speculative_tokens_per_batch_size must be a non-empty list of [start, end, k]")
    ranges = []
    for i, entry in enumerate(table):
        if isinstance(entry, (list, tuple)) and len(entry) == 5:
            raise ScheduleError(f"num_speculative_tokens_per_batch_size[{i}] has 5 items (a context-length range): "
                                "only [start, end, k] schedules are read")
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ScheduleError(f"num_speculative_tokens_per_batch_size[{i}] must be [start, end, k], got {entry!r}")
        lo = _int(entry[0], f"num_speculative_tokens_per_batch_size[{i}] start", 1)
        hi = _int(entry[1], f"num_speculative_tokens_per_batch_size[{i}] end", lo)
        ranges.append((lo, hi, _int(entry[2], f"num_speculative_tokens_per_batch_size[{i}] k", 0)))
    ranges.sort()
    if ranges[0][0] != 1:
        raise ScheduleError(f"the first batch-size range must start at 1 (vLLM refuses it otherwise), got {ranges[0]}")
    points: list[tuple[int, int]] = []
    prev_hi, prev_k = 0, 0
    for lo, hi, k in ranges:
        if lo <= prev_hi:
            raise ScheduleError(f"batch-size ranges overlap at {lo}")
        if lo > prev_hi + 1:
            points.append((lo - 1, prev_k))  # vLLM fills the gap with the previous k
        prev_hi, prev_k = hi, min(k, top)
        points.append((hi, prev_k))
    return _chain_schedule(points)


# --- TensorRT-LLM


def from_trtllm_schedule(obj: Any) -> ServingSchedule:
    """Chain lengths per batch size from ``{"max_draft_len": L, "draft_len_schedule": {...}}``, or from the
    bare schedule mapping; dict or JSON text, keys ints or decimal strings, checked as TensorRT-LLM does."""
    cfg = _load(obj, "TensorRT-LLM config")
    if not isinstance(cfg, Mapping):
        raise ScheduleError(f"draft_len_schedule is a mapping of batch size to draft length, got {type(cfg).__name__}")
    max_len = None
    if "draft_len_schedule" in cfg:
        if cfg.get("max_draft_len") is not None:
            max_len = _int(cfg["max_draft_len"], "max_draft_len", 1)
        cfg = cfg["draft_len_schedule"]
        if not isinstance(cfg, Mapping):
            raise ScheduleError(f"draft_len_schedule must be a mapping, got {type(cfg).__name__}")
    if not cfg:
        raise ScheduleError("draft_len_schedule is empty")
    points = {}
    for key, value in cfg.items():
        b = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        b = _int(b, f"draft_len_schedule key {key!r}", 1)
        if b in points:
            raise ScheduleError(f"draft_len_schedule lists batch size {b} twice")
        points[b] = _int(value, f"draft_len_schedule[{key!r}]", 0)
    first = points[min(points)]
    if max_len is not None and first != max_len:
        raise ScheduleError(f"draft_len_schedule[{min(points)}]={first} must equal max_draft_len={max_len} "
                            "(TensorRT-LLM's validator)")
    if max(points.values()) > first:
        raise ScheduleError(f"every draft length must be <= the smallest key's ({first}), as TensorRT-LLM requires")
    return _chain_schedule(sorted(points.items()))


# --- SGLang


def _adaptive_points(cfg: Any) -> list[tuple[int, int]]:
    """From an adaptive config to (batch size, chain length) points under the schedule rule. A slot with
    several candidates is read as its deepest one; a last slot that speculates as ending at its key."""
    if not isinstance(cfg, Mapping):
        raise ScheduleError(f"the SGLang adaptive config is a JSON object, got {type(cfg).__name__}")
    slots: dict[int, int] = {}
    for key, entry in cfg.items():
        if not (isinstance(key, str) and key.isdigit()):
            continue  # shared settings ("strategy", "ema_alpha", ...)
        steps = entry.get("candidate_steps") if isinstance(entry, Mapping) else None
        if not isinstance(steps, list) or not steps or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise ScheduleError(f"adaptive config slot {key!r}: candidate_steps must be a non-empty list of ints >= 0, "
                                f"got {steps!r}")
        slots[_int(int(key), f"adaptive config key {key!r}", 1)] = max(steps)
    if not slots:
        raise ScheduleError('the SGLang adaptive config has no batch-size key (e.g. {"1": {"candidate_steps": [3]}})')
    keys = sorted(slots)
    points = [(nxt - 1, slots[key]) for key, nxt in zip(keys, keys[1:])]
    if slots[keys[-1]] > 0:
        points.append((keys[-1], slots[keys[-1]]))
    return points


def from_sglang_schedule(obj: Any) -> ServingSchedule:
    """Read `to_sglang_schedule`'s lines back (static shapes and adaptive chain lengths per batch size), or a
    bare adaptive config (dict, or its JSON text) into chain lengths."""
    if isinstance(obj, Mapping) or (isinstance(obj, str) and obj.lstrip().startswith("{")):
        return _chain_schedule(_adaptive_points(_load(obj, "SGLang adaptive config")))
    if not isinstance(obj, str):
        raise ScheduleError(f"an SGLang export is text (flag lines), got {type(obj).__name__}")
    static: dict[int, tuple[int, int, int] | None] = {}
    adaptive, source = None, None
    for n, raw in enumerate(obj.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if n == 1 and line.startswith(_SGLANG_HEADER):
            rest = line[len(_SGLANG_HEADER):].strip()
            source = rest[1:-1] if rest.startswith("(") and rest.endswith(")") else None
            continue
        if line.startswith(COMMENT.strip()):
            continue  # the export's record (runtime.export.notes)
        if line.startswith("{"):
            if adaptive is not None:
                raise ScheduleError(f"line {n}: a second adaptive config")
            adaptive = _load(line, f"line {n}")
            continue
        flags, _, comment = line.partition("#")
        size = re.search(r"batch_size=(\d+)", comment)
        if not flags.strip():
            if size and "no speculation" in comment:
                static[_int(int(size.group(1)), f"line {n}: batch size", 1)] = None
            continue  # a comment
        tokens = flags.split()
        if tokens[:1] == [_EAGLE3_FLAGS[0]]:
            tokens = tokens[4:]  # the EAGLE-3 drafter (`sglang_drafter` reads it)
        if "--speculative-adaptive" in tokens:
            continue  # the adaptive launch line; its values follow from the config
        if not size:
            raise ScheduleError(f"line {n}: flags without '# batch_size=B': {line[:120]!r}")
        if len(tokens) != 6 or tuple(tokens[0::2]) != _STATIC_FLAGS or not all(t.isdigit() for t in tokens[1::2]):
            raise ScheduleError(f"line {n}: expected '{' N '.join(_STATIC_FLAGS)} N  # batch_size=B', "
                                f"got {line[:120]!r}")
        steps, topk, draft = (int(t) for t in tokens[1::2])
        if topk == 1 and draft != steps + 1:
            raise ScheduleError(f"line {n}: with --speculative-eagle-topk 1 SGLang drafts num_steps + 1 = {steps + 1} "
                                f"tokens, not {draft}")
        b = _int(int(size.group(1)), f"line {n}: batch size", 1)
        if b in static:
            raise ScheduleError(f"line {n}: batch size {b} is listed twice")
        static[b] = (steps, topk, draft)
    chains = _chain_schedule(_adaptive_points(adaptive)) if adaptive is not None else None
    sizes = sorted(set(static) | set(chains.batch_sizes if chains else ()))
    if not sizes:
        raise ScheduleError("no '# batch_size=B' line and no adaptive config: not an EntMTP SGLang export")
    choices = []
    for b in sizes:
        shape = static.get(b)
        chain = chains.chain_len_for(b) if chains else 0
        if shape is None:
            choices.append(ServingChoice(batch_size=b, chain_len=chain))
        else:
            choices.append(ServingChoice(batch_size=b, chain_len=chain, depth=shape[0], topk=shape[1], nodes=shape[2]))
    return ServingSchedule(choices=tuple(choices), source=source)


# --- JSON


def from_json_schedule(obj: Any) -> ServingSchedule:
    """Inverse of `to_json_schedule` (dict or JSON text)."""
    doc = _load(obj, "serving schedule JSON")
    if not isinstance(doc, Mapping) or doc.get("format") != JSON_FORMAT:
        raise ScheduleError(f"not an EntMTP serving schedule (expected an object with format {JSON_FORMAT!r})")
    if doc.get("version") != JSON_VERSION:
        raise ScheduleError(f"serving schedule version {doc.get('version')!r}; this runtime reads {JSON_VERSION}")
    try:
        trees = tuple(Tree(paths) for paths in doc.get("trees", []))
        rows, table = doc.get("choices"), doc.get("cost_table")
        if not isinstance(rows, list) or not isinstance(table, Mapping):
            raise ScheduleError("a serving schedule needs a 'choices' list and a 'cost_table' object")
        if not all(isinstance(r, Mapping) for r in rows):
            raise ScheduleError("every entry of 'choices' must be an object")
        sizes = [r.get("batch_size") for r in rows]
        if table.get("batch_sizes") != sizes:
            raise ScheduleError(f"cost_table batch_sizes {table.get('batch_sizes')!r} differ from the choices' "
                                f"{sizes!r}")
        step_rows, tps_rows = table.get("tree_step_ms"), table.get("tree_tok_per_s")
        if not (isinstance(step_rows, list) and isinstance(tps_rows, list)
                and len(step_rows) == len(tps_rows) == len(rows)):
            raise ScheduleError("cost_table needs one tree_step_ms and one tree_tok_per_s row per choice")
        choices = []
        for r, steps, tps in zip(rows, step_rows, tps_rows):
            unknown = set(r) - {"batch_size", "tree_index", "tree", *_CHOICE_FIELDS}
            if unknown:
                raise ScheduleError(f"choice {r.get('batch_size')!r}: unknown fields {sorted(unknown)}")
            choices.append(ServingChoice(
                batch_size=r.get("batch_size"), tree=None if r.get("tree") is None else Tree(r["tree"]),
                tree_index=r.get("tree_index"), tree_step_ms=tuple(steps), tree_tok_per_s=tuple(tps),
                **{name: r.get(name) for name in _CHOICE_FIELDS if name in r}))
        schedule = ServingSchedule(choices=tuple(choices), trees=trees, source=doc.get("source"))
    except (TreeError, TypeError) as e:
        raise ScheduleError(f"serving schedule JSON: {e}") from None
    if schedule.cost_table() != dict(table):
        raise ScheduleError("cost_table does not match the choices (ar_step_ms or chain differ): edited by hand?")
    return schedule


# --- dispatch


_SCHEDULE_PARSERS: dict[str, Callable[[Any], ServingSchedule]] = {
    "vllm": from_vllm_schedule, "trtllm": from_trtllm_schedule, "sglang": from_sglang_schedule,
    "json": from_json_schedule}


def parse_schedule(obj: Any, fmt: str, *, batch_size: int = 1) -> ServingSchedule:
    """Read an export back into a `ServingSchedule` holding what the format carries (chain lengths for
    vllm/trtllm, tree shapes and chain lengths for sglang, everything for json). A tree format gives a
    one-choice schedule at `batch_size` with that tree (its chain: the longest all-top-1 path in it)."""
    if fmt in TREE_FORMATS:
        tree = parse_tree(obj, fmt)
        choice = ServingChoice(batch_size=batch_size, tree=tree, chain_len=chain_in_tree(tree))
        return ServingSchedule(choices=(choice,))
    if fmt not in _SCHEDULE_PARSERS:
        raise ValueError(f"unknown schedule format {fmt!r}; choose one of {list(SCHEDULE_FORMATS)}")
    return _SCHEDULE_PARSERS[fmt](obj)
