"""SGLang's own code reads the SGLang exports (runtime/export/engines.py ``to_sglang_schedule``).

Run where an interpreter with sglang exists (tests/helpers/engine_envs.py; checked with sglang 0.5.23
installed with --no-deps): every flag line, with the record `entmtp export` puts in it, goes through
``ServerArgs.add_cli_args`` + ``ServerArgs.from_cli_args`` (python/sglang/srt/server_args.py) as a
launch command would, and every adaptive config through ``AdaptiveSpeculativeParams`` (its loader
``_load_adaptive_config`` and router ``get_steps_for_batch``,
python/sglang/srt/speculative/adaptive_spec_params.py), which must give every load the bank's
choice under the schedule rule and the boundary margin, with and without CUDA-graph padding.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from runtime.export.engines import EngineDrafter, export_schedule
from runtime.export.notes import BankFacts, embed_record, export_record
from runtime.export.schedule import ServingChoice, ServingSchedule
from runtime.tree import Tree
from tests.helpers import SIX_NODE_TREE
from tests.helpers.engine_envs import engine_python, run_check

pytestmark = pytest.mark.engines

DRAFTER = EngineDrafter(path="/srv/drafters/tiny-eagle3", aux_layer_ids=(1, 2, 3))


def _schedules() -> list[ServingSchedule]:
    """A hand-written schedule (a tree, a chain, a zero between, nothing at the top), one that still
    speculates at its largest batch size, and 24 seeded random ones."""
    fixed = [
        ServingSchedule(choices=(ServingChoice(1, tree=Tree.named("mc_sim_7b_63"), chain_len=4),
                                 ServingChoice(4, tree=SIX_NODE_TREE, chain_len=2), ServingChoice(8, chain_len=0),
                                 ServingChoice(16, chain_len=1), ServingChoice(64))),
        ServingSchedule(choices=(ServingChoice(2, chain_len=3), ServingChoice(32, tree=Tree.chain(2), chain_len=2))),
    ]
    rng = random.Random(0)
    for _ in range(24):
        sizes = sorted(rng.sample(range(1, 130), rng.randint(1, 5)))
        fixed.append(ServingSchedule(choices=tuple(
            ServingChoice(b, tree=rng.choice([None, Tree.chain(rng.randint(1, 4)), SIX_NODE_TREE]),
                          chain_len=rng.randint(0, 6)) for b in sizes)))
    return fixed


def _cases(tmp_path: Path) -> tuple[list[list[str]], list[dict], list[dict]]:
    """(flag lines as argv, their expected speculative fields, adaptive-config cases with expected steps)."""
    argv, expected, adaptive = [], [], []
    facts = BankFacts(source="banks/tiny", drafter="eagle3", device="cpu", hardware="test CPU", dtype="float32")
    for n, schedule in enumerate(_schedules()):
        for margin, drafter in ((0, None), (2, DRAFTER)):
            text = export_schedule(schedule, "sglang", margin=margin, drafter=drafter)
            text = embed_record(text, "sglang", export_record(schedule, "sglang", facts, margin=margin))
            for line in text.splitlines():
                flags = line.partition("#")[0].split()
                if not flags:
                    continue
                if line.startswith("{"):
                    path = tmp_path / f"adaptive-{n}-{margin}.json"
                    path.write_text(line)
                    assert "_entmtp" in json.loads(line)  # the record rides along; SGLang must ignore it
                    served = schedule.shifted(margin)
                    loads = list(range(1, served.batch_sizes[-1] + 4))
                    want = [served.chain_len_for(b) for b in loads]
                    for graphs in (None, [*served.batch_sizes, 512]):
                        adaptive.append({"path": str(path), "initial_steps": schedule.max_chain_len, "loads": loads,
                                         "cuda_graph_bs": graphs, "want": want})
                    continue
                values = dict(zip(flags[0::2], flags[1::2]))
                argv.append(["--model-path", "/models/target", *flags])
                expected.append({
                    "speculative_algorithm": "EAGLE3" if drafter else None,
                    "speculative_draft_model_path": drafter.path if drafter else None,
                    "speculative_num_steps": int(values["--speculative-num-steps"]),
                    "speculative_eagle_topk": int(values["--speculative-eagle-topk"]),
                    "speculative_num_draft_tokens": int(values["--speculative-num-draft-tokens"]),
                    "speculative_adaptive": "--speculative-adaptive" in flags,
                    "speculative_adaptive_config": "adaptive.json" if "--speculative-adaptive" in flags else None,
                    "model_path": "/models/target"})
    return argv, expected, adaptive


def test_sglang_reads_the_flags_and_routes_the_adaptive_config_as_the_schedule_says(tmp_path: Path) -> None:
    python = engine_python("sglang")
    if python is None:
        pytest.skip("no interpreter with sglang (tests/helpers/engine_envs.py says where one is looked for)")
    argv, expected, adaptive = _cases(tmp_path)
    assert len(argv) > 50 and len(adaptive) > 20
    answer = run_check(python, "sglang_check.py",
                       {"flag_lines": argv, "adaptive_configs": [{k: v for k, v in a.items() if k != "want"}
                                                                 for a in adaptive]}, tmp_path)
    for line, want, got in zip(argv, expected, answer["flag_lines"]):
        # SGLang's own types: ints, the algorithm's name, the path as given
        assert got == want, line
    for case, got in zip(adaptive, answer["adaptive_configs"]):
        assert got["steps"] == case["want"], (case["path"], case["cuda_graph_bs"])
        assert set(got["candidate_steps"]) <= set(range(0, 7))
