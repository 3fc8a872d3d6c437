"""Named chat templates for model folders that ship none (`model.chat_template`).

Llama-family checkpoints such as Vicuna v1.3 carry no chat template in their tokenizer config, so
prompts could not be rendered the way the model was fine-tuned. `model.chat_template` names one:

* `null` / `auto`: the folder's own (`chat_template.jinja`, else `chat_template` in
  `tokenizer_config.json`); a folder without one is an error that lists the names below.
* `vicuna_v1.1`: FastChat's "vicuna_v1.1" conversation (Vicuna v1.1 / v1.3 / v1.5): a fixed system
  line, then `USER: ... ASSISTANT: ...` turns, each reply closed by the EOS token.
* `llama2`: Llama-2-chat's `[INST] ... [/INST]` turns, the system prompt in `<<SYS>>` markers
  inside the first instruction, every exchange wrapped in BOS ... EOS.
* `chatml`: `<|im_start|>role\\n...<|im_end|>` blocks (Qwen, SmolLM and others).

The templates are Jinja strings in the form transformers' `apply_chat_template` renders (variables
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`). Prompts are tokenized without
special tokens by the pipeline, so templates of BOS-using models emit `bos_token` themselves.
The model stage writes the chosen template into the converted folder as `chat_template.jinja`,
where transformers, the prepare stage and the runtime's `render_chat` all find it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

OWN = "auto"   # the folder's own template (null means the same)

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

# FastChat "vicuna_v1.1": system + " ", then "USER: text " and "ASSISTANT: text</s>" per turn;
# the prompt for a new reply ends with "ASSISTANT:" (no trailing space).
_VICUNA_V11 = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}"
    "{% set system = '" + VICUNA_SYSTEM.replace("'", "\\'") + "' %}{% set turns = messages %}"
    "{% endif %}"
    "{{ system }} "
    "{% for m in turns %}"
    "{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# Llama-2-chat: "<s>[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] reply </s>" per exchange;
# the system block lives inside the first user turn only.
_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] == 'user' %}"
    "{{ bos_token }}[INST] "
    "{% if loop.first and system %}<<SYS>>\n{{ system }}\n<</SYS>>\n\n{% endif %}"
    "{{ m['content'] | trim }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] | trim }} {{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

# ChatML: every message is "<|im_start|>role\ncontent<|im_end|>\n"; a new reply opens the
# assistant block.
_CHATML = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT_TEMPLATES: dict[str, str] = {"vicuna_v1.1": _VICUNA_V11, "llama2": _LLAMA2, "chatml": _CHATML}


def template_choices() -> list[str]:
    """Every value `model.chat_template` accepts (null means `auto`)."""
    return [OWN, *CHAT_TEMPLATES]


def folder_chat_template(folder: str | Path) -> str | None:
    """The folder's own chat template: `chat_template.jinja`, else tokenizer_config's `chat_template`
    (a string, or the `default` entry of a list of named templates); None when it has none."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        text = jinja.read_text(encoding="utf-8")
        return text or None
    cfg_file = folder / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        tpl = json.loads(cfg_file.read_text(encoding="utf-8")).get("chat_template")
    except ValueError as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); fix or replace the tokenizer config") from e
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) and tpl else None


def resolve_chat_template(setting: str | None, folder: str | Path) -> tuple[str, str]:
    """(name, Jinja text) of the template `setting` selects for the model in `folder`.

    The name is the setting, or `auto` for the folder's own template."""
    if setting is None or setting == OWN:
        own = folder_chat_template(folder)
        if own is None:
            raise ValueError(
                f"the model folder {folder} has no chat template (no chat_template.jinja and no chat_template "
                f"in tokenizer_config.json); choose one with model.chat_template=NAME, one of: "
                f"{', '.join(CHAT_TEMPLATES)} (e.g. vicuna_v1.1 for Vicuna)")
        return OWN, own
    if not isinstance(setting, str) or setting not in CHAT_TEMPLATES:
        raise ValueError(f"model.chat_template={setting!r} is not a known chat template; choose one of: "
                         f"{', '.join(template_choices())} (null = auto, the folder's own)")
    return setting, CHAT_TEMPLATES[setting]


def describe_chat_template(folder: str | Path) -> dict[str, Any]:
    """What a stage records about the template a folder renders with: the named template it is
    (or `own`) and the SHA-256 of its text. Raises when the folder has none."""
    text = folder_chat_template(folder)
    if text is None:
        raise ValueError(f"the model folder {folder} has no chat template; set model.chat_template to one of: "
                         f"{', '.join(CHAT_TEMPLATES)}")
    name = next((n for n, t in CHAT_TEMPLATES.items() if t == text), "own")
    return {"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def render(template: str, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """Render `template` the way transformers does (sandboxed Jinja, trimmed blocks); for checks
    and tests that need no tokenizer."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                            add_generation_prompt=add_generation_prompt)
