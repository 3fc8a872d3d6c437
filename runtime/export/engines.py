"""Exports for serving engines: per-batch-size schedules, and single trees (legacy).

Per-batch-size formats (`export_schedule`, from a `runtime.export.schedule.ServingSchedule`).
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
  context-length range (not written; the test parser refuses it), and a proposal (PR #48944, merge status
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
  strings (pydantic's lax mode turns them back into ints; the test parser takes both).
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
  size and tree, AR and chain), from which an equal `ServingSchedule` can be read back.

Options of the engine formats (`export_schedule`):

* ``margin`` (sequences, default 0): the boundary margin (`ServingSchedule.shifted`): each measured
  batch size's choice also serves the next ``margin`` loads above it, so the requests an engine
  counts in its batch size but the bank did not time (prefills in flight, one request arriving at a
  boundary) do not flip the draft length; nothing speculates above the largest measured batch size
  + margin. The json format keeps the measured batch sizes.
* vLLM's draft length 0 (``keep_zeros=False``, the default): vLLM still runs the drafter at 0 (it
  keeps the drafter's KV cache in sync, vllm-project/vllm#49548), so a 0 there is AR *plus*
  drafting, not AR. Where the bank's cost row at a measured batch size holds a chain tree that
  measured at least AR's throughput there (its step cost already includes its drafting), that chain
  beats vLLM's 0 and is written instead (`fill_vllm_zeros`); elsewhere the 0 stays, and
  `runtime.export.notes` says what it costs. ``keep_zeros=True`` writes the bank's choices as they are.
* ``drafter`` (`EngineDrafter`, for a bank whose heads are an EAGLE-3 drafter): the engine's EAGLE-3
  settings around the lengths -- vLLM ``"method": "eagle3"`` and ``"model": <folder>``
  (vllm/config/speculative.py ``SpeculativeConfig.method``/``model``); TensorRT-LLM's one-model
  Eagle3 config ``"decoding_type": "Eagle3"``, ``"speculative_model_dir"`` (an accepted alias of
  ``speculative_model``), ``"eagle3_one_model": true`` and ``"eagle3_layers_to_capture"`` (layer
  OUTPUTS: its default {1, L//2-1, L-4} is EAGLE's inputs of 2, L//2, L-3), the fields of
  ``EagleDecodingConfig`` / ``Eagle3DecodingConfig`` in tensorrt_llm/llmapi/llm_args.py; SGLang
  ``--speculative-algorithm EAGLE3 --speculative-draft-model-path <folder>`` on every flag line
  (python/sglang/srt/server_args.py). The folder must hold the drafter in the layout that engine
  loads (`runtime.export.drafters`; ``entmtp export --drafter-out``).

vLLM's ``SpeculativeConfig`` (vllm/config/utils.py ``config``: ``extra="forbid"``) and TensorRT-LLM's
``DecodingBaseConfig`` (a ``StrictBaseModel``) refuse unknown keys, so what an export must say about
itself (`runtime.export.notes`) travels beside those two, never inside them.

Single-tree formats (`export_tree`; in `export_schedule`, the tree chosen at one batch size):

* ``legacy-vllm-tree``: vLLM's former ``speculative_config={"speculative_token_tree": "[(0,), (1,), (0, 0)]", ...}``
  -- a *string* holding a Python list of rank tuples (vLLM wanted num_speculative_tokens == number of paths).
* ``legacy-trtllm-medusa``: TensorRT-LLM's ``medusa_choices`` -- a list of lists of ranks, e.g. ``[[0], [0, 0], [1]]``
  (its command-line tools take the same thing as a string).
* ``tree-json``: a list of lists of ranks (the Medusa/Hydra "choices" files, and what `Tree.parse` reads).

Every tree export lists the paths in canonical node order (by depth, then lexicographic), which is also
the order vLLM laid tree nodes out in. The engine formats carry only part of a schedule (chain
lengths, or tree shapes). The runtime only writes them; the parsers that read each format back with
the engine's own rules (``export(parse(x)) == x`` for every export x) check these exports in the
tests (tests/helpers/engine_parsers.py), and, where an engine's package installs on a CPU, that
package's own code reads them (tests/runtime/export/: SGLang's ``ServerArgs`` and adaptive router,
speculators' ``Eagle3DraftModel``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from runtime.export.schedule import ScheduleError, ServingChoice, ServingSchedule
from runtime.tree import Tree

# ------------------------------------------------------------------------------- single trees

def to_vllm(tree: Tree) -> str:
    """vLLM's ``speculative_token_tree`` string, e.g. ``"[(0,), (1,), (0, 0)]"``."""
    return "[" + ", ".join(str(tuple(p)) for p in tree.paths) + "]"


