"""The heads build: the training mix, self-distillation data, training and report, as one
up-to-date-checked output `artifacts/heads/<model>/<name>/` (config.json with the base model's
fingerprint, heads.safetensors, report.json, manifest)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json, files_fingerprint, hash_obj, machine_info, read_json, run_stage
from pipeline.heads.mix import read_train_rows, select_prompts
from pipeline.model.provision import model_fingerprint
from pipeline.paths import Layout
from pipeline.config.schema import TrainSettings
from runtime.config import HeadsConfig, ModelArgs

log = logging.getLogger(__name__)

TRAIN_VERSION = 1
_HEAD_KEYS = {f.name for f in dataclasses.fields(HeadsConfig)} - {"hidden_size", "vocab_size", "base_fingerprint", "base_args"}
# entries of the `heads` config group that are not head shapes
_NOT_SHAPE = ("name", "dir", "train", "draft_vocab", "aux_convention")


def heads_config_for(heads_cfg: dict[str, Any], model_args: Any, fingerprint: str | None) -> HeadsConfig:
    """The HeadsConfig of a `heads` config group (its name/dir/train entries are not head shapes)."""
    shape = {k: v for k, v in heads_cfg.items() if k not in _NOT_SHAPE}
    unknown = sorted(set(shape) - _HEAD_KEYS)
    if unknown:
        raise ValueError(f"unknown heads config keys {unknown}; known: {sorted(_HEAD_KEYS | set(_NOT_SHAPE))}")
    return HeadsConfig.for_model(model_args, base_fingerprint=fingerprint, **shape)


def _mix_inputs(data_dir: Path, model_dir: Path, s: TrainSettings) -> dict[str, Any]:
    """What the training mix is cut from, by content: the prepared splits it reads (their hashes
    from the prepare manifests), the tokenizer and the function prompts' template. Reading these
    costs a few small files, where cutting the mix re-reads the whole chat train pool."""
    from pipeline.prepare import load_task_config, tokenizer_fingerprint

    tasks = sorted(set(s.tasks) | ({s.functions_from, s.functions_template} if s.functions_from else set()))
    splits: dict[str, Any] = {}
    for t in tasks:
        m = data_dir / t / "manifest.json"
        if m.is_file():
            splits[t] = read_json(m)["summary"]["split_hash"]
        else:  # split files written by hand (tests, custom data): hash them directly
            files = sorted((data_dir / t).glob("*.jsonl"))
            if not files:
                raise FileNotFoundError(f"{data_dir / t} holds no prepared splits; prepare task {t} first "
                                        f"(`python -m pipeline stage=prepare task={t}`)")
            splits[t] = files_fingerprint(files)
    style = load_task_config(s.functions_template) if s.functions_from else None
    # the tokenizer renders the function prompts only; other rows hold their ids already
    tokenizer = tokenizer_fingerprint(model_dir) if s.functions_from else None
    return {"settings": s.key_dict(), "splits": splits, "tokenizer": tokenizer,
            "functions_style": None if style is None else [style.get("template"), style.get("system")]}


def training_rows(data_dir: Path, model_dir: Path, s: TrainSettings, cache: Path) -> tuple[str, Any]:
    """(hash of the training rows, a function returning (train rows, holdout rows)).

    The hash is the heads key's record of the training data. It is computed once per content of
    the mix's inputs and kept in `cache`, so an up-to-date check does not cut the mix again."""

    def rows() -> tuple[list[dict], list[dict]]:
        return select_prompts(read_train_rows(data_dir, model_dir, s), s)

    memo = cache / f"mix-{hash_obj(_mix_inputs(data_dir, model_dir, s))}.json"
    if memo.is_file():
        return read_json(memo)["data_hash"], rows
    train_rows, hold_rows = rows()
    data_hash = hash_obj([[r["id"], r["input_ids"]] for r in train_rows + hold_rows])
    atomic_write_json(memo, {"data_hash": data_hash})
    return data_hash, lambda: (train_rows, hold_rows)


def train_key(s: TrainSettings) -> dict[str, Any]:
    """The training settings as the heads key records them. Whole epochs are written as integers,
    as the YAML spells them: the typed schema reads them as floats, and 4.0 would hash differently
    from the 4 in the shipped heads' manifests (they would be retrained for nothing)."""
    out = s.key_dict()
    if isinstance(out.get("epochs"), float) and out["epochs"].is_integer():
        out["epochs"] = int(out["epochs"])
    return out


