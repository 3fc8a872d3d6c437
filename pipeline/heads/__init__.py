"""Draft heads (Hydra, Hydra++, Medusa) distilled from the frozen base model.

What the heads are judged on is greedy acceptance along the base model's *own* continuations, so
they are trained on self-distillation text:

* `mix`: the training prompts — every task's train split (disjoint from every calib/eval split by
  construction of the prepare stage) plus HumanEval-style prompts cut from the Python functions in
  a chat task's train replies — drawn round-robin, with a held-out share for the report;
* `distill`: greedy continuations of those prompts by the base model, with hidden states and the
  base distribution's top-k at every step (cached, resumable);
* `train`: the heads learn the base distribution along those continuations (resumable);
* `report`: per-head accuracy and replayed tokens per step on the held-out continuations;
* `build`: all of it as one stage output, `artifacts/heads/<model>/<name>/`.
"""

from pipeline.heads.recipe import heads_config_for, train_heads
from pipeline.heads.mix import FUNCTIONS, function_prompts, function_texts, read_train_rows, select_prompts
from pipeline.config.schema import TrainSettings

__all__ = ["FUNCTIONS", "TrainSettings", "function_prompts", "function_texts", "heads_config_for", "read_train_rows",
           "select_prompts", "train_heads"]
