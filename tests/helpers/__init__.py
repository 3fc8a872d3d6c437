"""Shared builders for the tests (test modules import these, never each other).

* `env`: the repo root (`REPO`, which is `pipeline.paths.REPO_ROOT`), the venv's interpreter and
  child-process environment, torch thread counts;
* `models`: in memory, random runtime Transformers (`tiny_transformer`, `tiny_model`) and heads
  (`tiny_heads`), the AR reference `ar_greedy`, `DECODER_TREES` and the hypothesis strategy `trees`,
  the row-invariant arithmetics (`ARITHMETICS`, `invariant_model`), EntMTP-dyn's `SUPER` tree,
  `random_hf_causal_lm`;
* `banks`: a bank shaped like the pipeline's (`make_bank`, `reseal`) and the tiny bank's trees,
  figures and policies;
* `bundle`: the tiny model + heads + bank on disk (`TinyBundle`, `tiny_bundle`, `copy_bundle`) and
  the pipeline config sized for it (`tiny_pipeline_cfg`);
* `rollouts`: seeded fake rollouts, and real ones of a tiny model with their head scores;
* `step_cost`: a step-cost model from known costs;
* `training`: a tiny transformers checkpoint for heads training, its prompts, self-distillation
  data and fresh heads (imported as `tests.helpers.training`);
* `drafters`: EAGLE-3 drafters over a 3-layer tiny target in each arithmetic, random or briefly
  trained (imported as `tests.helpers.drafters`);
* `eagle3_folders`: an EAGLE-3 drafter for a model folder on disk (random or briefly trained), written
  in this project's format, EAGLE's own layout or the speculators layout (imported as
  `tests.helpers.eagle3_folders`);
* `own_model`: Vicuna-layout and sharded-safetensors folders, published Hydra / Medusa heads;
* `device_check`: `DeviceCheck`, which finds CPU tensors built next to CUDA ones without a GPU.

Every name is importable from `tests.helpers` itself.
"""

from __future__ import annotations

from tests.helpers.banks import (BANK_TREES, BEST_STATIC, HEADS_FP, MODEL_FP, SIX_NODE_TREE, fake_figures, make_bank,
                                 reseal, tiny_policies)
from tests.helpers.bundle import (HEADS_NAME, MODEL_NAME, NUM_HEADS, TASK_NAME, TOKENIZER_FILES, TinyBundle,
                                  build_tiny_bundle, copy_bundle, copy_tokenizer_files, make_tiny_bank, make_tiny_heads,
                                  make_tiny_model, tiny_bundle, tiny_pipeline_cfg, tiny_pipeline_overrides)
from tests.helpers.env import PYTHON, REPO, pin_to_one_cpu, python_exe, subprocess_env, torch_threads
from tests.helpers.models import (ARITHMETICS, DECODER_TREES, DRAFTS, GENTLE, SUPER, ar_greedy,
                                  invariant_model, random_hf_causal_lm, random_prompts, tiny_heads, tiny_model,
                                  tiny_transformer, trees)
from tests.helpers.own_model import (write_published_hydra, write_published_medusa, write_sharded_safetensors_folder,
                                     write_vicuna_bin_folder)
from tests.helpers.rollouts import scored_rollouts, synthetic_rollouts
from tests.helpers.step_cost import level_ms, synthetic_step_model, verify_ms

__all__ = [
    "ARITHMETICS", "BANK_TREES", "BEST_STATIC", "DECODER_TREES", "DRAFTS", "GENTLE", "HEADS_FP",
    "HEADS_NAME", "MODEL_FP", "MODEL_NAME", "NUM_HEADS", "PYTHON", "REPO", "SIX_NODE_TREE", "SUPER", "TASK_NAME",
    "TOKENIZER_FILES", "TinyBundle", "ar_greedy", "build_tiny_bundle", "copy_bundle",
    "copy_tokenizer_files", "fake_figures", "invariant_model", "level_ms", "make_bank", "make_tiny_bank",
    "make_tiny_heads", "make_tiny_model", "pin_to_one_cpu", "python_exe", "random_hf_causal_lm", "random_prompts",
    "reseal", "scored_rollouts", "subprocess_env", "synthetic_rollouts", "synthetic_step_model", "tiny_bundle", "tiny_heads",
    "tiny_model", "tiny_pipeline_cfg", "tiny_pipeline_overrides", "tiny_policies", "tiny_transformer",
    "torch_threads", "trees", "verify_ms", "write_published_hydra", "write_published_medusa",
    "write_sharded_safetensors_folder", "write_vicuna_bin_folder",
]
