"""`entmtp inspect BANK --check`: do a bank's choices per batch size still hold on this machine?

A choice is a ratio (the chosen tree's batch tok/s over batched AR's at batch size B), so it is
re-timed as a ratio: both sides decode the same prompts through `EntMTP.generate_batch` (the
tree with `policy=k`, AR with `ar=True`, the runtime's real batched AR), in blocks AR, T, T, AR
per round so that the drift of a shared machine cancels within a round. Each round gives one
ratio; the check reports their median and a bootstrap interval of the median, and runs more
rounds (within its time budget) while that interval still straddles 1.

A choice holds where the bank's own rule, applied to the new measurement, makes it again: a tree
holds when its interval lies above 1 (it beats AR here); AR holds when the bank's fastest tree at
B does not beat AR with that confidence. The bank's stored ratio is printed beside the new one.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from runtime.device import clock

if TYPE_CHECKING:
    from runtime.api import EntMTP
    from runtime.bank import TopologyBank

# Fixed prompts (code, arithmetic, chat, a function to complete): the check needs no task data.
BUILTIN_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar note. How much change does he get?",
    "Explain in a few sentences why the sky is blue.",
    'def is_palindrome(s: str) -> bool:\n    """Return True when s reads the same backwards."""\n',
)
DEFAULT_SECONDS = 60.0
DEFAULT_NEW_TOKENS = 32  # where the bank's provenance does not say how many tokens it timed
MIN_ROUNDS, MAX_ROUNDS = 3, 12
LEVEL = 0.9  # the interval's coverage


@dataclass(frozen=True)
class Block:
    """One timed decode of the batch: new tokens of every sequence and the wall time."""

    tokens: int
    seconds: float


def paired_ratios(time_ar: Callable[[], Block], time_tree: Callable[[], Block],
                  keep_going: Callable[[list[float]], bool], min_rounds: int = MIN_ROUNDS,
                  max_rounds: int = MAX_ROUNDS) -> list[float]:
    """Rounds of blocks AR, T, T, AR; per round the tree's tok/s over AR's (each side's two blocks
    pooled). At least `min_rounds`, then more while `keep_going(ratios)`, at most `max_rounds`."""
    ratios: list[float] = []
    while len(ratios) < max_rounds and (len(ratios) < min_rounds or keep_going(ratios)):
        a1, t1, t2, a2 = time_ar(), time_tree(), time_tree(), time_ar()
        tree = (t1.tokens + t2.tokens) / (t1.seconds + t2.seconds)
        ar = (a1.tokens + a2.tokens) / (a1.seconds + a2.seconds)
        ratios.append(tree / ar)
    return ratios


def median_interval(ratios: Sequence[float], level: float = LEVEL, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    """The median of `ratios` and a percentile-bootstrap interval of it (seeded: the same ratios
    always give the same interval); with few rounds it spans their min to max."""
    if not ratios:
        raise ValueError("no ratios: time at least one round")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = int((1 - level) / 2 * resamples)
    return statistics.median(ratios), meds[tail], meds[resamples - 1 - tail]


def straddles(ratios: Sequence[float], bar: float = 1.0) -> bool:
    """Whether the interval of `ratios` still contains `bar` (the measurement decides nothing yet)."""
    _, low, high = median_interval(ratios)
    return low <= bar <= high


@dataclass(frozen=True)
class ChoiceCheck:
    """The re-timing of the bank's choice at one batch size."""

    batch_size: int
    chosen: int | None              # the bank's tree at B; None = AR
    timed: int | None               # the tree timed against AR: the choice, or for AR the bank's fastest tree
    nodes: int | None               # the timed tree's nodes
    stored: float | None            # the bank's ratio of the timed tree to AR at B (None: not recorded)
    stored_range: tuple[float, float] | None = None  # the bank's interval of it, where it timed it paired
    ratios: tuple[float, ...] = ()  # per round, here
    min_gain: float = 0.0           # the bank's rule: a tree is chosen where its interval lies above 1 + this

    @property
    def interval(self) -> tuple[float, float, float] | None:
        return median_interval(self.ratios) if self.ratios else None

    @property
    def holds(self) -> bool:
        """The bank's rule on the new measurement makes the same choice: a tree beats AR with
        confidence (interval above 1 + the bank's `min_gain`), or, for AR, the fastest tree does not."""
        if self.interval is None:
            return True  # AR with no tree timed at B: nothing could beat it
        low = self.interval[1]
        return low > 1.0 + self.min_gain if self.chosen is not None else low <= 1.0 + self.min_gain

    def line(self) -> str:
        stored = "ratio not recorded" if self.stored is None else f"{self.stored:.2f}x AR" + (
            "" if self.stored_range is None else f" [{self.stored_range[0]:.2f}, {self.stored_range[1]:.2f}]")
        if self.timed is None:
            return f"B={self.batch_size}: bank's choice AR (no tree measured at this batch size): holds"
        tree = f"tree {self.timed} ({self.nodes} nodes)"
        head = (f"B={self.batch_size}: bank's choice {tree}, stored {stored}" if self.chosen is not None
                else f"B={self.batch_size}: bank's choice AR (its fastest tree, {tree}, stored {stored})")
        med, low, high = self.interval
        here = (f"here {'' if self.chosen is not None else f'tree {self.timed} '}{med:.2f}x AR [{low:.2f}, {high:.2f}] "
                f"(median, {100 * LEVEL:.0f}% interval, {len(self.ratios)} rounds)")
        if self.holds:
            verdict = "holds"
        elif self.chosen is None:
            verdict = f"does not hold: tree {self.timed} beats AR here"
        elif med > 1.0 + self.min_gain:
            verdict = f"not confirmed: its interval reaches {1.0 + self.min_gain:.2f}x (rerun with more --seconds, or rebuild)"
        elif med > 1.0:
            verdict = f"does not hold: its gain over AR is under the bank's {100 * self.min_gain:.0f}% margin here"
        else:
            verdict = "does not hold: AR is at least as fast here"
        return f"{head}; {here}: {verdict}"


