"""Typed schemas of the pipeline config, registered with hydra's ConfigStore.

Every config group (`model`, `heads`, `task`, `profile`, `policy`) and every top-level block has a
dataclass here; `conf/config.yaml` starts its defaults list with `schema`, so hydra merges each
YAML file and each command-line override into these types. A value of the wrong type or a key
that the schema does not declare fails while the config is composed, and the error names the
field's full path (e.g. `full_key: heads.train.lr`). Defaults live here once; the YAML files only
state what differs.

Ranges and choices of single fields are declared next to the field (`metadata`: `choices`,
`min`, `max`) and checked by `pipeline.config.validate`, which also holds the rules that span fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import typing
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipeline.config.names import STAGE_ORDER, TRAIN_TASKS
from runtime.config import DTYPES, KINDS, OUTPUTS
from runtime.config import SamplingConfig as RuntimeSampling

WEIGHT_DTYPES = DTYPES
# heads kinds of the `heads` group: the runtime's draft heads, and an EAGLE-3 drafter (runtime.eagle3),
# imported from a folder (`heads.dir`; training one here comes later)
EAGLE3 = "eagle3"
HEADS_KINDS = (*KINDS, EAGLE3)
# EAGLE-3 layer-id conventions of a published drafter file (`pipeline.heads.eagle3_import`)
AUX_CONVENTIONS = ("vllm", "sglang")


def choice(default: Any, *options: Any) -> Any:
    """A field that must hold one of `options`."""
    return field(default=default, metadata={"choices": options})


def at_least(default: Any, lo: float, hi: float | None = None) -> Any:
    """A numeric field that must be >= `lo` (and <= `hi` when given); None passes when allowed."""
    return field(default=default, metadata={"min": lo, "max": hi})


@dataclass
class ModelConfig:
    """The base model. `source` says where it comes from: a GGUF inside an installed package
    (converted once), a Hugging Face folder on disk, or a hub id."""

    name: str = MISSING
    source: str = choice(MISSING, "gguf_package", "local", "hub")
    package: Optional[str] = None        # gguf_package: the installed package holding the GGUF
    file: str = "*.gguf"                 # gguf_package: glob of the file inside it
    path: Optional[str] = None           # local: the folder
    repo_id: Optional[str] = None        # hub
    revision: Optional[str] = None       # hub
    dtype: str = choice("float32", *WEIGHT_DTYPES)   # dtype of the converted / loaded weights
    max_seq_len: Optional[int] = None                # KV cache capacity of the runtime model; null = max_position_embeddings
    chat_template: Optional[str] = None  # null: the model folder's own chat template


@dataclass
class TrainSettings:
    """`heads.train`: self-distillation data and training of draft heads (stated once, for every kind)."""

    tasks: List[str] = field(default_factory=lambda: list(TRAIN_TASKS))  # their train splits
    max_prompts: int = at_least(400, 1)     # training prompts in all, round-robin over the sources
    # one more source: HumanEval-style prompts (imports + signature + docstring, in the template of
    # task `functions_template`) cut from the functions in the recorded replies of the train pool of
    # task `functions_from` (HumanEval's own train pool is tiny)
    functions_from: Optional[str] = "sharegpt"
    functions_template: str = "humaneval"
    holdout_prompts: int = at_least(24, 0)  # of them, kept out of training for the accuracy report
    max_prompt_tokens: int = at_least(512, 1)  # longer prompts are left out (prefill dominates)
    max_new_tokens: int = at_least(128, 1)  # length of each self-distilled continuation
    gen_batch: int = at_least(32, 1)        # sequences generated together
    teacher_topk: int = at_least(32, 1)     # base distribution kept as its top-k, renormalised
    # sampled: softmax over the step's candidates (every teacher top-k id of the batch plus
    # `negatives` uniform draws); full: over the whole vocabulary (far slower, no more accurate)
    loss: str = choice("sampled", "sampled", "full")
    negatives: int = at_least(1024, 0)
    epochs: float = 4.0                     # passes over the training continuations ...
    max_steps: Optional[int] = at_least(None, 1)  # ... or an explicit number of optimiser steps
    batch_sequences: int = at_least(4, 1)   # continuations per optimiser step
    lr: float = 1.5e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    checkpoint_every: int = at_least(25, 1)
    seed: int = 0
    save_dtype: str = choice("bfloat16", *WEIGHT_DTYPES)  # shipped weights
    # training arithmetic: float32, or autocast to bfloat16 / float16 (parameters and optimiser
    # state stay float32). Training runs on the config's `device`.
    dtype: str = choice("float32", *WEIGHT_DTYPES)
    # --- training changes under trial (issue #13): off by default; measured effects are in the
    # heads ablation report (`python -m pipeline.experiments.heads_ablation`)
    # more varied data: per training prompt, this many extra continuations sampled at
    # `sample_temperature` (seeded, position-keyed Gumbel-max as runtime/sampling.py) besides the greedy one
    sampled_continuations: int = at_least(0, 0)
    sample_temperature: float = 0.8
    # HASS-style ranking term: weight of a listwise cross-entropy restricted to the teacher's
    # top-`rank_loss_topk` ids (the order among the likeliest tokens is what a tree's ranks use)
    rank_loss_weight: float = at_least(0.0, 0.0)
    rank_loss_topk: int = at_least(8, 2)
    # training-time test (EAGLE-3): weight of a second pass in which Hydra heads 2..D read the
    # heads' own top-1 drafts as the path tokens after the root instead of the true ones
    ttt_weight: float = at_least(0.0, 0.0)
    # --- EAGLE-3 drafters (heads.kind=eagle3, `pipeline.heads.eagle3_train`)
    ttt_steps: int = at_least(1, 1)         # unrolled steps of the training-time test (depths trained)
    ttt_decay: float = 0.8                  # step j's loss weight is ttt_decay ** j
    # train-pool prompts (beyond the mix's) teacher-forced with their reference replies: cheap
    # tokens (one forward each); the mix's holdout prompts and every eval split stay out
    reference_prompts: int = at_least(0, 0)
    batch_tokens: int = at_least(4096, 1)   # padded tokens per optimiser step
    eval_every: int = at_least(50, 1)       # optimiser steps between points of the held-out curve

    def __post_init__(self) -> None:
        problems = field_problems(self, "heads.train") + self.cross_field_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def cross_field_problems(self) -> list[str]:
        out = []
        if not self.holdout_prompts < self.max_prompts:
            out.append(f"heads.train.holdout_prompts must be in [0, max_prompts={self.max_prompts}), got {self.holdout_prompts}")
        if self.max_steps is None and not self.epochs > 0:
            out.append(f"heads.train.epochs must be > 0 (or set max_steps), got {self.epochs}")
        if not self.lr > 0 or not 0 <= self.warmup_frac < 1:
            out.append(f"heads.train needs lr > 0 and warmup_frac in [0, 1); got lr={self.lr}, warmup_frac={self.warmup_frac}")
        if self.sampled_continuations and not self.sample_temperature > 0:
            out.append(f"heads.train.sample_temperature must be > 0 for sampled continuations, got {self.sample_temperature}")
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any] | None) -> TrainSettings:
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown heads.train keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def data_dict(self) -> Dict[str, Any]:
        """The settings the self-distillation data depends on (its cache key)."""
        keys = ("tasks", "max_prompts", "holdout_prompts", "max_prompt_tokens", "max_new_tokens", "teacher_topk", "seed")
        return {k: getattr(self, k) for k in keys}

    def key_dict(self) -> Dict[str, Any]:
        """The settings as a key records them: fields added after the shipped heads were trained
        appear only when they differ from their defaults, so the default key stays the one the
        shipped heads' manifests hold (they are not retrained for nothing)."""
        out = dataclasses.asdict(self)
        for name, default in _ADDED_TRAIN_FIELDS.items():
            if out.get(name) == default:
                out.pop(name)
        return out