def to_trtllm(tree: Tree) -> list[list[int]]:
    """TensorRT-LLM's ``medusa_choices``, e.g. ``[[0], [0, 0], [1]]`` (pass ``str()`` of it on a command line)."""
    return [list(p) for p in tree.paths]


def to_json(tree: Tree) -> str:
    """A JSON list of lists of ranks."""
    return tree.to_json()


TREE_FORMATS = ("legacy-vllm-tree", "legacy-trtllm-medusa", "tree-json")
EXPORTERS: dict[str, Callable[[Tree], object]] = {"legacy-vllm-tree": to_vllm, "legacy-trtllm-medusa": to_trtllm,
                                                  "tree-json": to_json}


def export_tree(tree: Tree, fmt: str) -> object:
    """Export `tree` in one of `EXPORTERS`: ``legacy-vllm-tree``, ``legacy-trtllm-medusa``, ``tree-json``."""
    if fmt not in EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {sorted(EXPORTERS)}")
    return EXPORTERS[fmt](tree)


# ---------------------------------------------------------------------------- per batch size

SCHEDULE_FORMATS = ("vllm", "trtllm", "sglang", "json") + TREE_FORMATS
ENGINE_FORMATS = ("vllm", "trtllm", "sglang")
JSON_FORMAT = "entmtp-serving-schedule"
JSON_VERSION = 1
ADAPTIVE_FILE = "adaptive.json"
# what an EAGLE-3 export names as the drafter folder when none was written or given
DRAFTER_PLACEHOLDER = "DRAFTER_DIR"


@dataclass(frozen=True)
class EngineDrafter:
    """The EAGLE-3 drafter an engine export names: `path`, the folder the engine loads (in its layout,
    `runtime.export.drafters`), and the drafter's target layers in our convention (the input of
    layer i; TensorRT-LLM's ``eagle3_layers_to_capture`` names outputs)."""

    path: str
    aux_layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ScheduleError(f"the drafter path must be a non-empty string, got {self.path!r}")
        ids = tuple(self.aux_layer_ids)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ScheduleError(f"aux_layer_ids must be non-negative ints, got {list(ids)}")
        object.__setattr__(self, "aux_layer_ids", ids)


# --- vLLM


def _measured_chains(schedule: ServingSchedule, c: ServingChoice) -> list[tuple[int, float, float]]:
    """(depth, step_ms, tok_per_s) of every chain tree of the schedule measured at c's batch size."""
    out = []
    for k, t in enumerate(schedule.trees):
        if len(t) and t == Tree.chain(t.depth) and k < len(c.tree_tok_per_s):
            tps, ms = c.tree_tok_per_s[k], c.tree_step_ms[k]
            if tps is not None and ms is not None:
                out.append((t.depth, ms, tps))
    return out


