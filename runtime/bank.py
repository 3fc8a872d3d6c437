"""TopologyBank: the per-(model, heads, task, machine) set of throughput-Pareto trees.

On disk (one folder; no pickle, nothing in it is ever executed):
  bank.json            schema version, trees (paths + measured figures), the index of the best
                       static tree (EntMTP*), the choices per batch size (`batch_sizes`, the
                       contract in `runtime.export.schedule`; required: a bank built before the
                       batch axis is refused with a rebuild message) with, where the bank timed
                       them, each batch size's candidates' paired ratios to batched AR
                       (`PAIRED_KEY`; optional), fitted policies,
                       EntMTP-dyn's fitted dynamic policy (`dynamic`: super-tree, step cost per
                       size, calibration, where timed its paired ratio to EntMTP*; optional),
                       oracle figures, provenance, and two seals:
                       `buffers_sha256`/`buffers_bytes` (which tensor file belongs to this JSON)
                       and `doc_sha256` (a checksum of the JSON's own content)
  buffers.safetensors  every tree's precompiled `TreeBuffers`, prefixed `tree{k}.`
  *.png                plots written by the pipeline (not needed to decode)

`TopologyBank.load` validates everything it reads and raises `BankError` with a message saying
what is wrong and what to do. It trusts neither file alone: the seals catch a file damaged in a
copy or a JSON paired with the tensors of another build, and the content checks (trees, buffers
recompiled and compared, figures, policies) catch a bank that was sealed by a buggy writer.
Banks built for other weights (fingerprint mismatch) are refused unless `force=True`, which turns
only that check into a `BankFingerprintWarning`: decoding stays lossless, the figures do not apply.

To change a bank on purpose (e.g. a threshold), load it, change the object and `save` it again:
`save` validates the bank the same way and re-seals it. Hand edits of bank.json are refused.
`save` replaces the two files one after the other; an interruption between them leaves a pair
whose seal does not match (refused on load, never silently mixed). The pipeline writes banks
through `pipeline.artifacts.run_stage`, which publishes the whole folder at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from runtime.export.schedule import ScheduleError, ServingSchedule, choices_from_batch_sizes
from runtime.io import atomic_write_bytes
from runtime.tree import Tree, TreeBuffers, TreeError

# 2: adds the seals (buffers_sha256, buffers_bytes, doc_sha256). Version 1 banks had none.
# 3: adds `dynamic` (EntMTP-dyn: super-tree, step_ms per size, calibration, replayed figures), or null.
SCHEMA_VERSION = 3
BANK_JSON = "bank.json"
BUFFERS = "buffers.safetensors"
BATCH_KEY = "batch_sizes"  # bank.json's per-batch-size record (`runtime.export.schedule`)
# each batch size's paired timing of its candidate trees against batched AR (optional, `_check_paired`):
# {"ratio": what the ratios are, "level": coverage, "new_tokens", "rounds", "candidates": [{"tree": k,
# "median", "low", "high": ratio to AR, "rounds", "model_ratio": the step-cost model's, or null}],
# optional "unconstrained": the choice before the bank kept its choices monotone in the batch size}
PAIRED_KEY = "paired"
# Far above any real bank (a 1024-node tree's buffers are ~1 MiB); refuses a runaway file before
# reading it into memory.
MAX_JSON_BYTES = 64 << 20
MAX_BUFFERS_BYTES = 1 << 30

# figure key -> smallest allowed value (exclusive when the bound is 0.0, see _check_figures).
# Other figure keys are kept as they are (free-form measurements).
_POSITIVE_FIGURES = ("step_ms", "tok_per_s")
_AT_LEAST_ONE_FIGURES = ("tokens_per_step", "real_tokens_per_step")
_FRACTION_FIGURES = ("step_agreement",)
_REBUILD = "rebuild it with `make bank TASK=<task>`"


class BankError(ValueError):
    """A bank folder that cannot be used as it is. The message names the problem and what to do."""


class BankFingerprintWarning(UserWarning):
    """A bank built for other weights, loaded anyway with force=True."""


class BankProvenanceWarning(UserWarning):
    """A bank measured on another machine, dtype, kernel or thread count than this process decodes
    with (`runtime.machine.provenance_differences`): decoding stays lossless, its figures and
    choices may not hold (`entmtp inspect BANK --check` re-times them)."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(doc: dict[str, Any]) -> bytes:
    """The bytes `doc_sha256` is computed over: key order and whitespace do not matter."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _doc_checksum(doc: dict[str, Any]) -> str:
    return _sha256(_canonical({k: v for k, v in doc.items() if k != "doc_sha256"}))


def _json_default(obj: Any) -> Any:
    # numpy scalars and 0-d tensors become numbers (str() would turn a figure into a string);
    # anything else (a Path in the provenance) is recorded as text.
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


def _short(x: Any, limit: int = 80) -> str:
    """repr for an error message, cut short: a damaged field may hold a large nested value."""
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_figures(k: int, tree: Tree, fig: dict[str, Any], where: str) -> None:
    for key in ("nodes", "depth"):
        if key in fig:
            want = tree.num_nodes if key == "nodes" else tree.depth
            if fig[key] != want or not _is_number(fig[key]):
                raise BankError(f"{where}: tree {k} records {key}={_short(fig[key])} but its paths give {want}; "
                                f"the figures belong to another tree, {_REBUILD}")
    for key in _POSITIVE_FIGURES + _AT_LEAST_ONE_FIGURES + _FRACTION_FIGURES:
        v = fig.get(key)
        if v is None:  # not measured (e.g. no recalibration): allowed, shown as nan
            continue
        ok = _is_number(v) and math.isfinite(v) and (
            v > 0 if key in _POSITIVE_FIGURES else v >= 1 if key in _AT_LEAST_ONE_FIGURES else 0 <= v <= 1)
        if not ok:
            rule = ("a finite number > 0" if key in _POSITIVE_FIGURES
                    else "a finite number >= 1" if key in _AT_LEAST_ONE_FIGURES else "a number in [0, 1]")
            raise BankError(f"{where}: tree {k} has {key}={_short(v)}, which must be {rule} or null; "
                            f"the figures are damaged, {_REBUILD}")


def _check_policies(policies: dict[str, Any], n_trees: int, where: str) -> None:
    """Every stored policy must rebuild (kind, signal, thresholds) and only pick trees of this bank."""
    from runtime.policy import Scheduler  # lazy: the policy module is only needed to check/decode

    for name, d in policies.items():
        try:
            Scheduler.from_dict(d, n_trees=n_trees)
        except Exception as e:  # noqa: BLE001 - any failure to rebuild means the stored policy is unusable
            raise BankError(f"{where}: policy {_short(name)} is not usable ({type(e).__name__}: {str(e)[:200]}); "
                            f"refit it or {_REBUILD}") from e


def _check_paired(batch: Any, trees: list[Tree], where: str) -> None:
    """Each batch size's "paired" record, where it has one (checked after `choices_from_batch_sizes`):
    candidates that are distinct trees of this bank (not the root alone), each with a positive
    median inside its positive interval, a round count and the model's ratio (or null); the batch
    size's chosen tree one of them, with an interval above 1 (a tree is chosen only where it beats
    AR with confidence)."""
    if not isinstance(batch, dict):
        return  # `choices_from_batch_sizes` reports it
    for b, entry in batch.items():
        rec = entry.get(PAIRED_KEY) if isinstance(entry, dict) else None
        if rec is None:
            continue
        w = f"{where}: {BATCH_KEY}[{b!r}].{PAIRED_KEY}"
        if not isinstance(rec, dict) or not isinstance(rec.get("candidates"), list):
            raise BankError(f"{w} must be an object with a 'candidates' list, got {_short(rec)}; {_REBUILD}")
        lows: dict[int, float] = {}
        for c in rec["candidates"]:
            k = c.get("tree") if isinstance(c, dict) else None
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(trees) or not len(trees[k]) or k in lows:
                raise BankError(f"{w}: candidate {_short(c)} does not name a distinct tree of this bank with drafts "
                                f"(0..{len(trees) - 1}); {_REBUILD}")
            nums = [c.get(key) for key in ("low", "median", "high")]
            model = c.get("model_ratio")
            if (not all(_is_number(x) and math.isfinite(x) and x > 0 for x in nums) or not nums[0] <= nums[1] <= nums[2]
                    or not _is_number(c.get("rounds")) or c["rounds"] < 1
                    or model is not None and not (_is_number(model) and math.isfinite(model) and model > 0)):
                raise BankError(f"{w}: candidate tree {k} needs 0 < low <= median <= high, rounds >= 1 and a positive "
                                f"model_ratio or null, got {_short(c)}; {_REBUILD}")
            lows[k] = nums[0]
        chosen = entry.get("best_static")  # a valid index: `choices_from_batch_sizes` checked it first
        if chosen is not None and len(trees[chosen]) and not lows.get(chosen, 0.0) > 1.0:
            raise BankError(f"{w}: the chosen tree {_short(chosen)} was not timed there, or its interval reaches 1 "
                            f"(it does not beat AR with confidence); choose a timed tree, drop the record or {_REBUILD}")


DYNAMIC_KEYS = ("super_tree", "step_ms", "calibration")


def _check_dynamic_paired(rec: Any, where: str) -> None:
    """EntMTP-dyn's "paired" record, where it has one (timed against EntMTP*, its unpriced cost per
    step added to its step costs): a positive median inside its positive interval, rounds >= 1,
    finite overheads (ms per step) and `offered` true exactly where the interval lies above 1 + its
    `min_gain` (0 where a bank predates it)."""
    if rec is None:
        return
    w = f"{where}: dynamic.{PAIRED_KEY}"
    nums = [rec.get(key) for key in ("low", "median", "high")] if isinstance(rec, dict) else []
    if (len(nums) != 3 or not all(_is_number(x) and math.isfinite(x) and x > 0 for x in nums)
            or not nums[0] <= nums[1] <= nums[2] or not _is_number(rec.get("rounds")) or rec["rounds"] < 1
            or not all(_is_number(rec.get(k, 0.0)) and math.isfinite(rec.get(k, 0.0))
                       for k in ("overhead_ms", "measured_overhead_ms", "priced_overhead_ms"))
            or not (_is_number(rec.get("min_gain", 0.0)) and 0.0 <= rec.get("min_gain", 0.0) < 1.0)
            or rec.get("offered") is not (nums[0] > 1.0 + rec.get("min_gain", 0.0))):
        raise BankError(f"{w} needs 0 < low <= median <= high, rounds >= 1, finite overheads, a min_gain in [0, 1) "
                        f"and offered = (low > 1 + min_gain), got {_short(rec, 200)}; {_REBUILD}")


def _dynamic_policy(d: dict[str, Any], where: str, max_depth: int | None = None) -> Any:
    """The `runtime.dynamic.DynamicPolicy` a bank's `dynamic` entry describes, checked: its
    super-tree (rank paths), one positive step cost per size, a monotone calibration and, where
    the entry has them, the early-stop threshold and draft cost per depth."""
    from runtime.dynamic import DynamicPolicy  # lazy, like the policies

    if not isinstance(d, dict) or any(k not in d for k in DYNAMIC_KEYS):
        raise BankError(f"{where}: 'dynamic' must be an object with {', '.join(DYNAMIC_KEYS)} (EntMTP-dyn), got "
                        f"{_short(d)}; {_REBUILD}")
    _check_dynamic_paired(d.get(PAIRED_KEY), where)
    try:
        tree = Tree(d["super_tree"])
        if max_depth is not None and tree.depth > max_depth:
            raise BankError(f"{where}: EntMTP-dyn's super-tree has depth {tree.depth} but the heads draft only "
                            f"{max_depth} tokens; use heads with at least {tree.depth} heads, or rebuild the bank for these heads")
        return DynamicPolicy(tree, d["step_ms"], d["calibration"], draft_ms=d.get("draft_ms"),
                             stop_below=d.get("stop_below") or 0.0)
    except BankError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to rebuild means the stored policy is unusable
        raise BankError(f"{where}: EntMTP-dyn's dynamic policy is not usable ({type(e).__name__}: {str(e)[:200]}); "
                        f"{_REBUILD}") from e


@dataclass
class TopologyBank:
    trees: list[Tree]                      # ordered by size (nodes), ascending
    figures: list[dict[str, Any]]          # per tree: tokens_per_step, step_ms, tok_per_s, ...
    best_static: int                       # index of EntMTP*: the fastest single tree
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> policy dict
    default_policy: str = "static"
    oracle: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    buffers: list[TreeBuffers] = field(default_factory=list)
    path: Path | None = None
    # per batch size: the best tree (or none), the best chain and every tree's step cost and batch
    # throughput, as bank.json's "batch_sizes" holds them (`runtime.export.schedule`); `save` and
    # `load` require it (None only in memory, e.g. a bank being assembled)
    batch_schedule: dict[str, Any] | None = None
    # EntMTP-dyn (`runtime.dynamic`): {"super_tree": paths, "step_ms": [ms per size 1..N],
    # "calibration": Calibration dict, optional "draft_ms" [ms per drafted depth 0..D] and
    # "stop_below" (early stop), plus its replayed figures}; None where the bank has none
    dynamic: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.buffers:
            self.buffers = [TreeBuffers.compile(t) for t in self.trees]

    @property
    def max_depth(self) -> int:
        return max(t.depth for t in self.trees)

    def dynamic_policy(self, cache_size: int = 4096) -> Any:
        """A fresh `runtime.dynamic.DynamicPolicy` (EntMTP-dyn) from the bank's `dynamic` entry, to
        pass as `choose` to `TreeDecoder.generate`; BankError where the bank has none."""
        if not self.dynamic:
            raise BankError(f"bank {self.path or ''} has no EntMTP-dyn policy (built without one, e.g. by an older "
                            f"pipeline or without head scores); {_REBUILD}")
        pol = _dynamic_policy(self.dynamic, f"bank {self.path or ''}")
        pol.cache_size = int(cache_size)
        return pol

    def serving_schedule(self) -> ServingSchedule:
        """The bank's `ServingSchedule`: its choice at each measured batch size, from its "batch_sizes"
        record (the contract in `runtime.export.schedule`); BankError where it has none, ScheduleError
        where the record breaks the contract."""
        if self.batch_schedule is None or self.batch_schedule == {}:
            raise BankError(f"bank {self.path or ''} has no '{BATCH_KEY}' record (its choices per batch size): it "
                            f"was built before the batch axis; {_REBUILD}")
        choices = choices_from_batch_sizes(self.batch_schedule, list(self.trees), list(self.figures))
        return ServingSchedule(choices=choices, trees=tuple(self.trees),
                               source=None if self.path is None else str(self.path))

    def summary(self) -> str:
        lines = [f"TopologyBank {self.path or ''}".rstrip()]
        prov = self.provenance
        machine = prov.get("machine") if isinstance(prov.get("machine"), dict) else {}
        lines.append(f"  task={prov.get('task')} model={prov.get('model_name')} heads={prov.get('heads_name')} "
                     f"dtype={prov.get('dtype')} kernel={prov.get('kernel', 'unrecorded')} machine={machine.get('cpu')}")
        nan = float("nan")
        for k, (t, f) in enumerate(zip(self.trees, self.figures)):
            star = " *" if k == self.best_static else ""
            tps, ms, tok_s = (f.get(key) for key in ("tokens_per_step", "step_ms", "tok_per_s"))
            lines.append(f"  [{k}] nodes={t.num_nodes:3d} depth={t.depth} tokens/step={nan if tps is None else tps:.3f} "
                         f"step={nan if ms is None else ms:.1f} ms tok/s={nan if tok_s is None else tok_s:.1f}{star}")
        lines.append(f"  policies: {', '.join(self.policies) or 'none'} (default {self.default_policy})")
        if self.dynamic:
            rep = self.dynamic.get("replay") or {}
            share = rep.get("share_of_oracle")
            lines.append(f"  EntMTP-dyn: super-tree {len(self.dynamic['super_tree']) + 1} nodes, "
                         f"calibration {'fitted' if self.dynamic.get('calibration') else 'identity'}, "
                         + (f"stops drafting below {self.dynamic['stop_below']:g}, " if self.dynamic.get("stop_below") else "")
                         + f"replayed tokens/step={rep.get('tokens_per_step', nan):.3f} "
                         f"tok/s={rep.get('tokens_per_second') or nan:.1f}"
                         + (f" ({100 * share:.0f}% of the oracle)" if share else "")
                         + (f"; its super-tree's hindsight ceiling {ceiling['tokens_per_second']:.1f} tok/s"
                            if isinstance(ceiling := self.dynamic.get("ceiling"), dict) else ""))
            if isinstance(p := self.dynamic.get(PAIRED_KEY), dict):
                lines.append(f"  EntMTP-dyn paired against EntMTP*: {p['median']:.2f}x [{p['low']:.2f}, {p['high']:.2f}] "
                             f"in {p['rounds']} rounds (replayed {p.get('replay_ratio', nan):.2f}x, its steps priced "
                             f"{p.get('priced_overhead_ms', 0.0):.2f} ms dearer as measured): "
                             + ("offered (beats EntMTP*)" if p["offered"] else "not offered (does not beat EntMTP* here)"))
        for b, entry in sorted((self.batch_schedule or {}).items(), key=lambda kv: int(kv[0])):
            k, chain, ar = entry.get("best_static"), entry.get("best_chain"), entry.get("ar_tok_per_s")
            tree = "no speculation (AR)" if k is None else (
                f"tree [{k}] ({self.trees[k].num_nodes} nodes) {entry['tok_per_s'][k]:.1f} tok/s"
                + (f" = {entry['tok_per_s'][k] / ar:.2f}x AR" if ar else ""))
            lines.append(f"  batch {int(b):3d}: {tree}; AR {nan if ar is None else ar:.1f} tok/s; best chain "
                         f"{'none' if chain is None else chain['depth']}{_paired_cell(entry)}")
        replays = self.oracle.get("batch") if isinstance(self.oracle, dict) else None
        if replays:
            methods = ["one tree for all", "static per batch size", "batch scheduler"]
            lines.append("  replayed batch tok/s (share of the batch oracle): batch | " + " | ".join(methods)
                         + " | batch oracle")
            for b, r in sorted(replays.items(), key=lambda kv: int(kv[0])):
                cells = [f"{r[m]:.1f} ({100 * r[m + ' share of oracle']:.0f}%)" if m in r else "-" for m in methods]
                lines.append(f"    {int(b):3d} | " + " | ".join(cells) + f" | {r.get('batch oracle', nan):.1f}")
        return "\n".join(lines)

    def paired_lines(self) -> list[str]:
        """Every timed candidate of every batch size: its paired ratio to batched AR (median,
        interval, rounds) and the step-cost model's ratio with its distance; empty where the bank
        timed none."""
        lines = []
        for b, entry in sorted((self.batch_schedule or {}).items(), key=lambda kv: int(kv[0])):
            rec = entry.get(PAIRED_KEY) if isinstance(entry, dict) else None
            if not rec:
                continue
            free = rec.get("unconstrained", entry.get("best_static"))
            lines.append(f"  paired at batch {int(b)} ({rec.get('rounds')} rounds of {rec.get('new_tokens')} tokens; "
                         f"{rec.get('ratio', 'ratio to AR')}):"
                         + ("" if free == entry.get("best_static") else
                            f" alone it chose {'AR' if free is None else f'tree [{free}]'}, kept monotone in B"))
            for c in rec["candidates"]:
                k = c["tree"]
                mark = " <- chosen" if k == entry.get("best_static") else ""
                lines.append(f"    tree [{k}] ({self.trees[k].num_nodes} nodes): {_ratio_text(c)}{mark}")
        return lines

    # ----------------------------------------------------------------------------------------
    def _document(self) -> tuple[dict[str, Any], bytes]:
        """The sealed JSON document and the safetensors bytes, validated as `load` would."""
        if len(self.buffers) != len(self.trees) or len(self.figures) != len(self.trees):
            raise BankError(f"a bank needs one buffers and one figures entry per tree: {len(self.trees)} trees, "
                            f"{len(self.buffers)} buffers, {len(self.figures)} figures")
        tensors: dict[str, torch.Tensor] = {}
        for k, b in enumerate(self.buffers):
            tensors.update({key: v.contiguous() for key, v in b.to_tensors(prefix=f"tree{k}.").items()})
        blob = save_safetensors_bytes(tensors, metadata={"schema_version": str(SCHEMA_VERSION)})
        doc = {
            "schema_version": SCHEMA_VERSION,
            "trees": [{**f, "paths": [list(p) for p in t.paths]} for t, f in zip(self.trees, self.figures)],
            "best_static": self.best_static,
            "policies": self.policies,
            "default_policy": self.default_policy,
            "oracle": self.oracle,
            "provenance": self.provenance,
            "buffers_sha256": _sha256(blob),
            "buffers_bytes": len(blob),
        }
        if self.batch_schedule is not None:
            doc[BATCH_KEY] = {str(b): v for b, v in self.batch_schedule.items()}
        doc["dynamic"] = self.dynamic
        # Round trip through JSON first, so the checksum covers exactly what a reader will parse.
        doc = json.loads(json.dumps(doc, default=_json_default))
        doc["doc_sha256"] = _doc_checksum(doc)
        # Never write a bank that load() would refuse: a writer bug surfaces here, at build time.
        _parse(doc, blob, where="bank being saved")
        return doc, blob

    def save(self, folder: str | Path) -> Path:
        """Validate, seal and write bank.json and buffers.safetensors into `folder`, each file atomically."""
        folder = Path(folder)
        doc, blob = self._document()
        folder.mkdir(parents=True, exist_ok=True)
        # Tensors first: if we are stopped between the two files, the old bank.json's seal no
        # longer matches and load refuses the pair instead of mixing two builds.
        atomic_write_bytes(folder / BUFFERS, blob)
        atomic_write_bytes(folder / BANK_JSON, (json.dumps(doc, indent=2) + "\n").encode())
        self.path = folder
        return folder

    @classmethod
    def load(
        cls,
        folder: str | Path,
        model_fingerprint: str | None = None,
        heads_fingerprint: str | None = None,
        max_depth: int | None = None,
        force: bool = False,
    ) -> TopologyBank:
        """Load and validate a bank; raise `BankError` naming the problem if it cannot be used.

        `model_fingerprint` / `heads_fingerprint`: refuse a bank built for other weights (its
        trees and thresholds were measured on them). `force=True` downgrades only that check to a
        `BankFingerprintWarning`: a bank for other weights still decodes losslessly, just not at
        its measured speed. `max_depth`: the heads' number of draft tokens; a bank holding a
        deeper tree is refused (it cannot be drafted).
        """
        if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0):
            raise ValueError(f"max_depth must be the heads' number of draft tokens (an int >= 0) or None, got {max_depth!r}")
        for name, fp in (("model_fingerprint", model_fingerprint), ("heads_fingerprint", heads_fingerprint)):
            if fp is not None and not isinstance(fp, str):
                raise ValueError(f"{name} must be a str or None, got {type(fp).__name__}")
        folder = Path(folder)
        jf, bf = folder / BANK_JSON, folder / BUFFERS
        if not folder.is_dir():
            raise BankError(f"bank folder {folder} does not exist; {_REBUILD} or check the path")
        if not jf.is_file():
            raise BankError(f"{folder} has no {BANK_JSON}: not a bank, or an incomplete copy; copy it again or {_REBUILD}")
        doc = _read_json(jf)
        where = str(jf)
        # Which weights it was built for is checked before the content, so that pointing at the
        # wrong bank says so rather than reporting a detail of a bank that is not the right one.
        _check_fingerprints(doc, folder, model_fingerprint, heads_fingerprint, force)
        if not bf.is_file():
            raise BankError(f"{folder} has no {BUFFERS}: the bank is incomplete; copy the whole folder again or {_REBUILD}")
        size = bf.stat().st_size
        if size > MAX_BUFFERS_BYTES:
            raise BankError(f"{bf} is {size} bytes, more than any bank's buffers ({MAX_BUFFERS_BYTES}); "
                            f"it is not this bank's file, {_REBUILD}")
        try:
            blob = bf.read_bytes()
        except OSError as e:
            raise BankError(f"{bf} cannot be read ({e}); check its permissions or {_REBUILD}") from e
        bank = _parse(doc, blob, where=where, max_depth=max_depth)
        bank.path = folder
        return bank


# ------------------------------------------------------------------------------------ helpers


def _ratio_text(c: dict[str, Any]) -> str:
    """One paired candidate: median [low, high] over its rounds, and the model's ratio and distance."""
    model = c.get("model_ratio")
    return (f"{c['median']:.2f}x AR [{c['low']:.2f}, {c['high']:.2f}] in {c['rounds']} rounds; model "
            + ("-" if model is None else f"{model:.2f}x ({100 * (model / c['median'] - 1):+.0f}%)"))


