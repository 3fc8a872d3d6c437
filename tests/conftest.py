"""Shared fixtures: the default model folder (skipped when not provisioned) and test markers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"

torch.set_num_threads(2)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test, excluded from the default run (make test-slow)")


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
