"""Stage bookkeeping shared by every pipeline stage.

Every stage builds its output folder in a temporary sibling, records a `manifest.json` (config
hash, input fingerprints, versions, wall time) and is skipped when an up-to-date output already
exists. A per-output file lock stops two processes building the same artifact at once: the
second one waits, then finds the first one's output up to date.

Crash safety of `run_stage` (a job may be killed at any instruction, SIGKILL included):

* the build writes only into `.<name>.partial-<pid>-<random>/`; the manifest is its last file,
  and every file is fsynced before the folder is published, so a folder under the final name
  always holds a complete build (an output without a manifest is never "up to date"). The
  manifest lists every file's size and SHA-256, so an output damaged later (an interrupted copy
  to another machine, a hand edit) is rebuilt rather than trusted;
* publishing replaces an existing output in two renames (old -> `.<name>.old-<pid>-<random>`,
  new -> final name), because POSIX has no portable atomic swap of two non-empty folders.
  A kill between the two leaves no folder under the final name for an instant; the next
  `run_stage` for that output (under the lock) first *recovers*: it moves the `.old` folder back
  if the final one is missing, deletes `.old` folders whose successor was published, and deletes
  `.partial` folders (while we hold the lock no other process can be building this output, so
  every one of them belongs to a dead or interrupted run);
* SIGINT (Ctrl-C) and exceptions in the build delete the partial folder at once.

The lock is `fcntl.flock` on `.<name>.lock` next to the output: released by the kernel when its
holder dies, so a killed job never leaves a stale lock. It is reliable on local filesystems
(and on NFSv4); on filesystems without working flock run one job per output.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runtime.fingerprint import file_sha256, files_fingerprint
from runtime.io import atomic_write_bytes, fsync_dir
from runtime.machine import cpu_name_and_flags

__all__ = ["atomic_write_bytes", "atomic_write_json", "files_fingerprint", "fsync_dir", "save_figure"]  # re-exported for stages

MANIFEST = "manifest.json"
_log = logging.getLogger(__name__)
# What a process does once before its first build (seeding torch, its thread count): kept out of
# the up-to-date path so that checking a finished pipeline never imports torch (3 s of start-up).
_pending_setup: Callable[[], None] | None = None


def before_first_build(setup: Callable[[], None]) -> None:
    """Run `setup()` just before this process's next stage build (not at all when all is up to
    date); a later call replaces a setup that has not run yet."""
    global _pending_setup
    _pending_setup = setup


def run_build_setup() -> None:
    """Run the pending `before_first_build` setup now (`run_stage` does before a build; so does
    other work that measures outside a stage build, e.g. the dtype benchmark)."""
    global _pending_setup
    setup, _pending_setup = _pending_setup, None
    if setup is not None:
        setup()


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """`atomic_write_bytes` of `obj` as indented, key-sorted JSON (non-JSON values are written with str()).

    The object is serialised completely before anything is written, so an unserialisable object
    (e.g. a circular reference) raises without touching `path`.
    """
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Write a matplotlib figure as a PNG at `path` atomically (rendered to memory first, so a
    failed render leaves no half-written plot), and close it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_obj(obj: Any) -> str:
    """Stable hash of a JSON-able object (configs, lists of prompts)."""
    return hash_bytes(json.dumps(obj, sort_keys=True, default=str).encode())[:16]


def fingerprint_dir(folder: str | Path, pattern: str = "*.safetensors") -> str:
    files = sorted(Path(folder).glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} files in {folder}: nothing to fingerprint")
    return files_fingerprint(files)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "numpy", "safetensors", "hydra-core"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def _cpu_name_and_flags() -> tuple[str, str]:
    # the runtime's reader, so what a bank records is what `EntMTP.load` compares it with
    return cpu_name_and_flags()


def cpu_identity() -> dict[str, Any]:
    """The CPU model and core count: what decides whether a machine-specific measurement (the
    dtype choice) still holds. Read without torch, so up-to-date checks stay cheap."""
    return {"cpu": _cpu_name_and_flags()[0], "cores": os.cpu_count()}


def _machine(cuda: str | None, torch_version: str) -> dict[str, Any]:
    cpu, flags = _cpu_name_and_flags()
    return {"cpu": cpu, "cores": os.cpu_count(), "amx": "amx_bf16" in flags, "torch": torch_version, "cuda": cuda,
            "platform": platform.platform()}


def machine_info() -> dict[str, Any]:
    """What a timing figure was measured on: CPU model, cores, AMX, torch threads."""
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {**_machine(cuda, torch.__version__), "torch_threads": torch.get_num_threads()}


def machine_key(device: str) -> dict[str, Any]:
    """`machine_info()` less the thread count, for the key of a stage that times: read without
    importing torch (the GPU's name is asked of torch only when the stage runs on one)."""
    import importlib.metadata as md

    cuda = None
    if device.startswith("cuda"):
        import torch

        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return _machine(cuda, md.version("torch"))


@contextlib.contextmanager
def file_lock(target: str | Path, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Exclusive lock next to `target`, so two processes never build the same artifact at once.

    Blocks until the lock is free; `on_wait(holder)` is called first when another process holds
    it (`holder` is what that process wrote in the lock file: its pid and host). The kernel
    releases the lock when its holder exits or is killed, so there are no stale locks.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                f.seek(0)
                on_wait(f.read().strip() or "unknown")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {platform.node()}\n")
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def file_table(folder: str | Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of every regular file under `folder` except the manifest."""
    folder = Path(folder)
    table = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink() and p != folder / MANIFEST:
            # large files (a converted 7B model) are hashed once per stat signature, not at every check
            table[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    return table


def why_not_up_to_date(out_dir: str | Path, key: dict[str, Any]) -> str | None:
    """None when `out_dir` is a complete, undamaged output built with `key`; else the reason.

    The manifest lists every file with its size and SHA-256: an output copied between machines
    incompletely, or edited after the build, is rebuilt instead of being trusted. (Manifests
    written before the file table existed are checked by key only.)
    """
    out_dir = Path(out_dir)
    m = out_dir / MANIFEST
    if not m.is_file():
        return "no output yet" if not os.path.lexists(out_dir) else f"{out_dir} has no {MANIFEST} (not a complete build)"
    try:
        manifest = read_json(m)
    except (OSError, ValueError) as e:
        return f"{m} is unreadable ({e})"
    if not isinstance(manifest, dict):
        return f"{m} is not a manifest"
    if manifest.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
        return "its inputs or configuration changed"
    files = manifest.get("files")
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"{m} has a damaged file table"
    for rel, want in files.items():
        p = out_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        if not isinstance(want, dict) or p.stat().st_size != want.get("bytes"):
            return f"{rel} has {p.stat().st_size} bytes, the build wrote {want.get('bytes') if isinstance(want, dict) else '?'}"
    actual = file_table(out_dir)
    for rel, want in files.items():
        if actual.get(rel, {}).get("sha256") != want.get("sha256"):
            return f"{rel} differs from what the build wrote (checksum mismatch)"
    return None


def is_up_to_date(out_dir: str | Path, key: dict[str, Any]) -> bool:
    """True when `out_dir` holds a complete manifest whose key matches `key` and whose files are intact."""
    return why_not_up_to_date(out_dir, key) is None


def _partial_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.partial-\d+-\w+")


def _old_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.old-\d+-\w+")


def _leftovers(out_dir: Path) -> tuple[list[Path], list[Path]]:
    """(partial build folders, moved-aside old outputs) that runs of `out_dir` left next to it."""
    partial, old = _partial_re(out_dir.name), _old_re(out_dir.name)
    siblings = list(out_dir.parent.iterdir()) if out_dir.parent.is_dir() else []
    return ([p for p in siblings if partial.fullmatch(p.name)], [p for p in siblings if old.fullmatch(p.name)])


def recover_stage_output(out_dir: str | Path, log: Callable[[str], None] | None = None) -> None:
    """Undo what a killed `run_stage` of `out_dir` left behind. Call only while holding `file_lock(out_dir)`.

    * the final folder is missing but a moved-aside `.old` one exists (killed between the two
      renames of a publish): move it back, so the previous artifact is what it was;
    * `.old` folders next to a published output: their replacement was published, delete them;
    * `.partial` folders: the lock proves no live run is building this output; delete them.
    """
    log = log or _log.info
    out_dir = Path(out_dir)
    partials, olds = _leftovers(out_dir)
    for p in partials:
        log(f"removing the partial build {p.name} of an interrupted run")
        shutil.rmtree(p, ignore_errors=True)
    if olds and not os.path.lexists(out_dir):
        newest = max(olds, key=lambda p: p.stat().st_mtime)
        os.replace(newest, out_dir)
        olds.remove(newest)
        fsync_dir(out_dir.parent)
        log(f"restored {out_dir} from {newest.name}: a run was interrupted while publishing its output")
    for p in olds:
        shutil.rmtree(p, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, so a published output survives a power cut whole."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished build `tmp` to `out_dir`, replacing what is there (see the module docstring)."""
    old = None
    if os.path.lexists(out_dir):
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None and not os.path.lexists(out_dir):
            os.replace(old, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def run_stage(
    name: str,
    out_dir: str | Path,
    key: dict[str, Any],
    build: Callable[[Path], dict[str, Any] | None],
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build `out_dir` with `build(tmp_dir)` unless an output with the same `key` exists.

    `key` holds everything the output depends on (config subset, input fingerprints); it is
    stored in the manifest and compared on the next run. `build` writes into a fresh temporary
    folder that replaces `out_dir` only after `build` returned and the manifest was written, so
    an interrupted stage never leaves a partial artifact under its final name and the previous
    output stays intact (see the module docstring for a kill during the swap itself). Whatever
    dict `build` returns is stored in the manifest as `summary`.
    """
    log = log or _log.info  # hydra's job log records what stages say
    out_dir = Path(out_dir)
    with file_lock(out_dir, on_wait=lambda holder: log(f"[{name}] waiting for {holder}, which is building {out_dir}")):
        recover_stage_output(out_dir, log=lambda msg: log(f"[{name}] {msg}"))
        reason = why_not_up_to_date(out_dir, key)
        if not force and reason is None:
            log(f"[{name}] up to date: {out_dir}")
            return out_dir
        run_build_setup()
        if os.path.lexists(out_dir):
            log(f"[{name}] rebuilding {out_dir}: {'forced' if force else reason}")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=out_dir.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; artifacts are meant to be shared
        t0 = time.time()
        try:
            summary = build(tmp) or {}
            manifest = {
                "stage": name,
                "key": key,
                "summary": summary,
                "files": file_table(tmp),
                "versions": versions(),
                "wall_time_s": round(time.time() - t0, 2),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write_json(tmp / MANIFEST, manifest)  # last: a folder with a manifest is complete
            _fsync_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _publish(tmp, out_dir)
        log(f"[{name}] wrote {out_dir} in {time.time() - t0:.1f} s")
        return out_dir