def fill_vllm_zeros(schedule: ServingSchedule) -> tuple[ServingSchedule, dict[int, tuple[int, float, float]]]:
    """The schedule vLLM should get, and what changed: at each measured batch size whose chain length
    is 0, the fastest chain tree of the bank measured there at no less than AR's throughput (batch
    size x 1000 / ``ar_step_ms``) replaces the 0, because vLLM's 0 still runs the drafter (AR plus
    drafting) while the chain's measured cost includes its drafting. Returns the new schedule and
    {batch size: (chain length, its tok/s, AR's tok/s)} for each replaced 0."""
    choices, filled = [], {}
    for c in schedule.choices:
        if c.chain_len == 0 and c.ar_step_ms:
            ar_tps = c.batch_size * 1000.0 / c.ar_step_ms
            ok = [ch for ch in _measured_chains(schedule, c) if ch[2] >= ar_tps]
            if ok:
                depth, ms, tps = max(ok, key=lambda ch: ch[2])
                filled[c.batch_size] = (depth, tps, ar_tps)
                c = replace(c, chain_len=depth, chain_step_ms=ms, chain_tok_per_s=tps, chain_tokens_per_step=None)
        choices.append(c)
    return (replace(schedule, choices=tuple(choices)) if filled else schedule), filled


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


def vllm_eagle3(cfg: dict[str, Any], drafter: EngineDrafter) -> dict[str, Any]:
    """A vLLM ``speculative_config`` that serves the lengths `cfg` with the EAGLE-3 drafter in
    `drafter.path` (a speculators folder: vLLM reads its layer ids from there)."""
    return {"method": "eagle3", "model": drafter.path, **cfg}


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


def trtllm_eagle3(cfg: dict[str, Any], drafter: EngineDrafter) -> dict[str, Any]:
    """TensorRT-LLM's one-model Eagle3 ``speculative_config`` around `cfg` (see the module docstring)."""
    if min(drafter.aux_layer_ids) < 1:
        raise ScheduleError(f"the drafter reads layer 0's input (the token embeddings; aux_layer_ids "
                            f"{list(drafter.aux_layer_ids)}), which TensorRT-LLM's eagle3_layers_to_capture cannot "
                            "name (it names layer outputs)")
    return {"decoding_type": "Eagle3", "speculative_model_dir": drafter.path, "eagle3_one_model": True, **cfg,
            "eagle3_layers_to_capture": [i - 1 for i in drafter.aux_layer_ids]}


# --- SGLang

_SGLANG_HEADER = "# SGLang speculative decoding from an EntMTP serving schedule"
_STATIC_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
_EAGLE3_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path")


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


def _sglang_prefix(drafter: EngineDrafter | None) -> str:
    if drafter is None:
        return ""
    if any(ch.isspace() for ch in drafter.path):
        raise ScheduleError(f"the drafter path {drafter.path!r} holds white space, which a flag line cannot carry: "
                            "write the drafter to a path without spaces")
    return f"{_EAGLE3_FLAGS[0]} EAGLE3 {_EAGLE3_FLAGS[1]} {drafter.path} "


def to_sglang_schedule(schedule: ServingSchedule, drafter: EngineDrafter | None = None, margin: int = 0) -> str:
    """SGLang flag lines (see the module docstring); `from_sglang_schedule` reads them back. With a
    `margin`, the batch sizes are the measured ones + margin (`ServingSchedule.shifted`)."""
    prefix = _sglang_prefix(drafter)
    shifted = schedule.shifted(margin)
    lines = [_SGLANG_HEADER + (f" ({schedule.source})" if schedule.source else ""),
             "# static: the flags for one load (SGLang grows its own EAGLE tree within these budgets)"]
    for measured, c in zip(schedule.choices, shifted.choices):
        where = f"batch_size={c.batch_size}" + (f" (measured at {measured.batch_size}, margin {margin})"
                                                if margin else "")
        flags = _static_flags(c)
        if flags is None:
            lines.append(f"# {where}: no speculation (leave out the --speculative-* flags)")
        else:
            lines.append(prefix + " ".join(f"{f} {v}" for f, v in zip(_STATIC_FLAGS, flags)) + f"  # {where}")
    top = schedule.max_chain_len
    if top == 0:
        lines.append("# adaptive: no batch size speculates with a chain, so there is no --speculative-adaptive setup")
    else:
        lines.append(f"# adaptive (EAGLE/EAGLE3, topk 1): save the JSON line below as {ADAPTIVE_FILE}, then serve with")
        lines.append(prefix + f"--speculative-num-steps {top} --speculative-eagle-topk 1 "
                     f"--speculative-num-draft-tokens {top + 1} "
                     f"--speculative-adaptive --speculative-adaptive-config {ADAPTIVE_FILE}")
        lines.append(json.dumps(sglang_adaptive_config(shifted)))
    return "\n".join(lines) + "\n"


