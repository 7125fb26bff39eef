"""Rotary embedding of the rope slice of MLA queries/keys in one launch, and the step's
cos/sin tables in one launch.

The torch form (`rope_ref`) is 9 kernels per call. The model rotates inside
`kernels.latent_cache` with this module's jitted `pair_columns` / `rotate_pairs`; the
`rope` launcher stays as the separate-launch form that bench.kernel_variants' unfused
latent write times and the tests compare against. Rounding follows the torch form exactly:
cos/sin are rounded to x's dtype, each product and the sum/difference are rounded to x's
dtype, as torch does op by op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Semantics: pairs (a, b) of x[t, ..., :] → (a·cos − b·sin, b·cos + a·sin), written as
    [all first halves ⊕ all second halves].

    Pairs are (x[2i], x[2i+1]) when `interleave`, else (x[i], x[i + dim/2]).
    Args:
        x: [T, ..., dim]; cos, sin: [T, dim/2] float32. Returns [T, ..., dim] in x's dtype.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@triton.jit
def pair_columns(offs_i, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Columns of the pairs i: (2i, 2i+1) interleaved, else (i, i + dim/2)."""
    if INTERLEAVE:
        return 2 * offs_i, 2 * offs_i + 1
    return offs_i, offs_i + HALF


@triton.jit
def rotate_pairs(a, b, cos, sin):
    """Pairs (a, b) in x's dtype, cos/sin fp32 → (a·cos − b·sin, b·cos + a·sin) in x's dtype,
    each product and the sum rounded to it as torch does op by op. Shared by every kernel
    that rotates, so they all round alike."""
    dtype = a.dtype
    cos, sin = cos.to(dtype), sin.to(dtype)
    a_cos = (a * cos).to(dtype)
    b_sin = (b * sin).to(dtype)
    b_cos = (b * cos).to(dtype)
    a_sin = (a * sin).to(dtype)
    return (a_cos - b_sin).to(dtype), (b_cos + a_sin).to(dtype)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, M,
    stride_xt, stride_xm, stride_ct, stride_ot, stride_om,
    HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    t = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask = (offs_m[:, None] < M) & (offs_i[None, :] < HALF)
    row = x_ptr + t * stride_xt + offs_m[:, None] * stride_xm
    first, second = pair_columns(offs_i, HALF, INTERLEAVE)
    a = tl.load(row + first[None, :], mask=mask, other=0.0)
    b = tl.load(row + second[None, :], mask=mask, other=0.0)
    cos = tl.load(cos_ptr + t * stride_ct + offs_i, mask=offs_i < HALF, other=0.0)
    sin = tl.load(sin_ptr + t * stride_ct + offs_i, mask=offs_i < HALF, other=0.0)
    rotated_a, rotated_b = rotate_pairs(a, b, cos[None, :], sin[None, :])
    out = out_ptr + t * stride_ot + offs_m[:, None] * stride_om + offs_i[None, :]
    tl.store(out, rotated_a, mask=mask)
    tl.store(out + HALF, rotated_b, mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Triton version of `rope_ref`. x [T, dim] or [T, M, dim] with unit stride in dim."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, dim] or [T, M, dim], unit-stride dim")
    x3 = x if x.dim() == 3 else x[:, None, :]
    tokens, heads, dim = x3.shape
    half = dim // 2
    if dim % 2 or cos.shape != (tokens, half) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [T, dim/2] for x {tuple(x.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        block_m = min(16, next_power_of_2(heads))
        fast(_rope_kernel)[(tokens, cdiv(heads, block_m))](
            x3, cos, sin, out, heads,
            x3.stride(0), x3.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            HALF=half, BLOCK_M=block_m, BLOCK_HALF=next_power_of_2(half),
            INTERLEAVE=interleave,
        )  # fmt: skip
    return out.view(x.shape)


def rope_cos_sin_ref(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: cos, sin [T, dim/2] float32 of the angles positions[t] · inv_freq[i],
    each times `scale` (YaRN's attention factor). positions: int [T]; inv_freq: float32
    [dim/2]. Six torch kernels."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
    return angles.cos() * scale, angles.sin() * scale


# Rows of the cos/sin tables a program writes.
COS_SIN_BLOCK_T = 32


@triton.jit(do_not_specialize=["T"])
def _cos_sin_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, T, scale,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """The float32 ops of `rope_cos_sin_ref`, in its order: the product, cos / sin, the
    scale."""
    grid_dependency_control()
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_t, mask_i = offs_t < T, offs_i < HALF
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + offs_i, mask=mask_i, other=0.0)
    angles = pos[:, None] * inv_freq[None, :]  # [t, i]
    offs = offs_t[:, None].to(tl.int64) * HALF + offs_i[None, :]
    mask = mask_t[:, None] & mask_i[None, :]
    tl.store(cos_ptr + offs, tl.cos(angles) * scale, mask=mask)
    tl.store(sin_ptr + offs, tl.sin(angles) * scale, mask=mask)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rope_cos_sin_ref`: one launch instead of six (a decode step's
    first kernels, ahead of every layer)."""
    if positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(
            f"positions must be [T] and inv_freq float32 [dim/2]: {tuple(positions.shape)}, "
            f"{tuple(inv_freq.shape)} {inv_freq.dtype}"
        )
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((tokens, half), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens:
        fast(_cos_sin_kernel)[(cdiv(tokens, COS_SIN_BLOCK_T),)](
            positions.contiguous(), inv_freq.contiguous(), cos, sin, tokens, scale,
            HALF=half, BLOCK_T=COS_SIN_BLOCK_T, BLOCK_HALF=next_power_of_2(half),
        )  # fmt: skip
    return cos, sin
