"""Bad configuration fails at start-up (issue 7): exit status != 0, a message naming the setting and
what to do, no artifacts written, and no long work done.

The real CLI (`python -m pipeline ...`, a subprocess from the repo root) is run a few times with
several bad settings at once (validation reports every problem, so one run checks many); each
setting alone is checked in-process through hydra's compose API (fast), and once more through the
CLI in the slow suite.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.validate import ConfigError, config_problems, validate_config

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

# (overrides, words the message must contain): each alone makes the config unusable
BAD = {
    "unknown stage": (["stage=nope"], ["stage='nope'", "choose one of", "bank"]),
    "bad dtype": (["dtype=fp8"], ["dtype='fp8'", "float32", "bfloat16"]),
    "budget < 1": (["profile.grow_budget=0"], ["profile.grow_budget=0", ">= 1"]),
    "depth > heads": (["grow.max_depth=5"], ["grow.max_depth=5", "heads.num_heads=4", "grow.max_depth<=4"]),
    "shard >= num_shards": (["rollout.shard=2", "rollout.num_shards=2"], ["rollout.shard=2", "[0, rollout.num_shards=2)"]),
    "tau_off > tau_on": (["policy.tau_on=0.1", "policy.tau_off=0.5"], ["policy.tau_off=0.5 > policy.tau_on=0.1", "tau_off <= tau_on"]),
    "ladder thresholds": (["policy=ladder", "policy.thresholds=[0.5,0.3]"], ["policy.thresholds", "strictly increasing"]),
    "unknown policy name": (["policy.name=nope"], ["policy.name", "hysteresis", "ladder"]),
    "missing model folder": (["model=local", "model.path=/nope"], ["model.path=/nope", "not a folder", "Hugging Face"]),
    "model path not set": (["model=local"], ["model.path is required", "model.path=..."]),
    "negative threads": (["threads=0"], ["threads=0", ">= 1"]),
    "cache too small": (["model.max_seq_len=512"], ["model.max_seq_len=512", "max_prompt_tokens", "raise model.max_seq_len"]),
    "unknown train task": (["heads.train.tasks=[humaneval,nope]"], ["heads.train.tasks", "'nope'", "conf/task"]),
    "task schema": (["task.overlong=drop"], ["task", "overlong", "'drop'"]),
    "bank members": (["bank.members=all"], ["bank.members='all'", "hull", "oracle"]),
    "taus on a ladder": (["policy=ladder", "policy.tau_on=0.5"], ["policy.tau_on", "only apply to the hysteresis"]),
}


def _compose(overrides: list[str], tmp: Path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"artifacts_dir={tmp}", f"data_dir={tmp}"])


def _fake_model_dir(tmp: Path) -> Path:
    """Only presence is checked at start-up, so empty files make a folder that passes."""
    d = tmp / "model"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        (d / f).write_text("{}")
    return d


# ------------------------------------------------------------------------------ in-process
def test_default_config_is_valid(tmp_path: Path) -> None:
    model = _fake_model_dir(tmp_path)
    for extra in ([], ["policy=ladder"], ["policy=static"], ["policy=expected_throughput"], ["heads=hydra_pp"],
                  ["profile=paper"], ["++policy.tau_on=0.5", "++policy.tau_off=0.2"],
                  ["policy=ladder", "++policy.thresholds=[0.2,0.5,0.9]"], ["rollout.num_shards=4", "rollout.shard=3"]):
        cfg = _compose(["model=local", f"model.path={model}", *extra], tmp_path)
        assert config_problems(cfg) == [], extra
        validate_config(cfg)  # does not raise


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_setting_alone_is_caught(case: str, tmp_path: Path) -> None:
    overrides, words = BAD[case]
    if not any(o.startswith("model=") for o in overrides):
        overrides = ["model=local", f"model.path={_fake_model_dir(tmp_path)}", *overrides]
    cfg = _compose(overrides, tmp_path)
    problems = config_problems(cfg)
    assert len(problems) == 1, problems
    for w in words:
        assert w in problems[0], (w, problems[0])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.code != 0 and words[0] in str(e.value.code)


def test_fixed_policy_values_are_used_by_the_fitter() -> None:
    """The config's fixed tau_on/tau_off (thresholds) reach the bank: only the trees are fitted."""
    from pipeline.fit_policy import fit_all_policies
    from tests.helpers import synthetic_rollouts

    rolls = synthetic_rollouts(4, 64, 3, rank_cap=6, seed=1)
    trees = [[(0,)], [(0,), (0, 0), (1,)], [(0,), (0, 0), (0, 0, 0), (1,), (0, 1)]]
    costs = [0.010, 0.011, 0.013]
    out = fit_all_policies(rolls, trees, costs, {"name": "hysteresis", "signal": "p0", "tau_on": 0.7, "tau_off": 0.3})
    h = out["policies"]["hysteresis"]["policy"]
    assert (h["tau_on"], h["tau_off"], h["signal"]) == (0.7, 0.3, "p0")
    out = fit_all_policies(rolls, trees, costs, {"name": "hysteresis", "signal": "p0", "tau_on": 0.4})
    h = out["policies"]["hysteresis"]["policy"]
    assert h["tau_on"] == h["tau_off"] == 0.4  # one of the two alone: tau_on = tau_off
    out = fit_all_policies(rolls, trees, costs, {"name": "ladder", "signal": "p0", "thresholds": [0.25, 0.75]})
    lad = out["policies"]["ladder"]["policy"]
    assert lad["thresholds"] == [0.25, 0.75] and len(lad["trees"]) == 3
    assert lad["trees"] == sorted(lad["trees"])


