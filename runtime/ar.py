"""Plain autoregressive (AR) decoding, greedy or seeded sampling: the baseline every speculative
decode must equal.

Also a small command line (`python -m runtime.ar`) that streams a greedy continuation of a raw prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable

import torch

from runtime.device import clock
from runtime.model.batch import BatchItem
from runtime.model.cache import KVCache
from runtime.model.llama import Transformer
from runtime.model.checkpoint import load_model, load_tokenizer
from runtime.sampling import RowPositions, Sampler

__all__ = ["ar_generate", "ar_generate_batch", "load_model", "load_tokenizer", "main"]


def check_prompt(model: Transformer, input_ids: list[int], max_new_tokens: int) -> None:
    """Raise ValueError when the prompt is unusable or prompt + max_new_tokens does not fit the cache."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if len(input_ids) == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    vocab = model.args.vocab_size
    bad = [t for t in input_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if model.max_seq_len == 0:
        raise RuntimeError("the KV cache is not allocated: call model.setup_cache(max_seq_len) first")
    need = len(input_ids) + max_new_tokens
    if need > model.max_seq_len:
        raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                         f"KV cache capacity {model.max_seq_len}; call model.setup_cache({need}) (or load_model with "
                         "a larger max_seq_len), or shorten the prompt / max_new_tokens")


@torch.inference_mode()
def ar_generate(model: Transformer, input_ids: list[int], max_new_tokens: int,
                eos_ids: Iterable[int] | None = None,
                stream: Callable[[int], None] | None = None, sampler: Sampler | None = None) -> list[int]:
    """Continuation of `input_ids` (greedy unless `sampler` says otherwise): the new tokens only, stopping after an EOS (included) or
    `max_new_tokens`. `eos_ids` defaults to the model's; pass () to never stop early. `stream`, if
    given, is called with each token as soon as it is chosen. `sampler`, if given and not greedy,
    picks the token at output position t (t = 0 for the first new token) with seeded sampling
    (runtime/sampling.py). Resets the model's KV cache."""
    input_ids = [int(t) for t in input_ids]
    check_prompt(model, input_ids, max_new_tokens)
    stop = set(model.args.eos_token_ids if eos_ids is None else (int(t) for t in eos_ids))
    if max_new_tokens == 0:
        return []
    device = model.device
    model.reset_cache()
    logits, _ = model(torch.tensor([input_ids], device=device), torch.arange(len(input_ids), device=device),
                      last_only=True)
    out: list[int] = []
    # reused one-element inputs: the per-token path should allocate as little as possible
    token = torch.empty(1, 1, dtype=torch.long, device=device)
    pos = torch.empty(1, dtype=torch.long, device=device)
    sampled = sampler is not None and not sampler.greedy
    row_offset = torch.zeros(1, dtype=torch.long, device=device)
    while True:
        if sampled:
            nxt = int(sampler.next_tokens(logits[0, -1:], RowPositions(len(out), row_offset, 1))[0])
        else:
            nxt = int(logits[0, -1].argmax())  # ties go to the lowest id, as in transformers
        out.append(nxt)
        if stream is not None:
            stream(nxt)
        if nxt in stop or len(out) >= max_new_tokens:
            return out
        token.fill_(nxt)
        pos.fill_(model.cache_len)
        logits, _ = model(token, pos)


@torch.inference_mode()
def ar_generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int | list[int],
                      eos_ids: Iterable[int] | None = None, sampler: Sampler | None = None,
                      prefill_seconds: list[float] | None = None) -> list[list[int]]:
    """`ar_generate` of several prompts together, the batched baseline: each step runs one token of
    every live sequence in one forward (`Transformer.forward_batch`, each sequence with its own KV
    cache), and a sequence leaves the batch after its EOS or token limit. Needs the row-invariant
    arithmetic (`lossless: exact`); each sequence's tokens are then exactly `ar_generate`'s for it
    alone. A prompt that repeats the one before it copies that prefill's cache positions instead of
    computing them again (as `TreeDecoder.generate_batch` does). The model's own cache is left as it
    was. Given a list, `prefill_seconds` gets each prompt's prefill time appended (as
    `GenerationResult.prefill_seconds` of a tree decode; a copy's is its copying)."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if not prompts or len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts and {len(limits)} token limits: give at least one prompt, one limit each")
    prompts = [[int(t) for t in p] for p in prompts]
    for p, n in zip(prompts, limits):
        check_prompt(model, p, n)
    stop = set(model.args.eos_token_ids if eos_ids is None else (int(t) for t in eos_ids))
    sampled = sampler is not None and not sampler.greedy
    device = model.device
    row_offset = torch.zeros(1, dtype=torch.long, device=device)

    def pick(logits_row: torch.Tensor, emitted: int) -> int:
        if sampled:
            return int(sampler.next_tokens(logits_row[None], RowPositions(emitted, row_offset, 1))[0])
        return int(logits_row.argmax())

    own = model.cache
    outs: list[list[int]] = [[] for _ in prompts]
    caches = []
    try:
        shared: tuple[list[int], KVCache, torch.Tensor] | None = None  # the last prefill: prompt, cache, logits
        for k, p in enumerate(prompts):
            cache = model.new_cache(min(model.max_seq_len, len(p) + limits[k] + 1))
            caches.append(cache)
            if limits[k] == 0:
                continue
            model.use_cache(cache)
            t0 = clock(device)
            if shared is not None and shared[0] == p:  # a copy of the previous prompt: its positions
                cache.copy_prefix(shared[1], len(p))
            else:
                logits, _ = model(torch.tensor([p], device=device), torch.arange(len(p), device=device), last_only=True)
                shared = (p, cache, logits[0, -1])
            outs[k].append(pick(shared[2], 0))
            if prefill_seconds is not None:
                prefill_seconds.append(clock(device) - t0)
        live = [k for k in range(len(prompts)) if outs[k] and outs[k][-1] not in stop and len(outs[k]) < limits[k]]
        while live:
            items = [BatchItem(caches[k], torch.tensor([outs[k][-1]], device=device),
                               torch.tensor([caches[k].length], device=device), [[0]]) for k in live]
            for k, (logits, _) in zip(live, model.forward_batch(items)):
                outs[k].append(pick(logits[-1], len(outs[k])))
            live = [k for k in live if outs[k][-1] not in stop and len(outs[k]) < limits[k]]
    finally:
        if own is not None:
            model.use_cache(own)
    return outs


def main(argv: list[str] | None = None) -> None:
    """`python -m runtime.ar --model DIR --prompt TEXT`: stream an AR greedy continuation of a raw prompt
    (no chat template: the runtime does not render Jinja; render it beforehand if you need one)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", required=True, help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="raw prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=2048)
    a = p.parse_args(argv)

    tokenizer = load_tokenizer(a.model)
    model = load_model(a.model, dtype=getattr(torch, a.dtype), max_seq_len=a.max_seq_len, device=a.device)
    ids = tokenizer.encode(a.prompt, add_special_tokens=False).ids
    emitted: list[int] = []
    printed = ""

    def stream(token: int) -> None:
        nonlocal printed
        emitted.append(token)
        text = tokenizer.decode(emitted)  # decode the whole tail: byte-level tokens may split characters
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    t0 = time.perf_counter()
    out = ar_generate(model, ids, a.max_new_tokens, stream=stream)
    dt = time.perf_counter() - t0
    print(f"\n[{len(out)} tokens in {dt:.2f} s, {len(out) / dt:.1f} tok/s, prompt {len(ids)} tokens]", file=sys.stderr)


if __name__ == "__main__":
    main()
