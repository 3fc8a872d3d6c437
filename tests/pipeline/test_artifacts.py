"""Stage bookkeeping: atomic files, run_stage's skip/rebuild, and what a killed or concurrent job leaves.

The kill and concurrency tests run real Python subprocesses (SIGKILL, SIGINT, two builders at
once); their builds write one file, then wait, then write a second one, so a kill lands in the
middle of a build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import artifacts
from pipeline.paths import REPO_ROOT
from pipeline.artifacts import MANIFEST, atomic_write_bytes, atomic_write_json, file_lock, read_json, run_stage

ROOT = REPO_ROOT

# A stage whose build writes part1, optionally signals "ready" and waits, then writes part2.
# argv: out_dir key mode marker. Modes: normal | hang (wait 60 s) | slow (wait 1 s) |
# die_in_publish (SIGKILL itself between the two renames of the publish) |
# die_before_cleanup (SIGKILL itself after publishing, before deleting the old output).
STAGE_SCRIPT = r"""
import os, shutil, signal, sys, time
from pathlib import Path
from pipeline import artifacts

# A process started from a background job inherits SIGINT ignored, and Python then keeps it
# ignored; restore Ctrl-C's KeyboardInterrupt so the SIGINT case tests what a user's Ctrl-C does.
signal.signal(signal.SIGINT, signal.default_int_handler)

out, key, mode, marker = sys.argv[1:5]

def build(tmp):
    with open(marker + ".builds", "a") as f:
        f.write(f"{os.getpid()}\n")
    (tmp / "part1.txt").write_text(f"first half of {key}\n")
    if mode in ("hang", "slow"):
        Path(marker).write_text("ready")
        time.sleep(60 if mode == "hang" else 1.0)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "part2.txt").write_text(f"second half of {key}\n")
    return {"built": key}

if mode == "die_in_publish":
    real_replace = os.replace
    def replace(src, dst):
        if ".partial-" in str(src) and str(dst) == out:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    os.replace = replace
if mode == "die_before_cleanup":
    def rmtree(path, *args, **kwargs):
        if ".old-" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
    shutil.rmtree = rmtree

