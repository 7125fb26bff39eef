"""MLA `attn.kv_b` LoRA in the absorbed decode path, without materialising B·A.

The absorbed path never forms k_nope / v: it folds kv_b's weight into the query
(q_lat = q_nope·W_UK, per head) and into the output (o = o_lat·W_UVᵀ). kv_b's LoRA
ΔW = B·A (A `[slots, R, kv_lora_rank]`, B `[slots, H*(nope+v), R]` with head h's rows
h*(nope+v) + [0:nope] = k part, + [nope:nope+v] = v part) is folded the same way:

    q_lat[t,h,:] += (q_nope[t,h,:] · B_k[slot,h]) · A[slot]        (before attention)
    o[t,h,:]     += (o_lat[t,h,:] · A[slot]ᵀ) · B_v[slot,h]ᵀ        (after attention)

Each correction is one launch (they sit on either side of the attention kernel), one
program per (segment, head): the rank-sized intermediate stays in registers. Shapes:
T tokens, H heads, D = qk_nope_head_dim, V = v_head_dim, C = kv_lora_rank, R pool rank.
Prefill runs the unabsorbed path, where kv_b LoRA is plain SGMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.lora_segments import LoraSegments, live_rank_columns, load_segment
from kernels.sgmv import dot_precision


@triton.jit
def _mla_kv_b_lora_q_kernel(
    q_nope_ptr,
    q_lat_ptr,
    a_ptr,
    b_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    NOPE,
    V,
    C,
    stride_nt,
    stride_nh,
    stride_nd,
    stride_lt,
    stride_lh,
    stride_lc,
    stride_as,
    stride_ar,
    stride_ac,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
    if rank == 0:
        return
    offs_t = t_start + tl.arange(0, BLOCK_T)
    mask_t = offs_t < t_end
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    b_k = b_ptr + slot.to(tl.int64) * stride_bs + head * (NOPE + V) * stride_bn
    z = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)  # [t, r] = q_nope · B_k
    for d in range(0, NOPE, BLOCK_D):
        offs_d = d + tl.arange(0, BLOCK_D)
        mask_d = offs_d < NOPE
        q = tl.load(
            q_nope_ptr
            + offs_t[:, None] * stride_nt
            + head * stride_nh
            + offs_d[None, :] * stride_nd,
            mask=mask_t[:, None] & mask_d[None, :],
            other=0.0,
        )  # [t, d]
        b = tl.load(
            b_k + offs_d[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=mask_d[:, None] & mask_r[None, :],
            other=0.0,
        )  # [d, r]
        z = tl.dot(q, b, z, input_precision=DOT_PRECISION)
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    for c in range(0, C, BLOCK_C):
        offs_c = c + tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        a = tl.load(
            a_slot + offs_r[:, None] * stride_ar + offs_c[None, :] * stride_ac,
            mask=mask_r[:, None] & mask_c[None, :],
            other=0.0,
        )  # [r, c]
        delta = tl.dot(z.to(a.dtype), a, input_precision=DOT_PRECISION)  # [t, c]
        lat_ptrs = (
            q_lat_ptr + offs_t[:, None] * stride_lt + head * stride_lh + offs_c[None, :] * stride_lc
        )
        lat_mask = mask_t[:, None] & mask_c[None, :]
        prev = tl.load(lat_ptrs, mask=lat_mask, other=0.0)
        tl.store(lat_ptrs, (prev.to(tl.float32) + delta).to(prev.dtype), mask=lat_mask)


@triton.jit
def _mla_kv_b_lora_o_kernel(
    o_lat_ptr,
    o_ptr,
    a_ptr,
    b_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    NOPE,
    V,
    C,
    stride_lt,
    stride_lh,
    stride_lc,
    stride_ot,
    stride_oh,
    stride_ov,
    stride_as,
    stride_ar,
    stride_ac,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    slot, rank, t_start, t_end = load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr)
    if rank == 0:
        return
    offs_t = t_start + tl.arange(0, BLOCK_T)
    mask_t = offs_t < t_end
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    z = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)  # [t, r] = o_lat · Aᵀ
    for c in range(0, C, BLOCK_C):
        offs_c = c + tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        lat = tl.load(
            o_lat_ptr
            + offs_t[:, None] * stride_lt
            + head * stride_lh
            + offs_c[None, :] * stride_lc,
            mask=mask_t[:, None] & mask_c[None, :],
            other=0.0,
        )  # [t, c]
        a = tl.load(
            a_slot + offs_c[:, None] * stride_ac + offs_r[None, :] * stride_ar,
            mask=mask_c[:, None] & mask_r[None, :],
            other=0.0,
        )  # [c, r]
        z = tl.dot(lat, a, z, input_precision=DOT_PRECISION)
    b_v = b_ptr + slot.to(tl.int64) * stride_bs + (head * (NOPE + V) + NOPE) * stride_bn
    for v in range(0, V, BLOCK_V):
        offs_v = v + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        b = tl.load(
            b_v + offs_v[None, :] * stride_bn + offs_r[:, None] * stride_br,
            mask=mask_v[None, :] & mask_r[:, None],
            other=0.0,
        )  # [r, v]
        delta = tl.dot(z.to(b.dtype), b, input_precision=DOT_PRECISION)  # [t, v]
        o_ptrs = (
            o_ptr + offs_t[:, None] * stride_ot + head * stride_oh + offs_v[None, :] * stride_ov
        )
        o_mask = mask_t[:, None] & mask_v[None, :]
        prev = tl.load(o_ptrs, mask=o_mask, other=0.0)
        tl.store(o_ptrs, (prev.to(tl.float32) + delta).to(prev.dtype), mask=o_mask)


def mla_kv_b_lora_q(
    q_nope: Tensor, q_lat: Tensor, A: Tensor, B: Tensor, segs: LoraSegments
) -> Tensor:
    """Add kv_b LoRA's key part to the absorbed query, in place.

    Semantics: q_lat[t,h] += (q_nope[t,h] · B[slot, h*(D+V) : h*(D+V)+D, :rank]) · A[slot, :rank]

    Args:
        q_nope: [T, H, D] (may be a strided view of q), same dtype as A and B.
        q_lat: [T, H, C] absorbed query, written in place (any float dtype).
        A: [slots, R, C] kv_b pool A; B: [slots, H*(D+V), R] kv_b pool B.
        segs: segments of this batch; slot -1 tokens are left unchanged.
    """
    num_tokens, num_heads, nope = q_nope.shape
    v_dim = _check_kv_b(A, B, q_nope.dtype, num_heads, q_lat.shape, segs, num_tokens) - nope
    if v_dim <= 0:
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} / q_lat {tuple(q_lat.shape)} do not fit A, B"
        )
    if num_tokens == 0:
        return q_lat
    _mla_kv_b_lora_q_kernel[(segs.grid_segments(), num_heads)](
        q_nope,
        q_lat,
        A,
        B,
        segs.seg_indptr,
        segs.seg_slot,
        segs.slot_rank,
        nope,
        v_dim,
        A.shape[2],
        *q_nope.stride(),
        *q_lat.stride(),
        *A.stride(),
        *B.stride(),
        BLOCK_T=segs.max_seg_len,
        BLOCK_R=_full_rank_block(A.shape[1]),
        BLOCK_D=min(triton.next_power_of_2(max(nope, 16)), 128),
        BLOCK_C=128,
        DOT_PRECISION=dot_precision(A.dtype),
    )
    return q_lat


def mla_kv_b_lora_o(o_lat: Tensor, o: Tensor, A: Tensor, B: Tensor, segs: LoraSegments) -> Tensor:
    """Add kv_b LoRA's value part to the absorbed attention output, in place.

    Semantics: o[t,h] += (o_lat[t,h] · A[slot, :rank]ᵀ) · B[slot, h*(D+V)+D : (h+1)*(D+V), :rank]ᵀ

    Args:
        o_lat: [T, H, C] attention output in latent space, same dtype as A and B.
        o: [T, H, V] per-head output (before o_proj), written in place (any float dtype).
        A: [slots, R, C] kv_b pool A; B: [slots, H*(D+V), R] kv_b pool B.
        segs: segments of this batch; slot -1 tokens are left unchanged.
    """
    num_tokens, num_heads, v_dim = o.shape
    nope = _check_kv_b(A, B, o_lat.dtype, num_heads, o_lat.shape, segs, num_tokens) - v_dim
    if o_lat.shape[:2] != o.shape[:2] or nope <= 0:
        raise ValueError(f"o_lat {tuple(o_lat.shape)} / o {tuple(o.shape)} do not fit A, B")
    if num_tokens == 0:
        return o
    _mla_kv_b_lora_o_kernel[(segs.grid_segments(), num_heads)](
        o_lat,
        o,
        A,
        B,
        segs.seg_indptr,
        segs.seg_slot,
        segs.slot_rank,
        nope,
        v_dim,
        A.shape[2],
        *o_lat.stride(),
        *o.stride(),
        *A.stride(),
        *B.stride(),
        BLOCK_T=segs.max_seg_len,
        BLOCK_R=_full_rank_block(A.shape[1]),
        BLOCK_V=min(triton.next_power_of_2(max(v_dim, 16)), 128),
        BLOCK_C=128,
        DOT_PRECISION=dot_precision(A.dtype),
    )
    return o


def mla_kv_b_lora_q_ref(
    q_nope: Tensor, q_lat: Tensor, A: Tensor, B: Tensor, segs: LoraSegments
) -> Tensor:
    """Torch reference of `mla_kv_b_lora_q` (gather + einsum in A's dtype), in place."""
    num_tokens, num_heads, nope = q_nope.shape
    slot, keep, a = _gather_kv_b_A(A, segs, num_tokens)
    b = B[slot].unflatten(1, (num_heads, -1))[:, :, :nope]  # [T, H, D, R]
    b = torch.where(keep[:, None, None, :], b, 0)
    z = torch.einsum("thd,thdr->thr", q_nope.to(A.dtype), b)  # [T, H, R]
    q_lat += torch.einsum("thr,trc->thc", z, a).to(q_lat.dtype)
    return q_lat


def mla_kv_b_lora_o_ref(
    o_lat: Tensor, o: Tensor, A: Tensor, B: Tensor, segs: LoraSegments
) -> Tensor:
    """Torch reference of `mla_kv_b_lora_o` (gather + einsum in A's dtype), in place."""
    num_tokens, num_heads, v_dim = o.shape
    slot, keep, a = _gather_kv_b_A(A, segs, num_tokens)
    b = B[slot].unflatten(1, (num_heads, -1))[:, :, -v_dim:]  # [T, H, V, R]
    b = torch.where(keep[:, None, None, :], b, 0)
    z = torch.einsum("thc,trc->thr", o_lat.to(A.dtype), a)  # [T, H, R]
    o += torch.einsum("thr,thvr->thv", z, b).to(o.dtype)
    return o


def _gather_kv_b_A(A: Tensor, segs: LoraSegments, num_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: clamped slot [T], live rank columns [T, R], and A with dead rows zeroed."""
    token_slot = segs.token_slot[:num_tokens].long()  # [T]
    keep = live_rank_columns(segs.slot_rank, token_slot, A.shape[1])  # [T, R]
    slot = token_slot.clamp(min=0)
    a = torch.where(keep[:, :, None], A[slot], 0)  # [T, R, C]
    return slot, keep, a


def _full_rank_block(pool_rank: int) -> int:
    # One tile spans the whole pool rank: the rank-sized intermediate stays in registers.
    return max(triton.next_power_of_2(pool_rank), 16)


def _check_kv_b(
    A: Tensor,
    B: Tensor,
    dtype: torch.dtype,
    num_heads: int,
    lat_shape: torch.Size,
    segs: LoraSegments,
    num_tokens: int,
) -> int:
    """Validate the kv_b pool against the activations; returns B's rows per head (D + V)."""
    if A.dim() != 3 or B.dim() != 3 or A.dtype != dtype or B.dtype != dtype:
        raise ValueError(
            f"A, B must be 3-D {dtype}: {tuple(A.shape)} {A.dtype}, {tuple(B.shape)} {B.dtype}"
        )
    if A.shape[0] != B.shape[0] or A.shape[1] != B.shape[2] or B.shape[1] % num_heads:
        raise ValueError(
            f"A {tuple(A.shape)} and B {tuple(B.shape)} are not one kv_b pool of {num_heads} heads"
        )
    if A.stride(-1) != 1 or B.stride(-1) != 1:
        raise ValueError("A and B must be contiguous in their last dim")
    if tuple(lat_shape) != (num_tokens, num_heads, A.shape[2]):
        raise ValueError(f"latent {tuple(lat_shape)} != [{num_tokens}, {num_heads}, {A.shape[2]}]")
    segs.require_tokens(num_tokens)
    return B.shape[1] // num_heads
