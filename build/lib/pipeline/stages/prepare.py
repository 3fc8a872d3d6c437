"""prepare: the task's packaged data set as seeded, disjoint, rendered prompt splits
(data/<task>/{eval,calib,train}.jsonl). Its key (task config, source and tokenizer fingerprints,
`profile.max_prompt_tokens`) is built inside `pipeline.prepare.prepare_task`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import prepare as prepare_lib
from pipeline.artifacts import hash_obj
from pipeline.graph import forced, once_per_config, plain
from pipeline.paths import Layout
from pipeline.stages import model as model_stage

READS = ("task", "profile.max_prompt_tokens")


@once_per_config
def output(cfg: DictConfig) -> Path:
    return prepare_lib.prepare_task(plain(cfg.task), {"max_prompt_tokens": int(cfg.profile.max_prompt_tokens)},
                                    model_stage.output(cfg), Layout.from_cfg(cfg).data, force=forced(cfg, "prepare"))


def split_rows(cfg: DictConfig, split: str, n: int | None = None) -> list[dict[str, Any]]:
    """The first `n` rows of the task's prepared `split` (prepared first if needed)."""
    output(cfg)
    return prepare_lib.read_split(Layout.from_cfg(cfg).data, str(cfg.task.name), split, limit=n)


def rows_hash(rows: list[dict[str, Any]]) -> str:
    """What a stage key records of the prompts it reads: their token ids."""
    return hash_obj([r["input_ids"] for r in rows])