# TrainSettings fields newer than the shipped heads, with the defaults a key leaves out
_ADDED_TRAIN_FIELDS = {"dtype": "float32", "sampled_continuations": 0, "sample_temperature": 0.8, "rank_loss_weight": 0.0,
                       "rank_loss_topk": 8, "ttt_weight": 0.0, "ttt_steps": 1, "ttt_decay": 0.8,
                       "reference_prompts": 0, "batch_tokens": 4096, "eval_every": 50}


@dataclass
class DraftVocabConfig:
    """A frequency-ranked draft vocabulary (FR-Spec) derived from full-vocabulary heads without
    retraining (`pipeline.heads.draft_vocab`): the heads draft over the `size` ids the model itself emits
    most often on the train pools of `heads.train.tasks`, so their output product reads `size`
    rows of the lm_head instead of all of them. Verification by the base model keeps decoding
    lossless; a token outside the draft vocabulary is simply never drafted."""

    size: Optional[int] = at_least(None, 1)      # null: draft over the whole vocabulary
    prompts_per_task: int = at_least(24, 1)      # train prompts per task whose continuations are counted
    max_new_tokens: int = at_least(64, 1)        # length of each counted greedy continuation


@dataclass
class HeadsGroup:
    """The `heads` group: which heads folder, its shape (the fields of `runtime.config.HeadsConfig`
    that a heads config sets; that class checks them), and how the heads are trained (`train`)
    unless `dir` names a folder."""

    name: str = MISSING                     # the folder name under artifacts/heads/<model>/
    # an existing heads folder to use (published ones are converted), or null: train them. Every
    # heads file says which: `dir: null` (trained kinds), or `dir: ???` (a published checkpoint, whose
    # folder the command line must give: start-up validation refuses the config until it does)
    dir: Optional[str] = MISSING
    # hydra | medusa: draft heads; eagle3: an EAGLE-3 drafter (conf/heads/eagle3.yaml; heads.dir only)
    kind: str = choice("hydra", *HEADS_KINDS)
    num_heads: int = at_least(4, 1)         # draft tokens beyond the root (the deepest tree; eagle3: the max draft depth)
    num_layers: int = at_least(1, 1)        # ResBlocks per head
    prefix_layer: bool = False              # Hydra++: one extra decoder layer over the base hidden states
    output: str = choice("shared", *OUTPUTS)  # shared: the base lm_head, frozen
    # output: draft only: the size of the heads' own trained output layer (over the ids most frequent
    # in their training data; runtime.config.HeadsConfig.draft_vocab_size). Not the draft vocabulary of
    # heads that share the base lm_head: that is `draft_vocab.size` (validation refuses the mix-up)
    draft_vocab_size: Optional[int] = at_least(None, 1)
    dropout: float = at_least(0.0, 0.0, 1.0)                  # training only
    # the draft vocabulary (FR-Spec) of heads whose output layer is the base lm_head (`shared`),
    # derived after training or import: `draft_vocab.size` is the setting for it
    draft_vocab: DraftVocabConfig = field(default_factory=DraftVocabConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    # eagle3 only: what the layer ids in a published drafter file mean (vllm: the input of layer id;
    # sglang: the output of layer id); null: the layout's default (`pipeline.heads.eagle3_import`).
    # Newer than the shipped heads: left out of keys while null (`KEY_NEUTRAL_DEFAULTS`)
    aux_convention: Optional[str] = choice(None, None, *AUX_CONVENTIONS)


# Settings added after outputs were built whose default leaves every key as it was: `pipeline.graph.
# config_key` leaves them out while they hold this value (as `TrainSettings.key_dict` does for
# heads.train), so the default heads keep their stage key.
KEY_NEUTRAL_DEFAULTS: Dict[str, Any] = {"heads.aux_convention": None}


def key_view(path: str, value: Any) -> Any:
    """`value` (the plain config value at dotted `path`) as a stage key records it: settings of
    `KEY_NEUTRAL_DEFAULTS` under `path` left out while they hold their default."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for full, default in KEY_NEUTRAL_DEFAULTS.items():
        if not full.startswith(path + "."):
            continue
        rest = full[len(path) + 1:].split(".")
        node = out
        for k in rest[:-1]:
            if not isinstance(node.get(k), dict):
                break
            node[k] = node = dict(node[k])
        else:
            if rest[-1] in node and node[rest[-1]] == default:
                del node[rest[-1]]
    return out


@dataclass
class TaskSource:
    package: Optional[str] = None   # an installed package + a `file` inside it (located, never imported)
    file: Optional[str] = None
    path: Optional[str] = None      # or a file path
    format: Optional[str] = choice(None, None, "jsonl", "jsonl.gz", "json")  # null: from the file name
    loader: str = choice("auto", "auto", "datasets", "plain")


@dataclass
class TaskFields:
    id: Optional[str] = None        # dotted path to the record id; null: the record's position
    text: str = MISSING             # dotted path to the prompt text
    reference: Optional[str] = None


@dataclass
class TaskPools:
    eval: int = at_least(MISSING, 0)
    calib: int = at_least(MISSING, 0)
    train: Optional[int] = at_least(400, 0)   # a cap; null: every remaining record


@dataclass
class TaskConfig:
    """A task: where its records come from and how they become prompts (see `pipeline.prepare`)."""

    name: str = MISSING
    description: str = ""
    source: TaskSource = field(default_factory=TaskSource)
    fields: TaskFields = field(default_factory=TaskFields)
    filter: Dict[str, Any] = field(default_factory=dict)   # {dotted path: allowed value or list}
    template: str = "{text}"
    system: Optional[str] = None
    seed: int = 0
    pools: TaskPools = field(default_factory=TaskPools)
    overlong: str = choice("truncate", "truncate", "skip")


@dataclass
class ProfileConfig:
    """How much work the calibration stages do."""

    name: str = MISSING
    calib_prompts: int = at_least(MISSING, 1)
    eval_prompts: int = at_least(MISSING, 1)
    max_new_tokens: int = at_least(MISSING, 1)
    max_prompt_tokens: int = at_least(MISSING, 1)
    rank_cap: int = at_least(MISSING, 1)       # K: ranks >= K are "not in any tree"
    grow_budget: int = at_least(MISSING, 1)    # largest tree grown (nodes, root excluded)
    recalib_prompts: int = at_least(MISSING, 1)
    timing_prompts: int = at_least(MISSING, 1)
    # GPUs each rollout shard asks a cluster launcher for (conf/hydra/launcher/*_shards.yaml)
    shard_gpus: int = at_least(0, 0)


@dataclass
class PolicyConfig:
    """How the bank's tree-switching policy is fitted (`runtime.policy.validate_policy_config`)."""

    name: str = choice(MISSING, "static", "ladder", "hysteresis", "expected_throughput")
    signal: str = "paper"
    signal_params: Optional[Dict[str, Any]] = None
    tau_grid: Optional[List[float]] = None      # null: the paper's grid (pipeline.bank.policies.PAPER_TAUS)
    fine_search: bool = True
    num_buckets: Optional[int] = at_least(None, 1)
    n_quantiles: Optional[int] = at_least(None, 2)
    tau_on: Optional[float] = None              # fixed hysteresis thresholds instead of fitted ones
    tau_off: Optional[float] = None
    thresholds: Optional[List[float]] = None    # fixed ladder thresholds


def _structured(cls: type, doc: str) -> type:
    """A schema dataclass with the fields, types and defaults of a runtime config dataclass, so
    that a setting is declared once (its checks stay in the runtime class's `__post_init__`, which
    `pipeline.config.validate` runs on the composed values)."""
    hints = typing.get_type_hints(cls)
    fields = [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(cls)]
    schema = dataclasses.make_dataclass(cls.__name__, fields)
    schema.__doc__ = doc
    schema.__module__ = __name__
    return schema


# `sampling`: runtime.config.SamplingConfig's fields (recorded in the keys of the stages that decode)
SamplingConfig = _structured(RuntimeSampling, "Decoding settings: runtime.config.SamplingConfig (greedy by default).")


@dataclass
class AcceptanceConfig:
    """How a tree step accepts drafts (recorded in the keys of recalibrate, time and evaluate, and
    in the bank). exact: a draft is accepted when it equals the token the `sampling` sampler picks
    (greedy, or seeded sampling): lossless, and replayed exactly by rollout/grow. typical: the
    paper's (Medusa/Hydra) typical acceptance with its own temperature, epsilon and alpha (needs
    `sampling.temperature: 0`); it changes the output, and rollout/grow, which replay exact
    acceptance, only rank the trees: recalibrate and time measure them under typical acceptance.
    E.g. `acceptance.kind=typical acceptance.temperature=0.7 acceptance.epsilon=0.09 acceptance.alpha=0.3`;
    its banks live in `<task>@typT<temperature>e<epsilon>a<alpha>/` (`pipeline.paths.acceptance_tag`)."""

    kind: str = choice("exact", "exact", "typical")
    temperature: float = at_least(0.7, 1e-6)    # typical only
    epsilon: float = at_least(0.09, 0.0, 1.0)   # typical only: the hard probability threshold
    alpha: float = at_least(0.3, 0.0)           # typical only: the entropy-scaled threshold's factor


@dataclass
class RolloutConfig:
    shard: int = at_least(0, 0)        # this process's shard (stage=rollout); stage=merge runs missing ones
    num_shards: int = at_least(1, 1)


@dataclass
class GrowConfig:
    max_depth: int = at_least(4, 1)    # grow frontiers for every max depth 1..max_depth (<= heads.num_heads)
    candidate_tolerance: float = at_least(0.0, 0.0, 1.0)  # per size, also keep trees this close to the best
    # frontier sizes (draft nodes) decoded and timed for real; 0 = the root alone (AR)
    candidate_sizes: List[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64, 89])


