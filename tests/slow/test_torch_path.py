"""Every decode mode on the torch path, the one a GPU (and a CPU where bfloat16 wins) runs: the
default model with the small-row kernel off, row-invariant in padded 8-row blocks, in float32 and
bfloat16, 300 new tokens per mode (well past the 63 tokens one row-invariant forward holds deep),
each token-identical to AR in the same arithmetic: fixed trees, batched decoding, EntMTP-dyn,
seeded sampling and an EAGLE-3 drafter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.paths import REPO_ROOT, Layout
from runtime.ar import ar_generate
from runtime.config import SamplingConfig
from runtime.decoder import TreeDecoder
from runtime.dynamic import DynamicPolicy
from runtime.eagle3 import default_aux_layer_ids
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model, load_tokenizer
from runtime.sampling import Sampler
from runtime.tree import Tree, TreeBuffers
from tests.helpers.drafters import random_eagle3

NEW = 300
TEXTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "A farmer has 17 sheep and buys 5 more. How many sheep"]
# a chain, and a 16-node tree 4 deep (deep trees rather than wide: bfloat16 runs one 8-row block per call)
TREES = [Tree.chain(4), Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
                              (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (1, 0, 0, 0)])]
SUPER = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_decode_mode_equals_ar_on_the_torch_path(smollm2_dir: Path, dtype: torch.dtype) -> None:
    model = load_model(smollm2_dir, dtype=dtype, max_seq_len=1024, fast_paths=False)
    assert not model.kernel_decode
    model.set_row_invariance(8)
    tok = load_tokenizer(smollm2_dir)
    prompts = [tok.encode(t).ids for t in TEXTS]
    heads_dir = Layout.for_model(REPO_ROOT / "artifacts", smollm2_dir.name).heads_dir("hydra")
    heads = load_heads(heads_dir, model)
    ar = [ar_generate(model, p, NEW, eos_ids=()) for p in prompts]
    assert all(len(a) == NEW for a in ar)

    dec = TreeDecoder(model, heads, [TreeBuffers.compile(t) for t in TREES])
    for k in range(len(TREES)):
        assert dec.generate(prompts[k], NEW, choose=k, eos_ids=()).tokens == ar[k], ("tree", k)
    batch = dec.generate_batch(prompts, NEW, choose=1, eos_ids=())
    assert [r.tokens for r in batch] == ar, "batched"
    dyn = DynamicPolicy(SUPER, [1.0 + 0.05 * n for n in range(SUPER.num_nodes)])
    res = dec.generate(prompts[0], NEW, choose=dyn, eos_ids=())
    assert res.tokens == ar[0], "EntMTP-dyn"

    cfg = SamplingConfig(temperature=0.7, seed=3)
    want = ar_generate(model, prompts[1], NEW, eos_ids=(), sampler=Sampler(cfg))
    got = dec.generate(prompts[1], NEW, choose=1, eos_ids=(), sampler=Sampler(cfg)).tokens
    assert got == want, "seeded sampling"

    drafter = random_eagle3(model, draft_vocab=4096, aux=default_aux_layer_ids(model.args.n_layers))
    eagle = TreeDecoder(model, drafter, [TreeBuffers.compile(t) for t in TREES])
    assert eagle.generate(prompts[0], NEW, choose=1, eos_ids=()).tokens == ar[0], "EAGLE-3"