artifacts.run_stage("demo", out, {"k": key}, build, log=lambda m: print(m, flush=True))
"""


def start_stage(out: Path, key: str, mode: str, marker: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", STAGE_SCRIPT, str(out), key, mode, str(marker)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"stage process exited early ({proc.returncode}): {proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"stage process did not reach its build within {timeout} s")
        time.sleep(0.02)


def build_files(key: str):
    def build(tmp: Path) -> dict:
        (tmp / "part1.txt").write_text(f"first half of {key}\n")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "part2.txt").write_text(f"second half of {key}\n")
        return {"built": key}
    return build


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` except the manifest's timestamps, for comparing two builds."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == MANIFEST:
                m = json.loads(data)
                data = json.dumps({k: m[k] for k in ("stage", "key", "summary")}, sort_keys=True).encode()
            out[str(p.relative_to(folder))] = data
    return out


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and not p.name.endswith(".lock"))


def quiet(msg: str) -> None:
    pass


# ------------------------------------------------------------------------------- atomic writes


def test_atomic_write_json_round_trip_and_mode(tmp_path: Path) -> None:
    f = tmp_path / "a" / "x.json"
    atomic_write_json(f, {"b": 1, "a": [1.5, None], "p": Path("/x")})
    assert read_json(f) == {"a": [1.5, None], "b": 1, "p": "/x"}
    assert f.stat().st_mode & 0o777 == 0o644
    assert os.listdir(f.parent) == ["x.json"]


def test_unserialisable_object_leaves_the_old_file(tmp_path: Path) -> None:
    f = tmp_path / "x.json"
    atomic_write_json(f, {"v": 1})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular reference"):
        atomic_write_json(f, {"v": 2, "loop": loop})
    assert read_json(f) == {"v": 1}
    assert os.listdir(tmp_path) == ["x.json"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failing_fsync_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       error: BaseException) -> None:
    f = tmp_path / "x.bin"
    atomic_write_bytes(f, b"old content")

    def fsync(fd: int) -> None:
        raise error

    monkeypatch.setattr(artifacts.os, "fsync", fsync)
    with pytest.raises(type(error)):
        atomic_write_bytes(f, b"new content that never lands" * 1000)
    monkeypatch.undo()
    assert f.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["x.bin"]


def test_failing_rename_and_missing_target_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def replace(src: str, dst: str) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(artifacts.os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        atomic_write_json(tmp_path / "new.json", {"v": 1})
    assert os.listdir(tmp_path) == []


def test_atomic_write_bytes_refuses_text(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="encode text first"):
        atomic_write_bytes(tmp_path / "x", "text")  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------- run_stage in process


def test_run_stage_builds_skips_and_rebuilds(tmp_path: Path) -> None:
    out = tmp_path / "stage" / "demo"
    calls = []

    def build(tmp: Path) -> dict:
        calls.append(tmp)
        return build_files("A")(tmp)

    assert run_stage("demo", out, {"k": "A"}, build, log=quiet) == out
    manifest = read_json(out / MANIFEST)
    assert manifest["key"] == {"k": "A"} and manifest["summary"] == {"built": "A"} and manifest["stage"] == "demo"
    assert (out / "sub" / "part2.txt").read_text() == "second half of A\n"
    run_stage("demo", out, {"k": "A"}, build, log=quiet)
    assert len(calls) == 1, "an up-to-date output must not be rebuilt"
    run_stage("demo", out, {"k": "A"}, build, force=True, log=quiet)
    run_stage("demo", out, {"k": "B"}, build, log=quiet)
    assert len(calls) == 3
    assert read_json(out / MANIFEST)["key"] == {"k": "B"}
    assert leftovers(out) == []
    assert not calls[0].exists()


def test_failing_build_keeps_the_previous_output(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=quiet)
    before = contents(out)

    def broken(tmp: Path) -> dict:
        (tmp / "part1.txt").write_text("half of a broken build")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        run_stage("demo", out, {"k": "B"}, broken, log=quiet)
    assert contents(out) == before
    assert leftovers(out) == []


def test_output_without_manifest_is_not_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "part1.txt").write_text("something copied by hand")
    assert not artifacts.is_up_to_date(out, {"k": "A"})
    (out / MANIFEST).write_text("{truncated")
    assert not artifacts.is_up_to_date(out, {"k": "A"})
    (out / MANIFEST).write_text("[]")
    assert not artifacts.is_up_to_date(out, {"k": "A"})
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=quiet)
    assert not (out / "part1.txt").read_text().startswith("something")


@pytest.mark.parametrize("damage, reason", [
    (lambda out: (out / "sub" / "part2.txt").write_text("second half of"), "sub/part2.txt has 14 bytes, the build wrote 17"),
    (lambda out: (out / "sub" / "part2.txt").write_text("SECOND half of A\n"), "checksum mismatch"),
    (lambda out: (out / "part1.txt").unlink(), "part1.txt is missing"),
    (lambda out: (out / MANIFEST).write_text('{"key": '), "is unreadable"),
])
def test_damaged_output_is_rebuilt_not_trusted(tmp_path: Path, damage, reason: str) -> None:
    out = tmp_path / "demo"
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=quiet)
    before = contents(out)
    assert set(read_json(out / MANIFEST)["files"]) == {"part1.txt", "sub/part2.txt"}
    damage(out)  # e.g. an interrupted copy from another machine
    assert reason in artifacts.why_not_up_to_date(out, {"k": "A"})
    logs: list[str] = []
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=logs.append)
    assert any(reason in m and "rebuilding" in m for m in logs), logs
    assert contents(out) == before


def test_manifest_without_file_table_is_checked_by_key_only(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=quiet)
    manifest = read_json(out / MANIFEST)
    del manifest["files"]
    atomic_write_json(out / MANIFEST, manifest)
    (out / "part1.txt").write_text("edited")
    assert artifacts.is_up_to_date(out, {"k": "A"})
    assert not artifacts.is_up_to_date(out, {"k": "B"})


def test_recovery_restores_a_moved_aside_output_and_cleans_partials(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=quiet)
    before = contents(out)
    # What a kill between the two renames of a publish leaves, plus a dead run's partial build.
    os.replace(out, tmp_path / ".demo.old-4242-deadbeef")
    (tmp_path / ".demo.partial-4243-abc_12").mkdir()
    (tmp_path / ".demo.partial-4243-abc_12" / "part1.txt").write_text("half")
    (tmp_path / ".demo2.partial-1-x").mkdir()  # another output's: not ours to touch
    logs: list[str] = []
    run_stage("demo", out, {"k": "A"}, lambda tmp: pytest.fail("must not rebuild"), log=logs.append)
    assert contents(out) == before
    assert leftovers(out) == [] and (tmp_path / ".demo2.partial-1-x").is_dir()
    assert any("restored" in m for m in logs) and any("partial build" in m for m in logs)


def test_recovery_drops_old_outputs_whose_successor_was_published(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run_stage("demo", out, {"k": "B"}, build_files("B"), log=quiet)
    (tmp_path / ".demo.old-7-zz").mkdir()
    run_stage("demo", out, {"k": "B"}, build_files("B"), log=quiet)
    assert leftovers(out) == [] and read_json(out / MANIFEST)["key"] == {"k": "B"}


def test_file_lock_reports_the_holder(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipeline.artifacts import file_lock\n"
         "with file_lock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(1.5)", str(target)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    waited: list[str] = []
    t0 = time.monotonic()
    with file_lock(target, on_wait=waited.append):
        elapsed = time.monotonic() - t0
    holder.wait(timeout=30)
    assert waited == [f"pid {holder.pid} on {os.uname().nodename}"]
    assert elapsed > 0.3, "the lock did not block while another process held it"


# ------------------------------------------------------------------------------- killed subprocesses


@pytest.fixture
def stage_a(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A published output built with key A, and its contents."""
    out = tmp_path / "out" / "demo"
    run_stage("demo", out, {"k": "A"}, build_files("A"), log=quiet)
    return out, contents(out)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_build_keeps_previous_output_and_rerun_is_identical(
    stage_a: tuple[Path, dict[str, bytes]], tmp_path: Path, sig: signal.Signals
) -> None:
    out, before = stage_a
    marker = tmp_path / "ready"
    proc = start_stage(out, "B", "hang", marker)
    wait_for(marker, proc)
    assert any(".partial-" in name for name in leftovers(out)), "the build should be under way in a partial folder"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert contents(out) == before, "the previous output changed"
    assert not (out / "sub").exists() or (out / "sub" / "part2.txt").read_text() == "second half of A\n"
    if sig == signal.SIGINT:  # KeyboardInterrupt: the partial folder is removed at once
        assert leftovers(out) == []
    else:  # SIGKILL leaves its partial folder; the next run removes it
        assert len(leftovers(out)) == 1
    run_stage("demo", out, {"k": "B"}, build_files("B"), log=quiet)
    clean = tmp_path / "clean" / "demo"
    run_stage("demo", clean, {"k": "B"}, build_files("B"), log=quiet)
    assert contents(out) == contents(clean)
    assert leftovers(out) == []


