"""Typical acceptance picks the step's path as the published Medusa / Hydra code does.

`medusa_choice` below restates the published `evaluate_posterior` (typical, fast=True) over the
tree's leaf paths (`retrieve_indices`, as the published code's candidates): accept lengths by
cumulative product, the longest length, and among the candidates that reach it the largest summed
log-probability of the accepted tokens. The decoder works over nodes instead; these tests check
that it lands on the same node on real verify logits of a tiny model, and on hand-made logits
where two paths accept equally far and the likelier is not the first.
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime.decoder import TreeDecoder, TypicalAcceptance, acceptance_dict, make_acceptance
from runtime.sampling import Sampler
from runtime.tree import Tree, TreeBuffers
from tests.helpers import DECODER_TREES, tiny_heads, tiny_model, tiny_pipeline_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDE = Tree([(0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (0, 0, 0), (1, 0, 0)])


def medusa_choice(buf: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor, cfg: TypicalAcceptance) -> tuple[int, int]:
    """(chosen node, accept length) by the published rule, over leaf-path candidates."""
    paths = buf.retrieve_indices.tolist()
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    entropy = -torch.sum(probs * torch.log(probs + 1e-5), dim=-1)
    threshold = torch.minimum(torch.full_like(entropy, cfg.epsilon), torch.exp(-entropy) * cfg.alpha)
    lengths, cand_probs = [], []
    for path in paths:
        nodes = [n for n in path if n >= 0]
        p = [float(probs[nodes[j - 1], tokens[nodes[j]]]) for j in range(1, len(nodes))]
        ok = [float(probs[nodes[j - 1], tokens[nodes[j]]]) > float(threshold[nodes[j - 1]]) for j in range(1, len(nodes))]
        n_ok = 0
        for flag in ok:  # cumprod(...).sum()
            if not flag:
                break
            n_ok += 1
        lengths.append(n_ok)
        cand_probs.append(p)
    accept = max(lengths)
    if accept == 0:
        return 0, 0
    best_candidates = [c for c, n in enumerate(lengths) if n == accept]
    likelihood = [sum(math.log(q) for q in cand_probs[c][:accept]) for c in best_candidates]
    best = best_candidates[max(range(len(likelihood)), key=lambda i: (likelihood[i], -i))]  # argmax: first on ties
    return paths[best][accept], accept


class RecordingDecoder(TreeDecoder):
    """A TreeDecoder that keeps every step's verify inputs and its choice."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - TreeDecoder's
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[TreeBuffers, torch.Tensor, torch.Tensor, int, int]] = []

    def _accept(self, buf, tokens, logits, sampler, first_position):  # noqa: ANN001, ANN202 - TreeDecoder's
        best, bonus = super()._accept(buf, tokens, logits, sampler, first_position)
        self.steps.append((buf, tokens.clone(), logits.clone(), int(best), int(bonus)))
        return best, bonus


@pytest.mark.parametrize("temperature", [0.7, 3.0])
def test_decoder_chooses_the_node_published_typical_acceptance_chooses(temperature: float) -> None:
    model = tiny_model(4)
    heads = tiny_heads(model, "hydra", seed=4)
    cfg = TypicalAcceptance(temperature=temperature)
    trees = [WIDE, *DECODER_TREES]
    dec = RecordingDecoder(model, heads, [TreeBuffers.compile(t) for t in trees], acceptance=cfg)
    for k in range(len(trees)):
        for prompt in ([1, 2, 3, 4], [7, 30, 11]):
            dec.generate(prompt, 40, choose=k)
    tie_breaks = 0
    for buf, tokens, logits, best, bonus in dec.steps:
        want, accept = medusa_choice(buf, tokens, logits, cfg)
        assert best == want and int(buf.depths[best]) == accept
        assert bonus == int(logits[best].argmax())  # the next root: the base argmax, not sampled
        deepest = [n for n in range(len(tokens)) if int(buf.depths[n]) == accept and _accepted(buf, tokens, logits, cfg, n)]
        tie_breaks += len(deepest) > 1 and deepest[0] != best
    # the steps included ties in length that "the first deepest node" would have decided wrongly
    assert tie_breaks > 0, "no step needed the likelihood tie-break: the test would not see a first-on-ties rule"


def _accepted(buf: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor, cfg: TypicalAcceptance, node: int) -> bool:
    """Whether every node on `node`'s path passes the typical test."""
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    entropy = -torch.sum(probs * torch.log(probs + 1e-5), dim=-1)
    threshold = torch.clamp(cfg.alpha * torch.exp(-entropy), max=cfg.epsilon)
    n = node
    while n > 0:
        parent = int(buf.parents[n])
        if not float(probs[parent, tokens[n]]) > float(threshold[parent]):
            return False
        n = parent
    return True


