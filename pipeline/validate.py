"""Start-up validation of the pipeline config: fail in seconds, before any long work.

`python -m pipeline ...` calls `validate_config(cfg)` before it runs a stage. A stage may run for
hours (heads training, rollouts) and only then reach a setting that cannot work, so every setting
that can be checked without loading a model is checked here, all at once: the error lists every
problem found, each naming the setting, its value and what to do.

Unknown config *group options* (`task=nope`, `policy=nope`) never get here: hydra rejects them
while composing the config and lists the available options itself.

What is checked (all stages: one config drives the whole chain, and `stage=bank` runs them all):

* top level: stage, dtype, device (and that CUDA is visible), threads, seed, force;
* model: source; a `local` folder exists and holds config.json + tokenizer.json + *.safetensors;
  `gguf_package` finds its package unless the converted folder already exists; hub needs a
  repo_id; max_seq_len fits a prompt + the new tokens + the largest tree;
* heads: kind, output, draft vocabulary, num_heads / num_layers, an explicit `dir`, the training
  settings (`heads.train`, including that its tasks exist);
* task: the task file's schema (pipeline.prepare.validate_task_config);
* profile: positive sizes (prompts, tokens, rank cap, grow budget);
* grow: 1 <= max_depth <= heads.num_heads; candidate sizes;
* rollout: 0 <= shard < num_shards; time / evaluate sizes;
* policy: runtime.policy.validate_policy_config (kind, signal, tau grid, fixed taus with
  tau_off <= tau_on, strictly increasing fixed ladder thresholds).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
MODEL_SOURCES = ("gguf_package", "local", "hub")
HEAD_KINDS = ("hydra", "medusa")
HEAD_OUTPUTS = ("shared", "own", "draft")
# the Medusa/Hydra default tree (63 nodes + root) is decoded by the evaluate stage whatever the budget
REFERENCE_TREE_NODES = 64


class ConfigError(SystemExit):
    """Raised (as an exit with status 1) when the config cannot work; the message lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        head = "invalid configuration" + (f" ({len(problems)} problems)" if len(problems) > 1 else "")
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Checker:
    """Collects problems; each check reads a dotted key and records what is wrong with it."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.problems: list[str] = []

    def add(self, msg: str) -> None:
        if msg not in self.problems:
            self.problems.append(msg)

    def get(self, key: str, default: Any = None) -> Any:
        """The resolved value at `key` (containers as plain Python), or `default` when absent.
        A value that cannot be resolved is recorded as a problem and read as `default`."""
        try:
            v = OmegaConf.select(self.cfg, key, default=default, throw_on_missing=True)
        except MissingMandatoryValue:
            self.add(f"{key} is required but not set; pass {key}=... on the command line")
            return default
        except Exception as e:  # noqa: BLE001 - a bad interpolation must be reported, not crash
            self.add(f"{key} cannot be read ({type(e).__name__}: {e}); fix or override it")
            return default
        if isinstance(v, (DictConfig, ListConfig)):
            v = OmegaConf.to_container(v, resolve=True)
        return v

    def choice(self, key: str, options: tuple[str, ...]) -> Any:
        v = self.get(key)
        if v not in options:
            self.add(f"{key}={v!r} is not valid; use one of: {', '.join(options)}")
        return v

    def int_at_least(self, key: str, lo: int, what: str = "", optional: bool = False) -> int | None:
        v = self.get(key)
        if v is None and optional:
            return None
        if not _is_int(v) or v < lo:
            self.add(f"{key}={v!r} must be an integer >= {lo}{what}")
            return None
        return v

    def guard(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run a validator owned by another module; its ValueError becomes a problem under `key`."""
        try:
            return fn()
        except (ValueError, TypeError, FileNotFoundError) as e:
            msg = str(e)
            self.add(msg if msg.startswith(key) else f"{key}: {msg}")
            return None


def _missing_keys(cfg: DictConfig) -> list[str]:
    """Mandatory values (`???`) that were never set, e.g. model.path for `model=local`. Read without
    resolving interpolations (resolving `${hydra:...}` needs a running hydra app)."""
    raw = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if prefix == "" and k == "hydra":
                    continue
                walk(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix}[{i}]")
        elif node == "???":
            out.append(prefix)

    walk(raw, "")
    return out


