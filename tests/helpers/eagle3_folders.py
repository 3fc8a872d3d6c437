"""EAGLE-3 drafter folders for the pipeline tests: a drafter for a model folder on disk (random, or
trained for a few seconds on the model's own continuations so that drafts get accepted), written in
this project's format, EAGLE's own layout or the speculators layout (`heads=eagle3 heads.dir=...`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.ar import ar_generate
from runtime.eagle3 import Eagle3Drafter, save_drafter, target_forward
from runtime.model.llama import Transformer
from runtime.model.checkpoint import load_model
from tests.helpers.drafters import fit_depth1, random_eagle3
from tests.helpers.models import random_prompts

LAYOUTS = ("ours", "eagle", "speculators")


def drafter_for(model_dir: Path, aux: tuple[int, ...], draft_vocab: int = 512, seed: int = 0,
                train_steps: int = 0, prompts: list[list[int]] | None = None,
                new_tokens: int = 48) -> tuple[Eagle3Drafter, Transformer]:
    """A drafter for the model in `model_dir` (loaded in float32, returned with it), reading the inputs
    of layers `aux`, over `draft_vocab` ids: random, then with `train_steps` steps of depth-1
    teacher-forced training on the model's greedy continuations (`new_tokens`) of `prompts` (default:
    8 random ones), with its draft vocabulary the ids those sequences use most (so that it drafts
    them, and some get accepted)."""
    model = load_model(model_dir, max_seq_len=512)
    drafter = random_eagle3(model, seed=seed, draft_vocab=draft_vocab, aux=aux)
    if not train_steps:
        return drafter, model
    g = torch.Generator().manual_seed(seed)
    data, counts = [], torch.zeros(model.args.vocab_size)
    if prompts is None:
        prompts = random_prompts(8, seed=200 + seed, lengths=(4, 12), vocab=model.args.vocab_size)
    for prompt in prompts:
        x = torch.tensor(list(prompt) + ar_generate(model, list(prompt), new_tokens, eos_ids=()))
        counts += torch.bincount(x, minlength=model.args.vocab_size).float()
        model.reset_cache()
        with torch.inference_mode():
            _, _, features = target_forward(model, x[None, :-1], torch.arange(len(x) - 1), aux)
        data.append((features.clone(), x[1:].clone()))
    top = (counts + 1e-3 * torch.rand(model.args.vocab_size, generator=g)).argsort(descending=True)[:draft_vocab]
    drafter.set_draft_vocab(top.sort().values)
    draft_of = torch.full((model.args.vocab_size,), -1, dtype=torch.long)
    draft_of[drafter.target_ids()] = torch.arange(draft_vocab)
    fit_depth1(drafter, data, draft_of, train_steps)
    return drafter, model


def write_drafter(drafter: Eagle3Drafter, folder: Path, layout: str, file_ids: list[int] | None = None,
                  embeddings: bool = False) -> Path:
    """`drafter` as a folder in `layout`: "ours" (`save_drafter`), "eagle" (EAGLE's own layout, as
    SpecForge writes it: a LlamaConfig + draft_vocab_size, `midlayer.` tensors, `file_ids` as
    `eagle_aux_hidden_state_layer_ids` when given) or "speculators" (`write_speculators`, ids in the
    vLLM convention). `embeddings`: the file also carries the target's token embeddings."""
    from runtime.export.drafters import EAGLE, published_tensors, write_speculators

    if layout == "ours":
        return save_drafter(drafter, folder)
    if layout == "speculators":
        return write_speculators(drafter, folder, "tiny-llama", include_embeddings=embeddings)
    assert layout == "eagle", layout
    from safetensors.torch import save_file

    c = drafter.config
    tensors = published_tensors(drafter, EAGLE)
    if embeddings:
        tensors["embed_tokens.weight"] = drafter.embed(torch.arange(c.vocab_size)).detach().cpu()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": 1, "hidden_act": "silu",
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
              "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
              "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False}
    if file_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(file_ids)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
