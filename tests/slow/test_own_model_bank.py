"""End to end through the documented command: a bank built from a Vicuna-layout folder (.bin shards,
sentencepiece tokenizer, no chat template) or a sharded-safetensors one, with published Hydra++
heads given as `heads.dir`, by

    make bank TASK=humaneval ARGS="model=local model.path=DIR model.chat_template=vicuna_v1.1 heads.dir=DIR ..."

(artifacts and data in a temporary folder). The venv must be installed (`make install` is then a
no-op: its stamp holds pyproject.toml's hash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, write_published_hydra, write_sharded_safetensors_folder, write_vicuna_bin_folder

pytest.importorskip("sentencepiece")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bin", "safetensors"])
def test_bank_from_own_model_and_published_heads(tmp_path: Path, layout: str) -> None:
    src = tmp_path / "vicuna-tiny"
    src.mkdir()
    state = (write_vicuna_bin_folder if layout == "bin" else write_sharded_safetensors_folder)(src)
    heads = tmp_path / "hydra-tiny"
    write_published_hydra(heads, state, "prefix-mlp")
    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    venv = Path(sys.executable).parent.parent
    make = ["make", "-C", str(REPO), f"VENV={venv}", f"PYTHON={sys.executable}"]
    dry = subprocess.run([*make, "-n", "install"], capture_output=True, text=True, timeout=60)
    if "pip install" in dry.stdout:
        pytest.skip(f"{venv} was not installed by `make install` from this pyproject.toml; the test would reinstall it")
    args = " ".join([
        "model=local", f"model.path={src}", "model.name=tiny-vicuna", "model.chat_template=vicuna_v1.1",
        f"heads.dir={heads}", "heads.name=hydra_pp_published", "heads.draft_vocab.size=null", "dtype=float32", "threads=1",
        "profile.calib_prompts=3", "profile.recalib_prompts=1", "profile.timing_prompts=1",
        "profile.max_new_tokens=6", "profile.eval_prompts=2", "profile.max_prompt_tokens=256",
        "time.rounds=1", "time.new_tokens=4", "'grow.candidate_sizes=[0,2,4,8]'",
        f"artifacts_dir={artifacts}", f"data_dir={data}"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*make, "bank", "TASK=humaneval", f"ARGS={args}"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pip install" not in proc.stdout, "make bank reinstalled the venv"

    model_dir = artifacts / "models" / "tiny-vicuna"
    assert (model_dir / "tokenizer.json").is_file() and list(model_dir.glob("*.safetensors"))
    heads_dir = artifacts / "heads" / "tiny-vicuna" / "hydra_pp_published"
    provenance = json.loads((heads_dir / "manifest.json").read_text())["summary"]
    assert provenance["source"] == str(heads.resolve()) and provenance["layout"] == "hydra prefix-mlp"
    prepared = json.loads((data / "humaneval" / "manifest.json").read_text())["summary"]
    assert prepared["chat_template"]["name"] == "vicuna_v1.1"
    bank_dir = artifacts / "banks" / "tiny-vicuna" / "hydra_pp_published" / "humaneval"
    bank = json.loads((bank_dir / "bank.json").read_text())
    assert bank["trees"]
