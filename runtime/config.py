"""The typed configs of the runtime's objects, without torch: `ModelArgs` (a Llama-family model's
shape, read from a Hugging Face config.json), `HeadsConfig` (a draft-heads folder's shape) and
`SamplingConfig` (how output tokens are chosen).

Kept apart from the modules that build the objects so that reading or keying a configuration
(the pipeline's up-to-date checks) does not import torch; `runtime.model` and `runtime.heads`
re-export them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# the floating dtypes a model or heads run and are stored in, by torch name (`runtime.device.torch_dtype`)
DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# weight files of the published heads layouts (`pipeline.heads.published.read` reads them)
HYDRA_WEIGHTS = "hydra_lm_head.pt"
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": "linear"|"llama3", "factor": ..., ...} (HF keys)
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    o_bias: bool = False  # Llama `attention_bias: true` also puts a bias on o_proj
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral: we refuse caches longer than the window

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ("linear", "llama3"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported; use None, 'linear' or 'llama3'")
            if "factor" not in self.rope_scaling:
                raise ValueError(f"rope_scaling {self.rope_scaling} lacks 'factor'")
            if kind == "llama3":
                missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                           if k not in self.rope_scaling]
                if missing:
                    raise ValueError(f"llama3 rope_scaling lacks {', '.join(missing)}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Read a Hugging Face `config.json` dict (transformers 4 or 5 layout)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; this runtime handles "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) checkpoints")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; only SwiGLU (silu) MLPs are")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by this runtime")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}; is this a Llama-family config?")

        theta, scaling = _read_rope(cfg)
        dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window") if model_type == "mistral" else None,
        )


def _read_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either layout: transformers 4 keeps `rope_theta` at the top level and
    the scaling in `rope_scaling` ({"type"|"rope_type": ...}); transformers 5 puts both in
    `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported (not a Llama-family config)")
    legacy = cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    source = legacy or params
    kind = source.get("rope_type", source.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; use one of {', '.join(SUPPORTED_ROPE_TYPES)} "
                         "(dynamic/yarn/longrope scaling depends on the sequence length and is left out)")
    if float(source.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return float(theta), None
    scaling = {k: v for k, v in source.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return float(theta), scaling


# ----------------------------------------------------------------------------------------------
# Draft heads


KINDS = ("hydra", "medusa")
OUTPUTS = ("shared", "own", "draft")
FORMAT = "entmtp-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
# arithmetic of the drafting output product; None = the heads' own dtype, "auto" = measured
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "int8")


@dataclass
class HeadsConfig:
    hidden_size: int                  # base model hidden size (dim)
    vocab_size: int                   # base model vocabulary
    kind: str = "hydra"               # "hydra" | "medusa"
    num_heads: int = 4                # D: tokens drafted beyond the root
    num_layers: int = 1               # ResBlocks per head
    prefix_layer: bool = False        # Hydra++: one decoder layer over the base hidden states
    output: str = "shared"            # "shared" | "own" | "draft"
    draft_vocab_size: int | None = None  # V_draft: output="draft", or "shared" restricted to draft ids
    draft_dtype: str | None = None    # drafting output product: None (heads' dtype) | DRAFT_DTYPES
    output_bias: bool | None = None   # bias of own/draft output layers; None = Hydra yes, Medusa no
    dropout: float = 0.0              # training only (Hydra uses 0.2); inert at inference
    base_fingerprint: str | None = None  # weights fingerprint of the base model the heads were trained on
    base_args: dict[str, Any] | None = None  # the base ModelArgs (as a dict): shapes of the prefix layer

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"HeadsConfig.{name} must be a positive int, got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"HeadsConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"HeadsConfig.output must be one of {OUTPUTS}, got {self.output!r}")
        v = self.draft_vocab_size
        if self.output == "draft" or (self.output == "shared" and v is not None):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= self.vocab_size:
                raise ValueError(f"output={self.output!r} needs draft_vocab_size in [1, vocab_size={self.vocab_size}], got {v!r}")
        elif v is not None:
            raise ValueError(f"draft_vocab_size is only meaningful with output='draft' or 'shared' (output is "
                             f"{self.output!r}); set it to null")
        if self.draft_dtype is not None and self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"HeadsConfig.draft_dtype must be null or one of {DRAFT_DTYPES}, got {self.draft_dtype!r}")
        if self.output_bias is None:
            self.output_bias = self.kind == "hydra" and self.output != "shared"
        if self.output == "shared" and self.output_bias:
            raise ValueError("output='shared' reuses the base lm_head, which has no bias: set output_bias to false")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"HeadsConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.prefix_layer:
            if self.base_args is None:
                raise ValueError("prefix_layer=True needs base_args (the base ModelArgs as a dict); "
                                 "build the config with HeadsConfig.for_model(model.args, ...)")
            args = self.prefix_args()
            if args.dim != self.hidden_size:
                raise ValueError(f"base_args.dim ({args.dim}) != hidden_size ({self.hidden_size})")

    @classmethod
    def for_model(cls, args: ModelArgs, **kwargs: Any) -> HeadsConfig:
        """A config sized for a base model (hidden size, vocabulary, prefix-layer shapes)."""
        return cls(hidden_size=args.dim, vocab_size=args.vocab_size, base_args=_args_to_dict(args), **kwargs)

    def prefix_args(self) -> ModelArgs:
        """ModelArgs of the one-layer Llama block used by Hydra++."""
        if self.base_args is None:
            raise ValueError("these heads carry no base_args")
        fields = {f.name for f in dataclasses.fields(ModelArgs)}
        unknown = sorted(set(self.base_args) - fields)
        if unknown:
            raise ValueError(f"base_args has unknown keys {unknown}; expected a subset of {sorted(fields)}")
        return ModelArgs(**{**self.base_args, "n_layers": 1})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadsConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown heads config keys {unknown}; known keys: {sorted(fields)}")
        missing = [k for k in ("hidden_size", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"heads config lacks required keys {missing}")
        return cls(**d)


def _args_to_dict(args: ModelArgs) -> dict[str, Any]:
    d = dataclasses.asdict(args)
    d["eos_token_ids"] = list(d["eos_token_ids"])
    return d


# ----------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class SamplingConfig:
    """How each output token is chosen. temperature 0 is greedy argmax (top_k, top_p and seed are
    then irrelevant); temperature > 0 samples from softmax(logits / temperature) restricted to
    the top_k most probable tokens (0 = no limit) and then to the smallest most-probable set whose
    probability reaches top_p (1.0 = no limit), with noise keyed on `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no top-k limit), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = no top-p limit), got {p!r}")
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 1 << 64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, float | int]:
        return {"temperature": float(self.temperature), "top_k": self.top_k, "top_p": float(self.top_p),
                "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict) -> SamplingConfig:
        unknown = set(d) - {"temperature", "top_k", "top_p", "seed"}
        if unknown:
            raise ValueError(f"unknown sampling settings {sorted(unknown)}; known: temperature, top_k, top_p, seed")
        return cls(**d)
