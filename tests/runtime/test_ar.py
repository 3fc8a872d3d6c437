"""runtime.ar.ar_generate: token-identical to transformers' greedy `generate`, EOS and budget
handling, streaming, capacity errors; the SmolLM2 check on real task prompts is marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.ar import ar_generate, main
from runtime.model.checkpoint import load_model
from tests.helpers import random_hf_causal_lm

TINY_CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)


# tiny models gain nothing from threads (see tests/helpers/__init__.py `torch_threads`)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    hf = random_hf_causal_lm("llama", TINY_CFG, seed=1)
    hf.save_pretrained(str(d))
    return hf, load_model(d, max_seq_len=128), d


def _hf_greedy(hf, ids: list[int], n: int, eos: int | None) -> list[int]:
    from transformers import GenerationConfig

    x = torch.tensor([ids])
    # eos_token_id=None would fall back to the model's EOS; an empty list really disables stopping
    gc = GenerationConfig(max_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=[] if eos is None else eos,
                          pad_token_id=0)
    with torch.inference_mode():
        y = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    return y[0, len(ids):].tolist()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_token_identical_to_transformers_generate(kind: str, tmp_path: Path) -> None:
    hf = random_hf_causal_lm(kind, TINY_CFG, seed=2)
    hf.save_pretrained(str(tmp_path))
    ours = load_model(tmp_path, max_seq_len=128)
    for seed, plen in [(0, 1), (1, 9), (2, 40)]:
        ids = _prompt(plen, seed)
        want = _hf_greedy(hf, ids, 30, eos=None)
        assert len(want) == 30
        assert ar_generate(ours, ids, 30, eos_ids=()) == want, (kind, seed)


def test_stops_after_eos_and_includes_it(tiny_pair) -> None:
    hf, ours, _ = tiny_pair
    ids = _prompt(12, 3)
    free = ar_generate(ours, ids, 40, eos_ids=())
    eos = free[6]  # pretend a token the model emits is the EOS
    stop = free.index(eos)
    got = ar_generate(ours, ids, 40, eos_ids=[eos])
    assert got == free[:stop + 1] and got[-1] == eos
    assert got == _hf_greedy(hf, ids, 40, eos=eos)
    # the default stop set is the model's own (config eos_token_id = 2)
    assert ours.args.eos_token_ids == (2,)
    default = ar_generate(ours, ids, 40)
    assert default == (free[:free.index(2) + 1] if 2 in free else free)


def test_budget_streaming_and_repeatability(tiny_pair) -> None:
    _, ours, _ = tiny_pair
    ids = _prompt(7, 4)
    seen: list[int] = []
    out = ar_generate(ours, ids, 17, eos_ids=(), stream=seen.append)
    assert len(out) == 17 and seen == out
    assert ar_generate(ours, ids, 17, eos_ids=()) == out  # the cache is reset on every call
    assert ar_generate(ours, ids, 5, eos_ids=()) == out[:5]
    assert ar_generate(ours, ids, 0) == []


def test_refuses_bad_requests_with_what_to_do(tiny_pair) -> None:
    _, ours, _ = tiny_pair
    with pytest.raises(ValueError, match="empty"):
        ar_generate(ours, [], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ar_generate(ours, [1, 256], 4)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            ar_generate(ours, [1, 2], bad)
    # 100 + 29 = 129 > 128 slots: refused up front, naming the numbers and the fix
    with pytest.raises(ValueError, match=r"= 129 exceeds the KV cache capacity 128.*setup_cache\(129\)"):
        ar_generate(ours, _prompt(100, 5), 29)
    assert len(ar_generate(ours, _prompt(100, 5), 28, eos_ids=())) == 28  # exactly full is fine


def test_command_line_streams_a_continuation(smollm2_dir: Path, capsys) -> None:
    torch.set_num_threads(2)
    main(["--model", str(smollm2_dir), "--prompt", "The capital of France is", "--max-new-tokens", "4",
          "--max-seq-len", "64"])
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "4 tokens" in captured.err


@pytest.mark.slow
def test_smollm2_token_identical_to_transformers_on_task_prompts(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pipeline.prepare import task_prompts

    torch.set_num_threads(2)
    new = 48
    prompts = task_prompts(smollm2_dir, ("humaneval", "gsm8k", "sharegpt"), 5)
    assert len(prompts) == 15
    ours = load_model(smollm2_dir, max_seq_len=max(len(p) for _, p in prompts) + new)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32, attn_implementation="eager").eval()
    mismatches = []
    for task, ids in prompts:
        got = ar_generate(ours, ids, new)
        want = _hf_greedy(hf, ids, new, eos=2)
        if got != want:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            with torch.inference_mode():  # how close was the flipped choice? (a float tie is not a bug)
                logits = hf(torch.tensor([ids + want[:k]])).logits[0, -1]
            top2 = logits.topk(2).values
            mismatches.append(f"{task}: first difference at new token {k}, transformers' top-2 margin "
                              f"{(top2[0] - top2[1]).item():.2e}")
    assert not mismatches, "\n".join(mismatches)
