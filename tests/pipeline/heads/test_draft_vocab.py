"""Frequency-ranked draft vocabularies over a shared output layer, and cheap drafting arithmetic:
ranking, folders that round-trip, exactness at V_d = V, and decoding that stays identical to AR."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections import defaultdict

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.heads.draft_vocab import (
    FREQ_FILE, count_tokens, draft_vocab_config, draft_vocab_heads, frequency_ranking, read_frequencies,
    write_draft_vocab_heads,
)
from runtime.decoder import TreeDecoder
from runtime.ar import ar_generate
from runtime.heads import DraftHeads, HeadsConfig, choose_draft_dtype, draft_arithmetics, load_heads, save_heads
from runtime.config import ModelArgs
from runtime.fingerprint import heads_fingerprint
from runtime.heads_ref import OWN_FILE, REF_FILE
from runtime.model.llama import Transformer
from runtime.tree import Tree, TreeBuffers
from tests.helpers import REPO, tiny_transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
ARGS = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                 eos_token_ids=(VOCAB - 1,), tie_embeddings=True, max_position_embeddings=512)
TREES = [Tree.chain(4), Tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]), Tree.named("mc_sim_7b_63")]


def tiny_model(seed: int = 0) -> Transformer:
    return tiny_transformer(ARGS, seed)


def full_heads(model: Transformer, kind: str, seed: int = 1) -> DraftHeads:
    heads = DraftHeads(HeadsConfig.for_model(model.args, kind=kind, num_heads=4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():  # non-zero ResBlocks, so drafts differ from the root token
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    heads.bind(model)
    return heads.eval()


def fake_continuations(counts: dict[int, int], topk: list[tuple[int, float]]) -> list[dict[str, torch.Tensor]]:
    """`generate_batch`-shaped outputs whose tokens hold each id `counts[id]` times and whose every
    step lists the same teacher candidates `topk`."""
    tokens = torch.tensor([t for t, n in counts.items() for _ in range(n)], dtype=torch.long)
    ids = torch.tensor([[t for t, _ in topk]] * len(tokens), dtype=torch.int32)
    p = torch.tensor([[q for _, q in topk]] * len(tokens), dtype=torch.float16)
    return [{"tokens": tokens[:5], "topk_ids": ids[:5], "topk_p": p[:5]},
            {"tokens": tokens[5:], "topk_ids": ids[5:], "topk_p": p[5:]}]


def test_ranking_orders_by_emitted_count_then_candidate_mass_then_id() -> None:
    counts = {9: 5, 3: 2, 40: 2, 7: 1}
    emitted, mass = count_tokens(fake_continuations(counts, [(50, 0.6), (3, 0.3), (60, 0.1)]), VOCAB)
    assert emitted[[9, 3, 40, 7]].tolist() == [5, 2, 2, 1] and emitted.sum() == 10
    ranking = frequency_ranking(emitted, mass)
    # 3 and 40 tie on counts; 3 was also a teacher candidate. Unseen ids: candidates first, then by id
    assert ranking[:7].tolist() == [9, 3, 40, 7, 50, 60, 0]
    assert sorted(ranking.tolist()) == list(range(VOCAB))


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_draft_ids_are_the_most_frequent_ids_and_drafts_stay_inside(kind: str) -> None:
    model = tiny_model()
    counts = {int(t): int(n) for t, n in zip(torch.randperm(VOCAB)[:20], range(40, 20, -1))}
    ranking = frequency_ranking(*count_tokens(fake_continuations(counts, [(1, 1.0)]), VOCAB))
    heads = draft_vocab_heads(full_heads(model, kind), ranking, 12)
    heads.bind(model)
    most_frequent = sorted(counts, key=lambda t: -counts[t])[:12]
    assert heads.draft_ids.tolist() == most_frequent
    h = torch.randn(1, ARGS.dim)
    for tree in TREES:
        drafted = heads.propose(h, 5, TreeBuffers.compile(tree))[1:].tolist()
        assert set(drafted) <= set(most_frequent)


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_full_size_draft_vocabulary_drafts_exactly_like_the_shared_output(kind: str) -> None:
    model = tiny_model()
    shared = full_heads(model, kind)
    permuted = draft_vocab_heads(shared, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)), VOCAB)
    permuted.bind(model)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        h = torch.randn(1, ARGS.dim, generator=g)
        for tree in TREES:
            buf = TreeBuffers.compile(tree)
            assert permuted.propose(h, 11, buf).tolist() == shared.propose(h, 11, buf).tolist()
    # and the base-vocabulary logits agree (rollouts rank targets with these)
    nxt = torch.randint(0, VOCAB, (6, 4), generator=g)
    ctx = torch.randn(6, ARGS.dim, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(permuted.teacher_forced_logits(ctx, nxt), shared.teacher_forced_logits(ctx, nxt))


def test_training_uses_the_exact_product_over_the_draft_rows() -> None:
    model = tiny_model()
    heads = draft_vocab_heads(full_heads(model, "hydra"), torch.arange(VOCAB).flip(0), 10, draft_dtype="int8")
    heads.bind(model)
    states = torch.randn(3, 4, ARGS.dim)
    exact = states @ model.output.weight[heads.draft_ids].T
    with torch.enable_grad():
        torch.testing.assert_close(heads.output_logits(states), exact)
    with torch.no_grad():  # inference: the int8 product, close but not equal
        approx = heads.output_logits(states)
    assert not torch.equal(approx, exact)
    assert (approx - exact).abs().max() < 0.05 * exact.abs().max()


def write_frequencies(folder, emitted: np.ndarray) -> None:
    folder.mkdir(parents=True)
    mass = np.zeros(len(emitted))
    save_file({"emitted": torch.from_numpy(emitted), "candidate_mass": torch.from_numpy(mass),
               "ranking": torch.from_numpy(frequency_ranking(emitted, mass))}, str(folder / FREQ_FILE))
    (folder / "manifest.json").write_text(json.dumps({"key": {"split": "train"}, "summary": {"prompts": 3, "tokens": int(emitted.sum())}}))


def test_draft_vocab_heads_folder_round_trips_with_provenance(tmp_path) -> None:
    model = tiny_model()
    full = full_heads(model, "hydra")
    save_heads(full, tmp_path / "full", dtype=torch.bfloat16)
    emitted = np.zeros(VOCAB, dtype=np.int64)
    emitted[[5, 17, 33, 2]] = [10, 7, 3, 1]
    write_frequencies(tmp_path / "freq", emitted)
    out = write_draft_vocab_heads(tmp_path / "full", tmp_path / "freq", 3, tmp_path / "dv", draft_dtype="bfloat16",
                                  log=lambda _: None)
    loaded = load_heads(out, model=model)
    assert loaded.config.output == "shared" and loaded.config.draft_vocab_size == 3
    assert loaded.config.draft_dtype == "bfloat16"
    assert loaded.draft_ids.tolist() == [5, 17, 33]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["train_token_coverage"] == round(20 / 21, 4)
    assert manifest["key"]["full_heads"]["weights_sha256"] and manifest["key"]["frequencies"]["key"] == {"split": "train"}
    reference = load_heads(tmp_path / "full", model=model)  # the same (bf16-stored) ResBlocks
    got = {k: v for k, v in loaded.state_dict().items() if k != "draft_ids"}
    want = reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # up to date: a second call rebuilds nothing
    mtime = (out / OWN_FILE).stat().st_mtime_ns
    write_draft_vocab_heads(tmp_path / "full", tmp_path / "freq", 3, tmp_path / "dv", draft_dtype="bfloat16",
                            log=lambda _: None)
    assert (out / OWN_FILE).stat().st_mtime_ns == mtime


def test_draft_vocab_folder_refers_to_the_full_heads_and_follows_a_retrained_base(tmp_path) -> None:
    """No weight tensor stored twice: the folder holds its config, its draft ids and a reference to
    the full heads; it loads what a copy would hold; a retrained base is refused on load and the
    next derivation rebuilds the folder from it."""
    model = tiny_model()
    save_heads(full_heads(model, "medusa"), tmp_path / "medusa", dtype=torch.bfloat16)
    emitted = np.arange(VOCAB, dtype=np.int64)  # the highest ids most often
    write_frequencies(tmp_path / "freq", emitted)
    out = write_draft_vocab_heads(tmp_path / "medusa", tmp_path / "freq", 8, tmp_path / "medusa-draft8",
                                  log=lambda _: None)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", OWN_FILE, REF_FILE, "manifest.json"])
    assert json.loads((out / REF_FILE).read_text())["base"]["folder"] == "../medusa"
    with safe_open(str(out / OWN_FILE), framework="pt") as f:
        assert list(f.keys()) == ["draft_ids"]
    # what a self-contained copy holds, bit for bit
    copy = draft_vocab_heads(load_heads(tmp_path / "medusa"), frequency_ranking(emitted, np.zeros(VOCAB)), 8)
    got, want = load_heads(out).state_dict(), copy.state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
               for k in want)
    assert load_heads(out).draft_ids.tolist() == list(range(VOCAB - 1, VOCAB - 9, -1))
    before = heads_fingerprint(out)
    # as `heads.dir` it is project heads, used where they are
    from pipeline.heads.published.convert import import_heads

    assert import_heads(out, tmp_path / "no-model-needed", tmp_path / "unused") == out
    # the full heads retrained: the derived folder no longer loads, and deriving again rebuilds it
    save_heads(full_heads(model, "medusa", seed=2), tmp_path / "medusa", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="changed since"):
        load_heads(out)
    write_draft_vocab_heads(tmp_path / "medusa", tmp_path / "freq", 8, tmp_path / "medusa-draft8", log=lambda _: None)
    assert heads_fingerprint(out) != before
    torch.testing.assert_close(load_heads(out).heads[0].blocks[0].linear.weight,
                               load_heads(tmp_path / "medusa").heads[0].blocks[0].linear.weight, rtol=0, atol=0)


def test_loading_validates_what_it_reads(tmp_path) -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="output='shared'"):
        draft_vocab_config(HeadsConfig.for_model(model.args, output="own"), 8)
    with pytest.raises(ValueError, match="draft_dtype"):
        HeadsConfig.for_model(model.args, draft_dtype="int4")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        HeadsConfig.for_model(model.args, output="shared", draft_vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="another model"):
        write_frequencies(tmp_path / "f", np.ones(VOCAB + 3, dtype=np.int64))
        read_frequencies(tmp_path / "f", VOCAB)
    with pytest.raises(FileNotFoundError, match="pipeline.heads.draft_vocab"):
        read_frequencies(tmp_path / "missing")


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
@pytest.mark.parametrize("draft_dtype", [None, "float32", "bfloat16", "int8", "auto"])
def test_decoding_with_draft_vocab_and_cheap_arithmetic_is_identical_to_ar(kind: str, draft_dtype: str | None) -> None:
    if draft_dtype == "int8" and "int8" not in draft_arithmetics(torch.device("cpu")):
        pytest.skip("torch has no x86/fbgemm quantized engine here")
    model = tiny_model()
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))
    heads = draft_vocab_heads(full_heads(model, kind), ranking, 24, draft_dtype=draft_dtype)
    decoder = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = ar_generate(model, prompt, 40, eos_ids=())
        for k in range(len(TREES)):
            res = decoder.generate(prompt, 40, choose=k, eos_ids=())
            assert res.tokens == ref, f"tree {k}, prompt {seed}"
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0  # the drafts were sometimes right, so the comparison exercised acceptance


def test_auto_draft_dtype_picks_a_measured_arithmetic() -> None:
    choice = choose_draft_dtype(256, 32, torch.device("cpu"), torch.float32, repeats=3)
    assert choice in draft_arithmetics(torch.device("cpu"))
    assert choose_draft_dtype(256, 32, torch.device("cpu"), torch.float32) == choice  # measured once


SHIPPED_HEADS_BUDGET = 40 << 20  # bytes of artifacts/heads/ in git, every kind together (issue #51)


def test_shipped_heads_store_no_weight_twice_and_fit_the_budget() -> None:
    """The git-tracked heads: no floating-point tensor of any size worth naming is stored in two
    files (a draft-vocabulary folder refers to its full heads' weights), and they fit the budget."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "artifacts/heads"], cwd=REPO, capture_output=True,
                                check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: which heads are shipped is unknown")
    files = [REPO / f for f in listed if f and (REPO / f).is_file()]
    if not any(f.name == "heads.safetensors" for f in files):
        pytest.skip("no shipped heads in this checkout")
    total = sum(f.stat().st_size for f in files)
    assert total <= SHIPPED_HEADS_BUDGET, f"shipped heads take {total / 2**20:.1f} MiB, over the 40 MiB budget"
    where = defaultdict(list)
    for f in (f for f in files if f.suffix == ".safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118
                t = st.get_tensor(k)
                if t.is_floating_point() and t.numel() >= 1024:
                    digest = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                    where[digest].append(f"{f.relative_to(REPO)}:{k}")
    twice = [names for names in where.values() if len(names) > 1]
    assert not twice, f"tensors stored more than once: {twice[:3]}"
