"""Seeded, disjoint eval / calib / train pools, and reading the prepared splits back.

Records are ordered by SHA-256(seed, id) (a keyed shuffle that depends neither on the
file's order nor on any library's random stream, so it is stable across Python/NumPy versions),
then cut into eval (first `pools.eval`), calib (next `pools.calib`) and train (the rest, capped
at `pools.train`). The pools have fixed sizes that do not depend on the profile; a profile takes
the first n rows of a pool (`read_split(..., limit=n)`), so the train split, which trains the
draft heads, is disjoint from the calib and eval rows of every profile.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.artifacts import read_json
from pipeline.prepare.task_config import SPLITS, validate_task_config


def _shuffle_key(seed: int | str, record_id: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{record_id}".encode()).digest()


def assign_pools(records: list[dict[str, Any]], task_cfg: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Split records into disjoint eval / calib / train pools with the task's seed.

    eval takes the first `pools.eval` records of the keyed shuffle, calib the next
    `pools.calib`, train the rest (at most `pools.train`).
    """
    cfg = validate_task_config(task_cfg)
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"task {cfg['name']!r}: record ids are not unique; load records with load_records()")
    pools = cfg["pools"]
    need = pools["eval"] + pools["calib"]
    if len(records) < need:
        raise ValueError(f"task {cfg['name']!r} has {len(records)} usable records, fewer than "
                         f"pools.eval + pools.calib = {need}; lower the pool sizes in its YAML")
    order = sorted(records, key=lambda r: _shuffle_key(cfg["seed"], r["id"]))
    e, c = pools["eval"], pools["calib"]
    rest = order[e + c:]
    return {
        "eval": order[:e],
        "calib": order[e:e + c],
        "train": rest if pools["train"] is None else rest[:pools["train"]],
    }


def read_split(data_dir: Path, task: str, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of data/<task>/<split>.jsonl; `limit` takes the first n (what a profile uses)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    path = Path(data_dir) / task / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; run the prepare stage: "
                                f"`python -m pipeline stage=prepare task={task}`")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if limit is not None:
        if limit > len(rows):
            raise ValueError(f"{path} holds {len(rows)} prompts but {limit} were asked for; raise pools.{split} "
                             f"in conf/task/{task}.yaml (or use overlong: truncate) and rerun prepare, "
                             "or ask for fewer prompts in the profile")
        rows = rows[:limit]
    return rows


def read_manifest(data_dir: Path, task: str) -> dict[str, Any]:
    return read_json(Path(data_dir) / task / "manifest.json")
