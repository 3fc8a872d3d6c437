"""Exports for serving engines, and parsers back: per-batch-size schedules, and single trees (legacy).

Per-batch-size formats (`export_schedule` / `parse_schedule`, from a `runtime.export.schedule.ServingSchedule`).
In 2026 the engines no longer take a fixed draft tree; they take a draft length per batch size. Each
format below was checked against the engine's own code (file, and the PR that introduced it); every
export applies the schedule's one rule (`ServingSchedule.choice_for`): a load of b sequences uses the
choice of the smallest measured batch size >= b, and nothing speculates above the largest one. The
engines draft with their own methods (EAGLE/EAGLE3, MTP, n-gram, draft models; SGLang serves no
Medusa/Hydra heads): what transfers is the bank's measured answer to "how much to draft at this
load". The exported entries go into the engine's speculative config next to its method and model.

* ``vllm`` -- the ``speculative_config`` entries ``{"num_speculative_tokens": K,
  "num_speculative_tokens_per_batch_size": [[lo, hi, k], ...]}`` (vllm-project/vllm PR #32374,
  "Dynamic SD"). vllm/config/speculative.py types the schedule ``list[tuple[int, int, int]]``:
  inclusive batch-size ranges ``(range_start, range_end, k)``;
  vllm/v1/spec_decode/dynamic/utils.py (``build_dynamic_sd_schedule_lookup``) requires the first range to
  start at 1 and ranges not to overlap, fills a gap between ranges with the previous range's k, keeps
  the last range's k up to ``max_num_seqs``, and clamps every k to ``num_speculative_tokens``, which
  must be > 0 (it sizes the buffers). So the export writes ``num_speculative_tokens`` = the largest
  chain length (the smallest batch size's whenever drafts shrink with load, the usual case), one range
  per measured batch size (from just above the previous one up to it), and, when the largest measured
  batch size still speculates, a closing ``[B + 1, B + 1, 0]`` that vLLM carries to ``max_num_seqs``.
  The PR's description shows a mapping with "lo-hi" string keys; the merged code takes only the list
  of triples, which is what is written. A later vLLM revision also accepts 5-item entries with a
  context-length range (not written, refused by the parser), and a proposal (PR #48944, merge status
  not confirmed here) renames the key ``speculative_token_schedule``, keeping the old name as an alias.
  JSON has no tuples: the triples are lists, which vLLM accepts.
* ``trtllm`` -- ``{"max_draft_len": L, "draft_len_schedule": {batch_size: draft_len}}``, fields of TensorRT-LLM's
  ``DecodingBaseConfig`` (tensorrt_llm/llmapi/llm_args.py; PR #10860 "Dynamic draft length on spec
  decode one-model path" for one-model EAGLE3/MTP, after PR #8194 for n-gram and two-model drafters).
  ``get_draft_len_for_batch_size`` (tensorrt_llm/_torch/speculative/utils.py)
  takes the first key >= the batch size, so a key's draft length serves batch sizes from just above
  the previous key up to it, and batch sizes above the last key do not speculate. The validator wants
  keys >= 1, draft lengths >= 0, all <= ``max_draft_len``, and the smallest key's draft length equal to
  ``max_draft_len``. The export keys the schedule by the measured batch sizes and ends it after the last
  one that speculates (trailing zeros are implicit); a zero between speculating batch sizes is written
  out. A bank whose smallest batch size drafts less than a larger one cannot be written (ValueError).
  TensorRT-LLM before PR #10860 (PR #8194, stage 1) read keys as lower bounds and required key 1: it
  would misread these schedules. Keys are ints in the returned dict; printed as JSON they become
  strings (pydantic's lax mode turns them back into ints; the parser takes both).
* ``sglang`` -- flag lines (a str). One static line per measured batch size with the three flags
  ``--speculative-num-steps`` (tree depth), ``--speculative-eagle-topk`` (`runtime.export.schedule.tree_topk`: the
  smallest EAGLE beam width containing the tree) and ``--speculative-num-draft-tokens`` (nodes *including*
  the root: python/sglang/srt/server_args.py sets it to ``num_steps + 1`` for ``topk == 1``, counting the
  token the verify step produces). SGLang grows its own EAGLE tree within these budgets; the bank's
  exact tree cannot be passed. Then the ``--speculative-adaptive`` setup (sgl-project/sglang PR #21599;
  per-batch-size slots since PR #24055): ``--speculative-adaptive-config`` names a JSON file read by
  ``_load_adaptive_config`` (python/sglang/srt/speculative/adaptive_spec_params.py): an object whose
  decimal-string keys are batch-size *lower bounds*, each ``{"candidate_steps": [int >= 0, ...]}``
  (non-digit keys are shared settings such as ``"strategy"``). ``AdaptiveStepRouter``
  (adaptive_step_router.py) pads the batch size up to a CUDA-graph size, then takes the largest key
  <= it. The export gives each slot one candidate, the bank's chain length, so SGLang's EMA has
  nothing to move (a step of 0 disables drafting in the version read); keys are 1 and each measured
  batch size + 1, plus ``[0]`` above the largest speculating one. Routing matches the schedule exactly
  when the measured batch sizes are among SGLang's ``--cuda-graph-bs``. Adaptive mode supports only
  EAGLE/EAGLE3 with ``topk == 1`` (``adaptive_unsupported_reason``), hence chains.
* ``json`` -- the whole schedule: the choices, the bank's trees and the cost table (step ms by batch
  size and tree, AR and chain), ``parse_schedule`` gives back an equal `ServingSchedule`.

Single-tree formats (`export_tree` / `parse_tree`; in `export_schedule`, the tree chosen at one batch size):

* ``legacy-vllm-tree``: vLLM's former ``speculative_config={"speculative_token_tree": "[(0,), (1,), (0, 0)]", ...}``
  -- a *string* holding a Python list of rank tuples (vLLM wanted num_speculative_tokens == number of paths).
* ``legacy-trtllm-medusa``: TensorRT-LLM's ``medusa_choices`` -- a list of lists of ranks, e.g. ``[[0], [0, 0], [1]]``
  (its command-line tools take the same thing as a string).
* ``tree-json``: a list of lists of ranks (the Medusa/Hydra "choices" files, and what `Tree.parse` reads).

Every tree export lists the paths in canonical node order (by depth, then lexicographic), which is also
the order vLLM laid tree nodes out in. Tree parsers raise `TreeError`, schedule parsers `ScheduleError`
(both ValueErrors) on bad input. The engine formats carry only part of a schedule (chain lengths, or
tree shapes): their parsers fill what the format holds, and ``export(parse(x)) == x`` for every export x.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from runtime.export.schedule import ScheduleError, ServingChoice, ServingSchedule, chain_in_tree
from runtime.tree import Tree, TreeError, TreeTypeError

# ------------------------------------------------------------------------------- single trees

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


TREE_FORMATS = ("legacy-vllm-tree", "legacy-trtllm-medusa", "tree-json")
EXPORTERS: dict[str, Callable[[Tree], object]] = {"legacy-vllm-tree": to_vllm, "legacy-trtllm-medusa": to_trtllm,
                                                  "tree-json": to_json}
PARSERS: dict[str, Callable[..., Tree]] = {"legacy-vllm-tree": from_vllm, "legacy-trtllm-medusa": from_trtllm,
                                           "tree-json": from_json}
# the short names now name the per-batch-size exports
RENAMED = {"vllm": "legacy-vllm-tree", "trtllm": "legacy-trtllm-medusa", "json": "tree-json"}


def _tree_format(fmt: str, verb: str) -> str:
    if fmt in RENAMED:
        raise ValueError(f"tree format {fmt!r} is now {RENAMED[fmt]!r}: {fmt!r} names the per-batch-size export "
                         f"(export_schedule); {verb} one tree with {RENAMED[fmt]!r}")
    return fmt


def export_tree(tree: Tree, fmt: str) -> object:
    """Export `tree` in one of `EXPORTERS`: ``legacy-vllm-tree``, ``legacy-trtllm-medusa``, ``tree-json``."""
    if _tree_format(fmt, "export") not in EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {sorted(EXPORTERS)}")
    return EXPORTERS[fmt](tree)


def parse_tree(obj: object, fmt: str, max_depth: int | None = None) -> Tree:
    """Inverse of `export_tree`: ``parse_tree(export_tree(t, fmt), fmt) == t``."""
    if _tree_format(fmt, "parse") not in PARSERS:
        raise ValueError(f"unknown tree format {fmt!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[fmt](obj, max_depth)


# ---------------------------------------------------------------------------- per batch size

SCHEDULE_FORMATS = ("vllm", "trtllm", "sglang", "json") + TREE_FORMATS
JSON_FORMAT = "entmtp-serving-schedule"
JSON_VERSION = 1
ADAPTIVE_FILE = "adaptive.json"


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


def to_vllm_schedule(schedule: ServingSchedule) -> dict[str, Any]:
    """vLLM's ``num_speculative_tokens`` and ``num_speculative_tokens_per_batch_size`` (see the module docstring)."""
    top = schedule.max_chain_len
    if top == 0:
        raise ScheduleError("no batch size speculates with a chain, and vLLM needs num_speculative_tokens > 0: "
                            "serve without a speculative_config")
    ranges, lo = [], 1
    for c in schedule.choices:
        ranges.append([lo, c.batch_size, c.chain_len])
        lo = c.batch_size + 1
    if schedule.choices[-1].chain_len > 0:
        ranges.append([lo, lo, 0])  # no speculation above the largest measured batch size
    return {"num_speculative_tokens": top, "num_speculative_tokens_per_batch_size": ranges}


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