def _paired_cell(entry: dict[str, Any]) -> str:
    """The batch table's paired column: the choice's measured ratio (for AR, the best timed tree's)
    and the model's ratio beside it."""
    rec = entry.get(PAIRED_KEY) if isinstance(entry, dict) else None
    if not rec or not rec.get("candidates"):
        return ""
    k = entry.get("best_static")
    c = next((c for c in rec["candidates"] if c["tree"] == k), None)
    if c is None:
        c = max(rec["candidates"], key=lambda c: c["median"])
        return f"; paired: AR, its best tree [{c['tree']}] {_ratio_text(c)}"
    return f"; paired {_ratio_text(c)}"


def _read_json(jf: Path) -> dict[str, Any]:
    size = jf.stat().st_size
    if size > MAX_JSON_BYTES:
        raise BankError(f"{jf} is {size} bytes, more than any bank.json ({MAX_JSON_BYTES}); it is not a bank file, {_REBUILD}")
    try:
        text = jf.read_bytes().decode("utf-8")
        doc = json.loads(text)
    except OSError as e:
        raise BankError(f"{jf} cannot be read ({e}); check its permissions or {_REBUILD}") from e
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise BankError(f"{jf} is not valid JSON ({str(e)[:200]}); the file is damaged, copy it again or {_REBUILD}") from e
    if not isinstance(doc, dict):
        raise BankError(f"{jf} must hold a JSON object, got a JSON {type(doc).__name__}; it is not a bank file, {_REBUILD}")
    version = doc.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise BankError(f"{jf} has no valid schema_version (got {_short(version)}): not a bank file or a damaged one; {_REBUILD}")
    if version != SCHEMA_VERSION:
        hint = ("it was written by a newer EntMTP: update this runtime, or rebuild the bank with it"
                if version > SCHEMA_VERSION else "it was written by an older EntMTP: rebuild the bank with this version")
        raise BankError(f"{jf} has schema_version {version}, this runtime reads {SCHEMA_VERSION}; {hint}")
    claimed = doc.get("doc_sha256")
    if not isinstance(claimed, str) or claimed != _doc_checksum(doc):
        raise BankError(f"{jf} does not match its checksum (doc_sha256): it was damaged in a copy or edited by hand. "
                        "Copy the bank again or rebuild it; to change a bank on purpose, load it with "
                        "TopologyBank.load, change the object and save it (save validates and re-seals)")
    return doc


