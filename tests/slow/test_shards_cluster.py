"""Rollout shards through the cluster launchers, for real: merged, byte-identical to one process.

Ray: a Ray head started here on 127.0.0.1 (`ray start --head --block`, two CPUs, no GPU, token
authentication), `python -m pipeline -m stage=rollout rollout.num_shards=2 rollout.shard=0,1
hydra/launcher=ray_shards` with RAY_ADDRESS pointing at it (what a user does for a remote
cluster), then `stage=merge`; and the same sweep without RAY_ADDRESS, which starts a Ray instance
of its own. Submitit: the same through `hydra/launcher=submitit_local_shards`
(submitit's local executor: each shard a separate process that submitit starts and watches,
the way it runs Slurm jobs). Both against `stage=merge rollout.num_shards=1` in another artifacts
folder: every file of the merged rollout equal byte for byte.

Slow (each starts several interpreters). Fast: what each launcher config asks of the cluster
(composed, not run), Slurm's included. Everything here is skipped where the launchers are not
installed: `pip install ".[ray]"` / `".[slurm]"` over `make install` (the ray extra holds joblib below
1.6, whose cloudpickle >= 3 the Ray launcher's cloudpickle < 3 rules out).
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.artifacts import MANIFEST
from pipeline.rollout.record import load_rollout
from tests.helpers import MODEL_NAME, REPO, TinyBundle, python_exe, subprocess_env, tiny_pipeline_overrides

SHARDS = 2
CALIB_PROMPTS = 3  # tiny_pipeline_overrides' profile.calib_prompts: shard 0 gets 2 prompts, shard 1 gets 1


def _work(artifacts: Path) -> Path:
    """The rollout stages' folder for the tiny setup (task humaneval, profile cpu)."""
    return artifacts / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu"


def _artifacts(root: Path, bundle: TinyBundle) -> Path:
    """A fresh artifacts folder holding the tiny model where `model=local` expects it."""
    artifacts = root / "artifacts"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    return artifacts


def _pipeline(artifacts: Path, data: Path, bundle: TinyBundle, *overrides: str, multirun: bool = False,
              env: dict[str, str] | None = None) -> str:
    """`python -m pipeline [-m]` on the tiny setup; returns its stdout + stderr (fails the test on an error)."""
    cmd = [python_exe(), "-m", "pipeline", *(["-m"] if multirun else []),
           *tiny_pipeline_overrides(artifacts, data, bundle, *overrides)]
    proc = subprocess.run(cmd, cwd=REPO, env=env or subprocess_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(overrides)} failed:\n{out[-6000:]}"
    return out


def _assert_same_bytes(merged: Path, single: Path) -> None:
    """Every file of the two rollout folders equal byte for byte, and the same manifest key (the
    manifests' summaries and timings say how each was made, so they are not compared)."""
    files = sorted(p.name for p in single.iterdir() if p.name != MANIFEST)
    assert sorted(p.name for p in merged.iterdir() if p.name != MANIFEST) == files
    for name in files:
        assert (merged / name).read_bytes() == (single / name).read_bytes(), f"{name} differs from the single-process rollout"
    assert json.loads((merged / MANIFEST).read_text())["key"] == json.loads((single / MANIFEST).read_text())["key"]


