"""Rotary position embedding (RoPE): rotate pairs of q/k features by a position angle.

The dot product of a rotated query and key then depends only on their distance.
Feature i rotates at frequency theta^(-2i/d); Llama 3's scaling slows the low
frequencies so that a model trained on 8K positions reads 128K; YaRN (DeepSeek-V3)
blends interpolated and original frequencies along a ramp and may scale cos/sin by an
attention factor. The layout is "rotate half" (feature i pairs with i + d/2), the layout
Hugging Face checkpoints use.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":  # position interpolation: positions squeezed by `factor`
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn_scaling(head_dim, theta, scaling)
    elif rope_type == "freq_factors":  # llama.cpp's rope_freqs: each frequency divided by its own factor
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"freq_factors has {factors.numel()} factors; a head of {head_dim} rotates "
                             f"{inv_freq.numel()} pairs")
        inv_freq = inv_freq / factors
    return inv_freq


def _yarn_scaling(dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023, arXiv:2309.00071), as transformers computes it: frequencies
    that turn fewer than beta_slow times over the original context are interpolated
    (divided by `factor`), those turning more than beta_fast times are kept, a linear ramp between."""
    factor, old_len = float(s["factor"]), s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_attention_factor(scaling: dict | None) -> float:
    """YaRN's multiplier on cos and sin (1.0 for every other RoPE)."""
    s = scaling or {}
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(m=1.0):
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale()


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Long wavelengths are divided by `factor`, short ones kept, the middle band blended."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(middle, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        factor = yarn_attention_factor(scaling)
        # A table of cos/sin for every position, looked up by each token's position id.
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)
        # sin with rotate_half's minus sign folded into its first half: rotate_half(x) * sin
        # = [x2, x1] * signed_sin, one copy instead of chunk + neg + cat
        half = head_dim // 2
        self.register_buffer("signed_sin", torch.cat([-emb.sin()[:, :half], emb.sin()[:, half:]], -1) * factor,
                             persistent=False)
        self._step: tuple | None = None

    def new_step(self) -> None:
        """Forget the last lookup. A replayed step (CUDA graphs, llmopt/worker/cuda_graphs.py) passes the
        same positions buffer each time with new contents: its lookup must run, and be recorded, anew."""
        self._step = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim] turned by their positions'
        angles: x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1]."""
        # the cos and signed sin rows [tokens, 1, head_dim] of the step's positions: every layer of
        # a step passes the same positions tensor, so the lookup is done once per step
        if self._step is None or self._step[0] is not positions or self._step[1] != q.dtype:
            self._step = (positions, q.dtype, self.cos[positions].unsqueeze(1).to(q.dtype),
                          self.signed_sin[positions].unsqueeze(1).to(q.dtype))
        cos, sin = self._step[2], self._step[3]
        # rotate_half(x) * sin = [x2, x1] * signed_sin: the halves swapped by one view and flip
        return (q * cos + q.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin,
                k * cos + k.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin)