def _logits(rows: list[dict[int, float]], vocab: int) -> torch.Tensor:
    """Rows of logits = log-probabilities: the given tokens get their probability, the rest share what is left."""
    out = torch.empty(len(rows), vocab)
    for i, row in enumerate(rows):
        rest = (1.0 - sum(row.values())) / (vocab - len(row))
        out[i] = math.log(rest)
        for tok, p in row.items():
            out[i, tok] = math.log(p)
    return out


@pytest.mark.parametrize("likelier_first", [False, True])
def test_equal_length_paths_pick_the_likelier(likelier_first: bool) -> None:
    """Two siblings both pass the test and neither has an accepted child: the step keeps the one
    the base model finds likelier, wherever it sits in the tree."""
    model = tiny_model()
    vocab = model.args.vocab_size
    tree = Tree([(0,), (1,)])
    cfg = TypicalAcceptance(temperature=1.0, epsilon=0.09, alpha=0.3)
    dec = TreeDecoder(model, tiny_heads(model, "hydra"), [TreeBuffers.compile(tree)], acceptance=cfg)
    buf = dec.trees[0]
    a, b = 5, 9   # node 1 drafts a, node 2 drafts b; under the root, p(a) = 0.25, p(b) = 0.55
    tokens = torch.tensor([3, a, b] if not likelier_first else [3, b, a])
    logits = _logits([{a: 0.25, b: 0.55}, {11: 0.9}, {12: 0.9}], vocab)
    best, bonus = dec._accept(buf, tokens, logits, Sampler(), 0)
    likelier = 2 if not likelier_first else 1
    assert int(best) == likelier and int(bonus) == (12 if likelier == 2 else 11)
    assert medusa_choice(buf, tokens, logits, cfg) == (likelier, 1)


def test_equal_length_paths_sum_the_whole_path() -> None:
    """Depth 2 on both branches: the first branch has the likelier first token, the second the
    likelier path; the summed log-probability decides."""
    model = tiny_model()
    vocab = model.args.vocab_size
    tree = Tree([(0,), (1,), (0, 0), (1, 0)])
    cfg = TypicalAcceptance(temperature=1.0)
    dec = TreeDecoder(model, tiny_heads(model, "hydra"), [TreeBuffers.compile(tree)], acceptance=cfg)
    buf = dec.trees[0]
    order = [tuple(p) for p in tree.paths]   # node i + 1 is tree.paths[i] in the compiled order
    node = {p: i + 1 for i, p in enumerate(order)}
    tok = {(0,): 5, (1,): 6, (0, 0): 7, (1, 0): 8}
    tokens = torch.tensor([3] + [tok[p] for p in order])
    rows: list[dict[int, float]] = [{}] * len(tokens)
    rows[0] = {5: 0.5, 6: 0.4}          # first tokens: 0.5 vs 0.4
    rows[node[(0,)]] = {7: 0.3}         # path (0, 0): 0.5 * 0.3 = 0.15
    rows[node[(1,)]] = {8: 0.6}         # path (1, 0): 0.4 * 0.6 = 0.24, the likelier
    rows[node[(0, 0)]] = {20: 0.9}
    rows[node[(1, 0)]] = {21: 0.9}
    logits = _logits([r if r else {30: 0.9} for r in rows], vocab)
    best, bonus = dec._accept(buf, tokens, logits, Sampler(), 0)
    assert int(best) == node[(1, 0)] and int(bonus) == 21
    assert medusa_choice(buf, tokens, logits, cfg) == (node[(1, 0)], 2)


def test_acceptance_specs_round_trip() -> None:
    typical = make_acceptance({"kind": "typical", "temperature": 0.5, "epsilon": 0.1, "alpha": 0.2})
    assert typical == TypicalAcceptance(temperature=0.5, epsilon=0.1, alpha=0.2)
    assert make_acceptance(acceptance_dict(typical)) == typical
    assert make_acceptance(None) == make_acceptance("greedy") == make_acceptance({"kind": "exact"}) == "exact"
    assert make_acceptance("typical") == TypicalAcceptance()
    with pytest.raises(ValueError, match="choose one of exact, typical"):
        make_acceptance("nucleus")
    with pytest.raises(ValueError, match="temperature > 0"):
        make_acceptance({"kind": "typical", "temperature": 0})


# --- runtime API and command line -----------------------------------------------------------------


