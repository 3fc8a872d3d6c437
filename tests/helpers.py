"""Shared builders for tests that use EntMTP "from outside": a tiny but real model folder, draft
heads and a TopologyBank, laid out on disk the way the pipeline lays out `artifacts/`.

    root/models/tiny-llama/                  config.json (transformers' LlamaConfig), model.safetensors,
                                             SmolLM2's tokenizer.json + chat template
    root/heads/tiny-llama/hydra/             config.json + heads.safetensors (runtime.heads.save_heads)
    root/banks/tiny-llama/hydra/tiny/        bank.json + buffers.safetensors (TopologyBank.save)

The model has SmolLM2's vocabulary (49152) so that the real tokenizer and chat template work, but
a hidden size of 64 and 2 layers, so that decoding a few tokens costs milliseconds. The heads get
random ResBlock weights (a fresh ResBlock is its residual map, which would make every head
predict the root token again), so drafts vary and are sometimes, not always, accepted.

`tiny_bundle(tmp_path_factory, tokenizer_dir)` builds everything once per test process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.bank import TopologyBank
from runtime.fingerprint import heads_fingerprint, weights_fingerprint
from runtime.policy import HysteresisPolicy, LadderPolicy, StaticPolicy
from runtime.tree import Tree

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv" / "bin" / "python"

# Everything of a model folder a tokenizer / chat template reader may look at (weights excluded).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

MODEL_NAME = "tiny-llama"
HEADS_NAME = "hydra"
TASK_NAME = "tiny"
NUM_HEADS = 4

# Ordered by size, as a bank must be: a chain, a small branching tree, Medusa/Hydra's default.
SIX_NODE_TREE = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
BANK_TREES = (Tree.chain(2), SIX_NODE_TREE, Tree.named("mc_sim_7b_63"))
BEST_STATIC = 1


@dataclass(frozen=True)
class TinyBundle:
    root: Path
    model_dir: Path
    heads_dir: Path
    bank_dir: Path


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads, then restore the previous count.

    The tests decode a tiny model: each op is so small that a second thread only adds
    synchronisation, and on a busy shared machine (where the other thread's core is taken) that
    makes decoding 10-40x slower. `runtime.model.load_model` sets all cores once per process,
    so the tests set this around each test rather than once."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pin_to_one_cpu() -> None:
    """`preexec_fn` for child interpreters: one CPU, so the runtime (which uses every CPU it may
    run on) decodes the tiny model single-threaded, for the reason given in `torch_threads`."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def python_exe() -> str:
    """The venv's interpreter (falls back to the running one, e.g. in another checkout layout)."""
    import sys

    return str(PYTHON) if PYTHON.is_file() else sys.executable


def subprocess_env() -> dict[str, str]:
    """Environment for child interpreters: the repo importable, few threads (the CPU is shared)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


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
    from runtime.model import load_model

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


def fake_figures(tree: Tree, k: int) -> dict[str, float | int]:
    """Plausible measured figures (bigger trees accept more but cost more per step)."""
    tokens_per_step = 1.0 + 0.4 * tree.depth + 0.01 * len(tree)
    step_ms = 5.0 + 0.2 * tree.num_nodes
    return {"nodes": tree.num_nodes, "depth": tree.depth, "tokens_per_step": round(tokens_per_step, 4),
            "step_ms": step_ms, "tok_per_s": round(1000.0 * tokens_per_step / step_ms, 3),
            "real_tokens_per_step": round(tokens_per_step - 0.01 * k, 4), "step_agreement": 1.0}


def tiny_policies() -> dict[str, dict]:
    """A static policy, a hysteresis between the smallest and the largest tree on the EMA of
    accepted tokens, and a ladder on the heads' greedy-path value (which makes the decoder run
    the heads' greedy chain every step)."""
    n = len(BANK_TREES)
    return {
        "static": StaticPolicy(BEST_STATIC).to_dict(),
        # init 2.0: start on the large tree and drop to the small one after a few rejected steps
        "hysteresis": HysteresisPolicy(tau_on=1.5, tau_off=1.2, small=0, large=n - 1, signal="accept_ema",
                                       signal_params={"alpha": 0.5, "init": 2.0}).to_dict(),
        # random heads over a 49152-token vocabulary give greedy-path values around 1e-17
        "ladder": LadderPolicy(thresholds=[2e-17, 6e-17], trees=[0, 1, 2], signal="greedy_path").to_dict(),
    }


def make_tiny_bank(folder: Path, model_dir: Path, heads_dir: Path, trees: tuple[Tree, ...] = BANK_TREES,
                   best_static: int = BEST_STATIC, default_policy: str = "hysteresis") -> Path:
    """A TopologyBank with fake figures whose provenance points at `model_dir` / `heads_dir`
    (relative to the bank folder, as the pipeline records them) and carries their fingerprints."""
    folder.mkdir(parents=True, exist_ok=True)
    bank = TopologyBank(
        trees=list(trees),
        figures=[fake_figures(t, k) for k, t in enumerate(trees)],
        best_static=best_static,
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
            "machine": {"cpu": "test", "torch": torch.__version__},
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


def copy_bundle(bundle: TinyBundle, dst: Path) -> TinyBundle:
    """A private copy of a bundle (same layout, so the bank's relative paths still resolve)."""
    shutil.copytree(bundle.root, dst)
    rel = lambda p: dst / p.relative_to(bundle.root)  # noqa: E731
    return TinyBundle(root=dst, model_dir=rel(bundle.model_dir), heads_dir=rel(bundle.heads_dir), bank_dir=rel(bundle.bank_dir))


def synthetic_rollouts(
    n_prompts: int = 4, length: int = 64, depth: int = 4, rank_cap: int = 8, seed: int = 0, switch: float = 0.1
) -> list[dict]:
    """Seeded fake rollouts for tests: a hidden easy/hard regime (Markov, switching
    with probability `switch`) drives both the ranks (geometric, worse with depth) and the signals,
    so confidence-driven policies have something to find. Follows the rank-path convention,
    including K beyond the end of the continuation."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_prompts):
        T = int(length)
        easy = np.empty(T, dtype=bool)
        state = bool(rng.random() < 0.5)
        for t in range(T):
            if rng.random() < switch:
                state = not state
            easy[t] = state
        q_top = np.where(easy, 0.85, 0.35)  # probability that head 1's top-1 is right
        q = q_top[:, None] * (0.93 ** np.arange(depth))[None, :]
        ranks = rng.geometric(np.clip(q, 1e-3, 1.0)) - 1
        ranks = np.minimum(ranks, rank_cap)
        for d in range(depth):  # y_{i+2+d} exists only while i + 2 + d <= T
            ranks[max(T - 1 - d, 0) :, d] = rank_cap
        p0 = np.clip(q_top + rng.normal(0, 0.1, T), 0.01, 1.0)
        head_top1 = np.clip(q + rng.normal(0, 0.1, (T, depth)), 0.01, 1.0)
        entropy = np.clip(-np.log(p0) + rng.normal(0, 0.2, T), 0.0, None)
        out.append(
            {
                "rank_paths": ranks.astype(np.int16),
                "p0": p0.astype(np.float32),
                "head_top1": head_top1.astype(np.float32),
                "entropy": entropy.astype(np.float32),
                "rank_cap": int(rank_cap),
            }
        )
    return out
