"""Fingerprints of large files are computed once per stat signature and remembered on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import runtime.fingerprint as fp


@pytest.fixture
def small_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache every file set (the default threshold would need 64 MiB files)."""
    monkeypatch.setattr(fp, "CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(fp, "_MEMORY", {})


def test_cached_fingerprint_equals_the_uncached_one_and_is_reused(tmp_path: Path, small_threshold) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4096))
    cache = tmp_path / "cache.json"
    value = fp.files_fingerprint([f], cache=cache)
    assert value == fp.files_fingerprint([f], cache=None)
    table = json.loads(cache.read_text())
    assert list(table.values()) == [value]
    # a hit does not read the bytes again: a planted value comes back (fresh process = empty memory)
    (key,) = table
    cache.write_text(json.dumps({key: "planted"}))
    fp._MEMORY.clear()
    assert fp.files_fingerprint([f], cache=cache) == "planted"


def test_rewriting_a_file_invalidates_its_entry(tmp_path: Path, small_threshold) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 100)
    cache = tmp_path / "cache.json"
    first = fp.files_fingerprint([f], cache=cache)
    f.write_bytes(b"b" * 100)  # same size, new content: mtime/ctime move on
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 1_000_000))
    second = fp.files_fingerprint([f], cache=cache)
    assert second != first and second == fp.files_fingerprint([f], cache=None)
    assert fp.file_sha256(f, cache=cache) == fp.file_sha256(f, cache=None)


def test_unwritable_cache_is_ignored(tmp_path: Path, small_threshold) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 10)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert fp.files_fingerprint([f], cache=blocker / "cache.json") == fp.files_fingerprint([f], cache=None)


def test_cache_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ENTMTP_FINGERPRINT_CACHE", "")
    assert fp.default_cache_path() is None
    monkeypatch.setenv("ENTMTP_FINGERPRINT_CACHE", str(tmp_path / "c.json"))
    assert fp.default_cache_path() == tmp_path / "c.json"