@dataclass
class TimeConfig:
    # the step-cost model (pipeline/step_cost.py): interleaved rounds of its probes (medians over
    # them) and the new tokens of each probe decode that measures the fixed per-step cost
    cost_repeats: int = at_least(7, 1)
    cost_tokens: int = at_least(12, 4)
    # wall: seconds a user waits (on an idle machine); cpu: this thread's CPU seconds, not inflated by
    # other processes' load (needs threads=1): for building banks on a shared machine
    clock: str = choice("wall", "wall", "cpu")
    # timed decodes that check the model (the bank uses the modeled costs)
    # interleaved timing rounds over the checked trees, spread over the probe rounds: on a shared
    # machine the speed moves by ~20% for seconds at a time, and 2 rounds of ~1 s per tree let
    # such a phase land on one tree (a 1-node check decode 19% faster than the model); on a
    # machine whose identical forwards' 2-second medians range over +-15% (an AMD EPYC VM), 6
    # rounds left errors of 10-16%, hence 12
    rounds: int = at_least(12, 1)
    new_tokens: int = at_least(24, 1)  # tokens per timed decode (the first 2 steps of each are warm-up)
    prune: bool = True                 # skip trees whose replayed tokens/step cannot pay for their modeled cost
    # ... even this fraction cheaper than modeled (the first probe round's model, which decides what is
    # never timed, prunes with this margin twice over: `pipeline.timing.checks.early_margin`)
    prune_margin: float = at_least(0.15, 0.0, 0.99)
    # batch sizes the step-cost model is measured at (batched verify forwards, checked by timed
    # batched decodes); the bank chooses its trees at each (`pipeline.timing.batch`)
    batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])


