"""A sharded rollout, merged, equals the single-process rollout.

Function level (fast): `run_rollout` over `shard_rows(rows, k, 2)` for k = 0, 1, then
`merge_rollouts`, against `run_rollout` over all rows: every array equal, prompt order restored.

Launcher level (slow): the same through the real entry point, `python -m pipeline -m
stage=rollout rollout.num_shards=2 rollout.shard=0,1 hydra/launcher=joblib_shards` (two processes) and
`stage=merge`, against `stage=merge rollout.num_shards=1` in another artifacts folder.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pipeline.rollout.record import ARRAYS, load_rollout, run_rollout, shard_rows
from pipeline.rollout.merge import merge_rollouts
from tests.helpers import MODEL_NAME, REPO, TinyBundle, python_exe, subprocess_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "Write a function that reverses a string.",
    "What is 17 * 23?",
    "Tell me a joke about compilers.",
    "def fib(n):",
    "Summarise the plot of Hamlet in one sentence.",
]
NEW_TOKENS = 6
RANK_CAP = 10


def assert_same_rollout(a: Path, b: Path) -> None:
    """Same prompts in the same order, and every array bit-for-bit equal (dtype included)."""
    ra, rb = load_rollout(a), load_rollout(b)
    assert [r["id"] for r in ra] == [r["id"] for r in rb]
    for x, y in zip(ra, rb):
        assert x["rank_cap"] == y["rank_cap"]
        for key in ARRAYS:
            assert x[key].dtype == y[key].dtype, f"{x['id']} {key}: {x[key].dtype} vs {y[key].dtype}"
            assert np.array_equal(x[key], y[key]), f"prompt {x['id']}: {key} differs"
    # the flat files too (offsets included): a merged rollout is indistinguishable from a single one
    fa, fb = load_file(str(a / "rollout.safetensors")), load_file(str(b / "rollout.safetensors"))
    assert sorted(fa) == sorted(fb)
    for key in fa:
        assert fa[key].dtype == fb[key].dtype and np.array_equal(fa[key], fb[key]), key


@pytest.fixture(scope="module")
def rows(bundle: TinyBundle) -> list[dict]:
    from runtime.model.checkpoint import load_tokenizer

    tok = load_tokenizer(bundle.model_dir)
    return [{"id": f"test/{i}", "input_ids": tok.encode(t, add_special_tokens=False).ids} for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def runtime_pair(bundle: TinyBundle):
    from runtime.heads import load_heads
    from runtime.model.checkpoint import load_model

    model = load_model(bundle.model_dir, max_seq_len=128)
    return model, load_heads(bundle.heads_dir, model=model)


def test_two_shards_merged_equal_single_process(runtime_pair, rows: list[dict], tmp_path: Path) -> None:
    model, heads = runtime_pair
    single = tmp_path / "single"
    single.mkdir()
    run_rollout(model, heads, rows, NEW_TOKENS, RANK_CAP, single)

    shard_dirs = []
    for k in (1, 0):  # shard 1 first: the merge must not depend on which shard finished first
        d = tmp_path / f"shard{k}"
        d.mkdir()
        part = shard_rows(rows, k, 2)
        assert [r["id"] for r in part] == [r["id"] for r in rows[k::2]]
        run_rollout(model, heads, part, NEW_TOKENS, RANK_CAP, d)
        shard_dirs.append(d)
    merged = tmp_path / "merged"
    merged.mkdir()
    summary = merge_rollouts(shard_dirs, [r["id"] for r in rows], merged)
    assert summary["prompts"] == len(rows) and summary["shards"] == 2

    assert_same_rollout(merged, single)
    # sanity: the rollout is not degenerate (every prompt has tokens, rank paths are within the cap)
    for r in load_rollout(merged):
        assert 1 <= len(r["tokens"]) <= NEW_TOKENS
        assert r["rank_paths"].shape == (len(r["tokens"]), heads.config.num_heads)
        assert r["rank_paths"].min() >= 0 and r["rank_paths"].max() <= RANK_CAP


def test_shard_rows_partition(rows: list[dict]) -> None:
    for n in (1, 2, 3, len(rows) + 1):
        parts = [shard_rows(rows, k, n) for k in range(n)]
        ids = sorted(r["id"] for p in parts for r in p)
        assert ids == sorted(r["id"] for r in rows), f"{n} shards do not partition the rows"
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="rollout.shard must be in"):
            shard_rows(rows, bad, 2)


def test_merge_refuses_missing_shard(runtime_pair, rows: list[dict], tmp_path: Path) -> None:
    model, heads = runtime_pair
    d = tmp_path / "shard0"
    d.mkdir()
    run_rollout(model, heads, shard_rows(rows[:2], 0, 2), 2, RANK_CAP, d)
    out = tmp_path / "merged"
    out.mkdir()
    with pytest.raises(ValueError, match=r"cannot merge: 1 prompts have no shard output \(first: test/1\)"):
        merge_rollouts([d], [r["id"] for r in rows[:2]], out)
    assert not (out / "rollout.safetensors").exists()


# ------------------------------------------------------------------------- through the launcher


def _pipeline(artifacts: Path, data: Path, bundle: TinyBundle, *overrides: str) -> subprocess.CompletedProcess:
    # model=local reads the tiny model in place; it sits where the model stage would have put it,
    # <artifacts>/models/<model.name> (older Layouts derived the model folder from the name)
    cmd = [python_exe(), "-m", "pipeline", *overrides,
           "model=local", f"model.name={MODEL_NAME}", f"model.path={artifacts / 'models' / MODEL_NAME}",
           f"heads.dir={bundle.heads_dir}", "heads.draft_vocab.size=null", "task=humaneval", "dtype=float32", "threads=1",
           "profile.calib_prompts=3", "profile.recalib_prompts=2", "profile.timing_prompts=1",
           f"profile.max_new_tokens={NEW_TOKENS}", f"artifacts_dir={artifacts}", f"data_dir={data}"]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(overrides)} failed:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_joblib_sharded_rollout_equals_single_process(bundle: TinyBundle, tmp_path: Path) -> None:
    data = tmp_path / "data"  # shared: the prepare stage is deterministic and skips an up-to-date split
    sharded, single = tmp_path / "sharded" / "artifacts", tmp_path / "single" / "artifacts"
    for art in (sharded, single):
        shutil.copytree(bundle.model_dir, art / "models" / MODEL_NAME)

    _pipeline(sharded, data, bundle, "-m", "stage=rollout", "rollout.num_shards=2", "rollout.shard=0,1",
              "hydra/launcher=joblib_shards", "hydra.launcher.n_jobs=2")
    work = sharded / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu"
    shards = [work / "shards" / f"{k}-of-2" for k in range(2)]
    for s in shards:
        assert (s / "manifest.json").is_file(), f"shard {s.name} was not written by the launcher"
    assert [len(load_rollout(s)) for s in shards] == [2, 1]
    merge = _pipeline(sharded, data, bundle, "stage=merge", "rollout.num_shards=2")
    assert "[rollout] up to date" in merge.stdout + merge.stderr, "merge re-ran a shard the launcher had written"

    _pipeline(single, data, bundle, "stage=merge", "rollout.num_shards=1")
    single_work = single / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu"
    assert_same_rollout(work / "rollout", single_work / "rollout")
    assert len(load_rollout(work / "rollout")) == 3
