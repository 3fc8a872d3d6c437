"""Heads folders that take their weights from another heads folder, so no tensor is stored twice.

A draft-vocabulary heads folder (FR-Spec style, `pipeline.heads.draft_vocab`) drafts with exactly
the weights of the full-vocabulary heads it was derived from, plus the ids of its draft vocabulary.
Rather than a copy of those weights it holds:

    config.json          its heads config, as `runtime.heads.save_heads` writes it
    own.safetensors      the tensors the base folder does not hold (the draft vocabulary ids)
    weights_from.json    the reference: the base folder relative to this one (e.g. `../hydra`), the
                         sha256 of the base's heads.safetensors and of own.safetensors, and the
                         fingerprint the self-contained folder (one heads.safetensors) would have

Loading takes the base's tensors and this folder's own ones (`runtime.heads.load_heads`): the
heads are the same, bit for bit, as those a self-contained folder would give. A base that is
missing or whose weights changed since is refused with a message that says what to do.
`runtime.fingerprint.heads_fingerprint` returns the recorded fingerprint once both checksums
match, so banks and pipeline keys name the heads by their tensors, not by the file layout.

Torch-free (read by `heads_fingerprint`, which pipeline up-to-date checks call).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from runtime.config import WEIGHTS_FILE
from runtime.io import atomic_write_bytes

REF_FILE = "weights_from.json"
OWN_FILE = "own.safetensors"
REF_FORMAT = "entmtp-heads-weights-from"
REF_FORMAT_VERSION = 1


@dataclass(frozen=True)
class WeightsRef:
    """What `REF_FILE` says: where the base weights are and what they and the own tensors hash to."""

    base: str           # the base heads folder, relative to the referring folder (or absolute)
    base_sha256: str    # sha256 of the base's heads.safetensors when this folder was written
    own_sha256: str     # sha256 of this folder's own.safetensors
    fingerprint: str    # `heads_fingerprint` of the equivalent self-contained folder

    def base_file(self, folder: str | Path) -> Path:
        return Path(folder) / self.base / WEIGHTS_FILE


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes. (runtime.fingerprint has a cached one; it imports this module.)"""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def is_referring_folder(folder: str | Path) -> bool:
    """Whether `folder` takes its weights from another folder (holds `REF_FILE`)."""
    return (Path(folder) / REF_FILE).is_file()


def read_weights_ref(folder: str | Path) -> WeightsRef:
    """The reference in `folder`/weights_from.json, its format checked (not yet the files: see `checked_files`)."""
    path = Path(folder) / REF_FILE
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or raw.get("format") != REF_FORMAT:
        raise ValueError(f"{path} is not an EntMTP weights reference (its 'format' is not {REF_FORMAT!r})")
    if raw.get("format_version") != REF_FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {raw.get('format_version')!r} is not supported "
                         f"(expected {REF_FORMAT_VERSION})")
    try:
        ref = WeightsRef(base=raw["base"]["folder"], base_sha256=raw["base"]["sha256"],
                         own_sha256=raw["own"]["sha256"], fingerprint=raw["fingerprint"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} lacks {e}: rewrite the folder (`python -m pipeline stage=heads force=true`)") from e
    if raw["own"].get("file") != OWN_FILE or raw["base"].get("file") != WEIGHTS_FILE:
        raise ValueError(f"{path} names files other than {WEIGHTS_FILE} / {OWN_FILE}; this reader knows only those")
    return ref


def checked_files(folder: str | Path) -> tuple[WeightsRef, Path, Path]:
    """(the reference, the base's weights file, this folder's own tensors file) of a referring
    `folder`, after checking that both files exist and hash to what the reference recorded."""
    folder = Path(folder)
    ref = read_weights_ref(folder)
    if (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} holds both {WEIGHTS_FILE} and {REF_FILE}: it is either self-contained or a "
                         f"reference, not both; delete the one that was not written with it")
    base_file, own_file = ref.base_file(folder), folder / OWN_FILE
    redo = (f"restore the base folder {ref.base!r} as it was (e.g. `git checkout` it), or rebuild {folder} from the "
            f"current base (`python -m pipeline stage=heads force=true` with the same heads.draft_vocab.size, or "
            f"`python -m pipeline.heads.draft_vocab --force`)")
    if not base_file.is_file():
        raise FileNotFoundError(f"{folder} takes its weights from {base_file} ({REF_FILE}), which does not exist "
                                f"(a heads folder moved without its base?): {redo}")
    sha = file_sha256(base_file)
    if sha != ref.base_sha256:
        raise ValueError(f"{folder} takes its weights from {base_file}, but that file changed since {folder} was "
                         f"written (sha256 {sha[:16]}..., recorded {ref.base_sha256[:16]}...): these would be other "
                         f"heads; {redo}")
    if not own_file.is_file():
        raise FileNotFoundError(f"{own_file} not found next to {REF_FILE}: the folder is incomplete; rebuild it "
                                "(`python -m pipeline stage=heads force=true`)")
    if file_sha256(own_file) != ref.own_sha256:
        raise ValueError(f"{own_file} differs from what {REF_FILE} recorded: the folder was edited or copied "
                         "incompletely; rebuild it (`python -m pipeline stage=heads force=true`)")
    return ref, base_file, own_file


def canonical_safetensors(raw: bytes) -> bytes:
    """A safetensors file's bytes `raw` with its header's `__metadata__` entries in one fixed order:
    "format" first, then by name. safetensors writes them in hash-map order, which varies from one
    save to the next, so two saves of the same tensors can differ in those bytes alone; the
    fingerprint a referring folder records is that of the canonical bytes (the order
    `runtime.io.save_weights_folder` asks for, which the shipped self-contained folders have)."""
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n]
    meta = json.loads(header).get("__metadata__")  # json keeps the file's order
    if not meta:
        return raw
    compact = lambda d: json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode()  # noqa: E731 - as written
    lead, as_written = b'{"__metadata__":', compact(meta)
    if not header.startswith(lead + as_written):
        raise ValueError("a safetensors header laid out unlike safetensors' own (metadata first, compact JSON)")
    ordered = dict(sorted(meta.items(), key=lambda kv: (kv[0] != "format", kv[0])))
    return raw[:8] + lead + compact(ordered) + header[len(lead) + len(as_written):] + raw[8 + n:]


def write_weights_ref(folder: str | Path, base: str | Path, fingerprint: str) -> Path:
    """Write `folder`/weights_from.json pointing at heads folder `base` (recorded relative to
    `folder`, so the pair moves together), with the checksums of the files as they are now.
    `folder`/own.safetensors must already be written."""
    folder, base = Path(folder), Path(base)
    base_file = base / WEIGHTS_FILE
    if not base_file.is_file():
        raise FileNotFoundError(f"{base_file} not found: a referring folder takes its weights from a heads folder "
                                f"that holds its own {WEIGHTS_FILE}")
    doc = {
        "format": REF_FORMAT, "format_version": REF_FORMAT_VERSION,
        "base": {"folder": os.path.relpath(base.resolve(), folder.resolve()), "file": WEIGHTS_FILE,
                 "sha256": file_sha256(base_file)},
        "own": {"file": OWN_FILE, "sha256": file_sha256(folder / OWN_FILE)},
        "fingerprint": fingerprint,
    }
    atomic_write_bytes(folder / REF_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    return folder / REF_FILE
