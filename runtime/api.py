"""Public API: load a model, its draft heads and a TopologyBank, then generate.

    from runtime import EntMTP
    engine = EntMTP.load("artifacts/banks/smollm2-135m-instruct/hydra-draft8192/humaneval")
    out = engine.generate("Write a function that reverses a string.", max_new_tokens=128)
    print(out.text, out.stats)

A bank records which model and heads it was built for (provenance), so the bank folder alone is
enough; `model_dir=` / `heads_dir=` override those paths (the fingerprints are still checked).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.bank import BankError, BankProvenanceWarning, TopologyBank
from runtime.decoder import Acceptance, Drafter, GenerationResult, TreeDecoder, acceptance_dict, make_acceptance
from runtime.device import clock, resolve_device, torch_dtype
from runtime.dynamic import DynamicPolicy, StepTreePolicy
from runtime.eagle2 import EAGLE2, Eagle2Policy, Eagle2Settings
from runtime.fingerprint import heads_fingerprint, weights_fingerprint
from runtime.heads import load_heads
from runtime.machine import here, provenance_differences
from runtime.model.llama import Transformer
from runtime.model.checkpoint import load_model, load_tokenizer
from runtime.policy import BatchScheduler, Scheduler, policy_from_dict
from runtime.sampling import Sampler, SamplingConfig



@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    result: GenerationResult | None = None
    error: str | None = None  # in a batch: why this prompt was not decoded (the others were)


def render_chat(model_dir: Path, prompt: str, system: str | None = None) -> str:
    """Render one user turn with the model's own chat template (Jinja, as transformers does)."""
    tpl_file = model_dir / "chat_template.jinja"
    cfg_file = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    template = tpl_file.read_text(encoding="utf-8") if tpl_file.is_file() else tok_cfg.get("chat_template")
    if not template:
        return prompt
    import jinja2  # a torch dependency; imported here so plain-ids users never need it

    def special(name: str) -> str:
        # templates of BOS-using models (Llama-2, Vicuna) emit {{ bos_token }} themselves, as transformers renders them
        tok = tok_cfg.get(name)
        return tok.get("content", "") if isinstance(tok, dict) else tok if isinstance(tok, str) else ""

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=special("bos_token"), eos_token=special("eos_token"))


@dataclass(frozen=True)
class BatchChoice:
    """What a batch of `load` sequences decodes with when no policy is named (`batch_choice`): the
    bank's choice at `measured`, the smallest measured batch size >= load (None above the largest,
    where the bank does not speculate): tree index `tree`, the batch scheduler (`scheduler`), or
    neither, which is AR, decoded by the runtime's batched AR (`runtime.ar.ar_generate_batch`).
    `text` says so ("bank's choice for B=4: tree 2 (12 nodes)")."""

    load: int
    measured: int | None
    tree: int | None
    scheduler: bool
    text: str

    @property
    def ar(self) -> bool:
        return self.tree is None and not self.scheduler


# A batch-size entry of bank.json may record the batch scheduler's *measured* batch tok/s at its
# batch size (same convention as its "tok_per_s"); where that beats the static choice, the batch
# scheduler is the default there. The replays in the bank's oracle are not measurements.
SCHEDULER_TOK_PER_S = "scheduler_tok_per_s"


