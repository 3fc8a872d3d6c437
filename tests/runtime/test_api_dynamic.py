"""EntMTP-dyn through the public API and the CLI: `policy="dynamic"` decodes with the bank's
DynamicPolicy, alone and in a batch, with AR's tokens (greedy and seeded sampling), a per-step tree
size that varies, and a clear error where the bank was built without one.

The bank is the tiny bundle's, given a dynamic entry by hand (the pipeline's fit is tested in
tests/pipeline/stages/test_bank_dynamic.py): the 16-node super-tree `SUPER` of tests.helpers, a
gentle cost slope, and a per-depth calibration whose knots sit among the tiny random heads' path
values (about 4e-4 at depth 1, 2e-7 at depth 2), so that the chosen subset changes from step to step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.bank import TopologyBank
from runtime.cli import main
from runtime.dynamic import DYNAMIC_TREE, DynamicPolicy
from tests.helpers import SUPER, TinyBundle, copy_bundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Write a haiku about trees."
NEW_TOKENS = 24
CALIBRATION = {"xs": [[0.0, 3.5e-4, 5e-4, 1.0], [0.0, 1e-7, 3e-7, 1.0]],
               "ys": [[0.0, 0.05, 0.6, 0.9], [0.0, 0.02, 0.5, 0.8]]}
STEP_MS = [1.0 + 0.1 * k for k in range(SUPER.num_nodes)]


@pytest.fixture(scope="module")
def dyn_bundle(bundle: TinyBundle, tmp_path_factory: pytest.TempPathFactory) -> TinyBundle:
    """A copy of the tiny bundle whose bank carries an EntMTP-dyn entry."""
    own = copy_bundle(bundle, tmp_path_factory.mktemp("dyn") / "bundle")
    bank = TopologyBank.load(own.bank_dir)
    bank.dynamic = {"super_tree": [list(p) for p in SUPER.paths], "step_ms": STEP_MS, "calibration": CALIBRATION}
    bank.save(own.bank_dir)
    return own


@pytest.fixture(scope="module")
def engine(dyn_bundle: TinyBundle):
    from runtime.api import EntMTP

    return EntMTP.load(dyn_bundle.bank_dir)


@pytest.fixture(scope="module")
def plain_engine(bundle: TinyBundle):
    from runtime.api import EntMTP

    return EntMTP.load(bundle.bank_dir)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_dynamic_generate_is_ar_with_varying_trees(engine, temperature: float) -> None:
    out = engine.generate(PROMPT, NEW_TOKENS, policy="dynamic", temperature=temperature, seed=3)
    ar = engine.generate_ar(PROMPT, NEW_TOKENS, temperature=temperature, seed=3)
    assert out.tokens == ar.tokens and out.text == ar.text
    steps = out.result.steps
    assert steps and all(s.tree == DYNAMIC_TREE for s in steps)
    sizes = {s.nodes for s in steps}
    assert len(sizes) > 1, f"every step verified {sizes} nodes: the subset never changed"
    assert max(sizes) <= SUPER.num_nodes
    stats = out.stats
    assert stats["trees_used"] == {} and sum(stats["dynamic_nodes"].values()) == len(steps)
    cache = stats["dynamic_cache"]
    assert cache["hits"] + cache["misses"] == len(steps) and 1 <= cache["misses"] <= len(steps)


def test_each_call_gets_a_fresh_policy_from_the_bank(engine) -> None:
    a, b = engine.scheduler("dynamic"), engine.scheduler("dynamic")
    assert isinstance(a, DynamicPolicy) and a is not b
    assert a.super_tree.to_tree() == SUPER and a.step_ms == pytest.approx(STEP_MS)
    assert a.calibration.to_dict() == CALIBRATION
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; this bank has: .*\bdynamic\b"):
        engine.scheduler("nope")


def test_dynamic_batch_is_each_prompts_ar(engine) -> None:
    prompts = [PROMPT, "Say hello.", "", "List three colours."]
    outs = engine.generate_batch(prompts, NEW_TOKENS, policy="dynamic", batch_size=2)
    assert outs[2].error and not outs[2].tokens          # the empty prompt, reported; the others decoded
    for prompt, out in zip(prompts, outs):
        if not prompt:
            continue
        assert out.error is None
        assert out.tokens == engine.generate_ar(prompt, NEW_TOKENS).tokens, prompt
        assert all(s.tree == DYNAMIC_TREE for s in out.result.steps)
        # each sequence had its own policy: its cache saw exactly its own steps
        assert out.stats["dynamic_cache"]["hits"] + out.stats["dynamic_cache"]["misses"] == len(out.result.steps)


def test_a_bank_without_dynamic_says_how_to_get_one(plain_engine) -> None:
    assert not plain_engine.bank.dynamic
    for call in (lambda: plain_engine.generate(PROMPT, 4, policy="dynamic"),
                 lambda: plain_engine.generate_batch([PROMPT], 4, policy="dynamic")):
        with pytest.raises(ValueError, match=r"policy 'dynamic' \(EntMTP-dyn\).*has none.*dynamic\.enabled=true"):
            call()
    with pytest.raises(ValueError, match="unknown policy") as err:
        plain_engine.scheduler("nope")
    assert "dynamic" not in str(err.value)


def test_cli_generate_policy_dynamic(dyn_bundle: TinyBundle, bundle: TinyBundle, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--bank", str(dyn_bundle.bank_dir), "--prompt", PROMPT, "--policy", "dynamic",
                 "--max-new-tokens", "12", "--compare-ar"]) == 0
    err = capsys.readouterr().err
    stats = json.loads(next(ln for ln in err.splitlines() if ln.startswith("[entmtp] {"))[len("[entmtp] "):])
    assert stats["dynamic_nodes"] and not stats["trees_used"]
    assert "output identical" in err
    # many prompts, batched
    (tmp_path / "prompts.txt").write_text(f"{PROMPT}\nSay hello.\n")
    assert main(["generate", "--bank", str(dyn_bundle.bank_dir), "--prompts-file", str(tmp_path / "prompts.txt"),
                 "--policy", "dynamic", "--max-new-tokens", "8", "--compare-ar"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(ln["identical_to_ar"] for ln in lines)
    # a bank without it: one line saying what to do, exit code 2
    assert main(["generate", "--bank", str(bundle.bank_dir), "--prompt", "x", "--policy", "dynamic",
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entmtp: error: policy 'dynamic'") and "dynamic.enabled=true" in err and err.count("\n") == 1


def test_cli_help_and_inspect_mention_dynamic(dyn_bundle: TinyBundle, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    assert "dynamic (EntMTP-dyn" in " ".join(capsys.readouterr().out.split())
    assert main(["inspect", str(dyn_bundle.bank_dir)]) == 0
    assert f"EntMTP-dyn: super-tree {SUPER.num_nodes} nodes" in capsys.readouterr().out
