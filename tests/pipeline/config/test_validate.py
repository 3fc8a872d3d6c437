"""Bad configuration fails at start-up (issue 7): exit status != 0, a message naming the setting and
what to do, no artifacts written, and no long work done.

The real CLI (`python -m pipeline ...`'s module, a subprocess from the repo root) is run a few times
with several bad settings at once (validation reports every problem, so one run checks many); each
setting alone is checked in-process through hydra's compose API (fast), and once more through the
CLI in the slow suite. "No long work" is checked without a clock: the CLI runs with the stage graph's
entry (`pipeline.graph.stage_output`) replaced by a probe that reports any stage it is asked for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.paths import REPO_ROOT
from pipeline.config.validate import ConfigError, config_problems, validate_config

ROOT = REPO_ROOT
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
    # the own output layer's size (output=draft) given for shared-output heads: the FR-Spec setting is meant
    "draft vocab sizes mixed up": (["heads.draft_vocab_size=8192"], ["heads.draft_vocab_size=8192", "heads.output=draft",
                                                                     "heads.draft_vocab.size=8192"]),
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
    from pipeline.bank.policies import fit_all_policies
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
# `python -m pipeline <args>` (the same module, argv and hydra app), except that asking the stage
# graph for any stage's output prints a marker and exits: a start-up that fails on the config must
# fail before that, i.e. before any long work (loading a model, rollouts, timing)
STARTUP_PROBE = """
import runpy
import pipeline.graph as graph
def stage_started(name, cfg):
    print(f"{MARKER}{name!r}", flush=True)
    raise SystemExit(99)
graph.stage_output = stage_started
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""
STAGE_STARTED = "startup probe: stage started: "


def _cli(args: list[str], tmp: Path) -> tuple[int, str]:
    """Run the CLI under the start-up probe; returns (status, stdout+stderr)."""
    probe = STARTUP_PROBE.replace("{MARKER}", STAGE_STARTED)
    proc = subprocess.run([sys.executable, "-c", probe, *args, f"artifacts_dir={tmp}", f"data_dir={tmp}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    return proc.returncode, proc.stdout + proc.stderr


def _assert_failed_fast(tmp: Path, out: str) -> None:
    # hydra writes its own run log under artifacts_dir/logs before the job starts; nothing else may exist
    written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.relative_to(tmp).parts[0] != "logs")
    assert written == [], f"a failed start-up wrote {written}"
    assert STAGE_STARTED not in out, f"a stage started before the config was refused: {out}"


def test_the_startup_probe_sees_a_stage_start(tmp_path: Path) -> None:
    """A valid config gets past validation to the stage graph, where the probe stops it (so the
    probe's silence above means no stage started)."""
    rc, out = _cli(["stage=merge", "model=local", f"model.path={_fake_model_dir(tmp_path)}"], tmp_path / "out")
    assert rc == 99 and f"{STAGE_STARTED}'merge'" in out, out


def test_cli_reports_every_bad_setting_at_once(tmp_path: Path) -> None:
    cases = ["unknown stage", "bad dtype", "budget < 1", "depth > heads", "shard >= num_shards", "tau_off > tau_on",
             "missing model folder"]
    args = [o for c in cases for o in BAD[c][0]]
    rc, out = _cli(args, tmp_path)
    assert rc != 0
    assert f"invalid configuration ({len(cases)} problems)" in out, out
    for c in cases:
        for w in BAD[c][1]:
            assert w in out, (c, w, out)
    assert "Traceback" not in out, out
    _assert_failed_fast(tmp_path, out)


def test_cli_ladder_thresholds(tmp_path: Path) -> None:
    rc, out = _cli([*BAD["ladder thresholds"][0], "stage=grow"], tmp_path)
    assert rc != 0 and all(w in out for w in BAD["ladder thresholds"][1]), out
    _assert_failed_fast(tmp_path, out)


@pytest.mark.parametrize("group,option,listed", [("task", "nope", ["humaneval", "gsm8k", "sharegpt"]),
                                                   ("policy", "nope", ["hysteresis", "ladder", "static"])])
def test_cli_unknown_group_option_lists_the_choices(group: str, option: str, listed: list[str], tmp_path: Path) -> None:
    """Caught by hydra while composing (before our code runs); its message names the group and its options."""
    rc, out = _cli([f"{group}={option}"], tmp_path)
    assert rc != 0
    assert f"Could not find '{group}/{option}'" in out and f"Available options in '{group}'" in out, out
    for name in listed:
        assert name in out, out
    _assert_failed_fast(tmp_path, out)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD))
