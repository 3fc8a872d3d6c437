"""`entmtp generate --prompts-file F --batch N` says what decoded each batch: the bank's choice for
its size when no --policy is named (a tree, or AR; AR above the largest measured batch size), the
named policy otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.bank import TopologyBank
from runtime.cli import main
from tests.helpers import TinyBundle, copy_bundle
from tests.helpers.banks import batch_choices_record

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHOICES = {1: 0, 2: 2, 4: None}
PROMPTS = ["def add(a, b):", "Hello there", "What is 2 + 3?", "Write a haiku about rain.", "Name three colours."]


@pytest.fixture(scope="module")
def bank_dir(bundle: TinyBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    own = copy_bundle(bundle, tmp_path_factory.mktemp("cli_batch") / "bundle")
    bank = TopologyBank.load(own.bank_dir)
    bank.batch_schedule = batch_choices_record(bank.trees, CHOICES)
    bank.save(own.bank_dir)
    return own.bank_dir


def batch_lines(capsys: pytest.CaptureFixture[str], bank_dir: Path, tmp_path: Path, prompts: list[str],
                *args: str) -> list[str]:
    """The "[entmtp] batch of" lines of `entmtp generate --prompts-file ...` (exit code 0 asserted)."""
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    assert main(["generate", "--bank", str(bank_dir), "--prompts-file", str(file), "--max-new-tokens", "4", *args]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("[entmtp] batch of")]


def test_each_batch_size_says_the_banks_choice(bank_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    nodes = [t.num_nodes for t in TopologyBank.load(bank_dir).trees]

    def generate(prompts: list[str], *args: str) -> list[str]:
        return batch_lines(capsys, bank_dir, tmp_path, prompts, *args)

    assert generate(PROMPTS[:3], "--batch", "2") == [
        f"[entmtp] batch of 2: bank's choice for B=2: tree 2 ({nodes[2]} nodes)",
        f"[entmtp] batch of 1: bank's choice for B=1: tree 0 ({nodes[0]} nodes)"]
    assert generate(PROMPTS[:4], "--batch", "4") == ["[entmtp] batch of 4: bank's choice for B=4: AR"]
    assert generate(PROMPTS) == [  # --batch defaults to every prompt: 5, above the table
        "[entmtp] batch of 5: above the bank's largest measured batch size (4), where it does not speculate: AR"]


def test_a_named_policy_is_said(bank_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert batch_lines(capsys, bank_dir, tmp_path, PROMPTS[:2], "--batch", "2", "--policy", "static") == [
        "[entmtp] batch of 2: policy 'static' (named)"]
