"""Content fingerprints of weight files: what a bank or a set of heads records it was built for."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def files_fingerprint(paths: list[Path], chunk: int = 1 << 20) -> str:
    """SHA-256 over the names and contents of `paths` (in the given order), 16 hex chars."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()[:16]


def weights_fingerprint(folder: str | Path) -> str:
    """Fingerprint of a model folder's safetensors. The model stage records it in its manifest;
    reading that avoids hashing half a gigabyte at every load."""
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
    """Fingerprint of a heads folder (its weights file)."""
    f = Path(folder) / "heads.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: not a heads folder")
    return files_fingerprint([f])
