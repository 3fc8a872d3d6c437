"""Read EntMTP's SGLang exports with SGLang's own code (run by path under an interpreter that has
sglang; tests/helpers/engine_envs.py). Imports nothing of this project.

    python sglang_check.py REQUEST.json ANSWER.json

REQUEST: {"flag_lines": [[arg, ...], ...], "adaptive_configs": [{"path": file, "initial_steps": n,
"loads": [b, ...], "cuda_graph_bs": [b, ...] | null}, ...]}. Each flag line is parsed as a launch
command would be: ``ServerArgs.add_cli_args`` on a fresh parser, ``parse_args``, then
``ServerArgs.from_cli_args`` (python/sglang/srt/server_args.py); the answer holds the speculative
fields of each ServerArgs. Each adaptive config is loaded by ``AdaptiveSpeculativeParams``
(python/sglang/srt/speculative/adaptive_spec_params.py), and the answer holds the steps its router
gives each load (``get_steps_for_batch``), after ``set_cuda_graph_bs`` where given.
"""

from __future__ import annotations

import argparse
import json
import sys

FIELDS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
          "speculative_num_draft_tokens", "speculative_adaptive", "speculative_adaptive_config", "model_path")


def main(request_path: str, answer_path: str) -> None:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    request = json.loads(open(request_path).read())
    answer: dict = {"flag_lines": [], "adaptive_configs": []}
    for argv in request["flag_lines"]:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        answer["flag_lines"].append({name: getattr(args, name, None) for name in FIELDS})
    for case in request["adaptive_configs"]:
        params = AdaptiveSpeculativeParams(case["initial_steps"], case["path"])
        if case.get("cuda_graph_bs"):
            params.set_cuda_graph_bs(case["cuda_graph_bs"])
        answer["adaptive_configs"].append({"steps": [params.get_steps_for_batch(b) for b in case["loads"]],
                                           "candidate_steps": params.candidate_steps})
    with open(answer_path, "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
