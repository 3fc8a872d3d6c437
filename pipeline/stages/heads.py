"""heads: the draft heads folder — `heads.dir` when given, else heads trained for this model
(shipped ones are up to date when their manifest's key matches), which first prepares the train
pools the training mix reads. Its key (head shape, `heads.train`, the training rows' content,
the model's fingerprint) is built in `pipeline.heads.build.train_heads`."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline.graph import forced, once_per_config, plain
from pipeline.paths import Layout
from pipeline.stages import model as model_stage

READS = ("heads", "model.name", "profile.max_prompt_tokens")  # `device` only decides where training runs


@once_per_config
def output(cfg: DictConfig) -> Path:
    from pipeline.heads import train_heads
    from pipeline.prepare import load_task_config, prepare_task

    model_dir = model_stage.output(cfg)
    lay = Layout.from_cfg(cfg)
    if cfg.heads.dir:
        from pipeline.heads_import import import_heads

        # project-format heads are used as they are; published Hydra/Hydra++/Medusa folders are
        # converted once into artifacts/heads/<model>/<name>/ (with the source's checksum)
        return import_heads(cfg.heads.dir, model_dir, lay.heads_dir(), force=forced(cfg, "heads"))
    train = cfg.heads.train
    tasks = set(train.tasks) | ({train.functions_from, train.functions_template} if train.functions_from else set())
    for task in sorted(tasks):  # the training mix reads these tasks' prepared splits
        task_cfg = plain(cfg.task) if task == cfg.task.name else load_task_config(task)
        prepare_task(task_cfg, {"max_prompt_tokens": int(cfg.profile.max_prompt_tokens)}, model_dir, lay.data)
    return train_heads(plain(cfg.heads), model_dir, lay.data, lay.artifacts, force=forced(cfg, "heads"),
                       model_name=lay.model_name, device=str(cfg.device))
