"""Exact replay: accept lengths, walks, policy replay and the oracle schedule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.replay.policy import BankReplay, replay_policy
from pipeline.replay.accept import (PrefixIndex, accept_lengths, prompt_replays, rank_cap_of, replay_tokens_per_step,
                                   replay_tree, step_tokens, walk)
from pipeline.replay.oracle import oracle_replay, oracle_schedule
from tests.helpers import synthetic_rollouts
from runtime.policy import (
    ExpectedThroughputPolicy,
    HysteresisPolicy,
    LadderPolicy,
    Policy,
    Scheduler,
    StaticPolicy,
)

TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
K = 4


def _brute_accept(R: np.ndarray, tree: list[tuple[int, ...]], K: int | None = None) -> list[int]:
    """Longest prefix of each row that is a node (ranks equal to K never match)."""
    nodes = set(tree)
    out = []
    for row in R.tolist():
        a = 0
        for d in range(1, len(row) + 1):
            if (K is not None and row[d - 1] >= K) or tuple(row[:d]) not in nodes:
                break
            a = d
        out.append(a)
    return out


def _simulate_decoder(R: np.ndarray, tree: list[tuple[int, ...]], K: int) -> tuple[list[int], int]:
    """A token-level decoder loop written independently of the replay: the known text grows by
    the accepted drafts + the bonus, clipped at T tokens, until T tokens are out."""
    T = len(R)
    out = [0]  # y_1 from the prefill (token values are irrelevant: positions are what count)
    steps = 0
    while len(out) < T:
        i = len(out) - 1
        accepted = _brute_accept(R[i : i + 1], tree, K)[0]
        emitted = accepted + 1
        out.extend([0] * min(emitted, T - len(out)))
        steps += 1
    return out, steps


# --------------------------------------------------------------------------- accept lengths


def test_accept_lengths_hand_example() -> None:
    R = np.array(
        [
            [0, 0, 0],  # (0,), (0,0), (0,0,0): 3
            [0, 1, 0],  # (0,), (0,1); (0,1,0) absent: 2
            [1, 0, 0],  # (1,); (1,0) absent: 1
            [2, 0, 0],  # (2,) absent: 0
            [0, 2, 0],  # (0,); (0,2) absent: 1
            [0, K, K],  # K = "not in the top K": 1
            [K, K, K],  # beyond the end: 0
        ],
        dtype=np.int16,
    )
    assert accept_lengths(R, TREE, K).tolist() == [3, 2, 1, 0, 1, 1, 0]
    assert accept_lengths(R, TREE).tolist() == [3, 2, 1, 0, 1, 1, 0]  # literal matching agrees here
    assert accept_lengths(R, []).tolist() == [0] * 7


def test_accept_lengths_rejects_bad_inputs() -> None:
    R = np.zeros((3, 2), dtype=np.int16)
    with pytest.raises(ValueError, match="rank >= rank_cap"):
        accept_lengths(R, [(0,), (4,)], rank_cap=4)
    with pytest.raises(ValueError, match="0..4"):
        accept_lengths(np.full((3, 2), 5), [(0,)], rank_cap=4)
    with pytest.raises(ValueError, match="depth 3"):
        accept_lengths(R, [(0,), (0, 0), (0, 0, 0)])
    with pytest.raises(ValueError, match="prefix-closed"):
        accept_lengths(R, [(0, 0)])
    with pytest.raises(ValueError, match="non-negative"):
        accept_lengths(R, [(-1,)])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(2, 6))
def test_accept_lengths_match_brute_force(seed: int, D: int, K: int) -> None:
    rng = np.random.default_rng(seed)
    R = rng.integers(0, K + 1, size=(40, D))
    # a random prefix-closed tree: grow by attaching random children to present nodes
    tree: set[tuple[int, ...]] = set()
    for _ in range(rng.integers(0, 15)):
        parent = list(tree | {()})[rng.integers(0, len(tree) + 1)]
        if len(parent) < D:
            tree.add(parent + (int(rng.integers(0, K)),))
    tree_l = sorted(tree)
    assert accept_lengths(R, tree_l, K).tolist() == _brute_accept(R, tree_l, K)
    idx = PrefixIndex([{"rank_paths": R[:17]}, {"rank_paths": R[17:]}], rank_cap=K)
    assert np.concatenate(idx.accept(tree_l)).tolist() == _brute_accept(R, tree_l, K)


def test_rank_cap_is_read_off_the_last_row() -> None:
    rolls = synthetic_rollouts(2, 20, 3, rank_cap=6, seed=1)
    for r in rolls:
        del r["rank_cap"]
    assert rank_cap_of(rolls) == 6
    rolls[0]["rank_paths"] = rolls[0]["rank_paths"].copy()
    rolls[0]["rank_paths"][-1, 0] = 0
    with pytest.raises(ValueError, match="cannot infer rank_cap"):
        rank_cap_of(rolls)
    with pytest.raises(ValueError, match="exceeds rank_cap"):
        rank_cap_of(rolls, 2)


# --------------------------------------------------------------------------- walks


def test_walk_hand_example() -> None:
    a = np.array([1, 0, 2, 0, 0, 0, 1])  # T = 7: visits 0 -> 2 -> 5 -> 6 (= T - 1, stop)
    v = walk(a)
    assert v.tolist() == [0, 2, 5]
    assert step_tokens(a, v).tolist() == [2, 3, 1]
    assert replay_tokens_per_step(a) == pytest.approx(6 / 3)


def test_walk_clips_the_last_step() -> None:
    a = np.array([0, 3, 0, 0, 0])  # T = 5: step at 1 accepts 3 but only y_3..y_5 remain
    v = walk(a)
    assert v.tolist() == [0, 1]
    assert step_tokens(a, v).tolist() == [1, 3]
    assert step_tokens(a, v).sum() == len(a) - 1
    assert walk(np.array([0])).tolist() == [] and walk(np.array([], dtype=int)).tolist() == []


@pytest.mark.parametrize("seed", range(5))
def test_replay_matches_an_independent_decoder_loop(seed: int) -> None:
    rolls = synthetic_rollouts(3, 50, 4, rank_cap=5, seed=seed)
    tree = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (2,)]
    steps = tokens = 0
    for r in rolls:
        out, s = _simulate_decoder(r["rank_paths"], tree, 5)
        assert len(out) == len(r["rank_paths"])
        steps += s
        tokens += len(out) - 1
        a = accept_lengths(r["rank_paths"], tree, 5)
        assert len(walk(a)) == s
        assert step_tokens(a, walk(a)).sum() == len(out) - 1
    rep = replay_tree(rolls, tree)
    assert (rep.steps, rep.tokens) == (steps, tokens)
    assert replay_tokens_per_step(rolls, tree) == pytest.approx(tokens / steps)


# --------------------------------------------------------------------------- policies


def _bank() -> list[list[tuple[int, ...]]]:
    return [
        [(0,)],
        [(0,), (1,), (0, 0)],
        [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
        [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)],
    ]


def test_static_policy_replay_equals_tree_replay() -> None:
    rolls = synthetic_rollouts(4, 60, 4, rank_cap=6, seed=3)
    bank = _bank()
    costs = [1.0, 1.2, 1.5, 2.0]
    for k, tree in enumerate(bank):
        rep = replay_policy(rolls, bank, StaticPolicy(k), costs)
        ref = replay_tree(rolls, tree)
        assert (rep.steps, rep.tokens) == (ref.steps, ref.tokens)
        assert rep.tree_steps.tolist() == [ref.steps if j == k else 0 for j in range(len(bank))]
        assert rep.time_s == pytest.approx(ref.steps * costs[k])
        assert rep.tokens_per_second == pytest.approx(ref.tokens / (ref.steps * costs[k]))


def test_per_prompt_replays_pool_to_the_tree_replay() -> None:
    rolls = synthetic_rollouts(4, 60, 4, rank_cap=6, seed=3)
    bank = _bank()
    tokens, steps = prompt_replays(rolls, bank)
    assert tokens.shape == steps.shape == (len(bank), 4)
    for k, tree in enumerate(bank):
        ref = replay_tree(rolls, tree)
        assert (int(tokens[k].sum()), int(steps[k].sum())) == (ref.tokens, ref.steps)
        assert steps[k].tolist() == [replay_tree([r], tree).steps for r in rolls]


def test_hysteresis_replay_hand_example() -> None:
    # T = 6, D = 2. small = tree 0 {(0,)}, large = tree 1 {(0,), (0,0)}.
    R = np.array([[0, 0], [0, 0], [0, 0], [0, 0], [0, 3], [3, 3]])
    p0 = np.array([0.9, 0.9, 0.2, 0.9, 0.9, 0.9])
    roll = {"rank_paths": R, "p0": p0, "head_top1": np.ones((6, 2)), "entropy": np.zeros(6), "rank_cap": 3}
    # start large at i=0 (0.9 > off): accept 2 -> i=3; s=0.9 stays large: accept min... a(3)=2 -> i=6 stop
    pol = HysteresisPolicy(tau_on=0.5, tau_off=0.3, small=0, large=1, signal="p0")
    rep = replay_policy(roll, [[(0,)], [(0,), (0, 0)]], pol)
    assert rep.visited[0].tolist() == [0, 3] and rep.choices[0].tolist() == [1, 1]
    # start small: i=0 s=0.9 > 0.5 -> large, accept 2 -> i=3 -> large again
    roll["p0"] = np.array([0.4, 0.9, 0.2, 0.4, 0.9, 0.9])
    rep = replay_policy(roll, [[(0,)], [(0,), (0, 0)]], HysteresisPolicy(0.5, 0.3, 0, 1, "p0", start="small"))
    # i=0: 0.4 not > 0.5 -> small, a=1 -> i=2: 0.2 <= 0.3 stays small, a=1 -> i=4: 0.9 -> large, a=1 (R[4]=(0,3)) -> i=6
    assert rep.visited[0].tolist() == [0, 2, 4] and rep.choices[0].tolist() == [0, 0, 1]
    assert rep.tokens == 5 and rep.tokens_per_step == pytest.approx(5 / 3)


@pytest.mark.parametrize("seed", range(3))
def test_fast_paths_equal_the_exact_loop(seed: int) -> None:
    rolls = synthetic_rollouts(5, 70, 4, rank_cap=6, seed=seed)
    bank = _bank()
    costs = [1.0, 1.1, 1.3, 1.7]
    data = BankReplay.build(rolls, bank)
    policies = [
        StaticPolicy(2),
        LadderPolicy([0.3, 0.6, 0.8], signal="paper"),
        LadderPolicy([0.01, 0.1], trees=[0, 2, 3], signal="greedy_path"),
        HysteresisPolicy(0.6, 0.4, 1, 3, signal="p0"),
        HysteresisPolicy(0.05, 0.02, 0, 2, signal="greedy_path", start="small"),
        HysteresisPolicy(2.5, 2.0, 0, 3, signal="accept_ema"),
        ExpectedThroughputPolicy([0.4, 0.7], [[1, 1.2, 1.3, 1.3], [1, 2, 2.5, 2.6], [1, 2.5, 3.5, 4.5]], costs, signal="entropy_ema"),
        ExpectedThroughputPolicy([0.5], [[1, 1.5, 1.6, 1.6], [1, 2, 2.5, 3.6]], costs, signal="paper"),
    ]
    for pol in policies:
        fast = replay_policy(data, None, pol, costs)
        exact = replay_policy(data, None, pol, costs, exact_loop=True)
        assert fast.steps == exact.steps
        for a, b in zip(fast.choices, exact.choices):
            assert a.tolist() == b.tolist()
        assert fast.time_s == pytest.approx(exact.time_s)


def test_replay_policy_errors() -> None:
    rolls = synthetic_rollouts(2, 30, 3, rank_cap=5, seed=0)
    bank = _bank()[:3]
    with pytest.raises(ValueError, match="only 3 trees"):
        replay_policy(rolls, bank, StaticPolicy(3))
    with pytest.raises(ValueError, match="positive"):
        replay_policy(rolls, bank, StaticPolicy(0), [1.0, 0.0, 1.0])
    no_signal = [{"rank_paths": r["rank_paths"]} for r in rolls]
    with pytest.raises(ValueError, match="needs 'p0'"):
        replay_policy(no_signal, bank, LadderPolicy([0.5], [0, 1], signal="p0"))
    assert replay_policy(no_signal, bank, StaticPolicy(1)).steps > 0  # static needs no signal


# --------------------------------------------------------------------------- oracle


def _brute_oracle(acc: np.ndarray, costs: list[float]) -> float:
    """Every sequence of per-step choices, enumerated without memoisation."""
    T = acc.shape[1]
    best = float("inf")

    def go(i: int, t: float) -> None:
        nonlocal best
        if i >= T - 1:
            best = min(best, t)
            return
        for k in range(len(costs)):
            go(i + int(acc[k, i]) + 1, t + costs[k])

    go(0, 0.0)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_oracle_equals_brute_force_on_tiny_cases(seed: int) -> None:
    rng = np.random.default_rng(seed)
    T = 9
    acc = np.sort(rng.integers(0, 4, size=(3, T)), axis=0)  # bigger trees accept at least as much
    acc = np.minimum(acc, T - 1 - np.arange(T))  # the convention: nothing accepted past the end
    costs = [1.0, 1.4, 2.1]
    t, schedule = oracle_schedule(acc, costs)
    assert t == pytest.approx(_brute_oracle(acc, costs))
    # the returned schedule realises that time
    i, total = 0, 0.0
    for k in schedule.tolist():
        total += costs[k]
        i += int(acc[k, i]) + 1
    assert i >= T - 1 and total == pytest.approx(t)


def test_oracle_beats_every_static_tree_and_random_policy() -> None:
    rolls = synthetic_rollouts(6, 80, 4, rank_cap=6, seed=11)
    bank = _bank()
    costs = [1.0, 1.15, 1.4, 1.9]
    data = BankReplay.build(rolls, bank)
    orc = oracle_replay(data, None, costs)
    for k in range(len(bank)):
        rep = replay_policy(data, None, StaticPolicy(k), costs)
        assert orc.time_s <= rep.time_s + 1e-9
        assert orc.tokens_per_second >= rep.tokens_per_second - 1e-9

    class RandomPolicy(Policy):  # a policy with arbitrary per-step choices
        kind = "random"

        def __init__(self, seed: int) -> None:
            super().__init__("none", None)
            self.rng = np.random.default_rng(seed)

        def choose(self, signal: float) -> int:
            return int(self.rng.integers(0, len(bank)))

        def indices(self) -> list[int]:
            return list(range(len(bank)))

    for s in range(5):
        rep = replay_policy(data, None, Scheduler(RandomPolicy(s)), costs, exact_loop=True)
        assert orc.time_s <= rep.time_s + 1e-9
    assert orc.tokens == data.tokens and orc.steps == sum(len(c) for c in orc.choices)
