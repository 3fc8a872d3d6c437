"""Your own model: Vicuna-layout folders (.bin shards, sentencepiece tokenizer, no chat template),
sharded-safetensors folders, and heads in the published Hydra / Medusa-1 layouts (needs sentencepiece)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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