def train_heads(heads_cfg: dict[str, Any], model_dir: Path, data_dir: Path, artifacts_dir: Path, force: bool = False,
                model_name: str | None = None, device: str = "cpu") -> Path:
    """Train the heads of config group `heads_cfg` for the model in `model_dir` (skipped when an
    up-to-date folder exists, e.g. shipped in git) and return their folder. `model_name` names
    the model's folders (default: the model folder's name). Self-distillation and training run on
    `device`, which is not part of the key: heads trained on another device are up to date (they
    differ only by floating-point rounding)."""
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    lay = Layout.for_model(artifacts_dir, model_name or model_dir.name, data_dir)
    name = heads_cfg.get("name") or heads_cfg.get("kind", "hydra")
    s = TrainSettings.from_dict(heads_cfg.get("train"))
    fingerprint = model_fingerprint(model_dir)
    args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    config = heads_config_for(heads_cfg, args, fingerprint)  # validates before any long work
    data_hash, rows = training_rows(data_dir, model_dir, s, lay.heads_cache)
    # the drafting arithmetic is chosen at inference and does not change what is trained
    trained_shape = {k: v for k, v in config.to_dict().items() if k != "draft_dtype"}
    key = {"version": TRAIN_VERSION, "heads": trained_shape, "train": train_key(s), "data": data_hash,
           "model": fingerprint}

    def build(tmp: Path) -> dict[str, Any]:
        import torch  # training only: an up-to-date check stays torch-free

        from pipeline.heads.distill import build_selfdistill
        from pipeline.heads.report import evaluate_heads, format_report
        from pipeline.heads.train import draft_vocabulary, train_loop
        from runtime.heads import DraftHeads, save_heads
        from runtime.model.checkpoint import load_model

        train_rows, hold_rows = rows()
        t0, c0 = time.time(), time.process_time()
        threads = torch.get_num_threads()  # load_model may reset it; keep the caller's choice
        sd_dir = lay.heads_cache / f"selfdistill-{hash_obj([s.data_dict(), data_hash, fingerprint])}"
        train_seqs = build_selfdistill(model_dir, train_rows, s, sd_dir / "train", device=device)
        for k in range(s.sampled_continuations):  # extra, more varied continuations of the same prompts
            train_seqs += build_selfdistill(model_dir, train_rows, s, sd_dir / f"train-T{s.sample_temperature:g}-s{k}",
                                            device=device, temperature=s.sample_temperature,
                                            sample_seed=s.seed * 1000 + k)
        hold_seqs = build_selfdistill(model_dir, hold_rows, s, sd_dir / "holdout", device=device)
        t_data, c_data = time.time() - t0, time.process_time() - c0
        model = load_model(model_dir, dtype=torch.float32, max_seq_len=min(args.max_position_embeddings, 2048),
                           device=device)
        torch.set_num_threads(threads)
        torch.manual_seed(s.seed)
        heads = DraftHeads(config).to(model.device)  # initialised on the host: the same weights on every device
        heads.bind(model)
        heads.init_output_from_base()
        if config.output == "draft":
            heads.set_draft_vocab(draft_vocabulary(train_seqs, config.draft_vocab_size))
        work = lay.heads_cache / f"train-{name}-{hash_obj(key)}"
        work.mkdir(parents=True, exist_ok=True)
        fit = train_loop(heads, train_seqs, s, work, run_key=hash_obj(key))
        report = evaluate_heads(heads, hold_seqs)
        sources = [r["id"].split("/")[0] for r in hold_rows]
        report["by_source"] = {src: {k: v for k, v in evaluate_heads(
            heads, [q for q, r in zip(hold_seqs, sources) if r == src]).items() if k != "top5"}
            for src in sorted(set(sources))}
        report.update({
            "name": name, "kind": config.kind, "prefix_layer": config.prefix_layer, "output": config.output,
            "train_sequences": len(train_seqs), "train_positions": int(sum(len(x["tokens"]) for x in train_seqs)),
            "steps": fit["steps"], "loss_first": fit["loss_first"], "loss_last": fit["loss_last"],
            # wall time depends on what else the machine runs; CPU time (this process) is the
            # better figure to extrapolate from on a shared machine
            "wall_s": {"data": round(t_data, 1), "train_this_run": fit["seconds_this_run"],
                       "total_this_run": round(time.time() - t0, 1)},
            "cpu_s": {"data": round(c_data, 1), "total_this_run": round(time.process_time() - c0, 1)},
            "machine": machine_info(), "base_fingerprint": fingerprint, "device": str(model.device),
            "train_dtype": s.dtype,
        })
        save_heads(heads, tmp, dtype=getattr(torch, s.save_dtype))
        atomic_write_json(tmp / "report.json", report)
        atomic_write_json(work / "loss_history.json", fit["loss_history"])
        log.info("%s", format_report(name, report))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        return {"top1": report["top1"], "top5": report["top5"], "tokens_per_step": report.get("tokens_per_step"),
                "bytes": size, "base_fingerprint": fingerprint}

    return run_stage("heads", lay.heads_dir(name), key, build, force=force)
