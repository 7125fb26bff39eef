"""MLA's cache write in one launch: kv_a_norm of the latent, RoPE of the key's rope part,
and the scatter of both into the paged latent cache.

The torch form is four launches per layer (the norm, the rotation, a concatenation and an
indexed copy); at a 64-sequence decode step each is a ~2-4 µs latency-bound kernel. Each
part rounds exactly as its one-launch kernel does (`kernels.rms_norm`, `kernels.rope`): the
same jitted row functions compute them.

Shape legend: T tokens, C kv_lora_rank, R qk_rope_head_dim, S cache rows (pages · page size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import next_power_of_2
from kernels.rms_norm import rms_norm_ref, rms_normalize_row
from kernels.rope import pair_columns, rope_ref, rotate_pairs


def write_latent_cache_ref(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    cache_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Semantics: cache_rows[slot[t]] = rms_norm(kv_a[t, :C]) ⊕ rope(kv_a[t, C:]).

    Args:
        kv_a: [T, C + R] (rows may be strided: kv_a lies inside the qkv_a output);
        norm_weight: [C] (kv_a_norm); cos, sin: [T, R/2] float32;
        cache_rows: [S, C + R] written in place at rows slot_mapping [T] (int64).
    """
    latent_dim = norm_weight.shape[0]
    latent, k_rope = kv_a.split([latent_dim, kv_a.shape[-1] - latent_dim], dim=-1)
    row = torch.cat(
        [rms_norm_ref(latent, norm_weight, eps), rope_ref(k_rope, cos, sin, interleave)], -1
    )
    cache_rows[slot_mapping] = row.to(cache_rows.dtype)


@triton.jit
def _write_latent_cache_kernel(
    kv_a_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
    stride_kv, stride_cos, stride_cache, eps,
    C: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    source = kv_a_ptr + t * stride_kv
    dest = cache_ptr + tl.load(slot_ptr + t) * stride_cache
    dtype = kv_a_ptr.dtype.element_ty
    cache_dtype = cache_ptr.dtype.element_ty

    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < C
    latent = tl.load(source + cols, mask=col_mask, other=0.0)
    normed = rms_normalize_row(latent, w_ptr, cols, col_mask, C, eps)
    tl.store(dest + cols, normed.to(dtype).to(cache_dtype), mask=col_mask)

    offs_i = tl.arange(0, BLOCK_HALF)
    pair_mask = offs_i < HALF
    first, second = pair_columns(offs_i, HALF, INTERLEAVE)
    a = tl.load(source + C + first, mask=pair_mask, other=0.0)
    b = tl.load(source + C + second, mask=pair_mask, other=0.0)
    cos = tl.load(cos_ptr + t * stride_cos + offs_i, mask=pair_mask, other=0.0)
    sin = tl.load(sin_ptr + t * stride_cos + offs_i, mask=pair_mask, other=0.0)
    rotated_a, rotated_b = rotate_pairs(a, b, cos, sin)
    tl.store(dest + C + offs_i, rotated_a.to(cache_dtype), mask=pair_mask)
    tl.store(dest + C + HALF + offs_i, rotated_b.to(cache_dtype), mask=pair_mask)


def write_latent_cache(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    cache_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of `write_latent_cache_ref` (same arguments): one program per token."""
    tokens, width = kv_a.shape
    latent_dim = norm_weight.shape[0]
    rope_dim = width - latent_dim
    if rope_dim <= 0 or rope_dim % 2 or cache_rows.shape[-1] != width:
        raise ValueError(
            f"kv_a {tuple(kv_a.shape)}, norm weight {tuple(norm_weight.shape)}, cache rows "
            f"{tuple(cache_rows.shape)}: need widths C + R with an even R"
        )
    if norm_weight.dtype != kv_a.dtype or kv_a.stride(-1) != 1 or cache_rows.stride(-1) != 1:
        raise ValueError("kv_a and the norm weight share a dtype; unit stride in the last dim")
    if cos.shape != (tokens, rope_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [T, R/2] for kv_a {kv_a.shape}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one row per token")
    if not tokens:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    block_c = next_power_of_2(latent_dim)
    _write_latent_cache_kernel[(tokens,)](
        kv_a, norm_weight, cos, sin, slot_mapping, cache_rows,
        kv_a.stride(0), cos.stride(0), cache_rows.stride(0), eps,
        C=latent_dim, HALF=rope_dim // 2, BLOCK_C=block_c,
        BLOCK_HALF=next_power_of_2(rope_dim // 2), INTERLEAVE=interleave,
        num_warps=4 if block_c <= 2048 else 8,
    )  # fmt: skip
