"""In-memory models for the runtime tests: random runtime Transformers and heads, the greedy AR
reference, trees (fixed ones and a hypothesis strategy), the row-invariant arithmetics, the
super-tree of the EntMTP-dyn tests, and a transformers Llama / Qwen2 with wide random weights."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from runtime.heads import DraftHeads, HeadsConfig
from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from runtime.model import small_rows
from runtime.tree import Tree

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


# --- row-invariant arithmetics ---------------------------------------------------------------------

# padded blocks of 4 rows (torch's products), and the small-row kernels where they are built
ARITHMETICS = ["padded"] + (["kernel"] if small_rows.available() else [])


def invariant_model(arithmetic: str, seed: int = 0) -> Transformer:
    """The tiny model in a row-invariant arithmetic: padded blocks of 4 rows (torch's products), or
    the small-row kernels (where they are built)."""
    model = tiny_model(seed)
    if arithmetic == "kernel":
        model.add_fast_paths()
        assert model.kernel_decode
    model.set_row_invariance(4)
    return model


def random_prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (3, 20), vocab: int = 40) -> list[list[int]]:
    """`n` seeded prompts of random tokens below `vocab`, their lengths drawn from [lengths[0], lengths[1])."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (size,), generator=g).tolist() for size in sizes]


# --- EntMTP-dyn --------------------------------------------------------------------------------------

# a 16-node super-tree 4 deep: wide near the root, a deep spine
SUPER = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
              (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (1, 0, 0, 0)])
# a gentle cost slope: the tiny random heads' path values then pick anywhere from 1 to ~6 nodes
GENTLE = [1.0 + 0.02 * k for k in range(SUPER.num_nodes)]
# the part of GENTLE that drafts SUPER down to depth 0..4, for the early-stop policy
DRAFTS = [0.0, 0.1, 0.2, 0.3, 0.4]
