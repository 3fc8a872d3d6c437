"""The prepare library from the command line, without hydra:
`python -m pipeline.prepare humaneval gsm8k --profile cpu --model-dir ...`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.artifacts import read_json
from pipeline.prepare.write import prepare_task
from pipeline.prepare.task_config import load_profile_config, load_task_config


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.prepare humaneval gsm8k --profile cpu`: the stage without hydra."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tasks", nargs="+", help="task names (conf/task/<name>.yaml) or YAML paths")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--model-dir", required=True, help="the model folder whose tokenizer renders the prompts")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    profile = load_profile_config(args.profile)
    for task in args.tasks:
        out = prepare_task(load_task_config(task), profile, Path(args.model_dir), Path(args.data_dir), args.force)
        summary = read_json(out / "manifest.json")["summary"]
        print(json.dumps({"task": task, "pools": summary["pools"], "overlong": summary["overlong"],
                          "skipped": {k: v for k, v in summary["records"].items() if k.startswith("skipped")}}))

