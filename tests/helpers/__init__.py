"""Shared builders for the tests (test modules import these, never each other).

In memory: `tiny_transformer` / `tiny_model` (random runtime Transformers), `tiny_heads`,
`ar_greedy`, `DECODER_TREES`, `random_hf_causal_lm` (a transformers Llama / Qwen2 with wide random
weights) and the hypothesis strategy `trees` (random valid trees).

On disk, for tests that use EntMTP "from outside": a tiny but real model folder, draft heads and a
TopologyBank, laid out the way the pipeline lays out `artifacts/`.

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
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hypothesis import strategies as st

from runtime.bank import TopologyBank
from runtime.fingerprint import heads_fingerprint, weights_fingerprint
from runtime.heads import DraftHeads, HeadsConfig
from runtime.model import ModelArgs, Transformer
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


# --- in memory -----------------------------------------------------------------------------------

# a chain, Medusa/Hydra's default tree, a small branching tree and the root alone
DECODER_TREES = [Tree.named("chain4"), Tree.named("mc_sim_7b_63"), Tree([(0,), (1,), (0, 0)]), Tree([])]


def tiny_transformer(args: ModelArgs, seed: int = 0, std: float = 0.3, cache: int = 256) -> Transformer:
    """A random runtime Transformer with every weight drawn from N(0, std) (wide: clear argmax
    margins, and random heads sometimes guess right), its KV cache set up for `cache` positions."""
    torch.manual_seed(seed)
    model = Transformer(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    model.setup_cache(cache)
    return model.eval()


def tiny_model(seed: int = 0, vocab: int = 48) -> Transformer:
    """A random 2-layer Llama with a small vocabulary (its last token is EOS), so random heads
    sometimes guess right."""
    args = ModelArgs(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=64, eos_token_ids=(vocab - 1,), max_position_embeddings=512)
    return tiny_transformer(args, seed)


def tiny_heads(model: Transformer, kind: str, seed: int = 0, prefix: bool = False, num_heads: int = 4) -> DraftHeads:
    """Random heads bound to `model`, with non-zero ResBlocks so drafts differ from the base argmax."""
    torch.manual_seed(seed)
    heads = DraftHeads(HeadsConfig.for_model(model.args, kind=kind, num_heads=num_heads, prefix_layer=prefix))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    heads.bind(model)
    return heads.eval()


@torch.inference_mode()
def ar_greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    """Greedy AR decoding written out independently of runtime.ar (the reference)."""
    model.reset_cache()
    logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)))
    out = [int(logits[0, -1].argmax())]
    while len(out) < n and out[-1] not in model.args.eos_token_ids:
        logits, _ = model(torch.tensor([[out[-1]]]), torch.tensor([model.cache_len]))
        out.append(int(logits[0, -1].argmax()))
    return out


def random_hf_causal_lm(kind: str, config: dict, seed: int = 0, std: float = 0.3):  # noqa: ANN201 - transformers model
    """A transformers Llama ("llama") or Qwen2 ("qwen2") with eager attention and wide random
    weights (norm weights in [0.5, 1.5], the rest N(0, std)), so that a mis-mapped tensor cannot
    hide behind the near-identity initialisation and float rounding cannot flip a greedy choice."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg = (LlamaConfig if kind == "llama" else Qwen2Config)(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    return model


@st.composite
def trees(draw: st.DrawFn, max_depth: int = 5, max_children: int = 4, max_nodes: int = 40) -> Tree:
    """Random valid trees, grown breadth first: each node gets 0..max_children children of ranks 0..n-1."""
    depth_limit = draw(st.integers(0, max_depth))
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    while frontier:
        node = frontier.pop(0)
        if len(node) >= depth_limit:
            continue
        n = draw(st.integers(0, min(max_children, max_nodes - len(paths))))
        kids = [node + (r,) for r in range(n)]
        paths += kids
        frontier += kids
    order = draw(st.permutations(paths))  # the input order must not matter
    return Tree(order)


# --- on disk -------------------------------------------------------------------------------------


# A bank shaped like the pipeline's, in memory (test_bank.py, test_reliability.py)
MODEL_FP, HEADS_FP = "model-fp-0123456789", "heads-fp-abcdef"


