"""TopologyBank save/load: round trip, and every way a bank folder can be wrong is refused by name.

Each test builds a real small bank (chains and Medusa's mc_sim_7b_63, fake figures) in tmp_path
and damages it. Damage that a seal would catch anyway is also "re-sealed" (as a buggy writer
would) to check that the content checks behind the seals hold on their own.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import bank as bank_mod
from runtime.bank import BANK_JSON, BUFFERS, SCHEMA_VERSION, BankError, BankFingerprintWarning, TopologyBank
from runtime.tree import Tree, TreeBuffers
from tests.helpers import HEADS_FP, MODEL_FP, make_bank, reseal

def edit_json(folder: Path, edit, sealed: bool = True) -> None:
    doc = json.loads((folder / BANK_JSON).read_text())
    edit(doc)
    (folder / BANK_JSON).write_text(json.dumps(doc))
    if sealed:
        reseal(folder)


def edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / BUFFERS))
    edit(tensors)
    save_file(tensors, str(folder / BUFFERS))
    reseal(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bank") / "good"
    make_bank().save(folder)
    return folder


@pytest.fixture
def bank_dir(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good bank, free to damage."""
    folder = tmp_path / "bank"
    folder.mkdir()
    for name in (BANK_JSON, BUFFERS):
        (folder / name).write_bytes((saved / name).read_bytes())
    return folder


def refused(folder: Path, *fragments: str, **kwargs: Any) -> str:
    with pytest.raises(BankError) as info:
        TopologyBank.load(folder, **kwargs)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"expected {fragment!r} in the message: {msg}"
    return msg


# ------------------------------------------------------------------------------- round trip


def test_round_trip_keeps_everything(bank_dir: Path) -> None:
    original = make_bank()
    loaded = TopologyBank.load(bank_dir, model_fingerprint=MODEL_FP, heads_fingerprint=HEADS_FP, max_depth=4)
    assert loaded.trees == original.trees
    assert loaded.figures == original.figures
    assert loaded.best_static == original.best_static
    assert loaded.policies == original.policies
    assert loaded.default_policy == "hysteresis"
    assert loaded.oracle == original.oracle and loaded.provenance == original.provenance
    assert loaded.path == bank_dir
    for mine, theirs in zip(loaded.buffers, original.buffers):
        for key, t in mine.to_tensors().items():
            assert torch.equal(t, theirs.to_tensors()[key]), key
    assert "[3] nodes= 64" in loaded.summary()


def test_save_is_deterministic_and_load_save_is_identity(bank_dir: Path, tmp_path: Path) -> None:
    TopologyBank.load(bank_dir).save(tmp_path / "again")
    make_bank().save(tmp_path / "fresh")
    for name in (BANK_JSON, BUFFERS):
        assert (tmp_path / "again" / name).read_bytes() == (bank_dir / name).read_bytes()
        assert (tmp_path / "fresh" / name).read_bytes() == (bank_dir / name).read_bytes()


