"""The tiny bundle on disk, for tests that use EntMTP "from outside": a tiny but real model
folder, draft heads and a TopologyBank, laid out the way the pipeline lays out `artifacts/`.

    root/models/tiny-llama/                  config.json (transformers' LlamaConfig), model.safetensors,
                                             SmolLM2's tokenizer.json + chat template
    root/heads/tiny-llama/hydra/             config.json + heads.safetensors (runtime.heads.save_heads)
    root/banks/tiny-llama/hydra/tiny/        bank.json + buffers.safetensors (TopologyBank.save)

The model has SmolLM2's vocabulary (49152) so that the real tokenizer and chat template work, but
a hidden size of 64 and 2 layers, so that decoding a few tokens costs milliseconds. The heads get
random ResBlock weights (a fresh ResBlock is its residual map, which would make every head
predict the root token again), so drafts vary and are sometimes, not always, accepted.

`tiny_bundle(tmp_path_factory, tokenizer_dir)` builds everything once per test process; the
pipeline config sized for it is `tiny_pipeline_cfg`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.bank import TopologyBank
from runtime.fingerprint import heads_fingerprint, weights_fingerprint
from runtime.machine import cpu_name_and_flags
from runtime.tree import Tree
from tests.helpers.banks import BANK_TREES, BEST_STATIC, batch_one_record, fake_figures, tiny_policies
from tests.helpers.env import REPO, torch_threads

# Everything of a model folder a tokenizer / chat template reader may look at (weights excluded).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

MODEL_NAME = "tiny-llama"
HEADS_NAME = "hydra"
TASK_NAME = "tiny"
NUM_HEADS = 4



@dataclass(frozen=True)
class TinyBundle:
    root: Path
    model_dir: Path
    heads_dir: Path
    bank_dir: Path



def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer and chat template of model folder `src` into `dst`."""
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json to copy")
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def make_tiny_model(folder: Path, tokenizer_dir: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """A random Llama model saved by transformers (config.json + model.safetensors), with the
    tokenizer files of `tokenizer_dir` (which sets the vocabulary size)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"] \
        if (tokenizer_dir / "config.json").is_file() else 49152
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5,
        # wider than the default 0.02, so logits are not nearly uniform (fewer near-ties in argmax)
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)  # safetensors; the tied lm_head is not stored
    # transformers writes a generation_config.json; keep it (the runtime reads its eos ids)
    copy_tokenizer_files(tokenizer_dir, folder)
    return folder


def make_tiny_heads(model_dir: Path, folder: Path, seed: int = 1, kind: str = "hydra", num_heads: int = NUM_HEADS,
                    prefix_layer: bool = True, block_scale: float = 0.5) -> Path:
    """Random Hydra(++) heads for the model in `model_dir`, saved with `save_heads`."""
    from runtime.heads import DraftHeads, HeadsConfig, save_heads
    from runtime.model.checkpoint import load_model

    model = load_model(model_dir, max_seq_len=64)
    config = HeadsConfig.for_model(model.args, kind=kind, num_heads=num_heads, prefix_layer=prefix_layer,
                                   base_fingerprint=weights_fingerprint(model_dir))
    torch.manual_seed(seed)
    heads = DraftHeads(config)
    with torch.no_grad():
        for head in heads.heads:
            for block in head.blocks:
                fan_in = block.linear.in_features
                block.linear.weight.normal_(0.0, block_scale / fan_in**0.5)
                block.linear.bias.normal_(0.0, 0.1 * block_scale)
    return save_heads(heads, folder)


def make_tiny_bank(folder: Path, model_dir: Path, heads_dir: Path, trees: tuple[Tree, ...] = BANK_TREES,
                   best_static: int = BEST_STATIC, default_policy: str = "hysteresis") -> Path:
    """A TopologyBank with fake figures (timed at batch size 1: `batch_one_record`) whose provenance
    points at `model_dir` / `heads_dir` (relative to the bank folder, as the pipeline records them)
    and carries their fingerprints."""
    folder.mkdir(parents=True, exist_ok=True)
    figures = [fake_figures(t, k) for k, t in enumerate(trees)]
    bank = TopologyBank(
        trees=list(trees),
        figures=figures,
        best_static=best_static,
        batch_schedule=batch_one_record(list(trees), figures, best_static),
        policies=tiny_policies(),
        default_policy=default_policy,
        oracle={"tokens_per_step": 2.5, "tok_per_s": 150.0},
        provenance={
            "task": TASK_NAME, "model_name": MODEL_NAME, "heads_name": HEADS_NAME,
            "model_fingerprint": weights_fingerprint(model_dir),
            "heads_fingerprint": heads_fingerprint(heads_dir),
            "model_dir": os.path.relpath(model_dir.resolve(), folder.resolve()),
            "heads_dir": os.path.relpath(heads_dir.resolve(), folder.resolve()),
            "dtype": "float32",
            # this machine's CPU, as the pipeline records it, so that loading it here warns of nothing
            "machine": {"cpu": cpu_name_and_flags()[0], "torch": torch.__version__},
        },
    )
    return bank.save(folder)


def build_tiny_bundle(root: Path, tokenizer_dir: Path) -> TinyBundle:
    with torch_threads(1):
        return _build_tiny_bundle(root, tokenizer_dir)


def _build_tiny_bundle(root: Path, tokenizer_dir: Path) -> TinyBundle:
    model_dir = make_tiny_model(root / "models" / MODEL_NAME, tokenizer_dir)
    heads_dir = make_tiny_heads(model_dir, root / "heads" / MODEL_NAME / HEADS_NAME)
    bank_dir = make_tiny_bank(root / "banks" / MODEL_NAME / HEADS_NAME / TASK_NAME, model_dir, heads_dir)
    return TinyBundle(root=root, model_dir=model_dir, heads_dir=heads_dir, bank_dir=bank_dir)


_BUNDLES: dict[str, TinyBundle] = {}


def tiny_bundle(tmp_path_factory, tokenizer_dir: Path) -> TinyBundle:  # noqa: ANN001 - pytest's TempPathFactory
    """The tiny bundle, built once per test process (every test module shares it; never modify
    it in place: copy it first, see `copy_bundle`)."""
    key = str(tokenizer_dir)
    if key not in _BUNDLES:
        _BUNDLES[key] = build_tiny_bundle(tmp_path_factory.mktemp("tiny_bundle"), tokenizer_dir)
    return _BUNDLES[key]


def tiny_pipeline_overrides(artifacts: Path, data: Path, bundle: TinyBundle, *extra: str) -> list[str]:
    """The command-line overrides of `tiny_pipeline_cfg` (for `python -m pipeline` in a subprocess);
    a key that `extra` sets keeps the value given there."""
    given = {e.split("=", 1)[0] for e in extra}
    return ["heads.draft_vocab.size=null", *extra] + [o for o in [
            "stage=bank", "task=humaneval", "model=local", f"model.name={MODEL_NAME}",
            f"model.path={artifacts / 'models' / MODEL_NAME}", f"heads.dir={bundle.heads_dir}", "dtype=float32",
            "threads=1", "profile.calib_prompts=3", "profile.recalib_prompts=1", "profile.timing_prompts=1",
            "profile.max_new_tokens=6", "profile.eval_prompts=2", "time.rounds=1", "time.new_tokens=4",
            "grow.candidate_sizes=[0,2,4,8]", f"artifacts_dir={artifacts}", f"data_dir={data}"]
        if o.split("=", 1)[0] not in given]


def tiny_pipeline_cfg(artifacts: Path, data: Path, bundle: TinyBundle, *extra: str):  # noqa: ANN201 - DictConfig
    """The pipeline config (`stage=bank task=humaneval`) for the tiny bundle's model and heads, sized
    to run in seconds, with outputs in `artifacts` / `data`; `extra` overrides come first and win
    over those sizes (the draft vocabulary is off unless `extra` turns it on)."""
    from hydra import compose, initialize_config_dir

    import pipeline.config.schema  # noqa: F401 - registers the typed schema the config's defaults name

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=tiny_pipeline_overrides(artifacts, data, bundle, *extra))


def copy_bundle(bundle: TinyBundle, dst: Path) -> TinyBundle:
    """A private copy of a bundle (same layout, so the bank's relative paths still resolve)."""
    shutil.copytree(bundle.root, dst)
    rel = lambda p: dst / p.relative_to(bundle.root)  # noqa: E731
    return TinyBundle(root=dst, model_dir=rel(bundle.model_dir), heads_dir=rel(bundle.heads_dir), bank_dir=rel(bundle.bank_dir))


def bank_choosing(bundle: TinyBundle, dst: Path, choices: dict[int, int | None]) -> Path:
    """A private copy of the tiny bundle whose bank chose `choices` per batch size (tree index, or
    None for AR)."""
    from tests.helpers.banks import batch_choices_record

    own = copy_bundle(bundle, dst)
    bank = TopologyBank.load(own.bank_dir)
    bank.batch_schedule = batch_choices_record(bank.trees, choices)
    bank.save(own.bank_dir)
    return own.bank_dir