def _measured(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def paired_candidate(entry: dict[str, Any], k: int) -> dict[str, Any] | None:
    """Tree k's paired timing against batched AR in the bank's entry for one batch size (its
    "paired" record's candidate: median, low, high, rounds; `runtime.bank.PAIRED_KEY`), or None."""
    rec = entry.get("paired")
    candidates = rec.get("candidates") if isinstance(rec, dict) else None
    return next((c for c in candidates or [] if isinstance(c, dict) and c.get("tree") == k), None)


def paired_min_gain(entry: dict[str, Any]) -> float:
    """The margin over AR the bank's paired rule asked of a chosen tree at one batch size (0 for a
    bank built before it recorded one)."""
    rec = entry.get("paired")
    gain = rec.get("min_gain", 0.0) if isinstance(rec, dict) else 0.0
    return float(gain) if _measured(gain) else 0.0


def stored_ratio(bank: TopologyBank, entry: dict[str, Any], k: int) -> float | None:
    """The bank's ratio of tree k to batched AR at one batch size: the median of its paired timing
    where the bank has one, else tree k's batch tok/s over AR's (AR's from "ar_tok_per_s", else
    from the bank's root-only tree); None where neither is recorded."""
    paired = paired_candidate(entry, k)
    if paired is not None and _measured(paired.get("median")):
        return float(paired["median"])
    tps = entry["tok_per_s"][k]
    ar = entry.get("ar_tok_per_s")
    if not _measured(ar):
        ar = next((entry["tok_per_s"][j] for j, t in enumerate(bank.trees) if len(t) == 0), None)
    return tps / ar if _measured(tps) and _measured(ar) else None


def fastest_tree(bank: TopologyBank, entry: dict[str, Any]) -> int | None:
    """The bank tree (root-only excluded) with the highest stored ratio to AR in `entry`
    (`stored_ratio`), among its paired candidates where it has some; of equals, the smallest (the
    cheaper to time)."""
    trees = [k for k in range(len(bank.trees)) if len(bank.trees[k])]
    paired = [k for k in trees if paired_candidate(entry, k) is not None]
    timed = [(r, -k) for k in paired or trees if (r := stored_ratio(bank, entry, k)) is not None]
    return -max(timed)[1] if timed else None


def _new_tokens(bank: TopologyBank) -> int:
    """The tokens per decode the bank's time stage used (its recorded config), else the default."""
    timing = ((bank.provenance.get("config") or {}).get("time") or {}).get("new_tokens")
    return int(timing) if isinstance(timing, int) and timing > 0 else DEFAULT_NEW_TOKENS


def check_bank(engine: EntMTP, seconds: float = DEFAULT_SECONDS, new_tokens: int | None = None,
               prompts: Sequence[str] = BUILTIN_PROMPTS,
               report: Callable[[str], None] | None = None) -> list[ChoiceCheck]:
    """Re-time the bank's choice at each of its batch sizes on this machine (see the module
    docstring), in about `seconds` overall; `report` gets a header and each batch size's line as
    it is done."""
    bank = engine.bank
    schedule = bank.serving_schedule()
    n = new_tokens or _new_tokens(bank)
    ids = [engine.fit_context(engine.encode(p), n, truncate="left") for p in prompts]
    budget = seconds / len(schedule.choices)
    if report:
        report(f"re-timing bank {bank.path or ''} on this machine: per batch size, rounds of blocks AR, T, T, AR "
               f"({n} new tokens, {len(ids)} built-in prompts, about {seconds:.0f} s)")
    out = []
    for c in schedule.choices:
        b = c.batch_size
        entry = next(e for key, e in bank.batch_schedule.items() if int(key) == b)
        timed = c.tree_index if c.tree_index is not None else fastest_tree(bank, entry)
        paired = None if timed is None else paired_candidate(entry, timed)
        check = ChoiceCheck(b, c.tree_index, timed, None if timed is None else bank.trees[timed].num_nodes,
                            None if timed is None else stored_ratio(bank, entry, timed),
                            (paired["low"], paired["high"]) if paired is not None and _measured(paired.get("low"))
                            and _measured(paired.get("high")) else None,
                            min_gain=paired_min_gain(entry))
        if timed is not None:
            batch = [ids[i % len(ids)] for i in range(b)]

            def block(**how: Any) -> Block:
                t0 = clock(engine.model.device)
                outs = engine.generate_batch(batch, n, batch_size=b, **how)
                seconds_taken = clock(engine.model.device) - t0
                failed = [o.error for o in outs if o.error]
                if failed:
                    raise ValueError(f"the check could not decode its prompts at batch size {b}: {failed[0]}")
                return Block(sum(len(o.tokens) for o in outs), seconds_taken)

            block(ar=True), block(policy=timed)  # warm-up, untimed
            start = time.perf_counter()
            ratios = paired_ratios(lambda: block(ar=True), lambda: block(policy=timed),
                                   lambda r: time.perf_counter() - start < budget
                                   and straddles(r, 1.0 + check.min_gain))
            check = replace(check, ratios=tuple(ratios))
        if report:
            report(check.line())
        out.append(check)
    return out