# --- JSON

_CHOICE_FIELDS = ("nodes", "depth", "topk", "tokens_per_step", "step_ms", "tok_per_s", "chain_len",
                  "chain_tokens_per_step", "chain_step_ms", "chain_tok_per_s", "ar_step_ms")


def to_json_schedule(schedule: ServingSchedule) -> dict[str, Any]:
    """The whole schedule as a JSON object: choices, the bank's trees and the cost table."""
    return {
        "format": JSON_FORMAT, "version": JSON_VERSION, "source": schedule.source,
        "rule": "a load of b sequences uses the choice of the smallest listed batch size >= b; "
                "no speculation above the largest",
        "trees": [[list(p) for p in t.paths] for t in schedule.trees],
        "choices": [{"batch_size": c.batch_size, "tree_index": c.tree_index,
                     "tree": None if c.tree is None else [list(p) for p in c.tree.paths],
                     **{name: getattr(c, name) for name in _CHOICE_FIELDS}} for c in schedule.choices],
        "cost_table": schedule.cost_table(),
    }


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


def engine_schedule(schedule: ServingSchedule, fmt: str, *, margin: int = 0,
                    keep_zeros: bool = False) -> ServingSchedule:
    """The schedule an engine format writes: vLLM's zeros filled where the bank's data allow (unless
    `keep_zeros`), then every batch size moved up by the boundary `margin`; json and the tree formats
    write the bank's own."""
    if fmt == "vllm" and not keep_zeros:
        schedule = fill_vllm_zeros(schedule)[0]
    return schedule.shifted(margin) if fmt in ENGINE_FORMATS else schedule


def export_schedule(schedule: ServingSchedule, fmt: str, *, batch_size: int | None = None, margin: int = 0,
                    keep_zeros: bool = False, drafter: EngineDrafter | None = None) -> str | dict[str, Any]:
    """Export `schedule` in one of `SCHEDULE_FORMATS`: ``vllm``/``trtllm``/``json`` give a dict, ``sglang`` flag
    lines, the tree formats the tree chosen at `batch_size` (default: the smallest batch size with a tree).
    With `batch_size`, the per-batch-size formats export only the choice at that measured batch size
    (which then serves every load up to it). `margin`, `keep_zeros` and `drafter` (an EAGLE-3 bank's
    drafter folder: the engine's EAGLE-3 settings) are described in the module docstring."""
    if not isinstance(schedule, ServingSchedule):
        raise ValueError(f"export_schedule needs a ServingSchedule, got {type(schedule).__name__}")
    if drafter is not None and not isinstance(drafter, EngineDrafter):
        raise ValueError(f"drafter must be an EngineDrafter or None, got {type(drafter).__name__}")
    if fmt in TREE_FORMATS:
        return export_tree(_tree_at(schedule, batch_size), fmt)
    if fmt not in SCHEDULE_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {list(SCHEDULE_FORMATS)}")
    if batch_size is not None:
        schedule = schedule.restrict(batch_size)
    if fmt == "json":
        return to_json_schedule(schedule)
    if fmt == "sglang":
        return to_sglang_schedule(schedule, drafter, margin)
    served = engine_schedule(schedule, fmt, margin=margin, keep_zeros=keep_zeros)
    if fmt == "vllm":
        cfg = to_vllm_schedule(served)
        return cfg if drafter is None else vllm_eagle3(cfg, drafter)
    cfg = to_trtllm_schedule(served)
    return cfg if drafter is None else trtllm_eagle3(cfg, drafter)