def make_bank(trees: list[Tree] | None = None) -> TopologyBank:
    """A bank shaped like the pipeline's: trees ascending by size, figures, three policies, provenance."""
    trees = trees or [Tree.chain(1), Tree.chain(2), Tree.chain(4), Tree.named("mc_sim_7b_63")]
    figures = [
        {"nodes": t.num_nodes, "depth": t.depth, "tokens_per_step": 1.4 + 0.3 * k, "step_ms": 20.0 + 2.5 * k,
         "tok_per_s": 70.0 + k, "real_tokens_per_step": 1.4 + 0.3 * k if k % 2 else None, "step_agreement": 1.0}
        for k, t in enumerate(trees)
    ]
    last = len(trees) - 1
    policies = {
        "static": {"kind": "static", "index": last, "signal": "p0"},
        "hysteresis": {"kind": "hysteresis", "signal": "p0", "small": 0, "large": last, "tau_on": 0.8, "tau_off": 0.4},
        "ladder": {"kind": "ladder", "signal": "p0", "thresholds": [0.3, 0.6, 0.9][: last], "trees": list(range(last + 1))},
    }
    return TopologyBank(
        trees=trees, figures=figures, best_static=last, policies=policies, default_policy="hysteresis",
        oracle={"tokens_per_s": 99.5, "tokens_per_step": 2.9},
        provenance={"task": "humaneval", "model_name": "tiny", "heads_name": "hydra", "model_fingerprint": MODEL_FP,
                    "heads_fingerprint": HEADS_FP, "dtype": "float32", "machine": {"cpu": "test"}},
    )


def reseal(folder: Path) -> None:
    """Recompute bank.json's seals after a deliberate edit (what a buggy writer would produce)."""
    from runtime import bank as bank_mod
    from runtime.bank import BANK_JSON, BUFFERS

    doc = json.loads((folder / BANK_JSON).read_text())
    if (folder / BUFFERS).exists():
        blob = (folder / BUFFERS).read_bytes()
        doc["buffers_sha256"], doc["buffers_bytes"] = bank_mod._sha256(blob), len(blob)
    doc["doc_sha256"] = bank_mod._doc_checksum(doc)
    (folder / BANK_JSON).write_text(json.dumps(doc, indent=1))




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


# --- your own model: Vicuna-layout folders and published heads (test_own_model*.py; needs sentencepiece) ---

HIDDEN, LAYERS, HEADS_ATTN, FFN, POSITIONS = 64, 2, 4, 128, 512
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Write a Python function that sorts a list of numbers in ascending order.",
    "The quick brown fox jumps over the lazy dog. A chat between a curious user and an assistant.",
    "USER: What is 12 times 7? ASSISTANT: 12 times 7 is 84.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
] * 40

# tokenizer_config.json as Vicuna v1.3 ships it: a slow LlamaTokenizer, no chat template
VICUNA_TOKENIZER_CONFIG = {
    "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": True, "rstrip": False,
                  "single_word": False},
    "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": True, "rstrip": False,
                  "single_word": False},
    "unk_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False, "normalized": True, "rstrip": False,
                  "single_word": False},
    "model_max_length": 2048, "pad_token": None, "padding_side": "right", "sp_model_kwargs": {},
    "tokenizer_class": "LlamaTokenizer",
}


def train_sentencepiece(folder: Path) -> int:
    """A small BPE sentencepiece model with Llama's special ids (unk 0, <s> 1, </s> 2, byte fallback)."""
    import sentencepiece

    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(folder / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True)
    (folder / "tokenizer.vocab").unlink()
    return sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).get_piece_size()


def vicuna_config(vocab: int) -> dict:
    """config.json in Vicuna v1.3's form, tiny."""
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": FFN,
            "max_position_embeddings": POSITIONS, "model_type": "llama", "num_attention_heads": HEADS_ATTN,
            "num_hidden_layers": LAYERS, "pad_token_id": 0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.0.dev0", "use_cache": True, "vocab_size": vocab}


