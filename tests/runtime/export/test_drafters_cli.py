"""`entmtp export` of a bank whose heads are an EAGLE-3 drafter: the engine's EAGLE-3 settings, the
drafter written by --drafter-out in the layout that engine loads (read back into the bank's drafter),
the record on stderr and beside --out, and the options' errors (runtime/cli.py ``_export``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.bank import TopologyBank
from runtime.cli import main
from runtime.eagle3 import load_drafter, save_drafter
from runtime.model.checkpoint import load_model
from tests.helpers import TinyBundle, make_tiny_bank, reseal
from tests.helpers.bundle import make_tiny_model
from tests.helpers.eagle3_folders import drafter_for
from tests.helpers.engine_parsers import parse_schedule, sglang_drafter, strip_record

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = (1, 2, 3)


def _batch_axis(n_trees: int) -> dict:
    """Batch sizes 1 (the bank's tree, a 2-chain), 8 (a 1-chain) and 32 (nothing chosen, but the bank's
    2-chain measured 3600 tok/s there against AR's 32 x 1000 / 9 = 3556: vLLM gets it instead of 0)."""
    none = [None] * (n_trees - 1)
    return {
        "1": {"best_static": 1, "best_chain": {"depth": 2, "tokens_per_step": 1.7, "step_ms": 5.5, "tok_per_s": 309.0},
              "ar_step_ms": 5.0, "step_ms": [5.4 + k for k in range(n_trees)],
              "tok_per_s": [300.0 + k for k in range(n_trees)]},
        "8": {"best_static": 0, "best_chain": {"depth": 1, "tokens_per_step": 1.4, "step_ms": 7.0, "tok_per_s": 1600.0},
              "ar_step_ms": 6.0, "step_ms": [7.5, *none], "tok_per_s": [1500.0, *none]},
        "32": {"best_static": None, "best_chain": None, "ar_step_ms": 9.0, "step_ms": [8.9, *none],
               "tok_per_s": [3600.0, *none]},
    }


@pytest.fixture(scope="module")
def eagle3_bank(bundle: TinyBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny model, a random EAGLE-3 drafter reading its layers 1-3, and a bank for them
    (the tiny bank's trees, a batch axis), laid out as the pipeline lays them out."""
    root = tmp_path_factory.mktemp("eagle3_bank")
    model_dir = make_tiny_model(root / "models" / "tiny4", bundle.model_dir, num_layers=4)
    drafter, _ = drafter_for(model_dir, AUX, draft_vocab=512, seed=4)
    heads_dir = save_drafter(drafter, root / "heads" / "tiny4" / "eagle3")
    bank_dir = make_tiny_bank(root / "banks" / "tiny4" / "eagle3" / "tiny", model_dir, heads_dir)
    doc = json.loads((bank_dir / "bank.json").read_text())
    doc["batch_sizes"] = _batch_axis(len(doc["trees"]))
    doc["provenance"]["heads_name"] = "eagle3"
    (bank_dir / "bank.json").write_text(json.dumps(doc))
    reseal(bank_dir)
    return bank_dir


def _drafter_weights(bank: Path) -> dict[str, torch.Tensor]:
    prov = TopologyBank.load(bank, force=True).provenance
    model = load_model(bank / prov["model_dir"], max_seq_len=64)
    return load_drafter(bank / prov["heads_dir"], model=model).state_dict()


def _read_back(folder: Path, bank: Path) -> dict[str, torch.Tensor]:
    from pipeline.heads.eagle3_import import read_eagle3

    prov = TopologyBank.load(bank, force=True).provenance
    return read_eagle3(folder, load_model(bank / prov["model_dir"], max_seq_len=64)).state_dict()


def test_vllm_export_of_an_eagle3_bank_with_its_drafter(eagle3_bank: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out, drafter_dir = tmp_path / "vllm.json", tmp_path / "drafter-vllm"
    assert main(["export", str(eagle3_bank), "--format", "vllm", "--drafter-out", str(drafter_dir),
                 "--out", str(out), "--margin", "1"]) == 0
    err = capsys.readouterr().err
    cfg = json.loads(out.read_text())
    # 1 -> 2 (chain), 2-8 -> 1, 9-32 -> 2 (the filled 0), then nothing; every batch size + the margin
    assert cfg == {"method": "eagle3", "model": str(drafter_dir.resolve()), "num_speculative_tokens": 2,
                   "num_speculative_tokens_per_batch_size": [[1, 2, 2], [3, 9, 1], [10, 33, 2], [34, 34, 0]]}
    record = json.loads((tmp_path / "vllm.json.entmtp.json").read_text())
    assert record["bank"]["drafter"] == "eagle3" and record["filled_zeros"] == {"32": 2} and record["margin"] == 1
    assert record["drafter_path"] == cfg["model"]
    assert [w.split(" (")[0] for w in record["warnings"]] == ["the bank was measured on a CPU"]
    assert f"[entmtp] {record['header']}" in err and "wrote the drafter for vllm" in err
    # the folder is the speculators layout vLLM loads, holding the bank's drafter
    assert "speculators_model_type" in json.loads((drafter_dir / "config.json").read_text())
    want = _drafter_weights(eagle3_bank)
    for k, v in _read_back(drafter_dir, eagle3_bank).items():
        assert torch.equal(v, want[k]), k


def test_sglang_and_trtllm_exports_of_an_eagle3_bank(eagle3_bank: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    sg_dir = tmp_path / "drafter-sglang"
    assert main(["export", str(eagle3_bank), "--format", "sglang", "--drafter-out", str(sg_dir)]) == 0
    text = capsys.readouterr().out
    assert sglang_drafter(text) == ("EAGLE3", str(sg_dir.resolve()))
    assert parse_schedule(text, "sglang").chain_len_for(8) == 1
    assert "LlamaForCausalLMEagle3" in text  # the caveat, as a comment line
    assert json.loads((sg_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    want = _drafter_weights(eagle3_bank)
    for k, v in _read_back(sg_dir, eagle3_bank).items():
        assert torch.equal(v, want[k]), k
    # TensorRT-LLM: the one-model Eagle3 config naming a folder given before
    assert main(["export", str(eagle3_bank), "--format", "trtllm", "--drafter-path", str(sg_dir)]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg == {"decoding_type": "Eagle3", "speculative_model_dir": str(sg_dir), "eagle3_one_model": True,
                   "max_draft_len": 2, "draft_len_schedule": {"1": 2, "8": 1}, "eagle3_layers_to_capture": [0, 1, 2]}


def test_eagle3_export_without_a_drafter_folder_says_so(eagle3_bank: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(eagle3_bank), "--format", "vllm", "--keep-zeros"]) == 0
    out, err = capsys.readouterr()
    cfg = json.loads(out)
    assert cfg["model"] == "DRAFTER_DIR" and cfg["num_speculative_tokens_per_batch_size"][-1] == [9, 32, 0]
    assert "WARNING: the config names the drafter folder DRAFTER_DIR" in err
    assert "--out FILE also writes them to FILE.entmtp.json" in err
    # json carries its record inside, the tree formats nothing of the engine
    assert main(["export", str(eagle3_bank), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["notes"]["bank"]["drafter"] == "eagle3"
    assert "notes" not in strip_record(doc, "json")


def test_export_option_errors(eagle3_bank: Path, bundle: TinyBundle, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        ([str(bundle.bank_dir), "--format", "vllm", "--drafter-out", str(tmp_path / "d")],
         "name an EAGLE-3 drafter, but this bank's heads are hydra"),
        ([str(eagle3_bank), "--format", "tree-json", "--drafter-out", str(tmp_path / "d")],
         "not --format tree-json"),
        ([str(eagle3_bank), "--format", "vllm", "--drafter-out", str(tmp_path / "d"), "--drafter-path", "/x"],
         "give one of them"),
        ([str(eagle3_bank), "--format", "vllm", "--margin", "-1"], "--margin must be >= 0"),
    ]
    for argv, message in cases:
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("entmtp: error: ") and message in err, err
    assert not (tmp_path / "d").exists()
    # the model folder is gone: --drafter-out cannot take the target's embeddings
    moved = tmp_path / "moved"
    shutil.copytree(eagle3_bank.parents[3], moved)
    bank = moved / eagle3_bank.relative_to(eagle3_bank.parents[3])
    shutil.rmtree(moved / "models")
    assert main(["export", str(bank), "--format", "vllm", "--drafter-out", str(tmp_path / "d")]) == 2
    assert "--drafter-out needs the target model" in capsys.readouterr().err