def _sweep_and_merge(tmp_path: Path, data: Path, bundle: TinyBundle, single: Path, launcher: str,
                     env: dict[str, str], *extra: str) -> str:
    """The documented sweep of the shards through `launcher`, then the merge; checks the shards
    were written by the sweep (the merge reran none) and the merged rollout equals `single`."""
    artifacts = _artifacts(tmp_path / launcher, bundle)
    out = _pipeline(artifacts, data, bundle, "stage=rollout", f"rollout.num_shards={SHARDS}",
                    f"rollout.shard={','.join(map(str, range(SHARDS)))}", f"hydra/launcher={launcher}",
                    f"hydra.sweep.dir={tmp_path / launcher / 'sweep'}", *extra, multirun=True, env=env)
    shards = [_work(artifacts) / "shards" / f"{k}-of-{SHARDS}" for k in range(SHARDS)]
    for s in shards:
        assert (s / MANIFEST).is_file(), f"shard {s.name} was not written by the {launcher} sweep:\n{out[-4000:]}"
    assert [len(load_rollout(s)) for s in shards] == [2, 1]
    merge = _pipeline(artifacts, data, bundle, "stage=merge", f"rollout.num_shards={SHARDS}")
    assert "[rollout] up to date" in merge, "merge re-ran a shard the launcher had written"
    _assert_same_bytes(_work(artifacts) / "rollout", single)
    assert len(load_rollout(_work(artifacts) / "rollout")) == CALIB_PROMPTS
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by every run here: the prepare stage is deterministic and skips an up-to-date split."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def single(bundle: TinyBundle, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process rollout (`stage=merge rollout.num_shards=1`), the reference."""
    artifacts = _artifacts(tmp_path_factory.mktemp("single"), bundle)
    _pipeline(artifacts, data_dir, bundle, "stage=merge", "rollout.num_shards=1")
    return _work(artifacts) / "rollout"


def _ray_env() -> dict[str, str]:
    """The children's environment for Ray, with token authentication (Ray's default for a new
    cluster) and a token of this test's own: Ray otherwise reads and writes ~/.ray/auth_token,
    and a head started where that file exists refuses a driver that joins by address without it."""
    env = {k: v for k, v in subprocess_env().items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def needs_ray() -> None:
    """Skips the test (before its costlier fixtures) where Ray or its Hydra launcher is missing."""
    pytest.importorskip("ray", reason='Ray is not installed: pip install -e ".[pipeline,ray]"')
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason='hydra-ray-launcher is not installed: pip install -e ".[pipeline,ray]"')


@pytest.fixture
def needs_submitit() -> None:
    """Skips the test (before its costlier fixtures) where submitit or its Hydra launcher is missing."""
    pytest.importorskip("submitit", reason='submitit is not installed: pip install -e ".[pipeline,slurm]"')
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason='hydra-submitit-launcher is not installed: pip install -e ".[pipeline,slurm]"')