def test_engine_decodes_with_the_banks_acceptance_unless_told(bundle, tmp_path) -> None:  # noqa: ANN001 - fixtures
    from runtime.api import EntMTP
    from runtime.bank import TopologyBank
    from tests.helpers import copy_bundle

    exact = EntMTP.load(bundle.bank_dir)   # the tiny bank records no acceptance: exact
    assert exact.acceptance == "exact"
    ar = exact.generate_ar("Hello there", 16)
    assert exact.generate("Hello there", 16).tokens == ar.tokens
    typical = exact.generate("Hello there", 16, acceptance="typical")
    assert typical.stats["acceptance"] == {"kind": "typical", "temperature": 0.7, "epsilon": 0.09, "alpha": 0.3}
    assert typical.tokens == exact.generate("Hello there", 16, acceptance={"kind": "typical"}).tokens
    with pytest.raises(ValueError, match="typical acceptance decides with its own temperature"):
        exact.generate("Hello there", 4, acceptance="typical", temperature=0.7)

    # a bank measured under typical acceptance records it, and loads with it
    copy = copy_bundle(bundle, tmp_path / "copy")
    bank = TopologyBank.load(copy.bank_dir, force=True)
    bank.provenance["acceptance"] = {"kind": "typical", "temperature": 0.7, "epsilon": 0.09, "alpha": 0.3}
    bank.save(copy.bank_dir)
    engine = EntMTP.load(copy.bank_dir)
    assert engine.acceptance == TypicalAcceptance()
    assert engine.generate("Hello there", 16).tokens == typical.tokens
    assert EntMTP.load(copy.bank_dir, acceptance="exact").generate("Hello there", 16).tokens == ar.tokens


def test_cli_generate_with_typical_acceptance(bundle, capsys) -> None:  # noqa: ANN001 - fixtures
    import json

    from runtime.cli import main

    assert main(["generate", "--bank", str(bundle.bank_dir), "--prompt", "Hello there", "--max-new-tokens", "8",
                 "--acceptance", "typical", "--typical-temperature", "0.9", "--epsilon", "0.05", "--alpha", "0.2"]) == 0
    err = capsys.readouterr().err
    stats = json.loads(err.split("[entmtp] ", 1)[1].splitlines()[0])
    assert stats["acceptance"] == {"kind": "typical", "temperature": 0.9, "epsilon": 0.05, "alpha": 0.2}


# --- pipeline -------------------------------------------------------------------------------------


def test_config_refuses_typical_acceptance_with_sampling(bundle, tmp_path) -> None:  # noqa: ANN001 - fixtures
    from pipeline.config.validate import config_problems

    cfg = tiny_pipeline_cfg(tmp_path, tmp_path, bundle, "acceptance.kind=typical", "sampling.temperature=0.7")
    assert any("acceptance.kind=typical decides with its own temperature" in p for p in config_problems(cfg))
    cfg = tiny_pipeline_cfg(tmp_path, tmp_path, bundle, "acceptance.kind=nucleus")
    assert any("acceptance.kind='nucleus' is not valid" in p for p in config_problems(cfg))


def test_typical_bank_shares_the_rollout_and_records_its_acceptance(bundle, tmp_path) -> None:  # noqa: ANN001
    import json
    import shutil

    from pipeline import graph
    from tests.helpers import MODEL_NAME

    artifacts, data = tmp_path / "artifacts", tmp_path / "data"
    shutil.copytree(bundle.model_dir, artifacts / "models" / MODEL_NAME)
    graph.clear_memo()
    exact_bank = graph.run(tiny_pipeline_cfg(artifacts, data, bundle))
    work = artifacts / "rollouts" / MODEL_NAME / "hydra" / "humaneval" / "cpu"
    shared = {d: (work / d / "manifest.json").read_text() for d in ("rollout", "grow")}

    graph.clear_memo()
    typical_bank = graph.run(tiny_pipeline_cfg(artifacts, data, bundle, "acceptance.kind=typical"))
    tag = "typT0.7e0.09a0.3"
    assert typical_bank == exact_bank.parent / f"humaneval@{tag}"
    # rollout and grow (exact replay) are shared; recalibrate and time are measured again
    assert {d: (work / d / "manifest.json").read_text() for d in shared} == shared
    timing = json.loads((work / tag / "time" / "timing.json").read_text())
    recal = json.loads((work / tag / "recalibrate" / "recalibrate.json").read_text())
    assert timing["tokens_per_step_from"] == "recalibrate" and timing["acceptance"]["kind"] == "typical"
    real = {json.dumps(r["paths"]): r["real_tokens_per_step"] for r in recal["trees"]}
    assert all(t["tokens_per_step"] == real[json.dumps(t["paths"])] for t in timing["trees"])
    assert all(r["step_agreement"] is None for r in recal["trees"])  # no replay to agree with
    bank = json.loads((typical_bank / "bank.json").read_text())
    assert bank["provenance"]["acceptance"] == {"kind": "typical", "temperature": 0.7, "epsilon": 0.09, "alpha": 0.3}
    assert json.loads((exact_bank / "bank.json").read_text())["provenance"]["acceptance"]["kind"] == "exact"
