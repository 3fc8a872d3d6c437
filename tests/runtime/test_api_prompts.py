"""Bad prompts (issue 7): empty prompts, prompts longer than the context window, max_new_tokens
beyond the KV cache. Tiny random model (capacity 256 positions) and a bank of two trees.

Non-UTF-8 text in a task's data file is skipped and counted by the prepare stage: see
tests/pipeline/test_prepare.py::test_non_utf8_record_is_skipped_and_counted_jsonl (and the gz/json and
manifest variants next to it).
"""

from __future__ import annotations

import pytest
import torch

from runtime.api import EntMTP
from runtime.bank import TopologyBank
from runtime.decoder import TreeDecoder
from runtime.ar import ar_generate
from runtime.tree import Tree, TreeBuffers
from tests.helpers import ar_greedy, tiny_heads, tiny_model

CAPACITY = 256                               # tiny_model's KV cache
TREES = [Tree.chain(2), Tree.named("mc_sim_7b_63")]
LARGEST = max(t.num_nodes for t in TREES)     # 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model gains nothing from threads, and on a busy shared CPU two spinning OpenMP threads
    made these tests 15-50x slower (measured); restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> EntMTP:
    model = tiny_model(2)
    assert model.max_seq_len == CAPACITY
    heads = tiny_heads(model, "hydra", seed=2)
    bank = TopologyBank(trees=TREES, figures=[{} for _ in TREES], best_static=1)
    return EntMTP(model, heads, bank, tokenizer=None)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------ empty
def test_empty_prompt_is_refused_everywhere(engine: EntMTP) -> None:
    dec = TreeDecoder(engine.model, engine.heads, [TreeBuffers.compile(t) for t in TREES])
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([], 8)
    with pytest.raises(ValueError, match="empty"):
        ar_generate(engine.model, [], 8)
    for empty in ([], "", ()):
        with pytest.raises(ValueError, match="empty prompt"):
            engine.generate(empty, 8)


def test_bad_token_ids_and_arguments(engine: EntMTP) -> None:
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 48\)"):
        engine.generate([1, 2, 48], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([-1, 2], 4)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate("some text", 4)
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.generate([1, 2, 3], bad)
    with pytest.raises(ValueError, match="truncate"):
        engine.generate([1, 2, 3], 4, truncate="right")


# ------------------------------------------------------------------------------ context window
def test_prompt_that_exactly_fits_decodes_and_one_more_token_raises_with_the_numbers(engine: EntMTP) -> None:
    new = 16
    room = CAPACITY - new - LARGEST                                   # 176
    fits = _prompt(room)
    out = engine.generate(fits, new, policy="1")
    assert out.tokens == ar_greedy(engine.model, fits, new)
    with pytest.raises(ValueError) as e:
        engine.generate(_prompt(room + 1), new, policy="1")
    msg = str(e.value)
    for number in (f"prompt ({room + 1} tokens)", f"max_new_tokens ({new})", f"({LARGEST} nodes)", f"capacity {CAPACITY}"):
        assert number in msg, msg
    assert "shorten the prompt" in msg


def test_truncate_left_keeps_the_most_recent_tokens(engine: EntMTP) -> None:
    new = 16
    room = CAPACITY - new - LARGEST
    long_prompt = _prompt(3 * CAPACITY, seed=1)                       # far beyond the window
    assert engine.fit_context(long_prompt, new, "left") == long_prompt[-room:]
    assert engine.fit_context(long_prompt[:10], new, "left") == long_prompt[:10]   # short prompts untouched
    for policy in ("0", "1"):
        out = engine.generate(long_prompt, new, policy=policy, truncate="left")
        # lossless on what was kept: the same tokens as greedy AR decoding of the recent tokens
        assert out.tokens == ar_greedy(engine.model, long_prompt[-room:], new), policy
        assert out.tokens == engine.generate(long_prompt[-room:], new, policy=policy).tokens


def test_max_new_tokens_beyond_the_cache_names_the_capacity(engine: EntMTP) -> None:
    ids = _prompt(5)
    for truncate in (None, "left"):
        with pytest.raises(ValueError, match=f"capacity {CAPACITY}.*lower max_new_tokens to at most {CAPACITY - LARGEST - 1}"):
            engine.generate(ids, CAPACITY - LARGEST, truncate=truncate)
    # the layers below say the same on their own
    dec = TreeDecoder(engine.model, engine.heads, [TreeBuffers.compile(t) for t in TREES])
    with pytest.raises(ValueError, match=f"capacity {CAPACITY}"):
        dec.generate(ids, 1000)
    with pytest.raises(ValueError, match=f"capacity {CAPACITY}"):
        ar_generate(engine.model, ids, CAPACITY)
    # the largest that fits does decode (ignore EOS so that it really runs to the end)
    n = CAPACITY - LARGEST - len(ids)
    res = dec.generate(ids, n, choose=1, eos_ids=[])
    assert len(res.tokens) == n
    assert res.tokens == ar_generate(engine.model, ids, n, eos_ids=[])
