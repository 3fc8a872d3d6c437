"""Device-clean decoding, checked without a GPU by `tests.helpers.device_check.DeviceCheck`.

On a CPU-only machine every tensor is a CPU tensor, so a line that would build a CPU tensor next
to CUDA ones runs fine here. DeviceCheck finds such lines anyway (a factory called without
`device=`), and counts the host synchronisations a step makes, which on a GPU stall the queue.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.evaluate.run import continuation_nll
from pipeline.rollout.record import rollout_prompt
from tests.helpers.device_check import DeviceCheck, DeviceCheckError
from runtime.decoder import TreeDecoder, TypicalAcceptance
from runtime.device import resolve_device
from runtime.ar import ar_generate
from runtime.policy import LadderPolicy, Scheduler
from runtime.tree import Tree, TreeBuffers
from tests.helpers import DECODER_TREES as TREES
from tests.helpers import ar_greedy, tiny_heads, tiny_model

PROMPT = list(range(5, 14))


def _steps_syncs(dec: TreeDecoder, choose, n: int = 40) -> tuple[list[int], DeviceCheck, list[int]]:
    """Decode under a DeviceCheck; return (tokens, the check, host syncs of each step)."""
    marks: list[int] = []
    with DeviceCheck(dec.model.device) as check:
        res = dec.generate(PROMPT, n, choose=choose, stream=lambda _t: marks.append(check.sync_count()))
    return res.tokens, check, [b - a for a, b in zip(marks, marks[1:])]


@pytest.mark.parametrize("kind,prefix,rows", [("hydra", False, None), ("medusa", False, None), ("hydra", True, None),
                                              ("hydra", False, 4)])
def test_decode_step_is_device_clean_with_one_sync(kind: str, prefix: bool, rows: int | None) -> None:
    """rows: the row-invariant forward (lossless=exact), which reads a compiled tree's ancestors
    from its buffers instead of its mask, and builds its attention plan without the host."""
    model = tiny_model(1)
    model.set_row_invariance(rows)
    heads = tiny_heads(model, kind, seed=1, prefix=prefix)
    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    ref = ar_greedy(model, PROMPT, 40)
    for k in range(len(TREES)):
        if rows:  # the first forward of each shape probes how wide a product may be (then cached)
            dec.generate(PROMPT, 40, choose=k)
        tokens, check, per_step = _steps_syncs(dec, k)
        assert tokens == ref
        check.raise_if_violations()
        assert per_step and max(per_step) == 1, (k, per_step, check.syncs)
    # a policy reading the base logits: its two numbers ride on the same transfer
    tokens, check, per_step = _steps_syncs(dec, Scheduler(LadderPolicy([0.3, 0.6], signal="p0"), len(TREES)))
    assert tokens == ref
    check.raise_if_violations()
    assert max(per_step) == 1, check.syncs


def test_typical_acceptance_draws_on_the_device_generator() -> None:
    model = tiny_model(2)
    dec = TreeDecoder(model, tiny_heads(model, "hydra", seed=2), [TreeBuffers.compile(TREES[1])],
                      acceptance=TypicalAcceptance(seed=3))
    first, check, per_step = _steps_syncs(dec, 0, 30)
    check.raise_if_violations()
    assert max(per_step) == 1
    again, _, _ = _steps_syncs(dec, 0, 30)
    assert first == again


def test_rollout_and_evaluate_paths_are_device_clean() -> None:
    model = tiny_model(3)
    heads = tiny_heads(model, "hydra", seed=3)
    with DeviceCheck(model.device) as check:
        arrays = rollout_prompt(model, heads, PROMPT, 12, rank_cap=8)
        nll = continuation_nll(model, PROMPT, arrays["tokens"].tolist())
        ar_generate(model, PROMPT, 5)
    check.raise_if_violations()
    assert arrays["rank_paths"].dtype == np.int16 and len(arrays["tokens"]) == 12
    assert np.isfinite(nll)


def test_a_cpu_tensor_made_next_to_the_model_is_caught() -> None:
    model = tiny_model(4)
    heads = tiny_heads(model, "medusa", seed=4)

    def step_with_a_wrong_line() -> torch.Tensor:
        h = heads.observe(*_prefill(model))
        offsets = torch.arange(3)  # the mistake: no device=, so a CPU tensor on a CUDA machine
        return h[:, offsets]

    with DeviceCheck(model.device) as check:
        step_with_a_wrong_line()
    assert len(check.violations) == 1 and "arange called without device=" in check.violations[0]
    with pytest.raises(DeviceCheckError, match="arange"), DeviceCheck(model.device, strict=True):
        step_with_a_wrong_line()
    # a model that "lives" elsewhere: then even an explicit device="cpu" is a mistake, and so are
    # ops fed CPU tensors and a CPU generator
    with DeviceCheck("meta") as check:
        x = torch.zeros(4, device="cpu")
        with pytest.raises(RuntimeError):  # torch refuses too, after the check has recorded it
            x + torch.ones(4, device="meta")  # mixes devices
        try:
            torch.multinomial(torch.ones(1, 4, device="meta"), 1, generator=torch.Generator())
        except RuntimeError:
            pass  # whether torch refuses a CPU generator for a meta tensor does not matter here
    assert any("zeros returned a tensor on cpu" in v for v in check.violations)
    assert any("add" in v and "on cpu" in v for v in check.violations)
    assert any("Generator on cpu" in v for v in check.violations)


def _prefill(model):  # noqa: ANN001, ANN202
    pos = torch.arange(len(PROMPT), device=model.device)
    _, hidden = model(torch.tensor([PROMPT], device=model.device), pos)
    return hidden, pos


def test_syncs_are_counted_by_kind() -> None:
    t = torch.arange(6)
    with DeviceCheck("cpu") as check:
        t[0].item()
        int(t[1])
        t.tolist()
        bool(t[2] > 1)
        t.nonzero()
        torch.unique(t)
        (t + 1).sum()  # not a sync
    assert check.syncs == {"item": 1, "__int__": 1, "tolist": 1, "__bool__": 1, "nonzero": 1, "unique": 1}
    assert check.sync_count() == 6


def test_tree_masks_are_checked_once_when_compiled() -> None:
    good = TreeBuffers.compile(Tree([(0,), (1,), (0, 0)]))
    tensors = good.to_tensors()
    tensors["attn_mask"] = tensors["attn_mask"].clone()
    tensors["attn_mask"][3, 3] = False
    with pytest.raises(ValueError, match="attn_mask"):
        TreeBuffers.from_tensors(tensors)
    assert good.node_paths.tolist() == [[0, 0, 0], [0, 1, 1], [0, 2, 2], [0, 1, 3]]
    assert [u.tolist() for u in good.unique_parents] == [[0], [0]]


def test_resolve_device_defaults_to_where_the_bank_was_built() -> None:
    assert resolve_device(None, None) == torch.device("cpu")
    assert resolve_device(None, "cpu") == torch.device("cpu")
    assert resolve_device("cpu", "cuda") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="not available here"):
            assert resolve_device(None, "cuda:0") == torch.device("cpu")
        with pytest.raises(ValueError, match="not available"):
            resolve_device("cuda", None)
