"""Task and profile configs of the prepare stage: reading them, and checking a task config.

The fields of a task YAML and what they mean are described in `pipeline.prepare`.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

from pipeline.model.provision import find_package_file
from pipeline.paths import CONF_DIR

SPLITS = ("eval", "calib", "train")
FORMATS = ("jsonl", "jsonl.gz", "json")
LOADERS = ("auto", "datasets", "plain")
OVERLONG_POLICIES = ("truncate", "skip")
DEFAULT_TRAIN_CAP = 400

_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def load_task_config(name_or_path: str | Path, conf_dir: str | Path = CONF_DIR) -> dict[str, Any]:
    """Read a task YAML (a path to a file, or the name of one in `conf/task/`) through the task schema."""
    from omegaconf import OmegaConf

    from pipeline.config.schema import TaskConfig

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
