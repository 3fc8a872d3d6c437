"""The engine exports' EAGLE-3 settings, boundary margin and vLLM draft-length-0 handling
(runtime/export/engines.py).

Where the engine's package does not install on a CPU (vLLM, TensorRT-LLM), the fields are checked
against its source, cited here, and the exports are read back with our parsers of its lookup rule
(tests/helpers/engine_parsers.py) as a secondary check:

* vLLM: vllm/config/speculative.py ``SpeculativeConfig`` -- ``method`` (a ``SpeculativeMethod``
  literal that includes ``"eagle3"``), ``model`` (the draft folder), ``num_speculative_tokens``
  (``Field(gt=0)``) and ``num_speculative_tokens_per_batch_size: list[tuple[int, int, int]]``;
  vllm/v1/spec_decode/dynamic/utils.py ``validate_and_normalize_dynamic_sd_schedule`` (first range
  starts at 1, no overlap, k >= 0) and ``build_dynamic_sd_schedule_lookup`` (a gap keeps the previous
  k, the last k carries to max_num_seqs, every k clamped to num_speculative_tokens).
* TensorRT-LLM: tensorrt_llm/llmapi/llm_args.py ``DecodingBaseConfig`` (``max_draft_len``,
  ``speculative_model`` with the alias ``speculative_model_dir``, ``draft_len_schedule`` and its
  validator ``validate_draft_len_schedule_and_sort``: keys >= 1, lengths >= 0 and <= max_draft_len,
  the smallest key's length == max_draft_len), ``EagleDecodingConfig`` (``eagle3_one_model``,
  ``eagle3_layers_to_capture``, ``max_draft_len > 0``) and ``Eagle3DecodingConfig``
  (``decoding_type: "Eagle3"``).
* SGLang: its own ``ServerArgs`` and adaptive router read these exports in
  test_engines_sglang.py when sglang is installed.
"""

from __future__ import annotations

import pytest

from runtime.export.engines import (
    DRAFTER_PLACEHOLDER,
    EngineDrafter,
    engine_schedule,
    export_schedule,
    fill_vllm_zeros,
)
from runtime.export.schedule import ScheduleError, ServingChoice, ServingSchedule
from runtime.tree import Tree
from tests.helpers import SIX_NODE_TREE
from tests.helpers.engine_parsers import parse_schedule, sglang_drafter

TREES = (Tree.chain(1), Tree.chain(2), SIX_NODE_TREE)
# batch 16 drafts nothing, but its 1-chain measured 2100 tok/s against AR's 16 x 1000 / 8 = 2000;
# at 64 no chain reaches AR's 64 x 1000 / 14 = 4571 tok/s
SCHEDULE = ServingSchedule(choices=(
    ServingChoice(1, tree=SIX_NODE_TREE, tree_index=2, chain_len=3, ar_step_ms=5.0,
                  tree_step_ms=(5.5, 6.0, 7.0), tree_tok_per_s=(250.0, 280.0, 300.0)),
    ServingChoice(4, tree=Tree.chain(2), tree_index=1, chain_len=2, ar_step_ms=6.0,
                  tree_step_ms=(7.0, 7.5, 9.0), tree_tok_per_s=(800.0, 900.0, 850.0)),
    ServingChoice(16, chain_len=0, ar_step_ms=8.0, tree_step_ms=(9.0, 11.0, 14.0),
                  tree_tok_per_s=(2100.0, 1900.0, 1500.0)),
    ServingChoice(64, chain_len=0, ar_step_ms=14.0, tree_step_ms=(20.0, 25.0, None),
                  tree_tok_per_s=(3000.0, 2800.0, None)),
), trees=TREES, source="banks/tiny")
DRAFTER = EngineDrafter(path="/srv/drafters/tiny-eagle3", aux_layer_ids=(1, 2, 4))
LOADS = range(1, 90)


