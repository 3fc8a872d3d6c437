"""Stage bookkeeping shared by every pipeline stage.

Every stage writes its output folder atomically (build in a temporary sibling, then one
`os.replace`), records a `manifest.json` (config hash, input fingerprints, versions, wall time)
and is skipped when an up-to-date output already exists. A per-output file lock stops two
processes building the same artifact at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_obj(obj: Any) -> str:
    """Stable hash of a JSON-able object (configs, lists of prompts)."""
    return hash_bytes(json.dumps(obj, sort_keys=True, default=str).encode())[:16]


def fingerprint_files(paths: list[Path], chunk: int = 1 << 20) -> str:
    """SHA-256 over the contents of `paths` (in the given order), truncated to 16 hex chars."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()[:16]


def fingerprint_dir(folder: str | Path, pattern: str = "*.safetensors") -> str:
    files = sorted(Path(folder).glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} files in {folder}: nothing to fingerprint")
    return fingerprint_files(files)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "numpy", "safetensors", "hydra-core"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def machine_info() -> dict[str, Any]:
    """What a timing figure was measured on: CPU model, cores, AMX, torch threads."""
    import torch

    cpu = platform.processor() or platform.machine()
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "amx": "amx_bf16" in flags,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


@contextlib.contextmanager
def file_lock(target: str | Path) -> Iterator[None]:
    """Exclusive lock next to `target`, so two processes never build the same artifact at once."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_up_to_date(out_dir: str | Path, key: dict[str, Any]) -> bool:
    """True when `out_dir` holds a complete manifest whose key matches `key`."""
    m = Path(out_dir) / MANIFEST
    if not m.is_file():
        return False
    try:
        return read_json(m).get("key") == json.loads(json.dumps(key, sort_keys=True, default=str))
    except (OSError, ValueError):
        return False


def run_stage(
    name: str,
    out_dir: str | Path,
    key: dict[str, Any],
    build: Callable[[Path], dict[str, Any] | None],
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Build `out_dir` with `build(tmp_dir)` unless an output with the same `key` exists.

    `key` holds everything the output depends on (config subset, input fingerprints); it is
    stored in the manifest and compared on the next run. `build` writes into a fresh temporary
    folder that replaces `out_dir` in one rename only after `build` returned, so an interrupted
    stage never leaves a partial artifact under its final name. Whatever dict `build` returns is
    stored in the manifest as `summary`.
    """
    out_dir = Path(out_dir)
    with file_lock(out_dir):
        if not force and is_up_to_date(out_dir, key):
            log(f"[{name}] up to date: {out_dir}")
            return out_dir
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; artifacts are meant to be shared
        t0 = time.time()
        try:
            summary = build(tmp) or {}
            manifest = {
                "stage": name,
                "key": key,
                "summary": summary,
                "versions": versions(),
                "wall_time_s": round(time.time() - t0, 2),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write_json(tmp / MANIFEST, manifest)
            old = None
            if out_dir.exists():
                old = out_dir.parent / f".{out_dir.name}.old.{os.getpid()}"
                os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"[{name}] wrote {out_dir} in {time.time() - t0:.1f} s")
        return out_dir
