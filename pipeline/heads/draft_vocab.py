"""Frequency-ranked draft vocabularies (FR-Spec style) for heads with a shared output layer.

Heads whose output layer is the base lm_head (`output: shared`) can draft over a subset of the
vocabulary without retraining: the output product then covers only the lm_head rows of the
V_d draft ids, which is most of a head's drafting cost when V is large. Tokens outside the draft
vocabulary are never drafted; verification by the base model keeps decoding lossless either way,
so a smaller V_d only trades acceptance (rare tokens) for drafting time.

1. `token_frequencies`: the base model continues training prompts greedily (batched, the heads
   stage's generation code) and each token id is counted in those continuations: the text the
   heads will have to draft is the model's own output, not the prompts. Only the tasks' `train`
   pools are used, which the prepare stage keeps disjoint from calib/eval. The teachers' top-k
   candidates at each step are kept as a second, much weaker count, so ids the continuations never
   used are ranked by how often the model nearly chose them; the rest by id (byte-pair merge order).
2. `frequency_ranking`: every base id, most frequent first.
3. `write_draft_vocab_heads`: a heads folder = its config + the V_d top ids (`draft_ids`, most
   frequent first) + a reference to the full-vocabulary heads' folder, whose weights it uses as
   they are (`runtime.heads_ref`: no copy; a changed or missing base is refused) + provenance in
   the manifest.

    python -m pipeline.heads.draft_vocab --sizes 2048 4096 8192 16384 [--kinds hydra medusa]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.paths import REPO_ROOT, Layout, default_model_name
from pipeline.artifacts import atomic_write_bytes, hash_obj, run_stage
from pipeline.model.provision import model_fingerprint
from pipeline.config.schema import TRAIN_TASKS
from runtime.config import CONFIG_FILE, DRAFT_DTYPES, WEIGHTS_FILE, HeadsConfig

if TYPE_CHECKING:  # torch is imported where heads are built: an up-to-date check reads checksums only
    import torch

    from runtime.heads import DraftHeads


_log = logging.getLogger(__name__)
FREQ_VERSION = 1
# version of a draft-vocabulary heads folder's layout: 2 refers to the full heads' weights
# (`save_heads(weights_from=...)`), 1 copied them
DRAFT_HEADS_VERSION = 2
FREQ_FILE = "frequencies.safetensors"
# weight of one teacher top-k appearance (times its probability) against one emitted token:
# small enough that it only orders ids the continuations did not use, or used equally often
CANDIDATE_WEIGHT = 1e-3


@dataclass
class FrequencySettings:
    tasks: list[str] = field(default_factory=lambda: list(TRAIN_TASKS))
    prompts_per_task: int = 64        # from each task's train pool (all of it when smaller), seeded
    max_new_tokens: int = 128         # length of each greedy continuation
    max_prompt_tokens: int = 512      # longer prompts are skipped (prefill would dominate)
    gen_batch: int = 32               # continuations generated together
    teacher_topk: int = 16            # candidates per step kept for the second count
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts_per_task", "max_new_tokens", "max_prompt_tokens", "gen_batch", "teacher_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"FrequencySettings.{name} must be a positive int, got {value!r}")
        if not self.tasks:
            raise ValueError("FrequencySettings.tasks is empty: name at least one task with a train pool")


def select_train_prompts(data_dir: Path, s: FrequencySettings) -> list[dict[str, Any]]:
    """Up to `prompts_per_task` rows of each task's *train* split (a seeded sample), short enough."""
    from pipeline.prepare import read_split

    rows: list[dict[str, Any]] = []
    for task in s.tasks:
        pool = [r for r in read_split(Path(data_dir), task, "train") if len(r["input_ids"]) <= s.max_prompt_tokens]
        if not pool:
            raise ValueError(f"task {task!r} has no train prompt of <= {s.max_prompt_tokens} tokens in {data_dir}")
        random.Random(f"{s.seed}/{task}").shuffle(pool)
        rows.extend(pool[:s.prompts_per_task])
    return rows


