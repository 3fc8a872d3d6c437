"""The CPU kernels that ran are part of what a decode computes: every decoding stage's key and the
bank's provenance name them (`runtime.model.small_rows.kernel_id`), so a rollout made with the small-row
kernel and one made with torch's products never share a key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.model import small_rows
from tests.helpers import MODEL_NAME, TinyBundle, tiny_pipeline_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's state where the install built no kernel (what `available()` finds then)."""
    monkeypatch.setattr(small_rows, "_probed", True)
    monkeypatch.setattr(small_rows, "_lib", None)
    monkeypatch.setattr(small_rows, "_reason", "not built (test)")


def test_stage_keys_and_bank_provenance_name_the_kernel(bundle: TinyBundle, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import graph
    from pipeline.stages import dtype as dtype_stage
    from pipeline.stages import rollout as rollout_stage
    from pipeline.graph import runtime_key

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    cfg = tiny_pipeline_cfg(artifacts, data, bundle)
    graph.clear_memo()
    bank_dir = graph.run(cfg)
    here = small_rows.kernel_id()
    provenance = json.loads((bank_dir / "bank.json").read_text())["provenance"]
    assert provenance["kernel"] == here == runtime_key(cfg)["kernel"]
    from runtime.bank import TopologyBank

    assert f"kernel={here}" in TopologyBank.load(bank_dir).summary()
    with_kernel = rollout_stage.content_key(cfg)

    graph.clear_memo()
    _without_kernel(monkeypatch)
    assert small_rows.kernel_id() == "none"
    without = rollout_stage.content_key(cfg)
    assert without["kernel"] == "none"
    assert {k: v for k, v in without.items() if k != "kernel"} == {k: v for k, v in with_kernel.items() if k != "kernel"}
    if here != "none":  # where the kernel runs, the keys differ by it, and nothing else
        assert without != with_kernel
    # the dtype stage's choice was measured with the kernels too: its key names them as well
    assert dtype_stage.kernel_id() == "none"
    graph.clear_memo()


def test_only_float32_cpu_decodes_name_a_kernel(bundle: TinyBundle, tmp_path: Path) -> None:
    """bfloat16 forwards and CUDA never run the small-row kernel: their keys say "none"."""
    from pipeline import graph
    from pipeline.graph import kernel

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    graph.clear_memo()
    assert kernel(tiny_pipeline_cfg(artifacts, data, bundle, "dtype=bfloat16")) == "none"
    assert kernel(tiny_pipeline_cfg(artifacts, data, bundle)) == small_rows.kernel_id()
    graph.clear_memo()
