"""Writing the prepared splits: records -> pools -> rendered prompts -> data/<task>/{split}.jsonl.

Over-long prompts that the `skip` policy drops leave their pool smaller: they are never
back-filled from train, which would make train depend on the profile. As truncation can render
two texts to one prompt, a train row whose prompt repeats a calib/eval (or earlier train) prompt
is dropped too (`overlong.train.duplicate` in the manifest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.artifacts import files_fingerprint, hash_bytes, run_stage
from pipeline.prepare.records import load_records
from pipeline.prepare.render import load_chat_tokenizer, render_prompt, tokenizer_fingerprint
from pipeline.prepare.splits import assign_pools
from pipeline.prepare.task_config import SPLITS, resolve_source, validate_task_config

# Bump when the output of the stage changes for the same inputs, so old data/ folders rebuild.
PREPARE_VERSION = 3  # 3: train rows whose rendered prompt repeats another's are dropped


def prepare_task(task_cfg: dict[str, Any], profile_cfg: dict[str, Any], model_dir: Path, data_dir: Path,
                 force: bool = False) -> Path:
    """Write data/<task>/{eval,calib,train}.jsonl (+ manifest) unless they are up to date.

    The output depends on the task config, the source file's content, the tokenizer and chat
    template, and the profile's `max_prompt_tokens` (so switching profile rebuilds it).
    """
    cfg = validate_task_config(task_cfg)
    max_tokens = profile_cfg.get("max_prompt_tokens") if isinstance(profile_cfg, dict) else None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"profile.max_prompt_tokens must be a positive integer, got {max_tokens!r}")
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    source = resolve_source(cfg)
    key = {
        "version": PREPARE_VERSION,
        "task": cfg,
        "max_prompt_tokens": max_tokens,
        "source_fingerprint": files_fingerprint([source]),
        "tokenizer_fingerprint": tokenizer_fingerprint(model_dir),
    }

    def build(tmp: Path) -> dict[str, Any]:
        records, stats = load_records(cfg)
        pools = assign_pools(records, cfg)
        tokenizer = load_chat_tokenizer(model_dir)
        from pipeline.model.chat_templates import describe_chat_template

        summary: dict[str, Any] = {"source": str(source), "records": stats, "model_dir": str(model_dir),
                                   "chat_template": describe_chat_template(model_dir),
                                   "max_prompt_tokens": max_tokens, "overlong_policy": cfg["overlong"],
                                   "pools": {}, "overlong": {}, "prompt_tokens": {}, "split_hash": {}}
        seen: set[str] = set()  # prompts written so far: eval and calib first (SPLITS puts train last)
        for split in SPLITS:
            rows, counts = [], {"truncated": 0, "skipped": 0, "duplicate": 0}
            for rec in pools[split]:
                out = render_prompt(tokenizer, rec["text"], cfg["template"], cfg["system"], max_tokens, cfg["overlong"])
                if out is None:
                    counts["skipped"] += 1
                    continue
                prompt, ids, status = out
                counts["truncated"] += status == "truncated"
                if split == "train":
                    # truncation can turn two different texts into one prompt (a shared 2,000-character
                    # head): a train row must never repeat a calib/eval prompt, nor an earlier train row
                    if prompt in seen:
                        counts["duplicate"] += 1
                        continue
                seen.add(prompt)
                rows.append({"id": rec["id"], "prompt": prompt, "input_ids": ids, "reference": rec["reference"]})
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
            (tmp / f"{split}.jsonl").write_bytes(data)
            lengths = [len(r["input_ids"]) for r in rows]
            summary["pools"][split] = len(rows)
            summary["overlong"][split] = counts
            summary["split_hash"][split] = hash_bytes(data)[:16]
            summary["prompt_tokens"][split] = {
                "max": max(lengths, default=0), "mean": round(sum(lengths) / len(lengths), 1) if lengths else 0.0}
        return summary

    return run_stage("prepare", data_dir / cfg["name"], key, build, force=force)
