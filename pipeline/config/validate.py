"""Start-up validation of the pipeline config: fail in seconds, before any long work.

Types and unknown keys are enforced by the typed schema (`pipeline.config.schema`) while hydra composes
the config; ranges and choices of single fields are declared on the schema fields and checked here
(`field_problems`). What remains here are the rules that span fields or look outside the config
(a model folder exists, a task file exists, the KV cache fits the largest tree). Every problem is
reported at once, each naming the setting, its value and what to do.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from pipeline.paths import CONF_DIR
from pipeline.config.schema import EAGLE3, PipelineConfig, TrainSettings, field_problems

# the Medusa/Hydra default tree (63 nodes + root) is decoded by the evaluate stage whatever the budget
REFERENCE_TREE_NODES = 64


class ConfigError(SystemExit):
    """Raised (as an exit with status 1) when the config cannot work; the message lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        head = "invalid configuration" + (f" ({len(problems)} problems)" if len(problems) > 1 else "")
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))


def _missing_keys(cfg: DictConfig) -> list[str]:
    """Mandatory values (`???`) never set, e.g. model.path for `model=local`. Read without
    resolving interpolations (resolving `${hydra:...}` needs a running hydra app)."""
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, DictConfig):
            for k in node.keys():
                if prefix == "" and k == "hydra":
                    continue
                path = f"{prefix}.{k}" if prefix else str(k)
                if OmegaConf.is_missing(node, k):
                    out.append(path)
                else:
                    walk(node._get_node(k), path)
        elif isinstance(node, ListConfig):
            for i in range(len(node)):
                walk(node._get_node(i), f"{prefix}[{i}]")

    walk(cfg, "")
    return out