def _measured(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def batch_choice(bank: TopologyBank, load: int) -> BatchChoice:
    """The bank's choice for a batch of `load` sequences (`ServingSchedule.choice_for`: that of the
    smallest measured batch size >= load; AR above the largest, where the bank does not speculate),
    or the batch scheduler where the bank's entry records it measured faster than that choice (and
    the bank has the expected_throughput policy it runs on)."""
    schedule = bank.serving_schedule()
    c = schedule.choice_for(load)
    if c is None:
        return BatchChoice(load, None, None, False, f"above the bank's largest measured batch size "
                           f"({schedule.batch_sizes[-1]}), where it does not speculate: AR")
    b = c.batch_size
    entry = next(e for key, e in bank.batch_schedule.items() if int(key) == b)
    k = c.tree_index
    static = c.tok_per_s if k is not None else entry.get("ar_tok_per_s")
    timed = entry.get(SCHEDULER_TOK_PER_S)
    what = "AR" if k is None else f"tree {k} ({c.nodes} nodes)"
    if _measured(timed) and _measured(static) and timed > static and "expected_throughput" in bank.policies:
        return BatchChoice(load, b, None, True, f"bank's choice for B={b}: the batch scheduler (measured "
                           f"{timed:.1f} tok/s vs {static:.1f} for {what})")
    return BatchChoice(load, b, k, False, f"bank's choice for B={b}: {what}")


LOSSLESS_MODES = ("exact", "numerical")
DYNAMIC = "dynamic"   # the policy name of EntMTP-dyn (the bank's `dynamic` entry, `runtime.dynamic`)
DEFAULT_INVARIANT_ROWS = 8


class EntMTP:
    """A model + draft heads + TopologyBank, ready to decode losslessly with per-step tree choice."""

    def __init__(self, model: Transformer, heads: Drafter, bank: TopologyBank, tokenizer: Any = None,
                 model_dir: Path | None = None, acceptance: Acceptance | dict | None = None) -> None:
        """`acceptance`: "exact" (lossless), "typical" (the paper's settings), a dict {kind,
        temperature, epsilon, alpha} or a `TypicalAcceptance`; None takes the one the bank was
        measured with (its provenance; exact for banks that record none). `heads`: draft heads or
        an EAGLE-3 drafter (runtime.decoder's `Drafter`)."""
        self.model, self.heads, self.bank, self.tokenizer = model, heads, bank, tokenizer
        self.model_dir = model_dir
        self.acceptance = make_acceptance(acceptance if acceptance is not None else bank.provenance.get("acceptance"))
        self.decoder = TreeDecoder(model, heads, bank.buffers, acceptance=self.acceptance)
        self._decoders = {_acceptance_key(self.acceptance): self.decoder}

    def decoder_for(self, acceptance: Acceptance | dict | None = None) -> TreeDecoder:
        """The tree decoder over the bank for `acceptance` (None: the engine's own), made once."""
        if acceptance is None:
            return self.decoder
        acc = make_acceptance(acceptance)
        key = _acceptance_key(acc)
        if key not in self._decoders:
            self._decoders[key] = TreeDecoder(self.model, self.heads, self.bank.buffers, acceptance=acc)
        return self._decoders[key]

    @classmethod
    def load(
        cls,
        bank_dir: str | Path,
        model_dir: str | Path | None = None,
        heads_dir: str | Path | None = None,
        dtype: str | None = None,
        max_seq_len: int = 2048,
        force: bool = False,
        device: str | torch.device | None = None,
        acceptance: Acceptance | dict | None = None,
        lossless: str | None = None,
        invariant_rows: int | None = None,
    ) -> EntMTP:
        """Load the bank, then the model and heads it was built for (paths from its provenance
        unless given). `dtype` defaults to the bank's (the one its figures were measured in);
        `device` to the one the bank was built on, or the CPU, with a warning, when that device
        is not available here; `acceptance` to the bank's (see `EntMTP.__init__`).

        A bank measured elsewhere (another CPU or GPU model, dtype, small-row kernel or torch thread
        count than this load: `runtime.machine.provenance_differences`) loads with one
        `BankProvenanceWarning` naming what differs; `entmtp inspect BANK --check` re-times it.

        `lossless`: "exact" makes every decode forward row-invariant (`Transformer.set_row_invariance`,
        padded to `invariant_rows` rows), so `generate` equals `generate_ar` token for token in any
        dtype; "numerical" keeps the ordinary, fastest arithmetic, where a bf16 tree verify and a
        one-token AR forward can round a near-tied argmax apart. Both default to what the bank was
        built and measured with ("exact" with 8 rows for a bank that records neither).

        The heads folder may hold draft heads or an EAGLE-3 drafter (`runtime.eagle3.save_drafter`):
        `load_heads` tells them apart by their config.json."""
        bank_dir = Path(bank_dir)
        probe = TopologyBank.load(bank_dir, force=True)  # read provenance first: where are the weights?
        prov = probe.provenance
        # recorded paths are relative to the bank folder
        model_dir = Path(model_dir) if model_dir else bank_dir / prov.get("model_dir", "(none recorded)")
        heads_dir = Path(heads_dir) if heads_dir else bank_dir / prov.get("heads_dir", "(none recorded)")
        for what, p in (("model", model_dir), ("heads", heads_dir)):
            if not p.is_dir():
                raise BankError(f"the {what} folder {p} for bank {bank_dir} does not exist; "
                                f"pass {what}_dir=... or rebuild with `make bank`")
        dt = dtype or prov.get("dtype") or "float32"
        recorded = prov.get("device") or (prov.get("config") or {}).get("device")
        dev = resolve_device(device, recorded)
        model = load_model(model_dir, dtype=torch_dtype(dt), max_seq_len=max_seq_len, device=dev)
        elsewhere = provenance_differences(prov, here(dev), dt)
        if elsewhere:
            warnings.warn(f"bank {bank_dir} was measured elsewhere: {'; '.join(elsewhere)}. Decoding stays lossless, "
                          "but its figures and per-batch-size choices may not hold here: re-time them with "
                          f"`entmtp inspect {bank_dir} --check`, or rebuild the bank on this machine "
                          "(`make bank TASK=<task>`)", BankProvenanceWarning, stacklevel=2)
        mode = lossless or prov.get("lossless") or "exact"
        if mode not in LOSSLESS_MODES:
            raise ValueError(f"lossless must be one of {', '.join(LOSSLESS_MODES)}, got {mode!r}")
        rows = invariant_rows or prov.get("invariant_rows") or DEFAULT_INVARIANT_ROWS
        model.set_row_invariance(int(rows) if mode == "exact" else None)
        heads = load_heads(heads_dir, model=model)
        bank = TopologyBank.load(bank_dir, model_fingerprint=weights_fingerprint(model_dir),
                                 heads_fingerprint=heads_fingerprint(heads_dir), max_depth=heads.max_depth,
                                 force=force)
        return cls(model, heads, bank, load_tokenizer(model_dir), model_dir, acceptance=acceptance)

    def scheduler(self, policy: str | int | None = None) -> Scheduler | DynamicPolicy | int:
        """`policy`: a stored policy name (static, ladder, hysteresis, expected_throughput),
        "dynamic" (EntMTP-dyn: a fresh `DynamicPolicy` from the bank's dynamic entry, see
        `dynamic_policy`), "eagle2" (EAGLE-2's dynamic tree, `eagle2_policy`: no bank tree), a tree index (an int, or its digits as a string), or None for the
        bank's default. What it returns is the decoder's `choose`."""
        # `is None`, not `or`: policy=0 (the smallest tree) must not mean "the default policy"
        name = self.bank.default_policy if policy is None else policy
        if isinstance(name, bool) or not isinstance(name, (str, int)):
            raise ValueError(f"policy must be a policy name, a tree index or None, got {name!r}")
        if isinstance(name, int) or name.isdigit():
            k = int(name)
            if not 0 <= k < len(self.bank.trees):
                raise ValueError(f"tree index {k} out of range: the bank has {len(self.bank.trees)} trees")
            return k
        if name == "static" and "static" not in self.bank.policies:
            return self.bank.best_static
        if name == DYNAMIC:
            return self.dynamic_policy()
        if name == EAGLE2:
            return self.eagle2_policy()
        if name not in self.bank.policies:
            names = sorted({"static", EAGLE2, *self.bank.policies, *([DYNAMIC] if self.bank.dynamic else [])})
            raise ValueError(f"unknown policy {name!r}; this bank has: {', '.join(names)} or a tree index")
        return Scheduler(policy_from_dict(self.bank.policies[name]), len(self.bank.trees))

    def dynamic_policy(self) -> DynamicPolicy:
        """EntMTP-dyn (`policy="dynamic"`): a fresh `DynamicPolicy` (its own subset cache) from the
        bank's fitted super-tree, step costs and calibration. ValueError, saying how to get one,
        where the bank has no dynamic entry."""
        if not self.bank.dynamic:
            names = sorted({"static", *self.bank.policies})
            raise ValueError(f"policy 'dynamic' (EntMTP-dyn) needs a bank with a fitted dynamic policy, and the bank "
                             f"{self.bank.path or ''} has none (built with dynamic.enabled=false, with typical "
                             "acceptance, or by an older pipeline); rebuild it with `make bank TASK=<task> "
                             f"ARGS=dynamic.enabled=true` (exact acceptance), or pick one of: {', '.join(names)} "
                             "or a tree index")
        return self.bank.dynamic_policy()

    def eagle2_policy(self, settings: Eagle2Settings | None = None) -> Eagle2Policy:
        """EAGLE-2's dynamic tree (`policy="eagle2"`, `runtime.eagle2`) drafted by this engine's
        drafter: `settings` (default: SGLang's, depth 5, top-4, 8 tokens) capped to the depth the
        drafter drafts. A baseline: it reads nothing the bank measured."""
        return Eagle2Policy((settings or Eagle2Settings()).capped(self.heads.max_depth))

    def _tree_nodes(self, choose: Scheduler | StepTreePolicy | int) -> int | None:
        """The most nodes a step of `choose` verifies when it is not the bank's largest tree (a
        DynamicPolicy's super-tree), for the context-window checks; None: the bank's largest."""
        return choose.num_nodes if isinstance(choose, StepTreePolicy) else None

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Token ids of `prompt` (text through the chat template unless chat=False, or ids as
        given). An empty prompt, or text that encodes to no tokens, raises ValueError."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give some text or token ids")
            if self.tokenizer is None:
                raise ValueError("no tokenizer loaded: pass token ids instead of text")
            text = render_chat(self.model_dir, prompt) if chat and self.model_dir else prompt
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if not ids:
                raise ValueError(f"the prompt {prompt[:40]!r} encodes to no tokens; give some text")
            return ids
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: give at least one token id")
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab}); encode the text with "
                             "this model's tokenizer")
        return ids

    def fit_context(self, ids: list[int], max_new_tokens: int, truncate: str | None = None,
                    tree_nodes: int | None = None) -> list[int]:
        """Apply the context-window policy of `generate` to prompt ids (see there). `tree_nodes`:
        the largest tree a step verifies (default: the bank's; a DynamicPolicy's super-tree may
        be larger)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if truncate not in (None, "left"):
            raise ValueError(f"truncate must be None (raise on an overlong prompt) or 'left' (keep the most recent "
                             f"tokens), got {truncate!r}")
        capacity = self.model.max_seq_len
        tree = tree_nodes if tree_nodes is not None else max(int(b.depths.numel()) for b in self.bank.buffers)
        room = capacity - max_new_tokens - tree  # prompt tokens that fit (the decoder's own bound)
        if room < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) + the largest tree ({tree} nodes) leave no room for a "
                             f"prompt in the KV cache capacity {capacity}; lower max_new_tokens to at most "
                             f"{capacity - tree - 1} or load the model with a larger max_seq_len")
        if len(ids) <= room or truncate is None:
            return ids  # an overlong prompt without truncate: the decoder raises with the numbers
        return ids[len(ids) - room:]

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        policy: str | int | None = None,
        stream: Callable[[str], None] | None = None,
        chat: bool = True,
        truncate: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        acceptance: Acceptance | dict | None = None,
    ) -> Generation:
        """Decode losslessly: the same tokens as `generate_ar` with the same sampling arguments.
        `prompt` is text (rendered with the chat template unless chat=False) or token ids. `stream`
        gets text pieces.

        `acceptance` (default: the engine's, see `EntMTP.__init__`): "exact" is the lossless rule
        above; "typical" (or a dict / `TypicalAcceptance` with its temperature, epsilon and alpha)
        is the paper's typical acceptance, which accepts more drafts but changes the output (no
        longer the AR text); it takes no sampling arguments (temperature must stay 0).

        temperature 0 (default) is greedy. temperature > 0 samples from softmax(logits /
        temperature) cut to the top_k tokens (0: all) and then to the top_p probability mass
        (1.0: all), with noise keyed on (seed, output position): an exact sample, reproducible
        from the seed, whatever trees the policy picks (runtime/sampling.py).

        Context window: the KV cache holds `model.max_seq_len` positions, and a decode needs room
        for the prompt, `max_new_tokens` and the bank's largest tree. By default (truncate=None) a
        prompt that does not fit raises ValueError giving those numbers; truncate="left" instead
        keeps the most recent prompt tokens that fit (for a chat prompt this drops the start of
        the rendered template, keeping the end of the user turn and the assistant header).
        `max_new_tokens` so large that not even one prompt token fits raises ValueError naming
        the capacity, whatever `truncate` says. An empty prompt raises ValueError.
        """
        sampler = Sampler(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        choose = self.scheduler(policy)
        ids = self.fit_context(self.encode(prompt, chat), max_new_tokens, truncate, self._tree_nodes(choose))
        on_tokens = None
        if stream is not None:
            if self.tokenizer is None:
                raise ValueError("streaming text needs a tokenizer")
            emitted: list[int] = []
            printed = [0]

            def on_tokens(toks: list[int]) -> None:
                emitted.extend(toks)
                text = self.tokenizer.decode(emitted)
                # A character split over byte-level tokens (emoji, CJK) decodes as U+FFFD until its
                # last byte arrives; streaming it then would print a replacement character that the
                # next piece cannot take back. Hold the text until it decodes cleanly.
                if text.endswith("\ufffd") or len(text) <= printed[0]:
                    return
                stream(text[printed[0]:])
                printed[0] = len(text)

        decoder = self.decoder_for(acceptance)
        res = decoder.generate(ids, max_new_tokens, choose=choose, stream=on_tokens, sampler=sampler)
        text = self.tokenizer.decode(res.tokens) if self.tokenizer is not None else ""
        if stream is not None and len(text) > printed[0]:
            stream(text[printed[0]:])  # what was held back (generation stopped mid-character)
        stats = res.stats()
        stats["trees_used"] = {self.bank.trees[k].num_nodes: n for k, n in stats["trees_used"].items()}
        if isinstance(choose, DynamicPolicy):
            stats["dynamic_cache"] = _cache_stats(choose)
        stats["sampling"] = sampler.config.to_dict()
        stats["acceptance"] = acceptance_dict(decoder.acceptance)
        return Generation(text=text, tokens=res.tokens, stats=stats, result=res)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 128,
        policy: str | int | None = None,
        batch_size: int | None = None,
        chat: bool = True,
        truncate: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        ar: bool = False,
    ) -> list[Generation]:
        """Decode several prompts together, `batch_size` at a time (default: all at once): each step
        verifies every live sequence's tree in one forward, each sequence with its own cache,
        positions and tree, and a sequence leaves the batch when it finishes. Lossless per
        sequence: under the exact lossless mode every output equals that prompt decoded alone by
        AR, whatever shares the batch.

        `policy` None (the default) follows the bank's choice for each batch's size (`batch_choice`:
        a tree, the batch scheduler where the bank measured it faster, or AR, which then decodes
        with the runtime's batched AR); a named policy as in `generate` (one scheduler per
        sequence, "dynamic" one DynamicPolicy per sequence), or "batch" (every sequence's tree
        chosen together, `batch_scheduler`), overrides it. Each result's stats["choice"] says what
        decoded its batch.

        A prompt that cannot be decoded (empty, or too long for the KV cache without `truncate`)
        comes back with `error` set and no tokens; the others are decoded. `ar=True` decodes with
        plain AR instead, batched the same way (the baseline). Each result's stats give its
        tokens/step and the batch's tok/s (new tokens of the whole batch over its wall time)."""
        from runtime.ar import ar_generate_batch

        if isinstance(batch_size, bool) or batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1 (or None: every prompt in one batch), got {batch_size!r}")
        if not prompts:
            raise ValueError("no prompts to decode: give at least one")
        if not self.model.invariant_rows and not self.model.kernel_decode:
            raise ValueError("batched decoding needs lossless='exact' (row-invariant arithmetic); load the engine "
                             "with lossless='exact' or decode the prompts one by one")
        sampler = Sampler(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        decoder = self.decoder_for(None)
        # a bad policy name fails here, once, before any prompt is decoded; a dynamic policy's
        # super-tree (which may outgrow the bank's trees) sets the room each prompt needs
        nodes = None if ar or policy in (None, "batch") else self._tree_nodes(self.scheduler(policy))
        out: list[Generation | None] = [None] * len(prompts)
        ready: list[tuple[int, list[int]]] = []
        for k, prompt in enumerate(prompts):
            try:
                ids = self.fit_context(self.encode(prompt, chat), max_new_tokens, truncate, nodes)
                decoder.check_fits(len(ids), max_new_tokens, nodes)
                ready.append((k, ids))
            except ValueError as err:
                out[k] = Generation(text="", tokens=[], stats={}, error=str(err))
        size = batch_size or max(len(ready), 1)
        for first in range(0, len(ready), size):
            group = ready[first:first + size]
            ids = [g[1] for g in group]
            per_seq: list = [None] * len(group)   # each sequence's `choose` (its stats)
            plan = self.batch_choice(len(group)) if policy is None and not ar else None
            choice = "AR" if ar else plan.text if plan is not None else f"policy {policy!r} (named)"
            t0 = clock(self.model.device)
            if ar or plan is not None and plan.ar:
                results = [GenerationResult(tokens=t) for t in ar_generate_batch(self.model, ids, max_new_tokens,
                                                                                 sampler=sampler)]
            elif plan is not None and not plan.scheduler:
                results = decoder.generate_batch(ids, max_new_tokens, choose=plan.tree, sampler=sampler)
            elif policy == "batch" or plan is not None:
                chooses, batch_policy = self.batch_scheduler()
                results = decoder.generate_batch(ids, max_new_tokens, choose=[chooses() for _ in ids], sampler=sampler,
                                                 batch_policy=batch_policy)
            else:
                # a fresh scheduler (or DynamicPolicy, with its own subset cache) per sequence
                per_seq = [self.scheduler(policy) for _ in ids]
                results = decoder.generate_batch(ids, max_new_tokens, choose=per_seq, sampler=sampler)
            seconds = clock(self.model.device) - t0
            batch_tokens = sum(len(r.tokens) for r in results)
            for (k, _), res, choose in zip(group, results, per_seq):
                stats = res.stats() if res.steps else {"new_tokens": len(res.tokens), "tokens_per_step": 1.0}
                if "trees_used" in stats:
                    stats["trees_used"] = {self.bank.trees[t].num_nodes: n for t, n in stats["trees_used"].items()}
                if isinstance(choose, DynamicPolicy):
                    stats["dynamic_cache"] = _cache_stats(choose)
                stats.update(choice=choice, batch_size=len(group), batch_seconds=round(seconds, 4),
                             batch_tok_per_s=round(batch_tokens / seconds, 2) if seconds > 0 else float("nan"))
                text = self.tokenizer.decode(res.tokens) if self.tokenizer is not None else ""
                out[k] = Generation(text=text, tokens=res.tokens, stats=stats, result=res)
        return [g for g in out if g is not None]

    def batch_choice(self, load: int) -> BatchChoice:
        """What `generate_batch` decodes a batch of `load` sequences with when no policy is named
        (`batch_choice`)."""
        return batch_choice(self.bank, load)

    def batch_scheduler(self) -> tuple[Callable[[], Scheduler], BatchScheduler]:
        """`policy="batch"` of `generate_batch`: a factory of per-sequence schedulers (their signal)
        and the `BatchScheduler` that picks every sequence's tree at once from the bank's
        expected-throughput table and its step costs per batch size."""
        pol = self.bank.policies.get("expected_throughput")
        if pol is None or not self.bank.batch_schedule:
            raise ValueError("policy='batch' needs a bank with an expected_throughput policy and a batch-size axis; "
                             "rebuild the bank (make bank), or pick another policy")
        batch = BatchScheduler(policy_from_dict(pol), {int(b): e["step_ms"] for b, e in self.bank.batch_schedule.items()})
        return (lambda: Scheduler(policy_from_dict(pol), len(self.bank.trees))), batch

    def generate_ar(self, prompt: str | Sequence[int], max_new_tokens: int = 128, chat: bool = True,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Generation:
        """Plain autoregressive decoding on the same model, for comparison (greedy, or seeded
        sampling with the same arguments and meaning as `generate`)."""
        from runtime.ar import ar_generate

        sampler = Sampler(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        ids = self.encode(prompt, chat)
        t0 = clock(self.model.device)
        toks = ar_generate(self.model, ids, max_new_tokens, sampler=sampler)
        dt = clock(self.model.device) - t0
        text = self.tokenizer.decode(toks) if self.tokenizer is not None else ""
        return Generation(text=text, tokens=toks, stats={"new_tokens": len(toks), "tok_per_s": round(len(toks) / dt, 2),
                                                          "tokens_per_step": 1.0,
                                                          "sampling": sampler.config.to_dict()})


def _cache_stats(policy: DynamicPolicy) -> dict[str, int | float]:
    """A DynamicPolicy's subset-cache look-ups for a decode's stats (JSON-safe: no NaN)."""
    looks = policy.hits + policy.misses
    return {"hits": policy.hits, "misses": policy.misses, "hit_rate": round(policy.hits / looks, 4) if looks else 0.0}


def _acceptance_key(acceptance: Acceptance) -> tuple:
    return tuple(sorted(acceptance_dict(acceptance).items()))
