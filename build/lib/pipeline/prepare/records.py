"""A task's records as {id, text, reference}: field extraction, filtering and de-duplication.

Unusable records are skipped and counted (the counters end up in the manifest). Records are
de-duplicated by id and by text (first occurrence kept; texts equal up to whitespace and case
count as duplicates), so no prompt text can sit in two pools after the split.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

from pipeline.prepare.readers import has_invalid_unicode, iter_source
from pipeline.prepare.task_config import resolve_source, validate_task_config

_MISSING = object()
_SKIP_COUNTERS = (
    "skipped_non_utf8",  # bytes that are not UTF-8 (or escaped lone surrogates)
    "skipped_bad_json",  # a line that is not a JSON object
    "skipped_filtered",  # failed the task's `filter`
    "skipped_no_text",  # text field missing, not a string, or blank
    "skipped_no_id",  # id field configured but missing / null in the record
    "skipped_duplicate_id",
    "skipped_duplicate_text",
)


def get_path(obj: Any, dotted: str) -> Any:
    """Follow a dotted path ("conversations.0.value") through dicts and lists; _MISSING if absent."""
    for part in dotted.split("."):
        if isinstance(obj, dict):
            obj = obj.get(part, _MISSING)
        elif isinstance(obj, list) and re.fullmatch(r"-?\d+", part):
            i = int(part)
            obj = obj[i] if -len(obj) <= i < len(obj) else _MISSING
        else:
            return _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


def _empty_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {"records_read": 0, "kept": 0, "truncated_tail": 0}
    stats.update({k: 0 for k in _SKIP_COUNTERS})
    return stats


def _passes(obj: Any, filt: dict[str, Any]) -> bool:
    for dotted, allowed in filt.items():
        value = get_path(obj, dotted)
        if value is _MISSING:
            return False
        if isinstance(allowed, list):
            if value not in allowed:
                return False
        elif value != allowed:
            return False
    return True


def _extract_records(cfg: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    stats = _empty_stats()
    fields, name = cfg["fields"], cfg["name"]
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    records: list[dict[str, Any]] = []
    for index, obj in iter_source(path, cfg["source"]["format"], cfg["source"]["loader"], stats):
        stats["records_read"] += 1
        if not isinstance(obj, dict):
            stats["skipped_bad_json"] += 1
            continue
        if has_invalid_unicode(obj):
            stats["skipped_non_utf8"] += 1
            continue
        if not _passes(obj, cfg["filter"]):
            stats["skipped_filtered"] += 1
            continue
        text = get_path(obj, fields["text"])
        if not isinstance(text, str) or not text.strip():
            stats["skipped_no_text"] += 1
            continue
        raw_id: Any = index
        if fields["id"] is not None:
            raw_id = get_path(obj, fields["id"])
            if raw_id is _MISSING or raw_id is None:
                stats["skipped_no_id"] += 1
                continue
        # The task name in the id keeps ids unique across tasks (GSM8K has no ids of its own).
        rid = f"{name}/{raw_id}"
        if rid in seen_ids:
            stats["skipped_duplicate_id"] += 1
            continue
        key = " ".join(text.split()).casefold()  # duplicates that differ only in spacing or case count too
        if key in seen_texts:
            stats["skipped_duplicate_text"] += 1
            continue
        seen_ids.add(rid)
        seen_texts.add(key)
        reference = get_path(obj, fields["reference"]) if fields["reference"] else None
        records.append({"id": rid, "text": text, "reference": None if reference is _MISSING else reference})
    stats["kept"] = len(records)
    stats["skipped_total"] = sum(stats[k] for k in _SKIP_COUNTERS)
    stats["source"] = str(path)
    stats["format"] = cfg["source"]["format"]
    return records, stats


@functools.lru_cache(maxsize=8)
def _load_records_cached(cache_key: str) -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    spec = json.loads(cache_key)
    records, stats = _extract_records(spec["cfg"], Path(spec["path"]))
    return tuple(records), stats


def load_records(task_cfg: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Read a task's records as {id, text, reference}, skipping (and counting) unusable ones.

    Returns (records in file order, stats). Results are cached per process, keyed by the
    config's reading part and the file's size and modification time, so repeated calls (tests,
    several stages in one process) parse the file once. Callers get their own copies.
    """
    cfg = validate_task_config(task_cfg)
    path = resolve_source(cfg)
    st = path.stat()
    reading = {k: cfg[k] for k in ("name", "source", "fields", "filter")}
    cache_key = json.dumps({"cfg": reading, "path": str(path), "size": st.st_size, "mtime": st.st_mtime_ns},
                           sort_keys=True, default=str)
    records, stats = _load_records_cached(cache_key)
    return [dict(r) for r in records], copy.deepcopy(stats)


# --------------------------------------------------------------------------------------------
# splitting