@dataclass
class BankConfig:
    # hull: a tree stays only if faster than every smaller one; oracle: the hull plus every timed
    # tree the per-step oracle picks on at least `min_oracle_share` of calibration steps
    members: str = choice("oracle", "hull", "oracle")
    min_oracle_share: float = at_least(0.02, 1e-9, 1.0)
    # trees within this share of the fastest one's replayed decode tok/s are ties, and the smallest of them is the
    # best static tree, so that a near-tie does not flip it between runs. A 5% tolerance flipped the
    # choice between the 2- and 3-node trees in 5 of 12 banks of a noisy EPYC VM and gave up 2-5% where
    # it did; 1% was too tight on an AVX2 EPYC, where three timings put the 3- and 5-node trees 0.4-1.9%
    # apart on GSM8K and the choice flipped 5 -> 3 (2% would have held it); 2% gives up at most 2%
    tie_tolerance: float = at_least(0.02, 0.0, 0.5)
    # the choice at each batch size, timed as a ratio (`pipeline.timing.paired`): the bank's trees of
    # highest modeled batch tok/s there (this many) decode against the runtime's batched AR in
    # rounds of blocks AR, T1..Tn, Tn..T1, AR on the same prompts; a tree is chosen where the
    # interval of its median ratio lies above 1 + paired_min_gain
    paired_candidates: int = at_least(3, 1)
    # ... less those the step-cost model prices below this ratio to AR (its errors are ~15%; the
    # fastest candidate is timed whatever the model says)
    paired_model_floor: float = at_least(0.8, 0.0, 1.0)
    paired_min_rounds: int = at_least(4, 2)     # rounds every candidate gets
    paired_max_rounds: int = at_least(12, 2)    # the cap: more rounds only while an interval straddles the decision
    paired_new_tokens: int = at_least(32, 2)    # tokens per sequence of each timed block
    paired_prompts: int = at_least(4, 1)        # calibration prompts the rounds rotate over (B copies of one per block)
    paired_level: float = at_least(0.9, 0.5, 0.99)  # the intervals' coverage (seeded bootstrap of the median)
    # a tree is chosen only where its interval lies above 1 + this (else the batch size decodes AR):
    # an interval that grazes 1 is a gain the eval's own prompts can take back
    paired_min_gain: float = at_least(0.02, 0.0, 0.5)