def config_problems(cfg: DictConfig) -> list[str]:
    """Every problem found in `cfg` (empty when it is usable). Loads no model and no data."""
    problems: list[str] = []

    def add(msg: str) -> None:
        if msg not in problems:
            problems.append(msg)

    missing = _missing_keys(cfg)
    for key in missing:
        if key == "heads.dir":  # `dir: ???`: a published checkpoint's heads, imported from their folder
            name = OmegaConf.select(cfg, "heads.name", default=None)
            add(f"heads.dir is required for heads.name={name} (published heads, imported from their folder); "
                "pass heads.dir=/path/to/the/downloaded/folder")
        else:
            add(f"{key} is required but not set; pass {key}=... on the command line")
    for p in field_problems(cfg, "", PipelineConfig):
        add(p)
    bad = {p.split("=", 1)[0] for p in problems} | set(missing)

    def get(key: str) -> Any:
        """The value at `key` as plain Python, or None when it is missing or already reported."""
        if key in bad:
            return None
        try:
            v = OmegaConf.select(cfg, key, throw_on_missing=True)
        except MissingMandatoryValue:
            return None
        return OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v

    def guard(key: str, fn: Any) -> None:
        """Run a validator owned by another module; its ValueError becomes a problem under `key`."""
        try:
            fn()
        except (ValueError, TypeError, FileNotFoundError) as e:
            msg = str(e)
            add(msg if msg.startswith(key) else f"{key}: {msg}")

    if get("device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            add("device=cuda but no CUDA device is visible; use device=cpu")

    sampling = get("sampling")
    if isinstance(sampling, dict) and not any(b.startswith("sampling.") for b in bad):
        from runtime.config import SamplingConfig

        guard("sampling", lambda: SamplingConfig(**sampling))

    if get("acceptance.kind") == "typical" and (get("sampling.temperature") or 0) > 0:
        add(f"acceptance.kind=typical decides with its own temperature (acceptance.temperature), but "
            f"sampling.temperature={get('sampling.temperature')}; set sampling.temperature=0, or use acceptance.kind=exact "
            "to sample losslessly")

    # ---- model: the source decides which fields are needed
    source = get("model.source")
    max_seq_len = get("model.max_seq_len")
    template = get("model.chat_template")
    if template is not None:
        from pipeline.model.chat_templates import template_choices

        if template not in template_choices():
            add(f"model.chat_template={template!r} is not a known chat template; use one of: "
                f"{', '.join(template_choices())} (or null for the folder's own)")
    if source == "local" and get("model.path") is not None:
        path = get("model.path")
        p = Path(str(path))
        if not p.is_dir():
            add(f"model.path={path} is not a folder; point it at a Hugging Face model folder "
                "(config.json, tokenizer.json or tokenizer.model, *.safetensors or *.bin)")
        else:
            from pipeline.model.provision import inspect_model_folder, max_position_embeddings  # .bin / tokenizer.model are converted

            guard("model.path", lambda: inspect_model_folder(p))
            if max_seq_len is None and (p / "config.json").is_file():
                max_seq_len = max_position_embeddings(p)  # what null resolves to; checked below
    elif source == "local" and "model.path" not in missing:
        add("model.path is required for model=local; pass model.path=... (a Hugging Face model folder)")
    elif source == "gguf_package":
        converted = Path(str(get("artifacts_dir") or "artifacts")) / "models" / str(get("model.name")) / "config.json"
        if not converted.is_file():  # the package is only needed to convert the model the first time
            from pipeline.model.provision import find_package_file

            guard("model.package", lambda: find_package_file(str(get("model.package")), str(get("model.file"))))
    elif source == "hub" and not get("model.repo_id") and "model.repo_id" not in missing:
        add("model.repo_id is required for model=hub; pass e.g. model.repo_id=lmsys/vicuna-7b-v1.3")

    # ---- heads
    heads = get("heads")
    output = get("heads.output")
    own_size = get("heads.draft_vocab_size")
    kind = get("heads.kind")
    if own_size is not None and output != "draft":  # the two draft-vocabulary sizes, one dot apart
        add(f"heads.draft_vocab_size={own_size} only sizes the own output layer of heads.output=draft heads, but "
            f"heads.output={output}: to draft over the {own_size} ids the model emits most often, set "
            f"heads.draft_vocab_size=null heads.draft_vocab.size={own_size}")
    elif kind == EAGLE3:
        # the drafter's shape comes from its folder; num_heads is the max draft depth
        from runtime.eagle3 import DEFAULT_MAX_DEPTH

        depth = get("heads.num_heads")
        if depth is not None and depth > DEFAULT_MAX_DEPTH:
            add(f"heads.num_heads={depth} is the max draft depth of an EAGLE-3 drafter, which the runtime drafts at most "
                f"{DEFAULT_MAX_DEPTH} deep (runtime.eagle3.DEFAULT_MAX_DEPTH): set heads.num_heads<={DEFAULT_MAX_DEPTH}")
    elif isinstance(heads, dict) and not any(b.startswith("heads.") for b in bad):
        from runtime.config import HeadsConfig

        # the runtime's own rules for a heads shape; sizes that come from the model are stand-ins
        # (the prefix layer needs the model's shapes: checked when the heads are built)
        shape = {k: heads[k] for k in ("kind", "num_heads", "num_layers", "output", "draft_vocab_size", "dropout")}
        guard("heads", lambda: HeadsConfig(hidden_size=1, vocab_size=2 ** 31 - 1, **shape))
    # (heads.draft_vocab.size with heads whose output layer is their own: the heads stage skips it and says so)
    convention = get("heads.aux_convention")
    if convention is not None and kind != EAGLE3:
        add(f"heads.aux_convention={convention} says what an EAGLE-3 drafter file's layer ids mean, but "
            f"heads.kind={kind}: set heads.aux_convention=null")
    hdir = get("heads.dir")
    if hdir:
        if not (Path(str(hdir)) / "config.json").is_file():
            add(f"heads.dir={hdir} holds no heads (config.json + heads.safetensors, a published Hydra/Medusa "
                "folder or an EAGLE-3 drafter); fix the path" + ("" if kind == EAGLE3 else " or set heads.dir=null to "
                                                                 "train them"))
        else:
            from pipeline.heads.published.convert import EAGLE3_FOLDERS, heads_folder_kind

            found: list[str] = []
            guard("heads.dir", lambda: found.append(heads_folder_kind(Path(str(hdir)))))
            if found and kind == EAGLE3 and found[0] not in EAGLE3_FOLDERS:
                add(f"heads=eagle3 needs an EAGLE-3 drafter folder, but heads.dir={hdir} holds {found[0]} heads; use "
                    "heads=published_hydra_pp|published_hydra|published_medusa (or the trained kinds) for those")
            elif found and kind != EAGLE3 and found[0] in EAGLE3_FOLDERS:
                add(f"heads.dir={hdir} holds an EAGLE-3 drafter, but heads.kind={kind}: use heads=eagle3 heads.dir={hdir}")
            elif found and found[0] == "eagle3" and convention is not None:
                add(f"heads.aux_convention={convention}: heads.dir={hdir} holds a drafter in this project's format, "
                    "whose layer ids already name layer inputs; set heads.aux_convention=null")
    if not hdir and isinstance(get("heads.train"), dict):
        train = get("heads.train")
        for p in TrainSettings.cross_field_problems(SimpleNamespace(**train)):  # type: ignore[arg-type]
            add(p)
        named = list(train.get("tasks") or []) + [t for t in (train.get("functions_from"), train.get("functions_template")) if t]
        for t in named:
            if not (CONF_DIR / "task" / f"{t}.yaml").is_file():
                add(f"heads.train.tasks lists {t!r}, which has no conf/task/{t}.yaml; use tasks that have one")

    # ---- task: rules across its fields (one source, a template with {text})
    from pipeline.prepare import validate_task_config

    task = get("task")
    if isinstance(task, dict) and not any(b.startswith("task.") for b in bad):
        guard("task", lambda: validate_task_config(task))

    # ---- profile: prompts drawn from the calibration pool; the KV cache fits prompt + answer + tree
    calib = get("profile.calib_prompts")
    for key in ("recalib_prompts", "timing_prompts"):
        v = get(f"profile.{key}")
        if v is not None and calib is not None and v > calib:
            add(f"profile.{key}={v} exceeds profile.calib_prompts={calib}: they are drawn from the calibration prompts; "
                "lower it or raise calib_prompts")
    budget = get("profile.grow_budget")
    p_tok, n_tok = get("profile.max_prompt_tokens"), get("profile.max_new_tokens")
    if None not in (max_seq_len, budget, p_tok, n_tok):
        nodes = max(budget + 1, REFERENCE_TREE_NODES)
        need = p_tok + n_tok + nodes
        if need > max_seq_len:
            add(f"model.max_seq_len={max_seq_len} is too small: profile.max_prompt_tokens ({p_tok}) + "
                f"profile.max_new_tokens ({n_tok}) + the largest tree ({nodes} nodes) = {need}; "
                "raise model.max_seq_len or lower those sizes")

    # ---- grow
    max_depth, num_heads = get("grow.max_depth"), get("heads.num_heads")
    if max_depth is not None and num_heads is not None and max_depth > num_heads:
        add(f"grow.max_depth={max_depth} exceeds heads.num_heads={num_heads}: a tree cannot be deeper than the "
            f"number of draft heads; set grow.max_depth<={num_heads}")
    sizes = get("grow.candidate_sizes")
    if sizes is not None and (not sizes or min(sizes) < 0):
        add(f"grow.candidate_sizes={sizes!r} must be a non-empty list of integers >= 0 (draft nodes, root "
            "excluded; 0 = the root alone, i.e. AR)")
    elif sizes and budget is not None and min(sizes) > budget:
        add(f"grow.candidate_sizes={sizes} are all above profile.grow_budget={budget}, so no grown tree would be "
            "decoded; add sizes <= the budget or raise the budget")

    # ---- rollout
    shard, shards = get("rollout.shard"), get("rollout.num_shards")
    if shard is not None and shards is not None and shard >= shards:
        add(f"rollout.shard={shard!r} must be an integer in [0, rollout.num_shards={shards}); shards are numbered from 0")

    # ---- policy: rules across its fields (fixed thresholds only for the policy that uses them, ordered)
    from runtime.policy import validate_policy_config

    pol = get("policy")
    if isinstance(pol, dict) and not any(b.startswith("policy.") for b in bad):
        guard("policy", lambda: validate_policy_config({k: v for k, v in pol.items() if v is not None}))
    return problems


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError (a SystemExit, status 1) listing every problem of `cfg`; return when usable."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(problems)

