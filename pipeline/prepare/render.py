"""Rendering a task text into a prompt with the model's own chat template.

The user turn `template.format(text=...)` (plus `system` when given) goes through the
model's chat template (`AutoTokenizer.apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`), and the ids are `tokenizer(prompt, add_special_tokens=False)`: the chat
template already writes every special token, and transformers 5 changed the BOS defaults.
`truncate` keeps the head of the task text (not of the rendered prompt, which would cut off the
assistant header), shortened until the whole rendered prompt fits `max_prompt_tokens`.

`task_prompts` renders the first records of tasks this way for the benchmarks and the tests
that compare decoders on real prompts.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pipeline.artifacts import files_fingerprint
from pipeline.prepare.task_config import OVERLONG_POLICIES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _render(tokenizer: Any, content: str, system: str | None) -> tuple[str, list[int]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": content})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(prompt, str):
        raise ValueError("the tokenizer's chat template did not render a string; check the model folder's chat template")
    return prompt, list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, text: str, template: str, system: str | None, max_prompt_tokens: int,
                  overlong: str = "truncate") -> tuple[str, list[int], str] | None:
    """Render one task text with the chat template: (prompt, input_ids, "ok" | "truncated"),
    or None when it is too long and `overlong` is "skip"."""
    prompt, ids = _render(tokenizer, template.format(text=text), system)
    if len(ids) <= max_prompt_tokens:
        return prompt, ids, "ok"
    if overlong == "skip":
        return None
    if overlong != "truncate":
        raise ValueError(f"overlong policy {overlong!r} is not one of {OVERLONG_POLICIES}")
    # Keep the head of the task text. Token counts of the pieces do not add up exactly at the
    # seams, so shorten by the measured excess until the rendered prompt fits.
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    budget = len(text_ids) - (len(ids) - max_prompt_tokens)
    while budget > 0:
        head = tokenizer.decode(text_ids[:budget], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        head = head.rstrip("\ufffd")  # a cut through a multi-byte character
        prompt, ids = _render(tokenizer, template.format(text=head), system)
        if len(ids) <= max_prompt_tokens:
            return prompt, ids, "truncated"
        budget -= max(1, len(ids) - max_prompt_tokens)
    raise ValueError(f"max_prompt_tokens={max_prompt_tokens} is too small: the chat template and the task "
                     "template alone take more tokens; raise profile.max_prompt_tokens")


def load_chat_tokenizer(model_dir: str | Path) -> Any:
    """The model folder's tokenizer (with its chat template); cached per process and content."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no tokenizer; run the model stage (`make model`) first")
    return _load_chat_tokenizer(str(model_dir.resolve()), tokenizer_fingerprint(model_dir))


@functools.lru_cache(maxsize=4)
def _load_chat_tokenizer(model_dir: str, fingerprint: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {model_dir} has no chat template; prompts must be rendered with one")
    return tok


# --------------------------------------------------------------------------------------------
# the stage


def tokenizer_fingerprint(model_dir: Path) -> str:
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    if not files:
        raise FileNotFoundError(f"{model_dir} holds none of {TOKENIZER_FILES}; run the model stage first")
    return files_fingerprint(files)


def task_prompts(model_dir: str | Path, tasks: tuple[str, ...] | list[str], n_per_task: int,
                 max_prompt_tokens: int = 1024) -> list[tuple[str, list[int]]]:
    """[(task, prompt token ids)] for the first `n_per_task` usable records of each task, in file
    order (so runs are comparable), rendered exactly as the prepare stage renders them: the task's
    conf/task/<task>.yaml template through the model's chat template (generation prompt added),
    encoded without adding special tokens again. Reading (incl. the cut-off ShareGPT file) is the
    prepare stage's own."""
    from pipeline.prepare.records import load_records
    from pipeline.prepare.task_config import load_task_config

    if n_per_task <= 0:
        raise ValueError(f"n_per_task must be positive, got {n_per_task}")
    tokenizer = load_chat_tokenizer(model_dir)
    out: list[tuple[str, list[int]]] = []
    for task in tasks:
        cfg = load_task_config(task)
        records, _ = load_records(cfg)
        if len(records) < n_per_task:
            raise ValueError(f"task {task!r} has only {len(records)} usable records; ask for fewer prompts")
        for rec in records[:n_per_task]:
            rendered = render_prompt(tokenizer, rec["text"], cfg["template"], cfg.get("system"), max_prompt_tokens,
                                     "truncate")
            out.append((task, rendered[1]))
    return out