@dataclass
class DynamicConfig:
    """EntMTP-dyn (`runtime.dynamic`): a per-step subset of a super-tree, chosen from the heads' path
    values, fitted by the bank stage (`pipeline.bank.dynamic`) and evaluated beside the bank's trees."""

    enabled: bool = True               # fit it (needs acceptance.kind=exact: its replay is exact acceptance)
    # candidate super-trees: the grow frontier's trees of these many draft nodes at its deepest max
    # depth (at most runtime.dynamic.MAX_SUPER_NODES - 1 = 62, and the cost model's measured rows);
    # the calibration rollout is scored once per candidate, the best replayed one is kept
    super_sizes: List[int] = field(default_factory=lambda: [8, 16, 32, 62])
    calibrate: bool = True             # also try a per-depth monotone calibration fitted on the calibration split
    # early-stop thresholds tried by the fit: a step stops drafting after the first depth whose best
    # calibrated node value is below the threshold, and pays only the depths it drafted; 0 always
    # drafts the whole super-tree (and is always tried)
    stop_below: List[float] = field(default_factory=lambda: [0.0, 0.1, 0.15, 0.2, 0.3, 0.4])


@dataclass
class Eagle2EvalConfig:
    """The EAGLE-2 dynamic-tree baseline row of the evaluate stage (`runtime.eagle2`), drafted by the
    bank's drafter. Defaults: SGLang's (speculative_num_steps 5, speculative_eagle_topk 4,
    speculative_num_draft_tokens 8), the depth capped to what the drafter drafts."""

    enabled: bool = True
    depth: int = at_least(5, 1)         # tree depth below the root
    topk: int = at_least(4, 1)          # frontier width, and children per expanded node
    total_tokens: int = at_least(8, 1)  # nodes verified per step, the root included


