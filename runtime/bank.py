"""TopologyBank: the per-(model, heads, task, machine) set of throughput-Pareto trees.

On disk (one folder; no pickle):
  bank.json            schema version, trees (paths + measured figures), the index of the best
                       static tree (EntMTP*), fitted policies, oracle figures, provenance
  buffers.safetensors  every tree's precompiled `TreeBuffers`, prefixed `tree{k}.`
  *.png                plots written by the pipeline (not needed to decode)

`TopologyBank.load` validates everything it reads and raises `BankError` with a message saying
what is wrong and what to do; it never trusts the JSON over the tensors or the reverse.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.tree import Tree, TreeBuffers, TreeError

SCHEMA_VERSION = 1
BANK_JSON = "bank.json"
BUFFERS = "buffers.safetensors"


class BankError(ValueError):
    """A bank folder that cannot be used as it is."""


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

    def __post_init__(self) -> None:
        if not self.buffers:
            self.buffers = [TreeBuffers.compile(t) for t in self.trees]

    @property
    def max_depth(self) -> int:
        return max(t.depth for t in self.trees)

    def summary(self) -> str:
        lines = [f"TopologyBank {self.path or ''}".rstrip()]
        prov = self.provenance
        lines.append(f"  task={prov.get('task')} model={prov.get('model_name')} heads={prov.get('heads_name')} "
                     f"dtype={prov.get('dtype')} machine={prov.get('machine', {}).get('cpu')}")
        for k, (t, f) in enumerate(zip(self.trees, self.figures)):
            star = " *" if k == self.best_static else ""
            lines.append(f"  [{k}] nodes={t.num_nodes:3d} depth={t.depth} tokens/step={f.get('tokens_per_step', float('nan')):.3f} "
                         f"step={f.get('step_ms', float('nan')):.1f} ms tok/s={f.get('tok_per_s', float('nan')):.1f}{star}")
        lines.append(f"  policies: {', '.join(self.policies) or 'none'} (default {self.default_policy})")
        return "\n".join(lines)

    # ----------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Write bank.json and buffers.safetensors into `folder`, each file atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for k, b in enumerate(self.buffers):
            tensors.update(b.to_tensors(prefix=f"tree{k}."))
        fd, tmp = tempfile.mkstemp(prefix=".buffers.", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"schema_version": str(SCHEMA_VERSION)})
            os.replace(tmp, folder / BUFFERS)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        doc = {
            "schema_version": SCHEMA_VERSION,
            "trees": [{"paths": [list(p) for p in t.paths], **f} for t, f in zip(self.trees, self.figures)],
            "best_static": self.best_static,
            "policies": self.policies,
            "default_policy": self.default_policy,
            "oracle": self.oracle,
            "provenance": self.provenance,
        }
        data = (json.dumps(doc, indent=2, default=str) + "\n").encode()
        fd, tmp = tempfile.mkstemp(prefix=".bank.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / BANK_JSON)
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
        """Load and validate a bank.

        `model_fingerprint` / `heads_fingerprint`: refuse a bank built for other weights (its
        trees and thresholds were measured on them). `force=True` downgrades only that check to a
        warning: a bank for other weights still decodes losslessly, just not at its measured speed.
        `max_depth`: the heads' number of draft tokens; deeper trees cannot be drafted.
        """
        folder = Path(folder)
        jf, bf = folder / BANK_JSON, folder / BUFFERS
        if not folder.is_dir():
            raise BankError(f"bank folder {folder} does not exist; build it with `make bank TASK=<task>`")
        if not jf.is_file():
            raise BankError(f"{folder} has no {BANK_JSON}: not a bank, or an interrupted build; rebuild it with `make bank`")
        try:
            doc = json.loads(jf.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BankError(f"{jf} is not valid JSON ({e}); the file is damaged, rebuild the bank") from e
        if not isinstance(doc, dict):
            raise BankError(f"{jf} must hold a JSON object, got {type(doc).__name__}")
        version = doc.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BankError(f"{jf} has schema_version {version!r}, this runtime reads {SCHEMA_VERSION}; "
                            "rebuild the bank with this version of EntMTP")
        prov = doc.get("provenance") or {}
        for what, expected in (("model", model_fingerprint), ("heads", heads_fingerprint)):
            got = prov.get(f"{what}_fingerprint")
            if expected is not None and got != expected:
                msg = (f"bank {folder} was built for {what} weights {got!r}, but the loaded {what} has fingerprint "
                       f"{expected!r}; rebuild the bank for these weights (or pass force=True to decode anyway "
                       "— still lossless, but its figures and thresholds do not apply)")
                if not force:
                    raise BankError(msg)
                import warnings

                warnings.warn(msg, stacklevel=2)
        entries = doc.get("trees")
        if not isinstance(entries, list) or not entries:
            raise BankError(f"{jf} lists no trees; rebuild the bank")
        trees, figures = [], []
        for k, e in enumerate(entries):
            if not isinstance(e, dict) or "paths" not in e:
                raise BankError(f"{jf}: tree {k} has no 'paths'")
            try:
                t = Tree(e["paths"], max_depth=max_depth)
            except TreeError as err:
                raise BankError(f"{jf}: tree {k} is not usable: {err}") from err
            trees.append(t)
            figures.append({key: v for key, v in e.items() if key != "paths"})
        if not bf.is_file():
            raise BankError(f"{folder} has no {BUFFERS}; the bank is incomplete, rebuild it")
        try:
            tensors = load_file(str(bf))
        except (SafetensorError, OSError, ValueError) as e:
            raise BankError(f"{bf} cannot be read ({e}); the file is truncated or damaged, rebuild the bank") from e
        buffers = []
        for k, t in enumerate(trees):
            try:
                b = TreeBuffers.from_tensors(tensors, prefix=f"tree{k}.")
                b.validate()
            except (KeyError, TreeError, ValueError, RuntimeError) as e:
                raise BankError(f"{bf}: buffers of tree {k} are invalid ({e}); rebuild the bank") from e
            if b.to_tree() != t:
                raise BankError(f"{bf}: buffers of tree {k} do not match its paths in {BANK_JSON}; the bank was "
                                "assembled from different builds, rebuild it")
            buffers.append(b)
        best = doc.get("best_static")
        if not isinstance(best, int) or not 0 <= best < len(trees):
            raise BankError(f"{jf}: best_static={best!r} is not a tree index in 0..{len(trees) - 1}")
        policies = doc.get("policies") or {}
        default = doc.get("default_policy", "static")
        if default != "static" and default not in policies:
            raise BankError(f"{jf}: default_policy {default!r} is not among the stored policies {sorted(policies)}")
        return cls(trees=trees, figures=figures, best_static=best, policies=policies, default_policy=default,
                   oracle=doc.get("oracle") or {}, provenance=prov, buffers=buffers, path=folder)