def to_trtllm_schedule(schedule: ServingSchedule) -> dict[str, Any]:
    """TensorRT-LLM's ``max_draft_len`` and ``draft_len_schedule`` (see the module docstring)."""
    lens = [c.chain_len for c in schedule.choices]
    if max(lens) == 0:
        raise ScheduleError("no batch size speculates with a chain: serve TensorRT-LLM without speculative decoding")
    if lens[0] != max(lens):
        raise ScheduleError(f"TensorRT-LLM needs the smallest batch size's draft length to be the largest "
                            f"(draft_len_schedule[min key] == max_draft_len), but the bank drafts {lens[0]} at batch "
                            f"size {schedule.batch_sizes[0]} and {max(lens)} at a larger one; "
                            "use --format vllm or json")
    last = max(i for i, k in enumerate(lens) if k > 0)  # above it, TensorRT-LLM's implicit 0 says the same
    return {"max_draft_len": lens[0],
            "draft_len_schedule": {c.batch_size: c.chain_len for c in schedule.choices[: last + 1]}}


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

_SGLANG_HEADER = "# SGLang speculative decoding from an EntMTP serving schedule"
_STATIC_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")


def sglang_adaptive_config(schedule: ServingSchedule) -> dict[str, dict[str, list[int]]]:
    """The ``--speculative-adaptive-config`` JSON object: batch-size lower bounds -> one candidate step each."""
    cfg, lo = {}, 1
    for c in schedule.choices:
        cfg[str(lo)] = {"candidate_steps": [c.chain_len]}
        lo = c.batch_size + 1
    if schedule.choices[-1].chain_len > 0:
        cfg[str(lo)] = {"candidate_steps": [0]}  # no speculation above the largest measured batch size
    return cfg