def train_prompt_ids_hash(data_dir: Path, s: FrequencySettings, memo_dir: Path | None = None) -> str:
    """The frequencies key's record of the prompts `select_train_prompts` picks (a hash of their
    ids). With `memo_dir` it is kept per content of the splits it reads (the hashes in their
    prepare manifests), so an up-to-date check does not re-read the train pools."""
    inputs = {}
    for task in s.tasks:
        m = Path(data_dir) / task / "manifest.json"
        inputs[task] = json.loads(m.read_text())["summary"]["split_hash"] if m.is_file() else None
    memo = None
    if memo_dir is not None and None not in inputs.values():
        memo = Path(memo_dir) / f"freq-prompts-{hash_obj([asdict(s), inputs])}.json"
        if memo.is_file():
            return json.loads(memo.read_text())["prompts"]
    ids_hash = hash_obj([r["id"] for r in select_train_prompts(data_dir, s)])
    if memo is not None:
        atomic_write_bytes(memo, json.dumps({"prompts": ids_hash}).encode())
    return ids_hash


def count_tokens(continuations: Sequence[dict[str, torch.Tensor]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(emitted [V] int64: how often each id was generated, candidate_mass [V] float64: summed
    teacher top-k probability of each id over all steps) of `generate_batch` outputs."""
    emitted = np.zeros(vocab_size, dtype=np.int64)
    mass = np.zeros(vocab_size, dtype=np.float64)
    for c in continuations:
        np.add.at(emitted, c["tokens"].numpy(), 1)
        np.add.at(mass, c["topk_ids"].long().flatten().numpy(), c["topk_p"].double().flatten().numpy())
    return emitted, mass


def frequency_ranking(emitted: np.ndarray, candidate_mass: np.ndarray) -> np.ndarray:
    """Every id, most frequent first: by emitted count, then teacher candidate mass, then id."""
    if emitted.shape != candidate_mass.shape or emitted.ndim != 1:
        raise ValueError(f"emitted {emitted.shape} and candidate_mass {candidate_mass.shape} must be [V] alike")
    score = emitted.astype(np.float64) + CANDIDATE_WEIGHT * np.minimum(candidate_mass, 1.0 / CANDIDATE_WEIGHT - 1)
    ids = np.arange(len(emitted))
    # lexsort: last key first; ties (ids never seen at all) keep the tokenizer's id order
    return np.lexsort((ids, -score)).astype(np.int64)


def token_frequencies(model_dir: Path, data_dir: Path, out_root: Path, s: FrequencySettings | None = None,
                      force: bool = False, log: Callable[[str], None] = print, memo_dir: Path | None = None) -> Path:
    """Generate and count the model's greedy continuations of train prompts; write
    `<out_root>/freq-<key>/frequencies.safetensors` (emitted, candidate_mass, ranking) with a
    manifest of where they came from. Skipped when up to date."""
    s = s or FrequencySettings()
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    key = {"version": FREQ_VERSION, "model": model_fingerprint(model_dir), "settings": asdict(s),
           "prompts": train_prompt_ids_hash(data_dir, s, memo_dir), "split": "train"}
    out_dir = Path(out_root) / f"freq-{hash_obj(key)[:12]}"

    def build(tmp: Path) -> dict[str, Any]:
        import torch
        from safetensors.torch import save
        from transformers import LlamaForCausalLM

        from pipeline.heads.distill import generate_batch  # the heads stage's batched greedy generation

        rows = select_train_prompts(data_dir, s)
        model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        eos_cfg = model.config.eos_token_id
        eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg]) - {None}
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))  # little padding per batch
        continuations = []
        for b in range(0, len(order), s.gen_batch):
            batch = [rows[i]["input_ids"] for i in order[b:b + s.gen_batch]]
            continuations += generate_batch(model, batch, s.max_new_tokens, eos, s.teacher_topk)
            log(f"[draft_vocab] continued {len(continuations)}/{len(rows)} train prompts")
        vocab = int(model.config.vocab_size)
        emitted, mass = count_tokens(continuations, vocab)
        ranking = frequency_ranking(emitted, mass)
        tensors = {"emitted": torch.from_numpy(emitted), "candidate_mass": torch.from_numpy(mass),
                   "ranking": torch.from_numpy(ranking)}
        atomic_write_bytes(tmp / FREQ_FILE, save(tensors, metadata={"format": "entmtp-token-frequencies"}))
        return {"prompts": len(rows), "prompt_ids": [r["id"] for r in rows], "tokens": int(emitted.sum()),
                "distinct_tokens": int((emitted > 0).sum()), "vocab_size": vocab}

    return run_stage("draft_vocab", out_dir, key, build, force=force, log=log)


def read_frequencies(folder: str | Path, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """emitted, candidate_mass and ranking of a `token_frequencies` folder, validated."""
    path = Path(folder) / FREQ_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build it with `python -m pipeline.heads.draft_vocab`")
    from safetensors.numpy import load_file

    t = load_file(str(path))
    missing = sorted({"emitted", "candidate_mass", "ranking"} - set(t))
    if missing:
        raise ValueError(f"{path} lacks {missing}; rebuild it with `python -m pipeline.heads.draft_vocab --force`")
    v = len(t["emitted"])
    if vocab_size is not None and v != vocab_size:
        raise ValueError(f"{path} counts {v} ids but the model has {vocab_size}: the frequencies belong to another model")
    if not np.array_equal(np.sort(t["ranking"]), np.arange(v)):
        raise ValueError(f"{path}: 'ranking' is not a permutation of the {v} ids; rebuild it")
    return t


def draft_vocab_config(full: HeadsConfig, size: int, draft_dtype: str | None = None) -> HeadsConfig:
    """The config of `full` restricted to a draft vocabulary of `size` ids (shared output only)."""
    if full.output != "shared" or full.draft_vocab_size is not None:
        raise ValueError(f"a draft vocabulary is derived from full-vocabulary heads with output='shared' "
                         f"(these have output={full.output!r}, draft_vocab_size={full.draft_vocab_size}); "
                         "heads with their own output layer would need retraining")
    if draft_dtype is not None and draft_dtype not in DRAFT_DTYPES:
        raise ValueError(f"draft_dtype must be None or one of {DRAFT_DTYPES}, got {draft_dtype!r}")
    return HeadsConfig.from_dict({**full.to_dict(), "draft_vocab_size": int(size), "draft_dtype": draft_dtype})


def draft_vocab_heads(full: DraftHeads, ranking: np.ndarray | torch.Tensor, size: int,
                      draft_dtype: str | None = None) -> DraftHeads:
    """New heads = `full`'s weights + the `size` first ids of `ranking` as draft vocabulary."""
    import torch

    from runtime.heads import DraftHeads

    ranking = torch.as_tensor(np.asarray(ranking), dtype=torch.long)
    if ranking.numel() != full.config.vocab_size:
        raise ValueError(f"the ranking orders {ranking.numel()} ids but the heads' vocabulary has {full.config.vocab_size}")
    config = draft_vocab_config(full.config, size, draft_dtype)
    heads = DraftHeads(config).to(full.dtype)
    state = {k: v for k, v in full.state_dict().items()}
    state["draft_ids"] = ranking[:size].clone()
    heads.load_state_dict(state, strict=True)
    return heads.eval().requires_grad_(False)


def _shown(folder: Path) -> str:
    """A folder as recorded in a manifest: relative to the repository when inside it (portable)."""
    try:
        return str(folder.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(folder.resolve())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_draft_vocab_heads(full_dir: str | Path, freq_dir: str | Path, size: int, out_dir: str | Path,
                            draft_dtype: str | None = None, force: bool = False,
                            log: Callable[[str], None] = print) -> Path:
    """Write a draft-vocabulary heads folder from the full heads in `full_dir` and the ranking
    in `freq_dir`; its manifest records both sources (files' sha256, frequency provenance). The
    folder refers to `full_dir`'s weights (recorded relative to `out_dir`: keep the two side by
    side) and stores only its config and draft ids; it loads, and fingerprints, as the
    self-contained folder would."""
    full_dir, freq_dir = Path(full_dir), Path(freq_dir)
    full_config = json.loads((full_dir / CONFIG_FILE).read_text())
    freq_manifest = json.loads((freq_dir / "manifest.json").read_text()) if (freq_dir / "manifest.json").is_file() else {}
    stored_dtype = full_config["dtype"]
    key = {
        "version": DRAFT_HEADS_VERSION, "draft_vocab_size": int(size), "draft_dtype": draft_dtype,
        "full_heads": {"folder": _shown(full_dir), "weights_sha256": _sha256(full_dir / WEIGHTS_FILE),
                       "config_sha256": _sha256(full_dir / CONFIG_FILE)},
        "frequencies": {"folder": _shown(freq_dir), "sha256": _sha256(freq_dir / FREQ_FILE),
                        "key": freq_manifest.get("key")},
    }

    def build(tmp: Path) -> dict[str, Any]:
        # loaded only to build: an up-to-date check reads checksums, not weights
        import torch

        from runtime.heads import load_heads, save_heads

        full = load_heads(full_dir)
        freq = read_frequencies(freq_dir, full.config.vocab_size)
        heads = draft_vocab_heads(full, freq["ranking"], size, draft_dtype)
        save_heads(heads, tmp, dtype=getattr(torch, stored_dtype), weights_from=full_dir)
        emitted = freq["emitted"]
        covered = int(emitted[freq["ranking"][:size]].sum())
        summary = freq_manifest.get("summary", {})
        return {"draft_vocab_size": int(size), "draft_dtype": draft_dtype,
                "train_token_coverage": round(covered / max(int(emitted.sum()), 1), 4),
                "frequency_source": {"split": "train", "prompts": summary.get("prompts"),
                                     "tokens": summary.get("tokens"), "distinct_tokens": summary.get("distinct_tokens")}}

    return run_stage("draft_vocab_heads", Path(out_dir), key, build, force=force, log=log)


def check_shared_output(folder: str | Path) -> None:
    """Refuse heads whose output layers are their own (published Hydra/Hydra++/Medusa folders,
    project heads with output own/draft, EAGLE-3 drafters): a draft vocabulary restricts the base
    lm_head they share. (The heads stage skips the draft vocabulary for those before it gets here:
    `pipeline.heads.published.convert.own_output_reason`.)"""
    from pipeline.heads.published.convert import folder_own_output

    folder = Path(folder)
    what = folder_own_output(folder)
    if what is not None:
        raise ValueError(f"{folder} is {what}: its heads have their own output layers, and the draft vocabulary "
                         "(heads.draft_vocab.size) restricts the shared lm_head; set heads.draft_vocab.size=null")


def derive_draft_vocab_heads(full_dir: str | Path, model_dir: Path, data_dir: Path, freq_root: Path, out_dir: Path,
                             size: int, s: FrequencySettings, force: bool = False, memo_dir: Path | None = None) -> Path:
    """The heads stage's draft-vocabulary step (`heads.draft_vocab.size`): the frequencies of the
    model's own outputs on the train pools (under `freq_root`), then the draft heads in `out_dir`.
    Heads with output layers of their own are refused before any work (`check_shared_output`)."""
    check_shared_output(full_dir)
    freq_dir = token_frequencies(model_dir, data_dir, freq_root, s, force=force, log=_log.info, memo_dir=memo_dir)
    return write_draft_vocab_heads(full_dir, freq_dir, size, out_dir, force=force, log=_log.info)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO_ROOT / Layout.for_model("artifacts", default_model_name()).model_dir))
    ap.add_argument("--heads-root", default=None, help="default artifacts/heads/<model name>")
    ap.add_argument("--data", default=str(REPO_ROOT / "data"))
    ap.add_argument("--kinds", nargs="+", default=["hydra", "medusa"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    ap.add_argument("--draft-dtype", default=None, choices=list(DRAFT_DTYPES))
    ap.add_argument("--tasks", nargs="+", default=FrequencySettings().tasks)
    ap.add_argument("--prompts-per-task", type=int, default=FrequencySettings.prompts_per_task)
    ap.add_argument("--new-tokens", type=int, default=FrequencySettings.max_new_tokens)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)

    model_dir = Path(args.model)
    heads_root = Path(args.heads_root or REPO_ROOT / Layout.for_model("artifacts", model_dir.name).heads_dir(""))
    s = FrequencySettings(tasks=args.tasks, prompts_per_task=args.prompts_per_task, max_new_tokens=args.new_tokens)
    freq_dir = token_frequencies(model_dir, Path(args.data), REPO_ROOT / Layout.for_model("artifacts", model_dir.name).frequencies_root, s, force=args.force)
    for kind in args.kinds:
        for size in args.sizes:
            out = heads_root / f"{kind}-draft{size}"
            write_draft_vocab_heads(heads_root / kind, freq_dir, size, out, args.draft_dtype, force=args.force)
            print(f"[draft_vocab] {out}")


if __name__ == "__main__":
    main()
