"""MLA's per-token work between the projections and the attention, in one launch: kv_a_norm
of the latent, RoPE of the key's rope part, the scatter of both into the paged latent
cache, and RoPE of the queries' rope parts (same token, same angles).

The torch form is five launches per layer (the norm, two rotations, a concatenation and an
indexed copy); at a 64-sequence decode step each is a ~2-4 µs latency-bound kernel. Each
part rounds exactly as its one-launch kernel does (`kernels.rms_norm`, `kernels.rope`): the
same jitted row functions compute them.

Shape legend: T tokens, H heads, C kv_lora_rank, R qk_rope_head_dim, S cache rows (pages ·
page size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control
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
    q_rope: torch.Tensor,
) -> torch.Tensor:
    """Semantics: cache_rows[slot[t]] = rms_norm(kv_a[t, :C]) ⊕ rope(kv_a[t, C:]);
    returns rope(q_rope).

    Args:
        kv_a: [T, C + R] (rows may be strided: kv_a lies inside the qkv_a output);
        norm_weight: [C] (kv_a_norm); cos, sin: [T, R/2] float32;
        cache_rows: [S, C + R] written in place at rows slot_mapping [T] (int64);
        q_rope: [T, H, R] (strided: inside q). Returns the rotated queries [T, H, R].
    """
    latent_dim = norm_weight.shape[0]
    latent, k_rope = kv_a.split([latent_dim, kv_a.shape[-1] - latent_dim], dim=-1)
    row = torch.cat(
        [rms_norm_ref(latent, norm_weight, eps), rope_ref(k_rope, cos, sin, interleave)], -1
    )
    cache_rows[slot_mapping] = row.to(cache_rows.dtype)
    return rope_ref(q_rope, cos, sin, interleave)


@triton.jit
def _write_latent_cache_kernel(
    kv_a_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_ptr, q_out_ptr, H,
    stride_kv, stride_cos, stride_cache, stride_qt, stride_qh, stride_qot, stride_qoh, eps,
    C: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
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
    cos = tl.load(cos_ptr + t * stride_cos + offs_i, mask=pair_mask, other=0.0)
    sin = tl.load(sin_ptr + t * stride_cos + offs_i, mask=pair_mask, other=0.0)
    a = tl.load(source + C + first, mask=pair_mask, other=0.0)
    b = tl.load(source + C + second, mask=pair_mask, other=0.0)
    rotated_a, rotated_b = rotate_pairs(a, b, cos, sin)
    tl.store(dest + C + offs_i, rotated_a.to(cache_dtype), mask=pair_mask)
    tl.store(dest + C + HALF + offs_i, rotated_b.to(cache_dtype), mask=pair_mask)

    # The queries' rope parts: [BLOCK_H heads, pairs] at a time.
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < H) & pair_mask[None, :]
        q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        qa = tl.load(q_row + first[None, :], mask=mask, other=0.0)
        qb = tl.load(q_row + second[None, :], mask=mask, other=0.0)
        rotated_qa, rotated_qb = rotate_pairs(qa, qb, cos[None, :], sin[None, :])
        q_out = q_out_ptr + t * stride_qot + heads[:, None] * stride_qoh + offs_i[None, :]
        tl.store(q_out, rotated_qa, mask=mask)
        tl.store(q_out + HALF, rotated_qb, mask=mask)


def write_latent_cache(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    cache_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_rope: torch.Tensor,
) -> torch.Tensor:
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
    if q_rope.dim() != 3 or q_rope.shape[0] != tokens or q_rope.shape[2] != rope_dim:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} must be [T, H, R] with R = {rope_dim}")
    if q_rope.dtype != kv_a.dtype or q_rope.stride(-1) != 1:
        raise ValueError("q_rope shares kv_a's dtype and has unit stride in the last dim")
    heads = q_rope.shape[1]
    q_out = torch.empty((tokens, heads, rope_dim), dtype=q_rope.dtype, device=q_rope.device)
    if not tokens:
        return q_out
    cos, sin = cos.contiguous(), sin.contiguous()
    block_c = next_power_of_2(latent_dim)
    fast(_write_latent_cache_kernel)[(tokens,)](
        kv_a, norm_weight, cos, sin, slot_mapping, cache_rows, q_rope, q_out, heads,
        kv_a.stride(0), cos.stride(0), cache_rows.stride(0), q_rope.stride(0),
        q_rope.stride(1), q_out.stride(0), q_out.stride(1), eps,
        C=latent_dim, HALF=rope_dim // 2, BLOCK_C=block_c,
        BLOCK_HALF=next_power_of_2(rope_dim // 2), BLOCK_H=min(16, next_power_of_2(heads)),
        INTERLEAVE=interleave, num_warps=4 if block_c <= 2048 else 8,
    )  # fmt: skip
    return q_out
