"""Published Hydra / Hydra++ / Medusa-1 layouts load into our heads and draft the same tokens.

The real checkpoints cannot be downloaded here, so `RefHydra` / `RefMedusa` below re-implement
the published modules from their documented structure (module attribute names chosen so that
`state_dict()` yields the published key layout, the prefix layer a one-layer transformers
LlamaModel). Their drafts are computed node by node with their own forward pass, independently of
runtime.heads, and compared with what our loader + `propose` produce.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.config import ModelArgs
from runtime.model.llama import Transformer
from pipeline.heads.published.read import load_published, load_published_hydra, load_published_medusa, load_torch_weights
from runtime.tree import Tree, TreeBuffers
from tests.helpers import tiny_transformer

ARGS = ModelArgs(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64,
                 norm_eps=1e-6, rope_theta=10000.0, tie_embeddings=True, max_position_embeddings=256)


def tiny_model() -> Transformer:
    return tiny_transformer(ARGS, cache=128)


class RefResBlock(nn.Module):
    def __init__(self, hidden: int, num_condition: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden * (num_condition + 1), hidden)
        self.res_connection = nn.Linear(hidden * (num_condition + 1), hidden) if num_condition else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_connection(x) + nn.functional.silu(self.linear(x))


class RefHydra(nn.Module):
    """The published head module: `mlp` or `prefix-mlp` arch, grounded or not."""

    def __init__(self, arch: str, grounded: bool, n_heads: int, n_layers: int, embed: nn.Embedding) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        h, v = ARGS.dim, ARGS.vocab_size
        self.arch, self.grounded = arch, grounded
        drop = arch == "prefix-mlp"
        if drop:
            cfg = LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=ARGS.intermediate_size, num_hidden_layers=1,
                              num_attention_heads=ARGS.n_heads, num_key_value_heads=ARGS.n_kv_heads, head_dim=ARGS.head_dim,
                              rms_norm_eps=ARGS.norm_eps, rope_theta=ARGS.rope_theta, max_position_embeddings=256,
                              attn_implementation="eager")
            self.prefix_embeding_layer = LlamaModel(cfg)
        mlps = []
        for i in range(n_heads):
            mods: list[nn.Module] = []
            for j in range(n_layers):
                if drop:
                    mods.append(nn.Dropout(0.0))
                mods.append(RefResBlock(h, i + 1 if (grounded and j == 0) else 0))
            mlps.append(nn.Sequential(*mods))
        self.hydra_mlp = nn.ModuleList(mlps)
        self.hydra_lm_head = nn.ModuleList(
            nn.Sequential(nn.Dropout(0.0), nn.Linear(h, v)) if drop else nn.Linear(h, v) for _ in range(n_heads))
        self.input_embed_fn = embed  # registered as a submodule, as in the published code

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.arch != "prefix-mlp":
            return hidden
        pos = torch.arange(hidden.shape[0])[None]
        return self.prefix_embeding_layer(inputs_embeds=hidden[None], position_ids=pos).last_hidden_state[0]

    def head_logits(self, i: int, ctx: torch.Tensor, path_tokens: list[int]) -> torch.Tensor:
        x = ctx
        if self.grounded:
            x = torch.cat([ctx] + [self.input_embed_fn(torch.tensor(t)) for t in path_tokens[: i + 1]])
        return self.hydra_lm_head[i](self.hydra_mlp[i](x))


class RefMedusa(nn.Module):
    def __init__(self, n_heads: int, n_layers: int) -> None:
        super().__init__()
        h, v = ARGS.dim, ARGS.vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(*[RefResBlock(h) for _ in range(n_layers)], nn.Linear(h, v, bias=False)) for _ in range(n_heads))

    def head_logits(self, i: int, ctx: torch.Tensor, path_tokens: list[int]) -> torch.Tensor:
        return self.heads[i](ctx)


def randomise(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name != "input_embed_fn.weight":
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "norm" in name else 0.3))


def ref_tree(ref: nn.Module, ctx: torch.Tensor, root: int, tree: Tree) -> list[int]:
    tokens = {(): root}
    for path in tree.paths:
        prefix = [tokens[path[:i]] for i in range(len(path))]
        logits = ref.head_logits(len(path) - 1, ctx, prefix)
        tokens[path] = int(logits.argsort(descending=True)[path[-1]])
    return [root] + [tokens[p] for p in tree.paths]


def hidden_states(model: Transformer, n: int = 11) -> torch.Tensor:
    ids = torch.randint(0, ARGS.vocab_size, (1, n), generator=torch.Generator().manual_seed(4))
    model.reset_cache()
    return model(ids, torch.arange(n))[1]


def write_hydra(folder: Path, ref: RefHydra, arch: str, grounded: bool, n_heads: int, n_layers: int, **extra) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(ref.state_dict(), folder / "hydra_lm_head.pt")
    cfg = {"hydra_num_heads": n_heads, "hydra_num_layers": n_layers, "hydra_head_arch": arch,
           "grounded_heads": grounded, "hidden_state_offset": 0, "base_model_name_or_path": "tiny",
           "transformers_version": "4.36.2", **extra}
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("arch", "grounded", "n_layers"),
                         [("prefix-mlp", True, 1), ("prefix-mlp", True, 2), ("mlp", True, 2), ("mlp", False, 1),
                          ("prefix-mlp", False, 1)])
def test_published_hydra_drafts_like_the_published_module(tmp_path, arch: str, grounded: bool, n_layers: int) -> None:
    model = tiny_model()
    ref = RefHydra(arch, grounded, 4, n_layers, nn.Embedding.from_pretrained(model.tok_embeddings.weight.clone()))
    randomise(ref, seed=7)
    write_hydra(tmp_path, ref, arch, grounded, 4, n_layers)
    heads = load_published(tmp_path, model)
    assert heads.config.prefix_layer == (arch == "prefix-mlp")
    assert heads.config.kind == ("hydra" if grounded else "medusa")

    hidden = hidden_states(model)
    with torch.no_grad():
        ref_ctx = ref.context(hidden[0])
    heads.reset()
    h = heads.observe(hidden, torch.arange(hidden.shape[1]))
    assert torch.allclose(h[0], ref_ctx[-1], atol=1e-4)
    with torch.no_grad():
        for tree in (Tree.named("mc_sim_7b_63"), Tree.chain(4)):
            expected = ref_tree(ref, ref_ctx[-1], 5, tree)
            assert heads.propose(h, 5, TreeBuffers.compile(tree)).tolist() == expected


def test_published_medusa_count_from_weights_with_warning(tmp_path) -> None:
    model = tiny_model()
    ref = RefMedusa(5, 1)
    randomise(ref, seed=3)
    torch.save(ref.heads.state_dict(), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                      "base_model_name_or_path": "tiny"}))
    with pytest.warns(UserWarning, match="medusa_num_heads=2 but the weights hold 5"):
        heads = load_published(tmp_path, model)
    assert heads.config.num_heads == 5 and heads.config.kind == "medusa"
    hidden = hidden_states(model)
    h = heads.observe(hidden, torch.arange(hidden.shape[1]))
    tree = Tree([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1)])
    with torch.no_grad():
        assert heads.propose(h, 9, TreeBuffers.compile(tree)).tolist() == ref_tree(ref, hidden[0, -1], 9, tree)


def test_published_medusa_safetensors_with_prefix(tmp_path) -> None:
    from safetensors.torch import save_file

    ref = RefMedusa(3, 2)
    randomise(ref, seed=5)
    save_file({f"medusa_head.{k}": v.contiguous() for k, v in ref.heads.state_dict().items()},
              str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heads = load_published_medusa(tmp_path)
    assert (heads.config.num_heads, heads.config.num_layers) == (3, 2)
    h = torch.randn(4, ARGS.dim)
    with torch.no_grad():
        ours = heads.teacher_forced_logits(h, torch.zeros(4, 3, dtype=torch.long))
        for i in range(3):
            assert torch.allclose(ours[:, i], ref.heads[i](h), atol=1e-5)


class Payload:
    """Stands for any object a malicious checkpoint could smuggle into a pickle."""

    def __init__(self) -> None:
        self.note = "not a tensor"


def test_pt_with_a_pickled_object_is_refused(tmp_path) -> None:
    model = tiny_model()
    ref = RefHydra("mlp", True, 2, 1, nn.Embedding.from_pretrained(model.tok_embeddings.weight.clone()))
    state = dict(ref.state_dict())
    state["extra"] = Payload()
    write_hydra(tmp_path, ref, "mlp", True, 2, 1)
    torch.save(state, tmp_path / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match="pickled Python objects"):
        load_published_hydra(tmp_path, model)
    torch.save(ref, tmp_path / "whole_module.pt")  # a pickled nn.Module
    with pytest.raises(ValueError, match="pickled Python objects"):
        load_torch_weights(tmp_path / "whole_module.pt")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="does not hold a state dict"):
        load_torch_weights(tmp_path / "list.pt")


def test_strict_keys_shapes_and_config_checks(tmp_path) -> None:
    model = tiny_model()
    ref = RefHydra("prefix-mlp", True, 3, 1, nn.Embedding.from_pretrained(model.tok_embeddings.weight.clone()))
    randomise(ref, seed=1)
    good = dict(ref.state_dict())

    write_hydra(tmp_path, ref, "prefix-mlp", True, 3, 1)
    missing = {k: v for k, v in good.items() if k != "hydra_mlp.1.1.res_connection.bias"}
    torch.save(missing, tmp_path / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match=r"missing keys \['heads\.1\.blocks\.0\.residual\.bias'\]"):
        load_published_hydra(tmp_path, model)

    torch.save({**good, "hydra_mlp.0.7.linear.weight": torch.zeros(2, 2)}, tmp_path / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match=r"does not use: \['hydra_mlp\.0\.7\.linear\.weight'\]"):
        load_published_hydra(tmp_path, model)

    torch.save({**good, "hydra_mlp.2.1.linear.weight": torch.zeros(32, 64)}, tmp_path / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match=r"heads\.2\.blocks\.0\.linear\.weight: shape \(32, 64\), expected \(32, 128\)"):
        load_published_hydra(tmp_path, model)

    torch.save(good, tmp_path / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match="pass the base model"):
        load_published_hydra(tmp_path)  # Hydra++ without the base model's shapes
    assert load_published_hydra(tmp_path, base_args=ARGS).config.num_heads == 3

    other = tiny_model()
    with torch.no_grad():
        other.tok_embeddings.weight.add_(1.0)
    with pytest.raises(ValueError, match="another base model"):
        load_published_hydra(tmp_path, other)

    write_hydra(tmp_path, ref, "prefix-mlp", True, 3, 1, hidden_state_offset=2)
    with pytest.raises(ValueError, match="hidden_state_offset"):
        load_published_hydra(tmp_path, model)
    write_hydra(tmp_path, ref, "cross-attn", True, 3, 1)
    with pytest.raises(ValueError, match="cross-attn"):
        load_published_hydra(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps({"num_heads": 3}))
    with pytest.raises(ValueError, match="neither hydra_num_heads nor medusa_num_heads"):
        load_published(tmp_path, model)
