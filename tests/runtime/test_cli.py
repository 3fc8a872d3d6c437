"""The `entmtp` command line: inspect, export and generate with a bank, and clean errors.

`inspect` and `export` run in-process through `runtime.cli.main` (cheap); `generate` and the
damaged-bank error run as real subprocesses (`python -m runtime.cli`), because what they promise is
about the process: its exit code, its streams, no traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from runtime.bank import TopologyBank
from runtime.cli import main
from runtime.tree import Tree
from tests.helpers import REPO, TinyBundle, pin_to_one_cpu, python_exe, subprocess_env
from tests.helpers.engine_parsers import parse_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the single-tree formats (the short names vllm/trtllm/json are the per-batch-size exports, see test_export.py)
FORMATS = ("legacy-vllm-tree", "legacy-trtllm-medusa", "tree-json")


@pytest.fixture(scope="module")
def bank(bundle: TinyBundle) -> TopologyBank:
    return TopologyBank.load(bundle.bank_dir)


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m runtime.cli ARGS` in a fresh interpreter; stdout/stderr decoded as UTF-8 exactly."""
    proc = subprocess.run([python_exe(), "-m", "runtime.cli", *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, timeout=timeout, preexec_fn=pin_to_one_cpu)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8"),
                                       proc.stderr.decode("utf-8"))


def _parse_export(stdout: str, fmt: str) -> Tree:
    text = stdout.rstrip("\n")
    # medusa_choices is a list, printed as JSON; vLLM's tree and the tree JSON are strings
    return parse_tree(json.loads(text) if fmt == "legacy-trtllm-medusa" else text, fmt)


# ------------------------------------------------------------------------------------ inspect


def test_inspect_prints_trees_policies_and_plots(bundle: TinyBundle, bank: TopologyBank, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "bank"
    shutil.copytree(bundle.bank_dir, folder)
    (folder / "pareto.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # the pipeline writes plots next to the bank
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for k, t in enumerate(bank.trees):
        row = next((ln for ln in lines if ln.strip().startswith(f"[{k}]")), None)
        assert row is not None, f"tree {k} missing from:\n{out}"
        assert f"nodes={t.num_nodes:3d}" in row and f"depth={t.depth}" in row
        assert row.rstrip().endswith("*") == (k == bank.best_static)
        assert f"tokens/step={bank.figures[k]['tokens_per_step']:.3f}" in row
    for name in bank.policies:
        assert f"policy {name}: " in out
        shown = next(ln for ln in lines if f"policy {name}: " in ln).split(": ", 1)[1]
        assert json.loads(shown) == bank.policies[name]
    assert f"(default {bank.default_policy})" in out
    assert bank.provenance["model_fingerprint"] in out and bank.provenance["heads_fingerprint"] in out
    assert "oracle:" in out
    assert f"plot: {folder / 'pareto.png'}" in out


# ------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_best_tree_parses_back(bundle: TinyBundle, bank: TopologyBank, fmt: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(bundle.bank_dir), "--format", fmt]) == 0
    assert _parse_export(capsys.readouterr().out, fmt) == bank.trees[bank.best_static]


def test_export_round_trips_every_tree(bundle: TinyBundle, bank: TopologyBank, capsys: pytest.CaptureFixture[str]) -> None:
    assert Tree.named("mc_sim_7b_63") in bank.trees  # the published default is among them
    for k, tree in enumerate(bank.trees):
        for fmt in FORMATS:
            assert main(["export", str(bundle.bank_dir), "--format", fmt, "--tree", str(k)]) == 0
            out = capsys.readouterr().out
            assert _parse_export(out, fmt) == tree, f"tree {k} in {fmt}: {out[:200]}"
    # vLLM wanted num_speculative_tokens == number of paths: the exported list has exactly that many
    assert main(["export", str(bundle.bank_dir), "--format", "legacy-vllm-tree", "--tree", "2"]) == 0
    assert len(_parse_export(capsys.readouterr().out, "legacy-vllm-tree")) == 63


@pytest.mark.parametrize("tree", ["3", "-1", "big"])
def test_export_bad_tree_index(bundle: TinyBundle, tree: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(bundle.bank_dir), "--format", "legacy-vllm-tree", "--tree", tree]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entmtp: error:") and err.count("\n") == 1
    assert "0..2" in err, err  # says which indices exist


def test_console_script_is_declared() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("entmtp") == "runtime.cli:main"


# ----------------------------------------------------------------------------------- generate


def test_generate_compare_ar_subprocess(bundle: TinyBundle) -> None:
    from runtime.api import EntMTP

    prompt = "Say hello."
    proc = run_cli("generate", "--bank", str(bundle.bank_dir), "--prompt", prompt, "--compare-ar",
                   "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # both speeds, their ratio and the lossless check are reported
    report = [ln for ln in proc.stderr.splitlines() if ln.startswith("[entmtp] AR ")]
    assert len(report) == 1, proc.stderr
    assert " tok/s vs EntMTP " in report[0] and report[0].count("tok/s") == 2
    assert "output identical" in report[0], report[0]
    stats = json.loads(next(ln for ln in proc.stderr.splitlines() if ln.startswith("[entmtp] {"))[len("[entmtp] "):])
    assert stats["new_tokens"] <= 8 and stats["tok_per_s"] > 0 and stats["steps"] >= 1
    # the streamed text is what the library generates in this process (same bank, same prompt)
    expected = EntMTP.load(bundle.bank_dir).generate(prompt, 8).text
    assert proc.stdout == expected + "\n"


def test_generate_policy_errors_are_one_line(bundle: TinyBundle, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--bank", str(bundle.bank_dir), "--prompt", "x", "--policy", "nope",
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entmtp: error: unknown policy 'nope'") and err.count("\n") == 1


# ------------------------------------------------------------------------------ damaged banks


def _damage(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    if how == "json_truncated":
        data = (dst / "bank.json").read_bytes()
        (dst / "bank.json").write_bytes(data[: len(data) // 2])
    elif how == "json_edited":
        doc = json.loads((dst / "bank.json").read_text())
        doc["best_static"] = 0
        (dst / "bank.json").write_text(json.dumps(doc))
    elif how == "buffers_flipped":
        data = bytearray((dst / "buffers.safetensors").read_bytes())
        data[-5] ^= 0xFF
        (dst / "buffers.safetensors").write_bytes(bytes(data))
    elif how == "buffers_missing":
        (dst / "buffers.safetensors").unlink()
    else:
        raise AssertionError(how)
    return dst


@pytest.mark.parametrize("how", ["json_truncated", "json_edited", "buffers_flipped", "buffers_missing"])
def test_damaged_bank_in_process(bundle: TinyBundle, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _damage(bundle.bank_dir, tmp_path / "bank", how)
    for argv in (["inspect", str(bad)], ["export", str(bad)], ["generate", "--bank", str(bad), "--prompt", "x"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("entmtp: error:") and err.count("\n") == 1, err
        assert "Traceback" not in err


def test_damaged_bank_subprocess(bundle: TinyBundle, tmp_path: Path) -> None:
    bad = _damage(bundle.bank_dir, tmp_path / "bank", "json_truncated")
    proc = run_cli("inspect", str(bad))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("entmtp: error:") and "bank.json" in lines[0], proc.stderr


def test_missing_bank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["inspect", str(tmp_path / "nope")], ["export", str(tmp_path / "nope")],
                 ["generate", "--bank", str(tmp_path / "nope"), "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("entmtp: error: bank folder") and "does not exist" in err and err.count("\n") == 1
