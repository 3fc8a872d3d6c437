"""Heads folders that refer to another folder's weights (`runtime.heads_ref`, written by
`save_heads(weights_from=...)`): they hold no copy of a weight tensor, load the same heads bit for
bit as the self-contained folder, fingerprint the same, refuse a missing or changed base with a
message that says what to do, and work behind a bank (`EntMTP.load`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runtime.config import ModelArgs
from runtime.fingerprint import files_fingerprint, heads_fingerprint
from runtime.heads import DraftHeads, HeadsConfig, load_heads, save_heads
from runtime.heads_ref import OWN_FILE, REF_FILE, canonical_safetensors, read_weights_ref
from tests.helpers import TinyBundle, copy_bundle, tiny_transformer
from tests.helpers.bundle import make_tiny_bank

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
ARGS = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                 eos_token_ids=(VOCAB - 1,), tie_embeddings=True, max_position_embeddings=512)


def random_heads(config: HeadsConfig, seed: int) -> DraftHeads:
    heads = DraftHeads(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return heads.eval()


def with_draft_vocab(full: DraftHeads, ids: torch.Tensor) -> DraftHeads:
    """`full`'s weights over the draft vocabulary `ids` (what pipeline.heads.draft_vocab derives)."""
    config = HeadsConfig.from_dict({**full.config.to_dict(), "draft_vocab_size": len(ids)})
    heads = DraftHeads(config).to(full.dtype)
    heads.load_state_dict({**full.state_dict(), "draft_ids": ids}, strict=True)
    return heads.eval()


def derived_pair(root: Path, kind: str = "hydra", prefix: bool = True, seed: int = 1) -> tuple[Path, Path, Path]:
    """(full, self-contained draft-vocabulary copy, referring draft-vocabulary folder) under `root`."""
    config = HeadsConfig.for_model(ARGS, kind=kind, num_heads=3, prefix_layer=prefix, base_fingerprint="abc")
    full = random_heads(config, seed)
    save_heads(full, root / "full", dtype=torch.bfloat16)
    full = load_heads(root / "full")  # as the pipeline derives them: from the stored (bf16) weights
    draft = with_draft_vocab(full, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:10])
    save_heads(draft, root / "copy", dtype=torch.bfloat16)
    save_heads(draft, root / "dv", dtype=torch.bfloat16, weights_from=root / "full")
    return root / "full", root / "copy", root / "dv"


