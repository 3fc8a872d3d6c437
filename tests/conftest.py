"""Shared fixtures: the default model folder (skipped when not provisioned), the tiny bundle, one
torch thread. The markers (`slow`) are registered in pyproject.toml's [tool.pytest.ini_options]."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.paths import REPO_ROOT

DEFAULT_MODEL_DIR = REPO_ROOT / "artifacts" / "models" / "smollm2-135m-instruct"

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("default model not provisioned: run `make model` (or `make bank`) first")
    return DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    """The tiny model + heads + bank of tests/helpers/__init__.py (built once per test process)."""
    from tests.helpers import tiny_bundle

    return tiny_bundle(tmp_path_factory, smollm2_dir)


@pytest.fixture
def one_torch_thread():
    """Run the test with one torch thread: these tests run tiny models, where a second thread only
    adds contention (modules opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    from tests.helpers import torch_threads

    with torch_threads(1):
        yield
