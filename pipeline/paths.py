"""Where every pipeline output lives. `Layout` is the one place that turns the config (or a model
name and an artifacts folder) into paths; stages and library modules ask it instead of joining
folder names themselves."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def default_model_name() -> str:
    """The name of the model that `conf/config.yaml` picks by default (for tools outside hydra).

    Read line by line, without omegaconf (the GPU check calls it on a machine without hydra-core):
    the defaults list's `- model: <choice>` entry, then the top-level `name:` of
    conf/model/<choice>.yaml, both plain scalars."""
    choice = _yaml_entry(CONF_DIR / "config.yaml", "- model:")
    return _yaml_entry(CONF_DIR / "model" / f"{choice}.yaml", "name:", top_level=True)


def _yaml_entry(path: Path, prefix: str, top_level: bool = False) -> str:
    """The plain scalar after the first line of `path` that starts with `prefix` (after its
    indentation, unless `top_level`), without its comment and quotes."""
    for line in path.read_text().splitlines():
        text = line if top_level else line.lstrip()
        if text.startswith(prefix):
            value = text[len(prefix):].split(" #", 1)[0].strip().strip("\"'")
            if value:
                return value
    raise ValueError(f"{path} has no `{prefix} <value>` line")


def decoding_tag(sampling: Any) -> str:
    """"" for greedy decoding, else "T<temperature>[k<top_k>][p<top_p>]s<seed>"."""
    if sampling is None or float(sampling.get("temperature", 0.0)) == 0.0:
        return ""
    tag = f"T{float(sampling['temperature']):g}"
    if int(sampling.get("top_k", 0)):
        tag += f"k{int(sampling['top_k'])}"
    if float(sampling.get("top_p", 1.0)) < 1.0:
        tag += f"p{float(sampling['top_p']):g}"
    return tag + f"s{int(sampling.get('seed', 0))}"


def arithmetic_tag(cfg: Any) -> str:
    """How a run decodes, as its folders name it: `decoding_tag`, plus "numerical" under
    `lossless: numerical` (ordinary arithmetic: another rollout and bank than the row-invariant
    default's, so the two live side by side instead of rebuilding each other), plus the dtype when
    one other than float32 is forced (`dtype=bfloat16`: beside the default's bank, not over it;
    `dtype: auto` keeps the plain name whatever it picks, and the bank records the choice)."""
    dtype = str(cfg.get("dtype", "auto"))
    tags = [decoding_tag(cfg.get("sampling")), "numerical" if cfg.get("lossless", "exact") == "numerical" else "",
            dtype if dtype not in ("auto", "float32") else ""]
    return "-".join(t for t in tags if t)


def acceptance_tag(acceptance: Any) -> str:
    """"" for exact acceptance, else "typ<temperature>e<epsilon>a<alpha>" (typical acceptance)."""
    if acceptance is None or acceptance.get("kind", "exact") == "exact":
        return ""
    return (f"typT{float(acceptance['temperature']):g}e{float(acceptance['epsilon']):g}"
            f"a{float(acceptance['alpha']):g}")


def heads_run_name(heads: Any) -> str:
    """The name of the heads every stage after `heads` decodes with: `heads.name`, or
    `<name>-draft<size>` when they draft over a frequency-ranked vocabulary (`heads.draft_vocab`),
    which heads with an output layer of their own never do (the heads stage skips it for them:
    `pipeline.heads.published.convert.own_output_reason`)."""
    size = (heads.get("draft_vocab") or {}).get("size")
    if not size:
        return str(heads.name)
    from pipeline.heads.published.convert import own_output_reason

    return str(heads.name) if own_output_reason(heads) else f"{heads.name}-draft{int(size)}"


@dataclass(frozen=True)
class Layout:
    artifacts: Path
    data: Path
    model_name: str
    heads_name: str
    task: str
    profile: str
    decoding: str = ""   # "" for greedy and row-invariant; e.g. "T0.7s0" or "numerical" (see `arithmetic_tag`)
    acceptance: str = ""  # "" for exact acceptance; e.g. "typT0.7e0.09a0.3" (see `acceptance_tag`)

    @classmethod
    def from_cfg(cls, cfg: Any) -> Layout:
        return cls(Path(cfg.artifacts_dir), Path(cfg.data_dir), cfg.model.name, heads_run_name(cfg.heads), cfg.task.name,
                   cfg.profile.name, arithmetic_tag(cfg), acceptance_tag(cfg.get("acceptance")))

    @property
    def task_run(self) -> str:
        """The task's folder name for rollouts, banks and reports: `humaneval`, or `humaneval@T0.7`
        when the bank is built for seeded sampling (a bank at T > 0 is another bank)."""
        return f"{self.task}@{self.decoding}" if self.decoding else self.task

    @property
    def bank_run(self) -> str:
        """The folder name of the task's bank and reports: `task_run`, or `humaneval@typT0.7e0.09a0.3`
        for a bank measured under typical acceptance (another bank, from the same rollout)."""
        tags = [t for t in (self.decoding, self.acceptance) if t]
        return f"{self.task}@{'-'.join(tags)}" if tags else self.task

    @classmethod
    def for_model(cls, artifacts: str | Path, model_name: str, data: str | Path = "data") -> Layout:
        """A layout for model-level outputs only (heads, caches), outside a full pipeline config."""
        return cls(Path(artifacts), Path(data), model_name, "", "", "")

    @property
    def model_dir(self) -> Path:
        """The converted model folder of a `gguf_package` / `hub` model."""
        return self.artifacts / "models" / self.model_name

    def heads_dir(self, heads_name: str | None = None) -> Path:
        return self.heads_root / (heads_name or self.heads_name)

    @property
    def heads_root(self) -> Path:
        """The heads folders of this model, one per heads name."""
        return self.artifacts / "heads" / self.model_name

    @property
    def heads_cache(self) -> Path:
        """Self-distillation data and training checkpoints of every heads kind of this model."""
        return self.artifacts / "cache" / "heads" / self.model_name

    def task_data(self, task: str | None = None) -> Path:
        """data/<task>/: the prepared splits."""
        return self.data / (task or self.task)

    @property
    def work(self) -> Path:
        """Intermediate outputs of rollout / grow / recalibrate / time for this task and profile."""
        return self.artifacts / "rollouts" / self.model_name / self.heads_name / self.task_run / self.profile

    @property
    def decode_work(self) -> Path:
        """Outputs of the stages that decode with the tree decoder (recalibrate, time): `work` under
        exact acceptance, `work/<acceptance tag>/` under typical acceptance (rollout and grow,
        which replay exact acceptance, are shared)."""
        return self.work / self.acceptance if self.acceptance else self.work

    @property
    def rollouts_root(self) -> Path:
        """The intermediate outputs of every task and profile for this model and heads."""
        return self.artifacts / "rollouts" / self.model_name / self.heads_name

    @property
    def bank_dir(self) -> Path:
        return self.artifacts / "banks" / self.model_name / self.heads_name / self.bank_run

    @property
    def banks_root(self) -> Path:
        """The banks of every task for this model and heads."""
        return self.bank_dir.parent

    @property
    def frequencies_root(self) -> Path:
        """Token frequencies of the model's own outputs (draft-vocabulary rankings), one folder per
        key, shipped beside the heads they were derived for."""
        return self.heads_root / "frequencies"

    @property
    def model_reports(self) -> Path:
        return self.artifacts / "reports" / self.model_name

    @property
    def heads_training_reports(self) -> Path:
        """What was tried in training the draft heads and its measured effect (all kinds)."""
        return self.model_reports / "heads"

    def dtype_dir(self, invariant_rows: int | None) -> Path:
        """The dtype stage's output: the measured float32-vs-bfloat16 choice of `dtype: auto` on this
        machine, in the ordinary arithmetic or between row-invariant models padded to
        `invariant_rows` rows (`lossless: exact`)."""
        tag = f"exact{invariant_rows}" if invariant_rows else "numerical"
        return self.artifacts / "machine" / self.model_name / f"dtype-{tag}"

    @property
    def heads_reports(self) -> Path:
        """Reports across the tasks of one model and heads (the task comparison)."""
        return self.model_reports / self.heads_name

    @property
    def reports(self) -> Path:
        return self.heads_reports / self.bank_run

    @property
    def temperature_reports(self) -> Path:
        """One task's figures across sampling temperatures (the acceptance frontiers at T = 0, 0.7,
        1.0): beside the task's greedy reports, whatever this layout's own temperature."""
        return self.heads_reports / self.task / "temperatures"
