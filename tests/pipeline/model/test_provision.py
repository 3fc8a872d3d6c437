"""Your own model and published heads: a tiny random Llama written in Vicuna v1.3's on-disk layout
(two `.bin` shards + `pytorch_model.bin.index.json`, a sentencepiece `tokenizer.model` trained
here, a tokenizer config without a chat template) and in a sharded-safetensors layout goes through
the model stage; draft heads written key by key in the published Hydra, Hydra++ and Medusa-1
layouts go through the heads import.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from pipeline.model.chat_templates import CHAT_TEMPLATES, VICUNA_SYSTEM, describe_chat_template, render, resolve_chat_template
from pipeline.heads.published.convert import export_published_hydra, heads_folder_kind, import_heads
from pipeline.model.provision import inspect_model_folder, provision_model, resolve_max_seq_len
from runtime.fingerprint import weights_fingerprint
from runtime.heads import load_heads
from runtime.model.checkpoint import load_model, load_tokenizer
from pipeline.heads.published.read import load_published
from runtime.tree import Tree, TreeBuffers
from tests.helpers.own_model import (
    POSITIONS, hf_reference, write_published_hydra, write_published_medusa, write_sharded_safetensors_folder, write_vicuna_bin_folder,
)

sentencepiece = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")

PROMPTS = ["Write a function that returns the sum of two numbers.", "How many clips did Natalia sell in May?"]
TREES = (Tree.chain(3), Tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]), Tree.named("mc_sim_7b_63"))


@pytest.fixture(scope="module", params=["bin", "safetensors"])
def own_model(request, tmp_path_factory):
    """(source folder, its state dict, the model stage's output folder, artifacts dir)."""
    root = tmp_path_factory.mktemp(f"own-{request.param}")
    src = root / "source"
    src.mkdir()
    writer = write_vicuna_bin_folder if request.param == "bin" else write_sharded_safetensors_folder
    state = writer(src)
    cfg = {"name": "tiny-vicuna", "source": "local", "path": str(src), "dtype": "float32", "max_seq_len": None,
           "chat_template": "vicuna_v1.1"}
    out = provision_model(cfg, root / "artifacts")
    return src, state, out, root / "artifacts", cfg


# ---------------------------------------------------------------------------------------------- model stage


def test_converted_model_matches_transformers_on_the_original_weights(own_model) -> None:
    src, state, out, _, _ = own_model
    assert out != src and (out / "manifest.json").is_file()
    assert not list(out.glob("*.bin")) and list(out.glob("*.safetensors"))
    assert (out / "model.safetensors.index.json").is_file()  # two source shards -> two safetensors shards
    hf = hf_reference(json.loads((src / "config.json").read_text()), state)
    ours = load_model(out, dtype=torch.float32, max_seq_len=64)
    ids = torch.randint(3, hf.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = hf(ids).logits
        logits, _ = ours(ids, torch.arange(ids.shape[1]))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_converted_tokenizer_round_trips_like_sentencepiece(own_model) -> None:
    src, _, out, _, _ = own_model
    sp = sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    tok = load_tokenizer(out)  # what the runtime reads: tokenizer.json through `tokenizers`
    for text in [*PROMPTS, "def add(a, b):\n    return a + b", "Ünïcödé  spaces\tand 1234"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text)
        assert tok.decode(ids) == sp.decode(ids)
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2


def test_chat_template_renders_with_the_converted_tokenizer(own_model) -> None:
    from transformers import AutoTokenizer

    _, _, out, _, _ = own_model
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == f"<s>{VICUNA_SYSTEM} USER: Hi there ASSISTANT:"
    assert describe_chat_template(out)["name"] == "vicuna_v1.1"
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())


def test_model_stage_converts_once_and_validates_max_seq_len(own_model, caplog) -> None:
    src, _, out, artifacts, cfg = own_model
    fp = weights_fingerprint(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["fingerprint"] == fp and manifest["summary"]["chat_template"] == "vicuna_v1.1"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert provision_model(cfg, artifacts) == out
    assert "up to date" in caplog.text  # stages log through `logging`
    assert resolve_max_seq_len(cfg, out) == POSITIONS  # null = the model's max_position_embeddings
    assert resolve_max_seq_len({**cfg, "max_seq_len": 256}, out) == 256
    with pytest.raises(ValueError, match=rf"max_seq_len=4096 exceeds .*max_position_embeddings={POSITIONS}"):
        provision_model({**cfg, "max_seq_len": 4096}, artifacts)


def test_folder_without_template_fails_listing_the_names(own_model, tmp_path) -> None:
    src, _, _, _, cfg = own_model
    with pytest.raises(ValueError, match="vicuna_v1.1, llama2, chatml"):
        provision_model({**cfg, "chat_template": None}, tmp_path)
    with pytest.raises(ValueError, match=r"'vicuna'.*auto, vicuna_v1.1, llama2, chatml"):
        provision_model({**cfg, "chat_template": "vicuna"}, tmp_path)
    assert inspect_model_folder(src).tokenizer == "sentencepiece"


# ---------------------------------------------------------------------------------------------- templates


def test_named_templates_follow_their_formats() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert render(CHAT_TEMPLATES["vicuna_v1.1"], msgs, "<s>", "</s>") == "<s>Be brief. USER: Hi ASSISTANT: Hello!</s>USER: Bye ASSISTANT:"
    assert render(CHAT_TEMPLATES["llama2"], msgs, "<s>", "</s>") == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]")
    assert render(CHAT_TEMPLATES["chatml"], msgs[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(CHAT_TEMPLATES["llama2"], msgs[1:2], "<s>", "</s>") == "<s>[INST] Hi [/INST]"


def test_auto_uses_the_folders_own_template(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert resolve_chat_template(None, tmp_path) == ("auto", "{{ messages[0]['content'] }}")
    assert resolve_chat_template("auto", tmp_path)[1] == "{{ messages[0]['content'] }}"
    assert resolve_chat_template("chatml", tmp_path) == ("chatml", CHAT_TEMPLATES["chatml"])
    assert describe_chat_template(tmp_path)["name"] == "own"


# ---------------------------------------------------------------------------------------------- published heads


def _prefill(model, prompt_ids: list[int]) -> tuple[torch.Tensor, int]:
    """Base hidden states of a prompt and the root token (its greedy next token)."""
    model.reset_cache()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        logits, hidden = model(ids, torch.arange(ids.shape[1]))
    return hidden, int(logits[0, -1].argmax())


def _drafts(heads, hidden: torch.Tensor, root: int) -> list[list[int]]:
    heads.reset()
    with torch.inference_mode():
        h = heads.observe(hidden, torch.arange(hidden.shape[1]))
        return [heads.propose(h, root, TreeBuffers.compile(t)).tolist() for t in TREES]


@pytest.mark.parametrize("layout", ["hydra", "hydra_pp", "medusa"])
def test_published_heads_convert_strictly_and_draft_alike(own_model, tmp_path, layout: str) -> None:
    src, state, model_dir, artifacts, _ = own_model
    pub = tmp_path / f"published-{layout}"
    if layout == "medusa":
        write_published_medusa(pub, vocab=state["model.embed_tokens.weight"].shape[0])
    else:
        write_published_hydra(pub, state, "prefix-mlp" if layout == "hydra_pp" else "mlp")
    out = artifacts / "heads" / "tiny-vicuna" / f"{layout}_published"
    assert import_heads(pub, model_dir, out) == out
    assert heads_folder_kind(out) == "project"
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    ckpt = next(pub.glob("*_lm_head.pt"))
    assert summary["source"] == str(pub.resolve()) and summary["checkpoint"] == ckpt.name
    assert summary["checkpoint_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert summary["base_embeddings_checked"] == (layout != "medusa")
    assert summary["heads"]["dtype"] == "float16"

    model = load_model(model_dir, dtype=torch.float32, max_seq_len=256)
    converted = load_heads(out, model=model, base_fingerprint=weights_fingerprint(model_dir))
    direct = load_published(pub, model=model)  # pipeline.heads.published.read read in place: the reference
    tok = load_tokenizer(model_dir)
    for prompt in PROMPTS:
        hidden, root = _prefill(model, tok.encode(prompt, add_special_tokens=False).ids)
        assert _drafts(converted, hidden, root) == _drafts(direct, hidden, root)
    assert import_heads(out, model_dir, tmp_path / "unused") == out  # project format: used as it is


def test_published_heads_for_another_base_model_are_refused(own_model, tmp_path) -> None:
    _, state, model_dir, _, _ = own_model
    other = {**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"] + 1.0}
    write_published_hydra(tmp_path / "pub", other, "mlp")
    with pytest.raises(ValueError, match="trained for another base model"):
        import_heads(tmp_path / "pub", model_dir, tmp_path / "out")
    write_published_medusa(tmp_path / "pub-medusa", vocab=123)
    with pytest.raises(ValueError, match="another model"):
        import_heads(tmp_path / "pub-medusa", model_dir, tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


# ---------------------------------------------------------------------------------------------- shipped heads


# ~40 s each on the 2-core bench machine (a 135M model loaded, ~0.5 GB written and read back):
# the Medusa variant runs with the slow tests only
@pytest.mark.parametrize("name", ["hydra", pytest.param("medusa", marks=pytest.mark.slow)])
def test_shipped_heads_survive_the_published_hydra_layout(smollm2_dir, tmp_path, name: str) -> None:
    """The default model's shipped heads, written as a published Hydra folder and read back through
    the importer, draft the same tokens on real prompts."""
    shipped = Path("artifacts/heads") / smollm2_dir.name / name
    if not (shipped / "heads.safetensors").is_file():
        pytest.skip(f"no shipped heads at {shipped}")
    model = load_model(smollm2_dir, dtype=torch.float32, max_seq_len=512)
    heads = load_heads(shipped, model=model)
    pub = export_published_hydra(heads, tmp_path / "published", base_model_name_or_path=smollm2_dir.name)
    assert heads_folder_kind(pub) == "hydra"
    out = import_heads(pub, smollm2_dir, tmp_path / "converted")
    back = load_heads(out, model=model, base_fingerprint=weights_fingerprint(smollm2_dir))
    assert back.config.kind == heads.config.kind and back.config.num_heads == heads.config.num_heads
    tok = load_tokenizer(smollm2_dir)
    for prompt in [*PROMPTS, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]:
        hidden, root = _prefill(model, tok.encode(prompt, add_special_tokens=False).ids)
        assert _drafts(back, hidden, root) == _drafts(heads, hidden, root)


def test_import_never_overwrites_trained_or_shipped_heads(own_model, tmp_path) -> None:
    _, state, model_dir, _, _ = own_model
    write_published_hydra(tmp_path / "pub", state, "mlp")
    trained = tmp_path / "heads" / "hydra"
    trained.mkdir(parents=True)
    (trained / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="heads.name=hydra_published"):
        import_heads(tmp_path / "pub", model_dir, trained)
    assert (trained / "config.json").read_text() == "{}"


def test_bin_with_pickled_objects_is_refused(tmp_path) -> None:
    from pipeline.model.provision import convert_bin_weights

    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "extra": Path("x")}, tmp_path / "pytorch_model.bin")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="pickled Python objects"):
        convert_bin_weights([tmp_path / "pytorch_model.bin"], tmp_path / "out")


def test_hub_unreachable_says_what_to_do(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = {"name": "vicuna", "source": "hub", "repo_id": "lmsys/vicuna-7b-v1.3", "revision": None}
    with pytest.raises(RuntimeError, match=r"could not download 'lmsys/vicuna-7b-v1.3'.*model=local model.path="):
        provision_model(cfg, tmp_path)


def test_startup_validation_accepts_own_model_and_published_heads(own_model, tmp_path) -> None:
    from hydra import compose, initialize_config_dir

    from pipeline.config.validate import config_problems
    from tests.helpers import REPO

    src, state, _, _, _ = own_model
    write_published_hydra(tmp_path / "pub", state, "prefix-mlp")

    def problems(*extra: str) -> list[str]:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["model=local", f"model.path={src}", f"heads.dir={tmp_path / 'pub'}",
                                               f"artifacts_dir={tmp_path}", f"data_dir={tmp_path}", *extra])
        return config_problems(cfg)

    # the default heads config derives a frequency-ranked draft vocabulary from the shared lm_head,
    # which published heads (own output layers) do not have: the heads stage skips it for them (and
    # says so), so neither setting is refused
    assert problems("model.chat_template=vicuna_v1.1", "profile.max_prompt_tokens=256") == []
    assert problems("model.chat_template=vicuna_v1.1", "profile.max_prompt_tokens=256", "heads.draft_vocab.size=null") == []
    assert any("model.chat_template='vicuna'" in p and "llama2" in p
               for p in problems("model.chat_template=vicuna", "profile.max_prompt_tokens=256"))
    # null max_seq_len resolves to the folder's max_position_embeddings, too small for the cpu profile
    assert any(f"model.max_seq_len={POSITIONS} is too small" in p for p in problems("model.chat_template=vicuna_v1.1"))
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text((src / "config.json").read_text())
    assert any("holds no weights" in p for p in problems(f"model.path={empty}", "profile.max_prompt_tokens=256"))


def test_runtime_ready_folder_is_used_in_place_or_linked_with_another_template(own_model, tmp_path) -> None:
    _, _, out, _, _ = own_model
    cfg = {"name": "ready", "source": "local", "path": str(out), "max_seq_len": None}
    assert provision_model({**cfg, "chat_template": None}, tmp_path) == out  # complete: used in place
    linked = provision_model({**cfg, "chat_template": "chatml"}, tmp_path)
    assert linked == tmp_path / "models" / "ready"
    assert (linked / "chat_template.jinja").read_text() == CHAT_TEMPLATES["chatml"]
    for f in out.glob("*.safetensors"):  # the weights are linked, not copied
        assert (linked / f.name).samefile(f) or (linked / f.name).resolve() == f.resolve()
    assert weights_fingerprint(linked) == weights_fingerprint(out)


def test_runtime_renders_the_chat_like_prepare(own_model) -> None:
    """runtime.api.render_chat (no transformers) gives the prompt transformers renders, BOS included."""
    from transformers import AutoTokenizer

    from runtime.api import render_chat

    _, _, out, _, _ = own_model
    expected = AutoTokenizer.from_pretrained(str(out)).apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, tokenize=False)
    assert render_chat(out, PROMPTS[0]) == expected and expected.startswith("<s>")