def self_contained_fingerprint(folder: Path, scratch: Path) -> str:
    """`heads_fingerprint` of a self-contained folder whose weights file had its header in the
    canonical order (safetensors writes the metadata entries in hash order: either may be on disk)."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "heads.safetensors").write_bytes(canonical_safetensors((folder / "heads.safetensors").read_bytes()))
    return files_fingerprint([scratch / "heads.safetensors"], cache=None)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("kind", "prefix"), [("hydra", True), ("medusa", False)])
def test_referring_folder_loads_the_same_heads_bit_for_bit_and_stores_no_weight(tmp_path: Path, kind: str,
                                                                                prefix: bool) -> None:
    full_dir, copy_dir, dv = derived_pair(tmp_path, kind, prefix)
    assert sorted(p.name for p in dv.iterdir()) == sorted(["config.json", OWN_FILE, REF_FILE])
    assert (dv / "config.json").read_bytes() == (copy_dir / "config.json").read_bytes()
    # only what is new is stored: the draft ids, none of the base's tensors
    own = tensors(dv / OWN_FILE)
    assert list(own) == ["draft_ids"]
    assert not set(own) & set(tensors(full_dir / "heads.safetensors"))
    assert (dv / OWN_FILE).stat().st_size < (copy_dir / "heads.safetensors").stat().st_size / 20
    ref = json.loads((dv / REF_FILE).read_text())
    assert ref["base"]["folder"] == os.path.join("..", "full")

    model = tiny_transformer(ARGS)
    for dtype in (None, torch.float32):
        got, want = load_heads(dv, dtype=dtype), load_heads(copy_dir, dtype=dtype)
        assert got.config == want.config
        gs, ws = got.state_dict(), want.state_dict()
        assert gs.keys() == ws.keys()
        for k in ws:
            assert gs[k].dtype == ws[k].dtype and torch.equal(gs[k].view(torch.uint8), ws[k].view(torch.uint8)), k
    bound = load_heads(dv, model=model, base_fingerprint="abc")
    assert bound.is_bound and bound.draft_ids.tolist() == load_heads(copy_dir).draft_ids.tolist()
    # the identity of the heads is their content: the fingerprint of the self-contained copy
    assert heads_fingerprint(dv) == read_weights_ref(dv).fingerprint
    assert heads_fingerprint(dv) == self_contained_fingerprint(copy_dir, tmp_path / "canon")
    assert heads_fingerprint(dv) != heads_fingerprint(full_dir)


def test_a_missing_or_changed_base_is_refused_with_what_to_do(tmp_path: Path) -> None:
    full_dir, _, dv = derived_pair(tmp_path)
    # moved without its base
    moved = tmp_path / "elsewhere" / "dv"
    shutil.copytree(dv, moved)
    for read in (load_heads, heads_fingerprint):
        with pytest.raises(FileNotFoundError, match=r"does not exist.*restore the base folder '\.\./full'.*rebuild"):
            read(moved)
    # the base retrained: other weights under the same name
    config = load_heads(full_dir).config
    save_heads(random_heads(config, seed=7), full_dir, dtype=torch.bfloat16)
    for read in (load_heads, heads_fingerprint):
        with pytest.raises(ValueError, match=r"changed since .* was written.*restore.*or rebuild"):
            read(dv)


def test_edited_or_ambiguous_folders_are_refused(tmp_path: Path) -> None:
    full_dir, copy_dir, dv = derived_pair(tmp_path)
    own = tensors(dv / OWN_FILE)
    own["draft_ids"] = own["draft_ids"].flip(0)
    from safetensors.torch import save_file

    save_file(own, str(dv / OWN_FILE))
    with pytest.raises(ValueError, match="differs from what weights_from.json recorded"):
        load_heads(dv)
    _, _, dv2 = derived_pair(tmp_path / "b")
    shutil.copy(copy_dir / "heads.safetensors", dv2 / "heads.safetensors")
    with pytest.raises(ValueError, match="holds both heads.safetensors and weights_from.json"):
        load_heads(dv2)


def test_heads_refer_only_to_the_weights_they_hold(tmp_path: Path) -> None:
    full_dir, _, _ = derived_pair(tmp_path)
    other = with_draft_vocab(random_heads(load_heads(full_dir).config, seed=9), torch.arange(10))
    with pytest.raises(ValueError, match="differs from the one in"):
        save_heads(other, tmp_path / "x", dtype=torch.bfloat16, weights_from=full_dir)
    with pytest.raises(FileNotFoundError, match="holds its own heads.safetensors"):
        save_heads(other, tmp_path / "y", weights_from=tmp_path / "nowhere")


def test_saving_over_a_folder_replaces_the_other_layout(tmp_path: Path) -> None:
    full_dir, copy_dir, dv = derived_pair(tmp_path)
    heads = load_heads(copy_dir)
    save_heads(heads, dv, dtype=torch.bfloat16)  # self-contained over a referring folder
    assert sorted(p.name for p in dv.iterdir()) == ["config.json", "heads.safetensors"]
    save_heads(heads, dv, dtype=torch.bfloat16, weights_from=full_dir)  # and back
    assert sorted(p.name for p in dv.iterdir()) == sorted(["config.json", OWN_FILE, REF_FILE])
    assert heads_fingerprint(dv) == self_contained_fingerprint(copy_dir, tmp_path / "canon")


def test_the_recorded_fingerprint_does_not_depend_on_the_header_order_of_a_save(tmp_path: Path) -> None:
    """safetensors writes metadata entries in hash-map order, so saves of the same tensors differ in
    their header; the canonical bytes, and so a referring folder's fingerprint, do not."""
    full_dir, copy_dir, _ = derived_pair(tmp_path)
    heads = load_heads(copy_dir)
    files, prints = set(), set()
    for k in range(8):
        save_heads(heads, tmp_path / f"c{k}", dtype=torch.bfloat16)
        files.add((tmp_path / f"c{k}" / "heads.safetensors").read_bytes())
        save_heads(heads, tmp_path / f"r{k}", dtype=torch.bfloat16, weights_from=full_dir)
        prints.add(heads_fingerprint(tmp_path / f"r{k}"))
    assert len({canonical_safetensors(raw) for raw in files}) == 1
    assert len(prints) == 1
    canon = canonical_safetensors(next(iter(files)))
    assert canon.index(b'"format":"pt"') < canon.index(b'"entmtp":')
    assert tensors(copy_dir / "heads.safetensors").keys() == tensors(tmp_path / "c0" / "heads.safetensors").keys()


def test_a_bank_over_a_referring_heads_folder_loads_and_decodes_losslessly(bundle: TinyBundle, tmp_path: Path) -> None:
    from runtime.api import EntMTP

    b = copy_bundle(bundle, tmp_path / "b")
    full = load_heads(b.heads_dir)
    dv_dir = b.heads_dir.parent / "hydra-draft4096"
    ids = torch.randperm(full.config.vocab_size, generator=torch.Generator().manual_seed(0))[:4096]
    save_heads(with_draft_vocab(full, ids), dv_dir, weights_from=b.heads_dir)
    assert not (dv_dir / "heads.safetensors").exists()
    bank_dir = make_tiny_bank(b.root / "banks" / "tiny-llama" / "hydra-draft4096" / "tiny", b.model_dir, dv_dir)
    engine = EntMTP.load(bank_dir)  # the bank names the referring folder; it finds its base, fingerprints match
    assert torch.equal(engine.heads.draft_ids.cpu(), ids)
    ids_in = [5, 6, 7, 8]
    assert engine.generate(ids_in, 8, policy="2").tokens == engine.generate_ar(ids_in, 8).tokens
