"""heads: the draft heads folder — `heads.dir` when given (published Hydra / Medusa heads and
EAGLE-3 drafters converted once, `pipeline.heads.published.convert.import_heads`), else heads trained
for this model (shipped ones are up to date when their manifest's key matches), which first prepares
the train pools the training mix reads. Its key (head shape, `heads.train`, the training rows'
content, the model's fingerprint) is built in `pipeline.heads.recipe.train_heads`. With
`heads.draft_vocab.size` the stage then derives heads drafting over a frequency-ranked vocabulary
(`pipeline.heads.draft_vocab`), and every later stage uses those; heads with an output layer of
their own (published Hydra / Medusa, EAGLE-3 with its d2t) skip that step, which the log says."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline.graph import forced, once_per_config, plain
from pipeline.paths import Layout
from pipeline.stages import model as model_stage

READS = ("heads", "model.name", "profile.max_prompt_tokens")  # `device` only decides where training runs

log = logging.getLogger(__name__)


@once_per_config
def output(cfg: DictConfig) -> Path:
    from pipeline.heads.published.convert import own_output_reason
    from pipeline.prepare import load_task_config, prepare_task

    model_dir = model_stage.output(cfg)
    lay = Layout.from_cfg(cfg)
    train, dv = cfg.heads.train, cfg.heads.draft_vocab
    own = own_output_reason(cfg.heads) if dv.size else None
    size = None if own else dv.size
    if own:
        log.info("[heads] no frequency-ranked draft vocabulary (heads.draft_vocab.size=%s): %s, and the draft "
                 "vocabulary restricts the base lm_head that heads share; these heads draft over their own output "
                 "layer", dv.size, own)
    tasks: set[str] = set()  # the train pools read: by the training mix, and by the draft vocabulary's counts
    if not cfg.heads.dir:
        tasks |= set(train.tasks) | ({train.functions_from, train.functions_template} if train.functions_from else set())
    if size:
        tasks |= set(train.tasks)
    for task in sorted(tasks):
        task_cfg = plain(cfg.task) if task == cfg.task.name else load_task_config(task)
        prepare_task(task_cfg, {"max_prompt_tokens": int(cfg.profile.max_prompt_tokens)}, model_dir, lay.data)
    full = _full_heads(cfg, model_dir, lay)
    if not size:
        return full
    from pipeline.heads.draft_vocab import FrequencySettings, derive_draft_vocab_heads

    s = FrequencySettings(tasks=list(train.tasks), prompts_per_task=int(dv.prompts_per_task),
                          max_new_tokens=int(dv.max_new_tokens))
    # lay.heads_dir() is the run's heads name, `<heads.name>-draft<size>` (`pipeline.paths.heads_run_name`)
    return derive_draft_vocab_heads(full, model_dir, lay.data, lay.frequencies_root, lay.heads_dir(), int(size), s,
                                    force=forced(cfg, "heads"), memo_dir=lay.heads_cache)


def _full_heads(cfg: DictConfig, model_dir: Path, lay: Layout) -> Path:
    """The full-vocabulary heads: `heads.dir`, or heads trained for this model."""
    if cfg.heads.dir:
        from pipeline.heads.published.convert import import_heads

        # project-format heads are used as they are; published Hydra/Hydra++/Medusa folders and EAGLE-3
        # drafters are converted once into artifacts/heads/<model>/<name>/ (with the source's checksum)
        return import_heads(cfg.heads.dir, model_dir, lay.heads_dir(str(cfg.heads.name)), force=forced(cfg, "heads"),
                            aux_convention=cfg.heads.get("aux_convention"))
    if cfg.heads.kind == "eagle3":
        from pipeline.heads.eagle3_train import train_eagle3

        return train_eagle3(plain(cfg.heads), model_dir, lay.data, lay.artifacts, force=forced(cfg, "heads"),
                            model_name=lay.model_name, device=str(cfg.device))
    from pipeline.heads import train_heads

    return train_heads(plain(cfg.heads), model_dir, lay.data, lay.artifacts, force=forced(cfg, "heads"),
                       model_name=lay.model_name, device=str(cfg.device))