@pytest.fixture
def ray_head(needs_ray: None, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head on 127.0.0.1 with two CPUs and no GPU; yields its address and the environment
    (its auth token) that a driver needs to join it.

    Started with `--block` and stopped by signalling that process (it shuts its own Ray
    processes down): `ray stop` would stop every Ray instance of this user on the machine."""
    port = _free_port()
    # Ray's unix sockets live under --temp-dir, whose path must stay short (pytest's tmp_path may not)
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    log = tmp_path / "ray_head.log"
    cmd = [str(Path(python_exe()).parent / "ray"), "start", "--head", "--block", f"--port={port}",
           "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
           "--disable-usage-stats", f"--temp-dir={temp}"]
    env = _ray_env()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start (exit {proc.poll()}):\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # its Ray processes share its fate (prctl PDEATHSIG)
            proc.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_shards_on_a_running_cluster(ray_head: tuple[str, dict[str, str]], bundle: TinyBundle, data_dir: Path,
                                         single: Path, tmp_path: Path) -> None:
    address, env = ray_head
    out = _sweep_and_merge(tmp_path, data_dir, bundle, single, "ray_shards", {**env, "RAY_ADDRESS": address})
    # the shards ran as tasks of that cluster (Ray reports the head by the address it advertises)
    assert "Ray Launcher is launching 2 jobs" in out
    port = address.rsplit(":", 1)[1]
    assert re.search(rf"Connecting to existing Ray cluster at address: \S+:{port}\b", out), out[-4000:]
    assert re.search(r"\(_run_job pid=\d+\).*\[rollout\] wrote", out), "no shard was written by a Ray worker"


@pytest.mark.slow
def test_ray_shards_without_an_address_start_a_local_instance(needs_ray: None, bundle: TinyBundle, data_dir: Path,
                                                               single: Path, tmp_path: Path) -> None:
    env = _ray_env()  # no RAY_ADDRESS
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # not Ray's default /tmp/ray; short, as above
    try:
        out = _sweep_and_merge(tmp_path, data_dir, bundle, single, "ray_shards", env,
                               f"+hydra.launcher.ray.init._temp_dir={temp}")
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "Connecting to existing Ray cluster" not in out
    assert "Started a local Ray instance" in out, out[-4000:]
    assert re.search(r"\(_run_job pid=\d+\).*\[rollout\] wrote", out), "no shard was written by a Ray worker"


@pytest.mark.slow
def test_submitit_local_shards_merged_equal_single_process(needs_submitit: None, bundle: TinyBundle, data_dir: Path,
                                                           single: Path, tmp_path: Path) -> None:
    out = _sweep_and_merge(tmp_path, data_dir, bundle, single, "submitit_local_shards", subprocess_env())
    assert "Submitit 'local' sweep output dir" in out
    # each shard ran as a submitit job (a process submitit started and collected the result of)
    results = sorted((tmp_path / "submitit_local_shards" / "sweep" / ".submitit").glob("*/*_result.pkl"))
    assert len(results) == SHARDS, results


# ------------------------------------------------------------------ what the launchers ask for


LAUNCHERS = {  # config: (plugin module, where the shard's CPUs and GPUs are asked for)
    "ray_shards": ("hydra_plugins.hydra_ray_launcher", "ray.remote.num_cpus", "ray.remote.num_gpus"),
    "submitit_local_shards": ("hydra_plugins.hydra_submitit_launcher", "cpus_per_task", "gpus_per_node"),
    "submitit_shards": ("hydra_plugins.hydra_submitit_launcher", "cpus_per_task", "gpus_per_node"),
}


def _launcher(name: str, keys: tuple[str, ...], *overrides: str, env: dict[str, str | None] | None = None) -> list:
    """The values at `keys` of hydra.launcher for `hydra/launcher=<name>`, composed with the
    pipeline's config (whose `threads` and `profile` its interpolations read) and resolved under
    `env` (None: unset)."""
    from hydra import compose, initialize_config_dir

    import pipeline.config.schema  # noqa: F401 - registers the typed config schemas with hydra
    from pipeline.paths import CONF_DIR

    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v) if v is not None else mp.delenv(k, raising=False)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"hydra/launcher={name}", *overrides], return_hydra_config=True)
        return [OmegaConf.select(cfg.hydra.launcher, k, throw_on_missing=True) for k in keys]


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_asks_for_threads_cpus_and_no_gpu_on_the_cpu_profile(name: str) -> None:
    module, cpus, gpus = LAUNCHERS[name]
    pytest.importorskip(module, reason=f'{module} is not installed: pip install -e ".[pipeline,ray,slurm]"')
    for threads in (1, 4):
        asked_cpus, asked_gpus = _launcher(name, (cpus, gpus), "profile=cpu", f"threads={threads}")
        # none: a CPU cluster has no GPU, and a shard asking for one would never start
        assert asked_gpus == 0, f"{name} asks for a GPU on the cpu profile"
        assert asked_cpus == threads


def test_ray_address_from_the_environment() -> None:
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason='hydra-ray-launcher is not installed: pip install -e ".[pipeline,ray]"')
    # unset: null, i.e. a Ray instance of the sweep's own on this machine (not `auto`, which fails
    # where no cluster runs)
    address = ("ray.init.address",)
    assert _launcher("ray_shards", address, env={"RAY_ADDRESS": None}) == [None]
    assert _launcher("ray_shards", address, env={"RAY_ADDRESS": "10.0.0.5:6379"}) == ["10.0.0.5:6379"]
    assert _launcher("ray_shards", address, "hydra.launcher.ray.init.address=auto", env={"RAY_ADDRESS": None}) == ["auto"]
    # set, so that the launcher does not put in its 75 MB, which Ray refuses when joining a running cluster
    assert _launcher("ray_shards", ("ray.init.object_store_memory",)) == [None]


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_asks_for_the_gpu_profile_s_gpu(name: str) -> None:
    module, _, gpus = LAUNCHERS[name]
    pytest.importorskip(module, reason=f'{module} is not installed: pip install -e ".[pipeline,ray,slurm]"')
    assert _launcher(name, (gpus,), "profile=paper", "device=cuda") == [1]
    assert _launcher(name, (gpus,), "profile=paper", "profile.shard_gpus=2") == [2]