def _check_fingerprints(doc: dict[str, Any], folder: Path, model_fp: str | None, heads_fp: str | None, force: bool) -> None:
    prov = doc.get("provenance")
    if not isinstance(prov, dict):
        raise BankError(f"{folder / BANK_JSON}: provenance must be a JSON object, got {type(prov).__name__}; {_REBUILD}")
    for what, expected in (("model", model_fp), ("heads", heads_fp)):
        got = prov.get(f"{what}_fingerprint")
        if expected is None or got == expected:
            continue
        msg = (f"bank {folder} was built for {what} weights with fingerprint {_short(got)}, but the loaded {what} has "
               f"fingerprint {expected!r}: its trees, figures and thresholds were measured on other weights. "
               f"Rebuild the bank for these weights (`make bank TASK=<task>`), or pass force=True to decode "
               "anyway (still lossless, but slower than its figures say)")
        if not force:
            raise BankError(msg)
        warnings.warn(msg, BankFingerprintWarning, stacklevel=3)


def _parses(blob: bytes) -> bool:
    try:
        load_safetensors_bytes(blob)
    except Exception:  # noqa: BLE001 - only used to word the error message
        return False
    return True


def _parse(doc: dict[str, Any], blob: bytes, where: str, max_depth: int | None = None) -> TopologyBank:
    """Build a bank from its (sealed) JSON document and safetensors bytes, checking everything."""
    entries = doc.get("trees")
    if not isinstance(entries, list) or not entries:
        raise BankError(f"{where}: 'trees' must be a non-empty list of trees, got {type(entries).__name__}; {_REBUILD}")
    trees: list[Tree] = []
    figures: list[dict[str, Any]] = []
    for k, e in enumerate(entries):
        if not isinstance(e, dict) or "paths" not in e:
            raise BankError(f"{where}: tree {k} must be an object with 'paths' (a list of rank paths); {_REBUILD}")
        try:
            t = Tree(e["paths"])
        except (TreeError, RecursionError) as err:
            raise BankError(f"{where}: tree {k} breaks the tree rules: {err}; {_REBUILD}") from err
        if max_depth is not None and t.depth > max_depth:
            raise BankError(f"{where}: tree {k} has depth {t.depth} but the heads draft only {max_depth} tokens; "
                            f"use this bank with heads that have at least {t.depth} heads, or rebuild it for these heads")
        fig = {key: v for key, v in e.items() if key != "paths"}
        _check_figures(k, t, fig, where)
        trees.append(t)
        figures.append(fig)
    for k in range(1, len(trees)):
        if trees[k] == trees[k - 1] or trees[k].num_nodes < trees[k - 1].num_nodes:
            raise BankError(f"{where}: trees must be distinct and ordered by size (policies rely on it), but tree {k} "
                            f"has {trees[k].num_nodes} nodes after {trees[k - 1].num_nodes}; {_REBUILD}")
    if len(set(trees)) != len(trees):
        raise BankError(f"{where}: the same tree is listed twice; {_REBUILD}")
    best = doc.get("best_static")
    if isinstance(best, bool) or not isinstance(best, int) or not 0 <= best < len(trees):
        raise BankError(f"{where}: best_static={_short(best)} is not a tree index in 0..{len(trees) - 1}; {_REBUILD}")
    for key in ("policies", "oracle", "provenance"):
        if not isinstance(doc.get(key), dict):
            raise BankError(f"{where}: {key!r} must be a JSON object, got {type(doc.get(key)).__name__}; {_REBUILD}")
    policies, default = doc["policies"], doc.get("default_policy")
    if not isinstance(default, str) or (default != "static" and default not in policies):
        raise BankError(f"{where}: default_policy {_short(default)} is not among the stored policies {_short(sorted(policies))} "
                        f"(nor 'static'); {_REBUILD}")
    _check_policies(policies, len(trees), where)
    batch = doc.get(BATCH_KEY)
    if batch is None:
        raise BankError(f"{where}: has no '{BATCH_KEY}' record (the trees chosen per batch size): it was built "
                        f"before the batch axis; {_REBUILD}")
    try:
        choices_from_batch_sizes(batch, trees, figures)
    except ScheduleError as e:
        raise BankError(f"{where}: its batch_sizes record is unusable ({e}); {_REBUILD}") from e
    _check_paired(batch, trees, where)

    dynamic = doc.get("dynamic")
    if dynamic is not None:
        _dynamic_policy(dynamic, where, max_depth)

    # The tensors: sealed to this JSON, then parsed and recompiled-and-compared per tree.
    want_sha, want_bytes = doc.get("buffers_sha256"), doc.get("buffers_bytes")
    if not isinstance(want_sha, str) or not _is_number(want_bytes):
        raise BankError(f"{where}: buffers_sha256/buffers_bytes are missing; {_REBUILD}")
    if len(blob) != want_bytes or _sha256(blob) != want_sha:
        if len(blob) < want_bytes and not _parses(blob):
            raise BankError(f"{BUFFERS} of {where} is truncated ({len(blob)} of {want_bytes} bytes): an interrupted "
                            f"copy or write; copy the bank folder again or {_REBUILD}")
        raise BankError(f"{BUFFERS} does not belong to {where} ({len(blob)} bytes, sha256 {_sha256(blob)[:12]}..., "
                        f"expected {want_bytes} bytes, {want_sha[:12]}...): it is damaged or comes from another "
                        f"build; copy the whole bank folder again or {_REBUILD}")
    try:
        tensors = load_safetensors_bytes(blob)
    except Exception as e:  # noqa: BLE001 - the parser's error types vary by version; all mean "damaged"
        raise BankError(f"{BUFFERS} of {where} cannot be parsed ({type(e).__name__}: {str(e)[:200]}); {_REBUILD}") from e
    for key, t in tensors.items():
        # A bool stored as a byte other than 0/1 compares equal to True in torch, so the tree
        # checks below would accept it; kernels that read the raw bytes may not. Refuse it.
        if t.dtype == torch.bool and t.numel() and int(t.view(torch.uint8).max()) > 1:
            raise BankError(f"{BUFFERS} of {where}: bool tensor {key!r} holds bytes other than 0 and 1; "
                            f"the file is damaged, {_REBUILD}")
    expected_keys: set[str] = set()
    buffers: list[TreeBuffers] = []
    for k, t in enumerate(trees):
        prefix = f"tree{k}."
        try:
            b = TreeBuffers.from_tensors(tensors, prefix=prefix)  # checks keys, dtypes, shapes, consistency
        except (TreeError, ValueError, RuntimeError, IndexError) as e:
            raise BankError(f"{BUFFERS} of {where}: buffers of tree {k} are invalid ({e}); {_REBUILD}") from e
        if b.to_tree() != t:
            raise BankError(f"{BUFFERS} of {where}: buffers of tree {k} describe another tree than its paths in "
                            f"{BANK_JSON}; the bank was assembled from different builds, {_REBUILD}")
        expected_keys.update(b.to_tensors(prefix=prefix))
        buffers.append(b)
    extra = sorted(set(tensors) - expected_keys)
    if extra:
        raise BankError(f"{BUFFERS} of {where} holds tensors of no listed tree ({', '.join(extra[:5])}); "
                        f"the bank was assembled from different builds, {_REBUILD}")
    return TopologyBank(trees=trees, figures=figures, best_static=best, policies=policies, default_policy=default,
                        oracle=doc["oracle"], provenance=doc["provenance"], buffers=buffers, batch_schedule=batch,
                        dynamic=dynamic)