def test_vllm_zeros_are_filled_where_the_bank_measured_a_chain_at_ar_speed() -> None:
    filled, changes = fill_vllm_zeros(SCHEDULE)
    assert changes == {16: (1, 2100.0, 2000.0)}
    assert filled.choice(16).chain_len == 1 and filled.choice(16).chain_tok_per_s == 2100.0
    assert filled.choice(64).chain_len == 0 and filled.choices[:2] == SCHEDULE.choices[:2]
    out = export_schedule(SCHEDULE, "vllm")
    assert out["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 2], [5, 16, 1], [17, 64, 0]]
    kept = export_schedule(SCHEDULE, "vllm", keep_zeros=True)
    assert kept["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 2], [5, 16, 0], [17, 64, 0]]
    for load in LOADS:  # vLLM's lookup (our parser of build_dynamic_sd_schedule_lookup) serves the filled schedule
        assert parse_schedule(out, "vllm").chain_len_for(load) == filled.chain_len_for(load)
        assert parse_schedule(kept, "vllm").chain_len_for(load) == SCHEDULE.chain_len_for(load)
    # nothing measured at a batch size, or a chain slower than AR: the 0 stays
    bare = ServingSchedule(choices=(ServingChoice(1, chain_len=2), ServingChoice(8, ar_step_ms=4.0)))
    assert fill_vllm_zeros(bare) == (bare, {})
    # the other formats write the bank's own choices
    assert export_schedule(SCHEDULE, "trtllm")["draft_len_schedule"] == {1: 3, 4: 2}
    assert engine_schedule(SCHEDULE, "json") == SCHEDULE


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fmt", ["vllm", "trtllm", "sglang"])
def test_the_margin_keeps_each_choice_for_margin_more_sequences(fmt: str, margin: int) -> None:
    out = export_schedule(SCHEDULE, fmt, margin=margin, keep_zeros=True)
    read = parse_schedule(out, fmt)
    for load in LOADS:
        measured = max(1, load - margin)  # the choice of the smallest measured batch size >= load - margin
        assert read.chain_len_for(load) == SCHEDULE.chain_len_for(measured), (load, margin)
    assert SCHEDULE.shifted(margin).batch_sizes == tuple(b + margin for b in SCHEDULE.batch_sizes)
    if fmt == "sglang" and margin:
        assert f"# batch_size={16 + margin} (measured at 16, margin {margin}): no speculation" in out
    if fmt == "trtllm":  # the validator's rule survives: the smallest key drafts max_draft_len
        assert out["draft_len_schedule"] == {1 + margin: 3, 4 + margin: 2} and out["max_draft_len"] == 3


def test_margin_errors() -> None:
    assert SCHEDULE.shifted(0) is SCHEDULE
    for bad in (-1, True, 1.5):
        with pytest.raises(ScheduleError, match="boundary margin must be an int >= 0"):
            export_schedule(SCHEDULE, "vllm", margin=bad)  # type: ignore[arg-type]


def test_eagle3_exports_name_the_method_and_the_drafter() -> None:
    plain = {fmt: export_schedule(SCHEDULE, fmt) for fmt in ("vllm", "trtllm", "sglang")}
    vllm = export_schedule(SCHEDULE, "vllm", drafter=DRAFTER)
    assert vllm == {"method": "eagle3", "model": DRAFTER.path, **plain["vllm"]}
    trt = export_schedule(SCHEDULE, "trtllm", drafter=DRAFTER)
    assert trt == {"decoding_type": "Eagle3", "speculative_model_dir": DRAFTER.path, "eagle3_one_model": True,
                   **plain["trtllm"], "eagle3_layers_to_capture": [0, 1, 3]}  # layer outputs: our ids - 1
    text = export_schedule(SCHEDULE, "sglang", drafter=DRAFTER)
    flag_lines = [ln for ln in text.splitlines() if ln.startswith("--")]
    assert len(flag_lines) == 3  # batch sizes 1 and 4, and the adaptive launch line
    assert all(ln.startswith(f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {DRAFTER.path} --")
               for ln in flag_lines)
    assert sglang_drafter(text) == ("EAGLE3", DRAFTER.path) and sglang_drafter(plain["sglang"]) is None
    assert parse_schedule(text, "sglang") == parse_schedule(plain["sglang"], "sglang")
    # the parsers read the lengths back as without a drafter
    for fmt, out in (("vllm", vllm), ("trtllm", trt)):
        assert parse_schedule(out, fmt) == parse_schedule(plain[fmt], fmt)
    # json and the tree formats carry no engine settings
    assert export_schedule(SCHEDULE, "json", drafter=DRAFTER) == export_schedule(SCHEDULE, "json")


def test_eagle3_exports_refuse_what_the_engine_cannot_take() -> None:
    embeddings = EngineDrafter(path="/d", aux_layer_ids=(0, 2, 4))
    assert export_schedule(SCHEDULE, "vllm", drafter=embeddings)["model"] == "/d"  # vLLM names layer inputs too
    with pytest.raises(ScheduleError, match="layer 0's input .* eagle3_layers_to_capture cannot name"):
        export_schedule(SCHEDULE, "trtllm", drafter=embeddings)
    with pytest.raises(ScheduleError, match="white space"):
        export_schedule(SCHEDULE, "sglang", drafter=EngineDrafter(path="/my drafters/x", aux_layer_ids=(1,)))
    for path, ids, message in (("", (1,), "non-empty string"), ("/d", (), "non-negative ints"),
                               ("/d", (-1,), "non-negative ints"), ("/d", (True,), "non-negative ints")):
        with pytest.raises(ScheduleError, match=message):
            EngineDrafter(path=path, aux_layer_ids=ids)
    with pytest.raises(ValueError, match="EngineDrafter or None"):
        export_schedule(SCHEDULE, "vllm", drafter="/d")  # type: ignore[arg-type]
    assert DRAFTER_PLACEHOLDER == "DRAFTER_DIR"