def hf_reference(config: dict, state: dict[str, torch.Tensor]):
    """transformers' Llama with exactly these weights (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict({k: v.float() for k, v in state.items() if not k.endswith("inv_freq")}, strict=True)
    return model


def random_state(config: dict, seed: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return {k: v.detach().to(torch.float16).clone() for k, v in model.state_dict().items()}


def write_vicuna_bin_folder(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Vicuna v1.3's layout: pytorch_model-0000{1,2}-of-00002.bin + index, tokenizer.model only."""
    vocab = train_sentencepiece(folder)
    config = vicuna_config(vocab)
    state = random_state(config, seed)
    # old transformers saved the rotary buffers with the weights; Vicuna's shards carry them
    for i in range(LAYERS):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    for i, part in enumerate(halves):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, folder / shard)
        for k in part:
            weight_map[k] = shard
            total += state[k].numel() * state[k].element_size()
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                               "pad_token_id": 0}))
    (folder / "tokenizer_config.json").write_text(json.dumps(VICUNA_TOKENIZER_CONFIG))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "unk_token": "<unk>"}))
    return state


def write_sharded_safetensors_folder(folder: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json, tokenizer.model only."""
    from safetensors.torch import save_file

    vocab = train_sentencepiece(folder)
    config = vicuna_config(vocab)
    state = random_state(config, seed)
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate([names[:5], names[5:]]):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps(VICUNA_TOKENIZER_CONFIG))
    return state


def _w(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * 0.3


def write_published_hydra(folder: Path, base_state: dict, arch: str, n_heads: int = 4, n_layers: int = 2,
                          seed: int = 0) -> None:
    """hydra_lm_head.pt + config.json with the key layout Hydra's training code saves."""
    g = torch.Generator().manual_seed(seed)
    h, embed = HIDDEN, base_state["model.embed_tokens.weight"]
    v = embed.shape[0]
    drop = arch == "prefix-mlp"
    state = {"input_embed_fn.weight": embed.clone()}
    for i in range(n_heads):
        for j in range(n_layers):
            pos = 2 * j + 1 if drop else j
            fan_in = (i + 2) * h if j == 0 else h
            state[f"hydra_mlp.{i}.{pos}.linear.weight"] = _w(h, fan_in, g=g)
            state[f"hydra_mlp.{i}.{pos}.linear.bias"] = _w(h, g=g)
            if j == 0:
                state[f"hydra_mlp.{i}.{pos}.res_connection.weight"] = _w(h, fan_in, g=g)
                state[f"hydra_mlp.{i}.{pos}.res_connection.bias"] = _w(h, g=g)
        out = f"hydra_lm_head.{i}.{'1.' if drop else ''}"
        state[out + "weight"], state[out + "bias"] = _w(v, h, g=g), _w(v, g=g)
    if drop:
        p = "prefix_embeding_layer."
        for name, shape in {"layers.0.input_layernorm.weight": (h,), "layers.0.post_attention_layernorm.weight": (h,),
                            "layers.0.self_attn.q_proj.weight": (h, h), "layers.0.self_attn.k_proj.weight": (h, h),
                            "layers.0.self_attn.v_proj.weight": (h, h), "layers.0.self_attn.o_proj.weight": (h, h),
                            "layers.0.mlp.gate_proj.weight": (FFN, h), "layers.0.mlp.up_proj.weight": (FFN, h),
                            "layers.0.mlp.down_proj.weight": (h, FFN), "norm.weight": (h,)}.items():
            state[p + name] = 1.0 + _w(*shape, g=g) * 0.1 if "norm" in name else _w(*shape, g=g)
        state[p + "embed_tokens.weight"] = embed.clone()
    folder.mkdir(parents=True)
    torch.save({k: t.to(torch.float16) for k, t in state.items()}, folder / "hydra_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({
        "hydra_num_heads": n_heads, "hydra_num_layers": n_layers, "hydra_head_arch": arch, "grounded_heads": True,
        "hidden_state_offset": 0, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "dropout_rate": 0.0,
        "lm_loss_weight": 1.0, "teacher_loss_weight": 0.0, "transformers_version": "4.36.2"}))


def write_published_medusa(folder: Path, n_heads: int = 4, seed: int = 0, vocab: int = 400) -> None:
    """medusa_lm_head.pt + config.json as Medusa-1's training code saves them."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(n_heads):
        state[f"{i}.0.linear.weight"], state[f"{i}.0.linear.bias"] = _w(HIDDEN, HIDDEN, g=g), _w(HIDDEN, g=g)
        state[f"{i}.1.weight"] = _w(vocab, HIDDEN, g=g)
    folder.mkdir(parents=True)
    torch.save({k: t.to(torch.float16) for k, t in state.items()}, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": n_heads, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