def test_cli_each_bad_setting_alone(case: str, tmp_path: Path) -> None:
    overrides, words = BAD[case]
    rc, out = _cli(overrides, tmp_path)
    assert rc != 0, out
    for w in words:
        assert w in out, (w, out)
    _assert_failed_fast(tmp_path, out)


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


# ------------------------------------------------------------------------------ every conf file
# Each file under conf/<group>/ (and conf/hydra/launcher/) composed on its own, as `python -m pipeline
# <group>=<name>` would, against the typed schema. Nothing here may download or build anything.
# (conf/experiment/ files set several groups at once, in the global package: checked by their own tests below)
GROUP_FILES = sorted(f"{p.parent.name}/{p.stem}" for p in CONF.glob("*/*.yaml") if p.parent.name not in ("hydra", "experiment"))
EXPERIMENT_FILES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
LAUNCHER_FILES = sorted(p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml"))

# The overrides an option needs before it is usable: the fields its file leaves required (`???`, or
# documented as required). `{model}` / `{hydra_heads}` / `{medusa_heads}` are stand-in folders made
# by `_stand_ins` (start-up validation only checks that they are such folders).
REQUIRED = {
    # path: null, "required: model.path=/path/to/folder" (validate refuses model=local without it)
    "model/local": ["model.path={model}"],
    # repo_id: ??? (a hub id; nothing is downloaded while composing or validating)
    "model/hub": ["model.repo_id=lmsys/vicuna-7b-v1.3"],
    # dir: ??? (the published heads folder: config.json with hydra_num_heads / medusa_num_heads)
    "heads/published_hydra_pp": ["heads.dir={hydra_heads}"],
    "heads/published_hydra": ["heads.dir={hydra_heads}"],
    "heads/published_medusa": ["heads.dir={medusa_heads}"],
}

# The launcher plugins' own config nodes (what each of our launcher files extends), for plugins this
# environment lacks: field names and types as in the plugins' config.py (hydra-submitit-launcher 1.2
# SlurmQueueConf, hydra-ray-launcher 1.2 RayLauncherConf). With the plugin installed the real one is used.
LAUNCHER_PLUGINS = {  # our file -> (plugin config it extends, plugin module, its launcher class)
    "joblib_shards": ("joblib", "hydra_plugins.hydra_joblib_launcher",
                      "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
    "ray_shards": ("ray", "hydra_plugins.hydra_ray_launcher", "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"),
    "submitit_shards": ("submitit_slurm", "hydra_plugins.hydra_submitit_launcher",
                        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
    "submitit_local_shards": ("submitit_local", "hydra_plugins.hydra_submitit_launcher",
                              "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"),
}


def _plugin_stand_in(name: str) -> type:
    from dataclasses import field, make_dataclass
    from typing import Any, Dict, List, Optional

    if name == "ray":  # (built with make_dataclass: this module's annotations are strings)
        RayConf = make_dataclass("RayConf", [("init", Dict[str, Any], field(default_factory=lambda: {"address": None})),
                                             ("remote", Dict[str, Any], field(default_factory=dict))])
        return make_dataclass("RayLauncherConf", [("_target_", str, field(default=LAUNCHER_PLUGINS["ray_shards"][2])),
                                                  ("ray", RayConf, field(default_factory=RayConf))])
    assert name in ("submitit_slurm", "submitit_local"), name
    ours = "submitit_shards" if name == "submitit_slurm" else "submitit_local_shards"
    fields = [("_target_", str, LAUNCHER_PLUGINS[ours][2]),
              ("submitit_folder", str, "${hydra.sweep.dir}/.submitit/%j"), ("timeout_min", int, 60),
              ("cpus_per_task", Optional[int], None), ("gpus_per_node", Optional[int], None), ("tasks_per_node", int, 1),
              ("mem_gb", Optional[int], None), ("nodes", int, 1), ("name", str, "${hydra.job.name}"),
              ("stderr_to_stdout", bool, False)]
    if name == "submitit_local":  # the plugin's BaseQueueConf fields only
        return make_dataclass("LocalQueueConf", [(n, t, field(default=d)) for n, t, d in fields])
    fields += [("partition", Optional[str], None), ("qos", Optional[str], None),
              ("comment", Optional[str], None), ("constraint", Optional[str], None), ("exclude", Optional[str], None),
              ("gres", Optional[str], None), ("cpus_per_gpu", Optional[int], None), ("gpus_per_task", Optional[int], None),
              ("mem_per_gpu", Optional[str], None), ("mem_per_cpu", Optional[str], None), ("account", Optional[str], None),
              ("signal_delay_s", int, 120), ("max_num_timeout", int, 0), ("array_parallelism", int, 256),
              ("setup", Optional[List[str]], None)]
    return make_dataclass("SlurmQueueConf", [(n, t, field(default=d)) for n, t, d in fields]
                          + [("additional_parameters", Dict[str, Any], field(default_factory=dict))])


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Composing and validating must not reach the network: any connection attempt fails the test."""
    import socket

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError(f"network access while composing/validating: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def stand_ins(tmp_path: Path) -> dict[str, str]:
    """A model folder, published Hydra / Medusa heads folders and an EAGLE-3 drafter folder that pass start-up validation
    (which checks only their files' presence and the heads config's kind keys)."""
    import json

    out = {"model": str(_fake_model_dir(tmp_path))}
    for key, conf in (("hydra_heads", {"hydra_num_heads": 4, "hydra_num_layers": 4}), ("medusa_heads", {"medusa_num_heads": 5}),
                      ("eagle3_drafter", {"speculators_model_type": "eagle3"})):
        d = tmp_path / key
        d.mkdir()
        (d / "config.json").write_text(json.dumps(conf))
        out[key] = str(d)
    return out


def _file_values(path: Path) -> dict:
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    values.pop("defaults", None)
    return values


def _assert_holds(composed: dict, file_values: dict, where: str, supplied: dict[str, str]) -> None:
    """Every value the file sets is the composed one (unresolved interpolations compared as written);
    a field the file leaves required holds the value the test supplied."""
    for key, want in file_values.items():
        path = f"{where}.{key}"
        assert key in composed, f"{path} set by the file is not in the composed config"
        got = composed[key]
        if path in supplied:  # a value the file leaves required (`???`, or null documented as required)
            assert str(got) == supplied[path], (path, got)
        elif want == "???":
            raise AssertionError(f"{path} is required by the file but the test supplies no value (add it to REQUIRED)")
        elif isinstance(want, dict) and want:
            assert isinstance(got, dict), (path, got)
            _assert_holds(got, want, path, supplied)
        else:
            assert got == want, f"{path}: file says {want!r}, composed {got!r}"


def _required(option: str, stand_ins: dict[str, str]) -> list[str]:
    return [o.format(**stand_ins) for o in REQUIRED.get(option, [])]


@pytest.mark.parametrize("option", GROUP_FILES)
def test_every_group_file_composes_and_validates(option: str, tmp_path: Path, stand_ins: dict[str, str], offline: None) -> None:
    from omegaconf import OmegaConf

    from pipeline.graph import compose_cfg

    group, name = option.split("/")
    required = _required(option, stand_ins)
    cfg = compose_cfg([f"{group}={name}", *required, f"artifacts_dir={tmp_path / 'a'}", f"data_dir={tmp_path / 'd'}"])
    file_values = _file_values(CONF / group / f"{name}.yaml")
    assert "name" in file_values, f"conf/{option}.yaml sets no name"
    supplied = dict(o.split("=", 1) for o in required)
    _assert_holds(OmegaConf.to_container(cfg[group], resolve=False), file_values, group, supplied)
    if group == "model" and name == "hub":
        assert cfg.model.name == supplied["model.repo_id"]  # name: ${oc.select:model.repo_id,hub}
    else:
        assert cfg[group].name == file_values["name"]
    assert config_problems(cfg) == []
    validate_config(cfg)  # does not raise
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists(), "composing/validating wrote files"


def test_required_overrides_cover_every_required_field() -> None:
    """Each `???` in a conf file has its value supplied in REQUIRED (so the test above composes it honestly)."""
    def missing(values: dict, prefix: str) -> list[str]:
        out = []
        for k, v in values.items():
            if v == "???":
                out.append(f"{prefix}.{k}")
            elif isinstance(v, dict):
                out += missing(v, f"{prefix}.{k}")
        return out

    for option in GROUP_FILES:
        group = option.split("/")[0]
        supplied = {o.split("=", 1)[0] for o in REQUIRED.get(option, [])}
        for key in missing(_file_values(CONF / f"{option}.yaml"), group):
            assert key in supplied, f"conf/{option}.yaml leaves {key} required; add it to REQUIRED"


# What start-up validation says when the required field is left unset
UNSET_MESSAGE = {
    "model/local": "model.path is required for model=local; pass model.path=...",
    "model/hub": "model.repo_id is required for model=hub; pass e.g. model.repo_id=",
    # `dir: ???`: refused (not composed as heads.dir=null, which would train heads under the published name)
    **{f"heads/published_{kind}": (f"heads.dir is required for heads.name={kind}_published (published heads, imported "
                                   "from their folder); pass heads.dir=/path/to/the/downloaded/folder")
       for kind in ("hydra_pp", "hydra", "medusa")},
}


@pytest.mark.parametrize("option", sorted(REQUIRED))
def test_a_required_field_left_unset_is_refused_helpfully(option: str, tmp_path: Path, offline: None) -> None:
    from pipeline.graph import compose_cfg

    group, name = option.split("/")
    cfg = compose_cfg([f"{group}={name}", f"artifacts_dir={tmp_path}", f"data_dir={tmp_path}"])
    field = REQUIRED[option][0].split("=", 1)[0]
    problems = config_problems(cfg)
    assert len(problems) == 1 and field in problems[0], problems
    assert UNSET_MESSAGE[option] in problems[0], problems
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.code != 0 and UNSET_MESSAGE[option] in str(e.value.code)


# conf/experiment/<name>.yaml -> (the heads group it picks, the stand-in heads folder, resolved values it gives)
EXPERIMENTS = {
    "paper": ("published_hydra_pp", "hydra_heads",
              {"model.name": "vicuna-7b-v1.3", "heads.name": "hydra_pp_published", "heads.num_heads": 4,
               "profile.name": "paper", "device": "cuda", "dtype": "float16", "task.name": "humaneval", "stage": "bank"}),
    "paper_medusa": ("published_medusa", "medusa_heads",
                     {"model.name": "vicuna-7b-v1.3", "heads.name": "medusa_published", "heads.num_heads": 5,
                      "profile.name": "paper", "device": "cuda", "dtype": "float16", "task.name": "humaneval",
                      "stage": "bank"}),
}


def test_every_experiment_file_is_checked() -> None:
    assert EXPERIMENT_FILES == sorted(EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_the_paper_experiments_compose(name: str, stand_ins: dict[str, str], tmp_path: Path, offline: None) -> None:
    """`experiment=paper` (published Hydra++ heads on Vicuna-7B, paper profile, float16 on a GPU) and its
    Medusa twin: the same config as their groups and settings spelled out on the command line; valid
    as a whole (without a GPU, the one problem is the helpful device message); the command line
    overrides them; without heads.dir, refused with the setting to pass."""
    import torch
    from omegaconf import OmegaConf

    from pipeline.graph import compose_cfg, plain

    heads, stand_in, values = EXPERIMENTS[name]
    paths = [f"artifacts_dir={tmp_path}", f"data_dir={tmp_path}"]
    cfg = compose_cfg([f"experiment={name}", f"heads.dir={stand_ins[stand_in]}", *paths])
    assert {k: OmegaConf.select(cfg, k) for k in values} == values
    if name == "paper":
        assert (cfg.model.name, cfg.heads.name, cfg.profile.name, cfg.dtype) == ("vicuna-7b-v1.3", "hydra_pp_published",
                                                                                "paper", "float16")
    spelled_out = compose_cfg(["stage=bank", "task=humaneval", "model=vicuna7b", f"heads={heads}",
                               f"heads.dir={stand_ins[stand_in]}", "profile=paper", "device=cuda", "dtype=float16", *paths])
    assert plain(cfg) == plain(spelled_out)
    want = [] if torch.cuda.is_available() else ["device=cuda but no CUDA device is visible; use device=cpu"]
    assert config_problems(cfg) == want
    if want:
        with pytest.raises(ConfigError) as e:
            validate_config(cfg)
        assert want[0] in str(e.value.code)
    mine = compose_cfg([f"experiment={name}", "task=gsm8k", "profile=cpu", "device=cpu", *paths])
    assert (mine.task.name, mine.profile.name, mine.device, mine.dtype) == ("gsm8k", "cpu", "cpu", "float16")
    assert config_problems(mine) == [UNSET_MESSAGE[f"heads/{heads}"]]


@pytest.fixture
def launcher_plugin(request: pytest.FixtureRequest):  # noqa: ANN201
    """The plugin config the launcher file extends: the installed plugin's, else a stand-in with the
    plugin's fields (removed from the ConfigStore afterwards). Yields True when the real one is used."""
    import importlib.util

    from hydra.core.config_store import ConfigStore

    base, module, _ = LAUNCHER_PLUGINS[request.param]
    if importlib.util.find_spec(module) is not None:
        yield True
        return
    store = ConfigStore.instance()
    store.store(group="hydra/launcher", name=base, node=_plugin_stand_in(base), provider="entmtp-test-stand-in")
    try:
        yield False
    finally:
        store.repo["hydra"]["launcher"].pop(f"{base}.yaml", None)


@pytest.mark.parametrize("launcher_plugin", LAUNCHER_FILES, indirect=True)
def test_every_launcher_file_composes(launcher_plugin: bool, request: pytest.FixtureRequest, tmp_path: Path,
                                      offline: None) -> None:
    """`hydra/launcher=<name>` (used with -m): composed with hydra's own config, its values on the
    plugin's launcher node; the job config beside it still validates."""
    from omegaconf import OmegaConf

    import pipeline.config.schema  # noqa: F401 - registers the typed config schemas with hydra

    name = request.node.callspec.params["launcher_plugin"]
    assert name in LAUNCHER_PLUGINS, f"conf/hydra/launcher/{name}.yaml: add its plugin to LAUNCHER_PLUGINS"
    base, _, target = LAUNCHER_PLUGINS[name]
    path = CONF / "hydra" / "launcher" / f"{name}.yaml"
    assert OmegaConf.load(path).defaults == [base, "_self_"], "the file should extend the plugin's config"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={name}", f"artifacts_dir={tmp_path}", f"data_dir={tmp_path}"],
                      return_hydra_config=True)
    assert cfg.hydra.runtime.choices["hydra/launcher"] == name
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"] == target
    _assert_holds(launcher, _file_values(path), "hydra.launcher", {})
    assert config_problems(cfg) == []  # the top-level hydra node is not the pipeline's: skipped