def test_numpy_figures_are_saved_as_numbers(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    b = make_bank()
    b.figures[0]["tok_per_s"] = np.float32(71.5)
    b.figures[0]["step_ms"] = torch.tensor(20.0)
    b.save(tmp_path / "b")
    fig = TopologyBank.load(tmp_path / "b").figures[0]
    assert fig["tok_per_s"] == 71.5 and fig["step_ms"] == 20.0


def test_load_without_expectations_accepts_any_fingerprint(bank_dir: Path) -> None:
    assert len(TopologyBank.load(bank_dir).trees) == 4


# ------------------------------------------------------------------------------- files and seals


def test_missing_folder_and_files(bank_dir: Path, tmp_path: Path) -> None:
    refused(tmp_path / "nowhere", "does not exist")
    (bank_dir / BUFFERS).unlink()
    refused(bank_dir, f"has no {BUFFERS}")
    (bank_dir / BANK_JSON).unlink()
    refused(bank_dir, f"has no {BANK_JSON}")


@pytest.mark.parametrize("content, fragment", [
    (b"{\"schema_version\": 2, ", "is not valid JSON"),
    (b"\xff\xfe garbage", "is not valid JSON"),
    (b"[1, 2, 3]", "must hold a JSON object"),
    (b"[" * 100_000, "is not valid JSON"),
])
def test_bank_json_that_does_not_parse(bank_dir: Path, content: bytes, fragment: str) -> None:
    (bank_dir / BANK_JSON).write_bytes(content)
    refused(bank_dir, fragment)


@pytest.mark.parametrize("version, fragments", [
    (SCHEMA_VERSION - 1, ("older EntMTP", f"this runtime reads {SCHEMA_VERSION}")),
    (SCHEMA_VERSION + 1, ("newer EntMTP", f"this runtime reads {SCHEMA_VERSION}")),
    ("2", ("no valid schema_version",)),
    (True, ("no valid schema_version",)),
    (None, ("no valid schema_version",)),
])
def test_wrong_schema_version(bank_dir: Path, version: Any, fragments: tuple[str, ...]) -> None:
    edit_json(bank_dir, lambda d: d.__setitem__("schema_version", version))
    refused(bank_dir, *fragments)


def test_hand_edited_json_is_refused_by_its_checksum(bank_dir: Path) -> None:
    edit_json(bank_dir, lambda d: d["trees"][0].__setitem__("tok_per_s", 1e6), sealed=False)
    refused(bank_dir, "does not match its checksum", "save it")
    reseal(bank_dir)  # the same edit done through a writer that seals is a valid bank
    assert TopologyBank.load(bank_dir).figures[0]["tok_per_s"] == 1e6


def test_truncated_buffers(bank_dir: Path) -> None:
    data = (bank_dir / BUFFERS).read_bytes()
    (bank_dir / BUFFERS).write_bytes(data[: len(data) // 2])
    refused(bank_dir, "is truncated", f"of {len(data)} bytes", "copy the bank folder again")


def test_damaged_buffers_same_size(bank_dir: Path) -> None:
    data = bytearray((bank_dir / BUFFERS).read_bytes())
    data[-1] ^= 0x01
    (bank_dir / BUFFERS).write_bytes(bytes(data))
    refused(bank_dir, f"{BUFFERS} does not belong", "damaged or comes from another build")


def test_buffers_of_another_build(bank_dir: Path, tmp_path: Path) -> None:
    make_bank([Tree.chain(1), Tree.chain(3)]).save(tmp_path / "other")
    (bank_dir / BUFFERS).write_bytes((tmp_path / "other" / BUFFERS).read_bytes())
    refused(bank_dir, "does not belong")


def test_interrupted_save_between_the_two_files_is_detected(bank_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes = []
    real = bank_mod.atomic_write_bytes

    def write_then_die(path: Path, data: bytes) -> None:
        if writes:
            raise KeyboardInterrupt  # stopped after the tensors, before bank.json
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(bank_mod, "atomic_write_bytes", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        make_bank([Tree.chain(1), Tree.chain(2)]).save(bank_dir)
    assert writes == [bank_dir / BUFFERS]
    refused(bank_dir, "does not belong")
    assert not [p for p in bank_dir.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_unparseable_buffers_with_a_matching_seal(bank_dir: Path) -> None:
    (bank_dir / BUFFERS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}...")
    reseal(bank_dir)
    refused(bank_dir, "cannot be parsed")


# ------------------------------------------------------------------------------- tensors


def test_tensor_of_wrong_dtype(bank_dir: Path) -> None:
    edit_tensors(bank_dir, lambda t: t.__setitem__("tree1.depths", t["tree1.depths"].to(torch.int32)))
    refused(bank_dir, "buffers of tree 1 are invalid", "dtype torch.int32", "expected torch.int64")


def test_tensor_of_wrong_shape(bank_dir: Path) -> None:
    edit_tensors(bank_dir, lambda t: t.__setitem__("tree3.attn_mask", t["tree3.attn_mask"][:, :-1].contiguous()))
    refused(bank_dir, "buffers of tree 3 are invalid", "has shape (64, 63)")


def test_missing_tensor(bank_dir: Path) -> None:
    edit_tensors(bank_dir, lambda t: t.pop("tree2.retrieve_indices"))
    refused(bank_dir, "buffers of tree 2 are invalid", "missing tensor 'tree2.retrieve_indices'")


def test_tensor_values_inconsistent_with_the_tree(bank_dir: Path) -> None:
    def damage(t: dict[str, torch.Tensor]) -> None:
        mask = t["tree3.attn_mask"].clone()
        mask[5, 1] = ~mask[5, 1]  # one attention bit: would silently change what node 5 sees
        t["tree3.attn_mask"] = mask

    edit_tensors(bank_dir, damage)
    refused(bank_dir, "buffers of tree 3 are invalid", "attn_mask is inconsistent")


def test_bool_tensor_with_a_byte_other_than_0_or_1(bank_dir: Path) -> None:
    def damage(t: dict[str, torch.Tensor]) -> None:
        raw = t["tree2.attn_mask"].view(torch.uint8).clone()
        raw[raw == 1] = 9  # still "True" for torch.equal, so only a byte-level check sees it
        t["tree2.attn_mask"] = raw.view(torch.bool)

    edit_tensors(bank_dir, damage)
    refused(bank_dir, "bool tensor 'tree2.attn_mask' holds bytes other than 0 and 1")


def test_buffers_of_another_tree(bank_dir: Path) -> None:
    other = TreeBuffers.compile(Tree([[0], [1]])).to_tensors(prefix="tree1.")  # same size as chain(2)
    edit_tensors(bank_dir, lambda t: t.update(other))
    refused(bank_dir, "buffers of tree 1 describe another tree")


def test_tensors_of_no_listed_tree(bank_dir: Path) -> None:
    extra = TreeBuffers.compile(Tree.chain(1)).to_tensors(prefix="tree4.")
    edit_tensors(bank_dir, lambda t: t.update(extra))
    refused(bank_dir, "holds tensors of no listed tree", "tree4.")


# ------------------------------------------------------------------------------- trees, figures, policies


@pytest.mark.parametrize("paths, fragment", [
    ([[0], [2]], "children of the root must have ranks 0..n-1"),
    ([[0], [0, 0, 0]], "lacks its prefix"),
    ([[0], [0]], "listed twice"),
    ([[0], [-1]], "negative rank"),
    ([[0], ["1"]], "ranks must be ints"),
    ("[[0]]", "a tree is an iterable of paths"),
])
def test_tree_that_breaks_the_invariants(bank_dir: Path, paths: Any, fragment: str) -> None:
    edit_json(bank_dir, lambda d: d["trees"][1].__setitem__("paths", paths))
    refused(bank_dir, "tree 1 breaks the tree rules", fragment)


def test_trees_out_of_size_order(bank_dir: Path) -> None:
    def swap(d: dict) -> None:
        d["trees"][1], d["trees"][2] = d["trees"][2], d["trees"][1]

    edit_json(bank_dir, swap)
    refused(bank_dir, "ordered by size")


def test_depth_larger_than_the_heads(bank_dir: Path) -> None:
    refused(bank_dir, "tree 2 has depth 4 but the heads draft only 3 tokens", max_depth=3)
    assert TopologyBank.load(bank_dir, max_depth=4).max_depth == 4
    with pytest.raises(ValueError, match="max_depth must be"):
        TopologyBank.load(bank_dir, max_depth=-1)


@pytest.mark.parametrize("key, value, fragment", [
    ("nodes", 7, "records nodes=7 but its paths give 3"),
    ("step_ms", -1.0, "step_ms=-1.0"),
    ("tokens_per_step", 0.5, "tokens_per_step=0.5"),
    ("tok_per_s", "fast", "tok_per_s='fast'"),
    ("step_agreement", 1.5, "step_agreement=1.5"),
    ("tok_per_s", float("nan"), "tok_per_s=nan"),
])
def test_bad_figures(bank_dir: Path, key: str, value: Any, fragment: str) -> None:
    edit_json(bank_dir, lambda d: d["trees"][1].__setitem__(key, value))
    refused(bank_dir, "tree 1", fragment)


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.__setitem__("best_static", 4), "best_static=4 is not a tree index"),
    (lambda d: d.__setitem__("best_static", True), "best_static=True"),
    (lambda d: d.__setitem__("default_policy", "oracle"), "default_policy 'oracle' is not among"),
    (lambda d: d["policies"]["static"].__setitem__("index", 9), "policy 'static' is not usable"),
    (lambda d: d["policies"]["hysteresis"].__setitem__("tau_off", 0.9), "policy 'hysteresis' is not usable"),
    (lambda d: d["policies"].__setitem__("x", {"kind": "magic"}), "policy 'x' is not usable"),
    (lambda d: d.__setitem__("policies", []), "'policies' must be a JSON object"),
    (lambda d: d.__setitem__("trees", []), "'trees' must be a non-empty list"),
    (lambda d: d["trees"].__setitem__(0, {"nodes": 2}), "tree 0 must be an object with 'paths'"),
])
def test_bad_bank_fields(bank_dir: Path, edit, fragment: str) -> None:
    edit_json(bank_dir, edit)
    refused(bank_dir, fragment)


def test_missing_buffers_seal(bank_dir: Path) -> None:
    def drop_seal(d: dict) -> None:
        d.pop("buffers_sha256")
        d["doc_sha256"] = bank_mod._doc_checksum(d)

    edit_json(bank_dir, drop_seal, sealed=False)
    refused(bank_dir, "buffers_sha256/buffers_bytes are missing")


def test_save_refuses_what_load_would_refuse(tmp_path: Path) -> None:
    b = make_bank()
    b.policies["static"]["index"] = 7
    with pytest.raises(BankError, match="policy 'static' is not usable"):
        b.save(tmp_path / "b")
    b = make_bank()
    b.figures[0]["nodes"] = 99
    with pytest.raises(BankError, match="records nodes=99"):
        b.save(tmp_path / "b")
    assert not (tmp_path / "b").exists(), "a refused bank must not leave files behind"


# ------------------------------------------------------------------------------- fingerprints


@pytest.mark.parametrize("what", ["model", "heads"])
def test_fingerprint_mismatch_refused_and_force_warns(bank_dir: Path, what: str) -> None:
    kwargs = {"model_fingerprint": MODEL_FP, "heads_fingerprint": HEADS_FP, f"{what}_fingerprint": "other"}
    refused(bank_dir, f"built for {what} weights with fingerprint", "'other'", "force=True", **kwargs)
    with pytest.warns(BankFingerprintWarning, match=f"built for {what} weights"):
        loaded = TopologyBank.load(bank_dir, force=True, **kwargs)
    assert loaded.trees == make_bank().trees


def test_force_only_downgrades_the_fingerprint_check(bank_dir: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BankFingerprintWarning)
        refused(bank_dir, "tree 2 has depth 4", model_fingerprint="other", max_depth=3, force=True)
        (bank_dir / BUFFERS).unlink()
        refused(bank_dir, f"has no {BUFFERS}", model_fingerprint="other", force=True)


def test_bank_without_fingerprint_is_refused_when_one_is_expected(bank_dir: Path) -> None:
    edit_json(bank_dir, lambda d: d["provenance"].pop("heads_fingerprint"))
    refused(bank_dir, "built for heads weights with fingerprint None", heads_fingerprint=HEADS_FP)
