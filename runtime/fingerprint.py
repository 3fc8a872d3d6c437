"""Content fingerprints of weight files: what a bank or a set of heads records it was built for.

Hashing a 7B model's 13 GB at every start would dominate start-up, so fingerprints of large file
sets are remembered in a small JSON cache keyed by each file's resolved path, size, inode,
modification and change times (`stat`): any rewrite of a file changes its mtime/ctime, so a hit
means the bytes were hashed before. The cache lives at `$ENTMTP_FINGERPRINT_CACHE` if set (an
empty value disables it), else `$XDG_CACHE_HOME/entmtp/fingerprints.json` (`~/.cache/...`). It is
an optimisation only: an unreadable or unwritable cache is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from runtime.heads_ref import REF_FILE, checked_files
from runtime.io import atomic_write_bytes

# File sets smaller than this are hashed every time (fast, and they would only clutter the cache).
CACHE_MIN_BYTES = 64 << 20
_CACHE_MAX_ENTRIES = 512
_MEMORY: dict[str, str] = {}


def default_cache_path() -> Path | None:
    """Where fingerprints are remembered; None when caching is disabled."""
    env = os.environ.get("ENTMTP_FINGERPRINT_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "entmtp" / "fingerprints.json"


def _stat_key(kind: str, paths: list[Path]) -> str:
    rows = []
    for p in paths:
        st = os.stat(p)
        rows.append([os.path.realpath(p), p.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return hashlib.sha256(json.dumps([kind, rows]).encode()).hexdigest()


def _read_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _cached(kind: str, paths: list[Path], compute, cache: Path | None | str) -> str:  # noqa: ANN001
    """compute() once per stat signature of `paths`, remembered in memory and in `cache`."""
    if cache == "default":
        cache = default_cache_path()
    if sum(os.stat(p).st_size for p in paths) < CACHE_MIN_BYTES:
        return compute()
    key = _stat_key(kind, paths)
    if key in _MEMORY:
        return _MEMORY[key]
    table = _read_cache(cache) if cache is not None else {}
    if key in table:
        _MEMORY[key] = table[key]
        return table[key]
    value = compute()
    _MEMORY[key] = value
    if cache is not None:
        table = _read_cache(cache)  # re-read: another process may have added entries meanwhile
        table[key] = value
        while len(table) > _CACHE_MAX_ENTRIES:  # dicts keep insertion order: drop the oldest
            table.pop(next(iter(table)))
        with contextlib.suppress(OSError):
            atomic_write_bytes(cache, json.dumps(table).encode())
    return value


def files_fingerprint(paths: list[Path], chunk: int = 1 << 20, cache: Path | None | str = "default") -> str:
    """SHA-256 over the names and contents of `paths` (in the given order), 16 hex chars.

    Large file sets are looked up in the stat-keyed cache first (see the module docstring);
    `cache=None` always reads the bytes."""
    paths = [Path(p) for p in paths]

    def compute() -> str:
        h = hashlib.sha256()
        for p in paths:
            h.update(p.name.encode())
            with open(p, "rb") as f:
                while block := f.read(chunk):
                    h.update(block)
        return h.hexdigest()[:16]

    return _cached("files", paths, compute, cache)


def file_sha256(path: str | Path, cache: Path | None | str = "default") -> str:
    """Full SHA-256 of one file's bytes (hex), with the same stat-keyed cache for large files."""
    path = Path(path)

    def compute() -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    return _cached("sha256", [path], compute, cache)


def weights_fingerprint(folder: str | Path) -> str:
    """Fingerprint of a model folder's safetensors. The model stage records it in its manifest;
    reading that avoids hashing the weights at every load (and the stat-keyed cache covers
    folders used in place, which have no manifest)."""
    folder = Path(folder)
    manifest = folder / "manifest.json"
    if manifest.is_file():
        try:
            fp = json.loads(manifest.read_text()).get("summary", {}).get("fingerprint")
        except (OSError, ValueError):
            fp = None
        if fp:
            return fp
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}: not a model folder")
    return files_fingerprint(files)


def heads_fingerprint(folder: str | Path) -> str:
    """Fingerprint of a heads folder (its weights file: heads.safetensors, or an EAGLE-3
    drafter's drafter.safetensors). A folder that takes its weights from another one
    (`runtime.heads_ref`) has the fingerprint of its self-contained equivalent, once the files
    it reads are checked to be the ones it was written with."""
    folder = Path(folder)
    f = folder / "heads.safetensors"
    if not f.is_file() and (folder / REF_FILE).is_file():
        return checked_files(folder)[0].fingerprint
    if not f.is_file() and (folder / "drafter.safetensors").is_file():
        f = folder / "drafter.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: not a heads folder (nor an EAGLE-3 drafter's)")
    return files_fingerprint([f])