def _static_flags(c: ServingChoice) -> tuple[int, int, int] | None:
    if c.nodes > 1:
        return c.depth, c.topk, c.nodes
    if c.chain_len > 0:
        return c.chain_len, 1, c.chain_len + 1
    return None


def to_sglang_schedule(schedule: ServingSchedule) -> str:
    """SGLang flag lines (see the module docstring); `from_sglang_schedule` reads them back."""
    lines = [_SGLANG_HEADER + (f" ({schedule.source})" if schedule.source else ""),
             "# static: the flags for one load (SGLang grows its own EAGLE tree within these budgets)"]
    for c in schedule.choices:
        flags = _static_flags(c)
        if flags is None:
            lines.append(f"# batch_size={c.batch_size}: no speculation (leave out the --speculative-* flags)")
        else:
            lines.append(" ".join(f"{f} {v}" for f, v in zip(_STATIC_FLAGS, flags)) + f"  # batch_size={c.batch_size}")
    top = schedule.max_chain_len
    if top == 0:
        lines.append("# adaptive: no batch size speculates with a chain, so there is no --speculative-adaptive setup")
    else:
        lines.append(f"# adaptive (EAGLE/EAGLE3, topk 1): save the JSON line below as {ADAPTIVE_FILE}, then serve with")
        lines.append(f"--speculative-num-steps {top} --speculative-eagle-topk 1 "
                     f"--speculative-num-draft-tokens {top + 1} "
                     f"--speculative-adaptive --speculative-adaptive-config {ADAPTIVE_FILE}")
        lines.append(json.dumps(sglang_adaptive_config(schedule)))
    return "\n".join(lines) + "\n"


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