def test_kill_between_the_two_renames_is_recovered(stage_a: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    out, before = stage_a
    proc = start_stage(out, "B", "die_in_publish", tmp_path / "m")
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
    assert not out.exists(), "the kill should have landed between the renames"
    assert len([n for n in leftovers(out) if ".old-" in n]) == 1
    # The next run of the old configuration finds the previous artifact, intact and up to date.
    run_stage("demo", out, {"k": "A"}, lambda tmp: pytest.fail("must not rebuild"), log=quiet)
    assert contents(out) == before and leftovers(out) == []


def test_kill_after_publish_leaves_new_output(stage_a: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    out, _ = stage_a
    proc = start_stage(out, "B", "die_before_cleanup", tmp_path / "m")
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
    assert read_json(out / MANIFEST)["key"] == {"k": "B"}
    run_stage("demo", out, {"k": "B"}, lambda tmp: pytest.fail("must not rebuild"), log=quiet)
    assert leftovers(out) == []


# ------------------------------------------------------------------------------- concurrency


def test_two_processes_building_the_same_output(tmp_path: Path) -> None:
    out = tmp_path / "out" / "demo"
    marker = tmp_path / "ready"
    first = start_stage(out, "A", "slow", marker)
    wait_for(marker, first)  # the first one holds the lock and is inside its build
    second = start_stage(out, "A", "slow", marker)
    out1, _ = first.communicate(timeout=60)
    out2, _ = second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, out1 + out2
    builds = (tmp_path / "ready.builds").read_text().split()
    assert builds == [str(first.pid)], f"expected exactly one build (by the first process), got {builds}"
    assert "[demo] wrote" in out1
    assert "waiting for" in out2 and "[demo] up to date" in out2, out2
    clean = tmp_path / "clean" / "demo"
    run_stage("demo", clean, {"k": "A"}, build_files("A"), log=quiet)
    assert contents(out) == contents(clean)
    assert leftovers(out) == []


def test_save_figure_writes_a_whole_png_and_closes_the_figure(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.artifacts import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number) and [p.name for p in tmp_path.iterdir()] == ["plot.png"]
    broken, _ = plt.subplots()

    def fails(*_args, **_kwargs) -> None:  # noqa: ANN002, ANN003 - a render that fails half way
        raise ValueError("cannot render")

    broken.savefig = fails
    with pytest.raises(ValueError, match="cannot render"):
        save_figure(broken, tmp_path / "broken.png")
    assert not (tmp_path / "broken.png").exists() and not plt.fignum_exists(broken.number)