# ------------------------------------------------------------------------------ real CLI
def _cli(args: list[str], tmp: Path) -> tuple[int, str, float, float]:
    """Run the CLI; returns (status, stdout+stderr, wall s, child CPU s). CPU time is what shows
    that no long work ran: the machine is shared, so wall time alone would be noisy."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args, f"artifacts_dir={tmp}", f"data_dir={tmp}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.returncode, proc.stdout + proc.stderr, wall, cpu


def _assert_failed_fast(tmp: Path, wall: float, cpu: float) -> None:
    # hydra writes its own run log under artifacts_dir/logs before the job starts; nothing else may exist
    written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.relative_to(tmp).parts[0] != "logs")
    assert written == [], f"a failed start-up wrote {written}"
    assert cpu < 15.0, f"start-up validation used {cpu:.1f} s of CPU: long work ran before the check"
    assert wall < 120.0, f"took {wall:.1f} s"


def test_cli_reports_every_bad_setting_at_once(tmp_path: Path) -> None:
    cases = ["unknown stage", "bad dtype", "budget < 1", "depth > heads", "shard >= num_shards", "tau_off > tau_on",
             "missing model folder"]
    args = [o for c in cases for o in BAD[c][0]]
    rc, out, wall, cpu = _cli(args, tmp_path)
    assert rc != 0
    assert f"invalid configuration ({len(cases)} problems)" in out, out
    for c in cases:
        for w in BAD[c][1]:
            assert w in out, (c, w, out)
    assert "Traceback" not in out, out
    _assert_failed_fast(tmp_path, wall, cpu)


def test_cli_ladder_thresholds(tmp_path: Path) -> None:
    rc, out, wall, cpu = _cli([*BAD["ladder thresholds"][0], "stage=grow"], tmp_path)
    assert rc != 0 and all(w in out for w in BAD["ladder thresholds"][1]), out
    _assert_failed_fast(tmp_path, wall, cpu)


@pytest.mark.parametrize("group,option,listed", [("task", "nope", ["humaneval", "gsm8k", "sharegpt"]),
                                                   ("policy", "nope", ["hysteresis", "ladder", "static"])])
def test_cli_unknown_group_option_lists_the_choices(group: str, option: str, listed: list[str], tmp_path: Path) -> None:
    """Caught by hydra while composing (before our code runs); its message names the group and its options."""
    rc, out, wall, cpu = _cli([f"{group}={option}"], tmp_path)
    assert rc != 0
    assert f"Could not find '{group}/{option}'" in out and f"Available options in '{group}'" in out, out
    for name in listed:
        assert name in out, out
    _assert_failed_fast(tmp_path, wall, cpu)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD))
def test_cli_each_bad_setting_alone(case: str, tmp_path: Path) -> None:
    overrides, words = BAD[case]
    rc, out, wall, cpu = _cli(overrides, tmp_path)
    assert rc != 0, out
    for w in words:
        assert w in out, (w, out)
    _assert_failed_fast(tmp_path, wall, cpu)


def test_multirun_with_the_default_artifacts_dir(tmp_path: Path, smollm2_dir: Path) -> None:
    """`make banks` is a hydra multirun with the default `artifacts_dir` (an interpolation of
    ${hydra:runtime.cwd}): the sweep dir must resolve before hydra's runtime config exists."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", "-m", "stage=model", "task=humaneval,gsm8k", "model=local",
                           f"model.path={smollm2_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "#0 : stage=model" in out and "#1 : stage=model" in out, out
    assert (tmp_path / "artifacts" / "logs" / "multirun").is_dir()


# ------------------------------------------------------------------------------ typed schema
@pytest.mark.parametrize("override,path", [("heads.train.lr=fast", "heads.train.lr"),
                                           ("profile.calib_prompts=many", "profile.calib_prompts"),
                                           ("grow.candidate_sizes=[1,x]", "grow.candidate_sizes"),
                                           ("time.prune=maybe", "time.prune")])
def test_a_wrong_type_fails_at_compose_naming_the_field(override: str, path: str, tmp_path: Path) -> None:
    with pytest.raises(Exception) as e:
        _compose([override], tmp_path)
    assert path in str(e.value), str(e.value)


@pytest.mark.parametrize("path", ["heads.train.learning_rate", "model.weights", "grow.depth", "sampling.temp"])
def test_an_unknown_key_fails_naming_the_field(path: str, tmp_path: Path) -> None:
    """Refused by hydra while composing; forced in with `+key=` (hydra's explicit append), refused by
    the start-up validation."""
    with pytest.raises(Exception) as e:
        _compose([f"{path}=1"], tmp_path)
    assert path in str(e.value), str(e.value)
    problems = config_problems(_compose([f"+{path}=1"], tmp_path))
    assert any(p.startswith(f"{path} is not a setting") for p in problems), problems


def test_an_unknown_key_in_a_yaml_file_fails_naming_the_field(tmp_path: Path) -> None:
    """A group file with a key the schema does not declare (a typo) is refused, not ignored."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "profile" / "typo.yaml").write_text((CONF / "profile" / "cpu.yaml").read_text() + "calib_promts: 3\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"), pytest.raises(Exception) as e:
        compose("config", overrides=["profile=typo"])
    assert "profile.calib_promts" in str(e.value), str(e.value)


def test_cfg_job_prints_the_whole_typed_config(tmp_path: Path) -> None:
    """Every schema default shows up, including the ones no YAML file states (heads.train, sampling)."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--cfg", "job"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    import yaml

    printed = yaml.safe_load(proc.stdout)
    assert printed["heads"]["train"]["max_prompts"] == 400 and printed["heads"]["train"]["lr"] == 1.5e-3
    assert printed["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    assert printed["model"]["chat_template"] is None and printed["heads"]["dir"] is None
    assert printed["grow"]["candidate_sizes"][0] == 0 and printed["bank"]["members"] == "oracle"