def config_problems(cfg: DictConfig) -> list[str]:
    """Every problem found in `cfg` (empty when it is usable). Loads no model and no data."""
    from pipeline.run import STAGE_ORDER, TRAIN_TASKS  # lazy: run.py imports this module

    c = _Checker(cfg)
    missing = _missing_keys(cfg)
    for key in missing:
        c.add(f"{key} is required but not set; pass {key}=... on the command line")

    # ---- top level
    stage = c.get("stage")
    if stage not in STAGE_ORDER:
        c.add(f"stage={stage!r} is unknown; choose one of: {', '.join(STAGE_ORDER)}")
    if not isinstance(c.get("force", False), bool):
        c.add(f"force={c.get('force')!r} must be true or false")
    c.choice("dtype", DTYPES)
    device = c.choice("device", DEVICES)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            c.add("device=cuda but no CUDA device is visible; use device=cpu")
    c.int_at_least("threads", 1, " or null (all cores)", optional=True)
    c.int_at_least("seed", 0)

    # ---- model
    source = c.choice("model.source", MODEL_SOURCES)
    c.choice("model.dtype", WEIGHT_DTYPES)
    max_seq_len = c.int_at_least("model.max_seq_len", 2, " (the KV cache capacity in tokens), or null for the "
                                 "model's max_position_embeddings", optional=True)
    template = c.get("model.chat_template")
    if template is not None:
        from pipeline.chat_templates import template_choices

        if template not in template_choices():
            c.add(f"model.chat_template={template!r} is not a known chat template; use one of: "
                  f"{', '.join(template_choices())} (or null for the folder's own)")
    if source == "local":
        path = c.get("model.path")
        if path is not None:
            p = Path(str(path))
            if not p.is_dir():
                c.add(f"model.path={path} is not a folder; point it at a Hugging Face model folder "
                      "(config.json, tokenizer.json, *.safetensors), e.g. model.path=artifacts/models/smollm2-135m-instruct")
            else:
                from pipeline.model import inspect_model_folder  # .bin shards / tokenizer.model are converted

                if c.guard("model.path", lambda: inspect_model_folder(p)) is not None and max_seq_len is None:
                    from pipeline.model import max_position_embeddings

                    max_seq_len = max_position_embeddings(p)  # what null resolves to; checked below
    elif source == "gguf_package":
        name = c.get("model.name")
        converted = Path(str(c.get("artifacts_dir", "artifacts"))) / "models" / str(name) / "config.json"
        if not converted.is_file():  # the package is only needed to convert the model the first time
            from pipeline.model import find_package_file

            c.guard("model.package", lambda: find_package_file(str(c.get("model.package")), str(c.get("model.file", "*.gguf"))))
    elif source == "hub" and not c.get("model.repo_id") and "model.repo_id" not in missing:
        c.add("model.repo_id is required for model=hub; pass e.g. model.repo_id=lmsys/vicuna-7b-v1.3")

    # ---- heads
    c.choice("heads.kind", HEAD_KINDS)
    output = c.choice("heads.output", HEAD_OUTPUTS)
    num_heads = c.int_at_least("heads.num_heads", 1, " (draft heads = the deepest tree)")
    c.int_at_least("heads.num_layers", 1, " (ResBlocks per head)")
    if not isinstance(c.get("heads.prefix_layer", False), bool):
        c.add(f"heads.prefix_layer={c.get('heads.prefix_layer')!r} must be true or false")
    dv = c.get("heads.draft_vocab_size")
    if output == "draft" and (not _is_int(dv) or dv < 1):
        c.add(f"heads.draft_vocab_size={dv!r}: heads.output=draft needs a positive draft vocabulary size")
    if output in ("shared", "own") and dv is not None:
        c.add(f"heads.draft_vocab_size={dv!r} only applies to heads.output=draft; set it to null")
    hdir = c.get("heads.dir")
    if hdir:
        if not (Path(str(hdir)) / "config.json").is_file():
            c.add(f"heads.dir={hdir} holds no heads (config.json + heads.safetensors, or a published Hydra/Medusa "
                  "folder); fix the path or set heads.dir=null to train them")
        else:
            from pipeline.heads_import import heads_folder_kind

            c.guard("heads.dir", lambda: heads_folder_kind(Path(str(hdir))))
    elif c.get("heads.train") is not None:
        from pipeline.train_heads import TrainSettings

        train = c.get("heads.train")
        c.guard("heads.train", lambda: TrainSettings.from_dict(train))
        tasks = train.get("tasks") if isinstance(train, dict) else None
        for t in tasks or []:
            if t not in TRAIN_TASKS and not (Path(__file__).resolve().parent.parent / "conf" / "task" / f"{t}.yaml").is_file():
                c.add(f"heads.train.tasks lists {t!r}, which has no conf/task/{t}.yaml; use some of: {', '.join(TRAIN_TASKS)}")

    # ---- task
    from pipeline.prepare import validate_task_config

    task = c.get("task")
    if isinstance(task, dict):
        c.guard("task", lambda: validate_task_config(task))
    else:
        c.add(f"task={task!r} is not a task config; pick one with task=<name> (a file in conf/task/)")

    # ---- profile
    for key in ("calib_prompts", "eval_prompts", "max_new_tokens", "max_prompt_tokens", "rank_cap", "recalib_prompts",
                "timing_prompts"):
        c.int_at_least(f"profile.{key}", 1)
    budget = c.int_at_least("profile.grow_budget", 1, " (nodes of the largest grown tree, root excluded)")
    calib, recal, timing = (c.get(f"profile.{k}") for k in ("calib_prompts", "recalib_prompts", "timing_prompts"))
    for key, v in (("recalib_prompts", recal), ("timing_prompts", timing)):
        if _is_int(v) and _is_int(calib) and v > calib:
            c.add(f"profile.{key}={v} exceeds profile.calib_prompts={calib}: they are drawn from the calibration prompts; "
                  f"lower it or raise calib_prompts")

    # the decoder refuses a prompt + new tokens + tree that overflow the KV cache: say so now, not mid-run
    p_tok, n_tok = c.get("profile.max_prompt_tokens"), c.get("profile.max_new_tokens")
    if all(_is_int(v) for v in (max_seq_len, budget, p_tok, n_tok)):
        nodes = max(budget + 1, REFERENCE_TREE_NODES)
        need = p_tok + n_tok + nodes
        if need > max_seq_len:
            c.add(f"model.max_seq_len={max_seq_len} is too small: profile.max_prompt_tokens ({p_tok}) + "
                  f"profile.max_new_tokens ({n_tok}) + the largest tree ({nodes} nodes) = {need}; "
                  "raise model.max_seq_len or lower those sizes")

    # ---- grow
    max_depth = c.get("grow.max_depth")
    if not _is_int(max_depth) or max_depth < 1:
        c.add(f"grow.max_depth={max_depth!r} must be an integer >= 1")
    elif num_heads is not None and max_depth > num_heads:
        c.add(f"grow.max_depth={max_depth} exceeds heads.num_heads={num_heads}: a tree cannot be deeper than the "
              f"number of draft heads; set grow.max_depth<={num_heads}")
    sizes = c.get("grow.candidate_sizes")
    if not isinstance(sizes, list) or not sizes or not all(_is_int(s) and s >= 0 for s in sizes):
        c.add(f"grow.candidate_sizes={sizes!r} must be a non-empty list of integers >= 0 (draft nodes, root "
              "excluded; 0 = the root alone, i.e. AR)")
    elif budget is not None and min(s for s in sizes) > budget:
        c.add(f"grow.candidate_sizes={sizes} are all above profile.grow_budget={budget}, so no grown tree would be "
              "decoded; add sizes <= the budget or raise the budget")

    # ---- rollout / time / evaluate
    shards = c.int_at_least("rollout.num_shards", 1)
    shard = c.get("rollout.shard")
    if not _is_int(shard) or shard < 0 or (shards is not None and shard >= shards):
        c.add(f"rollout.shard={shard!r} must be an integer in [0, rollout.num_shards={c.get('rollout.num_shards')}); "
              "shards are numbered from 0")
    c.int_at_least("time.rounds", 1)
    c.int_at_least("time.new_tokens", 1)
    c.int_at_least("evaluate.max_new_tokens", 1)
    members, share = c.get("bank.members"), c.get("bank.min_oracle_share")
    if members not in ("hull", "oracle"):
        c.add(f"bank.members={members!r}: choose 'hull' (the paper's throughput hull) or 'oracle' (the hull plus "
              "trees the per-step oracle picks)")
    if not isinstance(share, (int, float)) or not 0 < share <= 1:
        c.add(f"bank.min_oracle_share={share!r} must be a number in (0, 1]")

    # ---- policy
    from runtime.policy import validate_policy_config

    pol = c.get("policy")
    c.guard("policy", lambda: validate_policy_config(pol))
    return c.problems


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError (a SystemExit, status 1) listing every problem of `cfg`; return when usable."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(problems)
