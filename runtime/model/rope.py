"""Rotary position embeddings (RoPE): the inverse frequencies with the checkpoint's scaling
(none, linear or llama3), the cos/sin tables a model precomputes for its cache length, and the
rotation itself.

A module of its own because every forward path uses it: the plain forward (`runtime.model.llama`),
the row-invariant and batched ones (`runtime.model.invariant`, `runtime.model.batch`, which may not
import llama.py) and the heads (`runtime.heads`, which compute the tables for just the positions
they need)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from runtime.config import ModelArgs


def rope_inv_freq(args: ModelArgs, device: torch.device | str = "cpu") -> Tensor:
    """Per-pair inverse frequencies (float32, [head_dim/2], on `device`) with the checkpoint's scaling applied."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args: ModelArgs, max_len: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """cos and sin tables [max_len, head_dim] in float32 (each frequency repeated for both halves)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), rope_inv_freq(args, device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [n, heads, head_dim] by cos/sin [n, 1, head_dim] (rotate-half convention), in float32."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
