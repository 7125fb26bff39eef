"""Rotary position embedding for the `qk_rope_head_dim` slice of MLA queries and keys.

Plain RoPE and YaRN (frequency ramp between interpolation and extrapolation, plus the
`attention_factor` scale on cos/sin). The softmax-side YaRN correction (mscale²) lives in
`ModelConfig.softmax_scale`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inference_svc.model.config import RopeConfig, yarn_mscale
from kernels.rope import rope_cos_sin, rope_cos_sin_ref


def rope_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin scale (YaRN attention factor)."""
    dim = rope.dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta**exponents
    if not rope.is_yarn:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    if rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
            rope.factor, rope.mscale_all_dim
        )
    else:
        attention_factor = yarn_mscale(rope.factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Semantics: x[..., pairs] rotated by angle pos·inv_freq, scaled by the YaRN factor
    (the rotation itself: `kernels.rope`, applied inside `kernels.latent_cache`).

    Interleaved layout (DeepSeek checkpoints): pairs are (x0, x1), (x2, x3), ...; the output
    is written de-interleaved, [rotated evens ⊕ rotated odds], as transformers does. Queries
    and keys get the same permutation, so their dot products are unchanged.
    Non-interleaved layout: pairs are (x_i, x_{i+dim/2}) (rotate-half).
    """

    def __init__(self, rope: RopeConfig, device: torch.device | str):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(rope)
        self.interleave = rope.interleave
        self.inv_freq = nn.Buffer(inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim/2] in float32 for integer positions [T]."""
        tables = rope_cos_sin if positions.is_cuda else rope_cos_sin_ref
        return tables(positions, self.inv_freq, self.attention_factor)
