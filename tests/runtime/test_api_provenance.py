"""`EntMTP.load` warns once, naming what differs, when a bank was measured on another CPU, thread
count, kernel or dtype than this load; a bank measured here loads silently."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from runtime.api import EntMTP
from runtime.bank import BankProvenanceWarning, TopologyBank
from tests.helpers import TinyBundle, copy_bundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def provenance_warnings(bank_dir: Path, **load: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EntMTP.load(bank_dir, **load)
    return [str(w.message) for w in caught if issubclass(w.category, BankProvenanceWarning)]


def test_a_bank_measured_here_loads_without_a_warning(bundle: TinyBundle) -> None:
    assert provenance_warnings(bundle.bank_dir) == []


def test_a_bank_measured_elsewhere_warns_once_naming_each_difference(bundle: TinyBundle, tmp_path: Path) -> None:
    own = copy_bundle(bundle, tmp_path / "bundle")
    bank = TopologyBank.load(own.bank_dir)
    bank.provenance["machine"] = {**bank.provenance["machine"], "cpu": "Some Other CPU", "torch_threads": 64}
    bank.provenance["kernel"] = "small_rows-avx512-000000000000"
    bank.save(own.bank_dir)
    [message] = provenance_warnings(own.bank_dir)
    assert "CPU 'Some Other CPU'" in message and "torch threads 64" in message
    assert "small-row kernel 'small_rows-avx512-000000000000'" in message
    assert f"entmtp inspect {own.bank_dir} --check" in message and "dtype" not in message


def test_another_dtype_than_the_banks_warns(bundle: TinyBundle) -> None:
    [message] = provenance_warnings(bundle.bank_dir, dtype="bfloat16")
    assert "dtype 'float32' (here 'bfloat16')" in message