_CHOICE_FIELDS = ("nodes", "depth", "topk", "tokens_per_step", "step_ms", "tok_per_s", "chain_len",
                  "chain_tokens_per_step", "chain_step_ms", "chain_tok_per_s", "ar_step_ms")


def to_json_schedule(schedule: ServingSchedule) -> dict[str, Any]:
    """The whole schedule as a JSON object: choices, the bank's trees and the cost table."""
    return {
        "format": JSON_FORMAT, "version": JSON_VERSION, "source": schedule.source, "approximate": schedule.approximate,
        "rule": "a load of b sequences uses the choice of the smallest listed batch size >= b; "
                "no speculation above the largest",
        "trees": [[list(p) for p in t.paths] for t in schedule.trees],
        "choices": [{"batch_size": c.batch_size, "tree_index": c.tree_index,
                     "tree": None if c.tree is None else [list(p) for p in c.tree.paths],
                     **{name: getattr(c, name) for name in _CHOICE_FIELDS}} for c in schedule.choices],
        "cost_table": schedule.cost_table(),
    }


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
        schedule = ServingSchedule(choices=tuple(choices), trees=trees, source=doc.get("source"),
                                   approximate=doc.get("approximate", False))
    except (TreeError, TypeError) as e:
        raise ScheduleError(f"serving schedule JSON: {e}") from None
    if schedule.cost_table() != dict(table):
        raise ScheduleError("cost_table does not match the choices (ar_step_ms or chain differ): edited by hand?")
    return schedule


# --- dispatch


def _tree_at(schedule: ServingSchedule, batch_size: int | None) -> Tree:
    if batch_size is None:
        chosen = next((c for c in schedule.choices if c.tree is not None), None)
        if chosen is None:
            raise ScheduleError("no batch size has a tree to export; use --format vllm, trtllm, sglang or json")
        return chosen.tree
    c = schedule.choice(batch_size)
    if c.tree is None:
        raise ScheduleError(f"the bank chose no tree at batch size {batch_size} (no tree speculation there)")
    return c.tree


_SCHEDULE_EXPORTERS: dict[str, Callable[[ServingSchedule], Any]] = {
    "vllm": to_vllm_schedule, "trtllm": to_trtllm_schedule, "sglang": to_sglang_schedule, "json": to_json_schedule}
_SCHEDULE_PARSERS: dict[str, Callable[[Any], ServingSchedule]] = {
    "vllm": from_vllm_schedule, "trtllm": from_trtllm_schedule, "sglang": from_sglang_schedule,
    "json": from_json_schedule}


def export_schedule(schedule: ServingSchedule, fmt: str, *, batch_size: int | None = None) -> str | dict[str, Any]:
    """Export `schedule` in one of `SCHEDULE_FORMATS`: ``vllm``/``trtllm``/``json`` give a dict, ``sglang`` flag
    lines, the tree formats the tree chosen at `batch_size` (default: the smallest batch size with a tree).
    With `batch_size`, the per-batch-size formats export only the choice at that measured batch size
    (which then serves every load up to it)."""
    if not isinstance(schedule, ServingSchedule):
        raise ValueError(f"export_schedule needs a ServingSchedule, got {type(schedule).__name__}")
    if fmt in TREE_FORMATS:
        return export_tree(_tree_at(schedule, batch_size), fmt)
    if fmt not in _SCHEDULE_EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {list(SCHEDULE_FORMATS)}")
    if batch_size is not None:
        schedule = schedule.restrict(batch_size)
    return _SCHEDULE_EXPORTERS[fmt](schedule)


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
