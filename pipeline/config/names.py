"""Plain constants of the config that code outside hydra reads (the benchmarks, the GPU check on a
bare machine): importing this module imports neither hydra-core nor omegaconf.
`pipeline.config.schema` builds the typed config from them."""

from __future__ import annotations

# the tasks of the default heads training mix, and of `make banks` / `stage=compare` and the benchmarks
TRAIN_TASKS = ("humaneval", "gsm8k", "sharegpt")
# the stages, in the order they run (one module each: pipeline/stages/<stage>.py)
STAGE_ORDER = ("model", "dtype", "heads", "prepare", "rollout", "merge", "grow", "scores", "recalibrate", "time", "bank",
               "evaluate", "compare")