@dataclass
class EvaluateConfig:
    max_new_tokens: int = at_least(MISSING, 1)
    hf_generate: bool = True           # include transformers generate as a baseline
    eagle2: Eagle2EvalConfig = field(default_factory=Eagle2EvalConfig)   # the EAGLE-2 baseline row
    # batched evaluation (after the single-sequence table): the eval prompts decoded in groups of
    # each of these batch sizes by batched AR and the bank's methods (batch_table.md); each >= 1
    # and at most batch_prompts; empty: no batched evaluation (needs lossless=exact)
    batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    batch_prompts: int = at_least(8, 8)  # eval prompts (the split's first) decoded at each batch size
    batch_repeats: int = at_least(3, 1)  # rounds of every group by every method; each group's time: their median


@dataclass
class PipelineConfig:
    """The whole pipeline config (`python -m pipeline --cfg job` prints it)."""

    model: ModelConfig = MISSING
    heads: HeadsGroup = MISSING
    task: TaskConfig = MISSING
    profile: ProfileConfig = MISSING
    policy: PolicyConfig = MISSING
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    stage: str = choice("bank", *STAGE_ORDER)  # the stage to run (its upstream stages run first when stale)
    force: bool = False                # rebuild the stage's output even when it is up to date
    artifacts_dir: str = "artifacts"
    data_dir: str = "data"
    seed: int = at_least(0, 0)
    dtype: str = choice("auto", "auto", *DTYPES)   # auto: the faster of float32 / bfloat16 on this machine (in the lossless mode's arithmetic)
    # exact: every decode forward is row-invariant (each token's logits do not depend on how many
    # tokens a forward holds or where they sit: padded to invariant_rows rows, keys in logical
    # order), so tree decoding equals AR token for token in any dtype; numerical: the fastest
    # arithmetic, divergences from AR listed and checked against a rounding bound (evaluate)
    lossless: str = choice("exact", "exact", "numerical")
    # under lossless=exact: every decode forward is padded to this many rows (bigger trees: chunks).
    # Smaller is cheaper on a CPU where the one-token path is slow (4 works on AVX2 + MKL); the model
    # refuses a size whose products round a row by its place in the block. Unused where the small-row
    # CPU kernels run (float32, AVX2): those are row-invariant unpadded
    invariant_rows: int = at_least(8, 1)
    device: str = choice("cpu", "cpu", "cuda")
    threads: Optional[int] = at_least(None, 1)  # torch threads; null: torch's default
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grow: GrowConfig = field(default_factory=GrowConfig)
    time: TimeConfig = field(default_factory=TimeConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    dynamic: DynamicConfig = field(default_factory=DynamicConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)


GROUP_SCHEMAS = {"model": ModelConfig, "heads": HeadsGroup, "task": TaskConfig, "profile": ProfileConfig,
                 "policy": PolicyConfig}


def field_problems(node: Any, prefix: str, schema: type | None = None) -> list[str]:
    """Range and choice violations of the fields of `node` (a dataclass instance or a DictConfig
    typed by `schema`), recursively, each naming its dotted path."""
    schema = schema or type(node)
    out: list[str] = []
    declared = {f.name for f in dataclasses.fields(schema)}
    if hasattr(node, "keys") and not dataclasses.is_dataclass(node):  # a DictConfig: `+key=...` can add keys
        for k in node.keys():
            if k not in declared and not (prefix == "" and k == "hydra"):
                path = f"{prefix}.{k}" if prefix else str(k)
                out.append(f"{path} is not a setting of {schema.__name__}; known: {', '.join(sorted(declared))}")
    for f in dataclasses.fields(schema):
        try:
            v = getattr(node, f.name)
        except Exception:  # noqa: BLE001 - missing / unresolvable values are reported elsewhere
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        sub = _dataclass_type(f.type)
        if sub is not None and v is not None:
            out += field_problems(v, path, sub)
            continue
        if v is None or v is MISSING:
            continue
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            out.append(f"{path}={v!r} is not valid; choose one of: {', '.join(str(c) for c in choices if c is not None)}")
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if lo is not None and isinstance(v, (int, float)) and not isinstance(v, bool) and v < lo:
            out.append(f"{path}={v!r} must be >= {lo}")
        if hi is not None and isinstance(v, (int, float)) and not isinstance(v, bool) and v > hi:
            out.append(f"{path}={v!r} must be <= {hi}")
    return out


def _dataclass_type(annotation: Any) -> type | None:
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return _SCHEMAS_BY_NAME.get(name)


_SCHEMAS_BY_NAME = {c.__name__: c for c in (ModelConfig, TrainSettings, HeadsGroup, TaskSource, TaskFields, TaskPools,
                                           TaskConfig, ProfileConfig, PolicyConfig, SamplingConfig, AcceptanceConfig, RolloutConfig,
                                           GrowConfig, TimeConfig, BankConfig, DynamicConfig, EvaluateConfig,
                                           PipelineConfig)}


def register_configs() -> None:
    """Register the schemas with hydra: `schema` (the whole config) and `<group>/schema`."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=PipelineConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name="schema", node=node)


register_configs()
