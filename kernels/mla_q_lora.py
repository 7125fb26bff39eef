"""q_b's LoRA expand and kv_b's absorbed query correction in one launch (decode steps).

In a decode step with adapters the query's chain is q_b's product, then q_b's LoRA expand
(q += y · B_q[slot]ᵀ), then, after the latent-cache write, kv_b's absorbed query correction
q_lat = (q_nope · B_k[slot, h]) · A[slot] (kernels.mla_lora). The correction reads only the
expanded q_nope, and both are (segment, head) work over the same tokens. So one program per
(segment, head) adds the expand to its head's q columns (nope and rope) and sets the
correction from the nope rows it has just rounded: one dependent launch fewer a layer. The
latent-cache write reads q_rope after this launch, as it read it after the expand.

The rounding is the separate launches': q rounded to its dtype after the expand, the rank
intermediate z rounded to the weights' dtype, q_lat written as (not added to) the correction,
zeros for tokens without an adapter (the caller adds q_nope · W_UK onto it).

Shapes: T tokens, H heads, D qk_nope_head_dim, P qk_rope_head_dim, V v_head_dim, C
kv_lora_rank, S pool slots, Rq / Rk q_b's / kv_b's pool rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.lora_segments import LoraSegments, load_segment, rank_alignment, rank_load_bound
from kernels.mla_lora import mla_kv_b_lora_q_ref
from kernels.pdl import grid_dependency_control
from kernels.sgmv import dot_precision, num_sms, sgmv_expand_ref

# Largest pool rank (either module) whose whole rank tile one program holds: [Rq, D] of q_b's
# B and [D, Rk] / [Rk, 128] of kv_b's at 64 are 8K-element tiles. Larger pools keep the two
# separate launches (`fits`).
MAX_POOL_RANK = 64
# Programs an SM walking the (live segment, head) items, as the decode SGMV expand (16): each
# item is a short chain of dependent loads, and more of them in flight shorten the kernel.
PROGRAMS_PER_SM = 16
# Latent columns a program writes at once.
LATENT_BLOCK = 128


@triton.jit
def _q_b_expand_kv_b_q_kernel(
    y_ptr,
    qb_b_ptr,
    q_ptr,
    kv_a_ptr,
    kv_b_ptr,
    q_lat_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    qb_rank_ptr,
    kv_rank_ptr,
    num_segments_ptr,
    H,
    D,
    P,
    C,
    stride_yt,
    stride_yr,
    stride_qbs,
    stride_qbn,
    stride_qbr,
    stride_qt,
    stride_qn,
    stride_kas,
    stride_kar,
    stride_kac,
    stride_kbs,
    stride_kbh,
    stride_kbn,
    stride_kbr,
    stride_lt,
    stride_lh,
    stride_lc,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_RQ: tl.constexpr,
    BLOCK_RK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    QB_RANK_ALIGN: tl.constexpr,
    KV_RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """A fixed grid walks the (live segment, head) items (a graph captured for many tokens
    starts no programs for its padding segments' heads beyond the grid)."""
    grid_dependency_control()
    items = tl.load(num_segments_ptr) * H
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        head = item % H
        slot, qb_rank, t_start, t_end = load_segment(
            item // H, seg_indptr_ptr, seg_slot_ptr, qb_rank_ptr
        )
        kv_rank = tl.load(kv_rank_ptr + tl.maximum(slot, 0))
        kv_rank = tl.where((slot >= 0) & (t_end > t_start), kv_rank, 0)
        slot = tl.maximum(slot, 0).to(tl.int64)
        offs_t = t_start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < t_end
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        q_head = q_ptr + head * (D + P) * stride_qn
        nope_ptrs = q_head + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qn
        nope_mask = mask_t[:, None] & mask_d[None, :]
        nope = tl.load(nope_ptrs, mask=nope_mask & ((qb_rank > 0) | (kv_rank > 0)), other=0.0)
        if qb_rank > 0:
            offs_rq = tl.arange(0, BLOCK_RQ)
            mask_rq = offs_rq < qb_rank
            load_rq = offs_rq < rank_load_bound(qb_rank, QB_RANK_ALIGN)
            y = tl.load(
                y_ptr + offs_t[:, None] * stride_yt + offs_rq[None, :] * stride_yr,
                mask=mask_t[:, None] & mask_rq[None, :],
                other=0.0,
            )  # [t, r]
            b_head = qb_b_ptr + slot * stride_qbs + head * (D + P) * stride_qbn
            b = tl.load(
                b_head + offs_d[None, :] * stride_qbn + offs_rq[:, None] * stride_qbr,
                mask=mask_d[None, :] & load_rq[:, None],
                other=0.0,
            )  # [r, d]
            b = tl.where(mask_rq[:, None], b, 0.0)
            y = y.to(b.dtype)
            delta = tl.dot(y, b, input_precision=DOT_PRECISION)  # [t, d]
            nope = (nope.to(tl.float32) + delta).to(nope.dtype)
            tl.store(nope_ptrs, nope, mask=nope_mask)
            offs_p = tl.arange(0, BLOCK_P)
            mask_p = offs_p < P
            rope_ptrs = q_head + offs_t[:, None] * stride_qt + (D + offs_p)[None, :] * stride_qn
            rope_mask = mask_t[:, None] & mask_p[None, :]
            rope = tl.load(rope_ptrs, mask=rope_mask, other=0.0)
            b = tl.load(
                b_head + (D + offs_p)[None, :] * stride_qbn + offs_rq[:, None] * stride_qbr,
                mask=mask_p[None, :] & load_rq[:, None],
                other=0.0,
            )  # [r, p]
            b = tl.where(mask_rq[:, None], b, 0.0)
            delta = tl.dot(y, b, input_precision=DOT_PRECISION)  # [t, p]
            tl.store(rope_ptrs, (rope.to(tl.float32) + delta).to(rope.dtype), mask=rope_mask)
        # kv_b's correction; a segment without kv_b work loads nothing and writes zeros.
        offs_rk = tl.arange(0, BLOCK_RK)
        mask_rk = offs_rk < kv_rank
        w1 = tl.load(
            kv_b_ptr
            + slot * stride_kbs
            + head * stride_kbh
            + offs_d[:, None] * stride_kbn
            + offs_rk[None, :] * stride_kbr,
            mask=mask_d[:, None] & (offs_rk < rank_load_bound(kv_rank, KV_RANK_ALIGN))[None, :],
            other=0.0,
        )  # [d, r]
        w1 = tl.where(mask_rk[None, :], w1, 0.0)
        z = tl.dot(nope.to(w1.dtype), w1, input_precision=DOT_PRECISION).to(w1.dtype)  # [t, r]
        a_slot = kv_a_ptr + slot * stride_kas
        lat_rows = q_lat_ptr + offs_t[:, None] * stride_lt + head * stride_lh
        for c in range(0, C, BLOCK_C):
            offs_c = c + tl.arange(0, BLOCK_C)
            mask_c = offs_c < C
            w2 = tl.load(
                a_slot + offs_rk[:, None] * stride_kar + offs_c[None, :] * stride_kac,
                mask=mask_rk[:, None] & mask_c[None, :],
                other=0.0,
            )  # [r, c]
            correction = tl.dot(z, w2, input_precision=DOT_PRECISION)  # [t, c]
            tl.store(
                lat_rows + offs_c[None, :] * stride_lc,
                correction.to(q_lat_ptr.dtype.element_ty),
                mask=mask_t[:, None] & mask_c[None, :],
            )


@dataclass(frozen=True)
class QueryLora:
    """What the launch reads besides q and q_lat.

    y: [T, Rq] q_b's shrink (float32 or the weights' dtype); qb_B: [S, H·(D+P), Rq] q_b's
    pool B; segs: the step's segments with q_b's per-slot ranks; kv_A: [S, Rk, C], kv_B:
    [S, H·(D+V), Rk] kv_b's pool; kv_rank: int32 [S] kv_b's per-slot ranks; nope_dim: D.
    """

    y: Tensor
    qb_B: Tensor
    segs: LoraSegments
    kv_A: Tensor
    kv_B: Tensor
    kv_rank: Tensor
    nope_dim: int


def fits(qb_B: Tensor, kv_A: Tensor) -> bool:
    """Whether one launch takes these pools (both pool ranks within MAX_POOL_RANK)."""
    return max(qb_B.shape[2], kv_A.shape[1]) <= MAX_POOL_RANK


def q_b_expand_kv_b_q(q: Tensor, q_lat: Tensor, lora: QueryLora) -> None:
    """Semantics (every row of the step is a decode token):

        q[t] += y[t, :rq] · qb_B[slot, :, :rq]ᵀ                        (q_b's LoRA expand)
        q_lat[t,h] = (q_nope[t,h] · B_k[slot,h][:, :rk]) · kv_A[slot, :rk]  (kv_b's correction)

    with rq = segs.slot_rank[slot], rk = kv_rank[slot], q_nope[t,h] = q[t, h(D+P) : h(D+P)+D]
    after the expand, B_k[s,h] = kv_B[s, h(D+V) : h(D+V)+D], and q_lat[t] = 0 where rk is 0.

    Args:
        q: [T, H·(D+P)] q_b's output, updated in place.
        q_lat: [T, H, C] overwritten (may be a strided view).
        lora: the two modules' operands (`QueryLora`).
    """
    num_tokens, num_heads, lat = q_lat.shape
    _check(q, q_lat, lora)
    if num_tokens == 0:
        return
    y, qb_B, segs, kv_A, kv_B = lora.y, lora.qb_B, lora.segs, lora.kv_A, lora.kv_B
    nope_dim = lora.nope_dim
    rope_dim = q.shape[1] // num_heads - nope_dim
    programs = min(segs.grid_segments() * num_heads, PROGRAMS_PER_SM * num_sms(q.device))
    fast(_q_b_expand_kv_b_q_kernel)[(programs,)](
        y, qb_B, q, kv_A, kv_B, q_lat, segs.seg_indptr, segs.seg_slot, segs.slot_rank,
        lora.kv_rank, segs.num_segments, num_heads, nope_dim, rope_dim, lat, *y.stride(),
        *qb_B.stride(), *q.stride(), *kv_A.stride(), kv_B.stride(0),
        kv_B.shape[1] // num_heads * kv_B.stride(1), *kv_B.stride()[1:], *q_lat.stride(),
        BLOCK_T=segs.max_seg_len, BLOCK_D=_tile(nope_dim), BLOCK_P=_tile(rope_dim),
        BLOCK_RQ=_tile(qb_B.shape[2]), BLOCK_RK=_tile(kv_A.shape[1]),
        BLOCK_C=min(_tile(lat), LATENT_BLOCK),
        QB_RANK_ALIGN=rank_alignment(qb_B.shape[2]), KV_RANK_ALIGN=rank_alignment(kv_A.shape[1]),
        DOT_PRECISION=dot_precision(qb_B.dtype),
    )  # fmt: skip


def q_b_expand_kv_b_q_ref(q: Tensor, q_lat: Tensor, lora: QueryLora) -> None:
    """Torch reference of `q_b_expand_kv_b_q`: the two separate references, in place."""
    num_tokens, num_heads, _ = q_lat.shape
    _check(q, q_lat, lora)
    sgmv_expand_ref(lora.y, lora.qb_B, q, lora.segs, [0, q.shape[1]])
    q_nope = q.view(num_tokens, num_heads, -1)[:, :, : lora.nope_dim]  # [T, H, D]
    kv_segs = lora.segs.with_slot_rank(lora.kv_rank)
    mla_kv_b_lora_q_ref(q_nope, q_lat, lora.kv_A, lora.kv_B, kv_segs, accumulate=False)


def _tile(n: int) -> int:
    """A power-of-two tile of at least 16 (tl.dot's smallest) covering n."""
    return next_power_of_2(max(n, 16))


def _check(q: Tensor, q_lat: Tensor, lora: QueryLora) -> None:
    """Validate the two pools against the activations (messages name the mismatch)."""
    num_tokens, num_heads, lat = q_lat.shape
    qb_B, kv_A, kv_B, nope_dim = lora.qb_B, lora.kv_A, lora.kv_B, lora.nope_dim
    for name, w in (("qb_B", qb_B), ("kv_A", kv_A), ("kv_B", kv_B)):
        if w.dim() != 3 or w.dtype != q.dtype or w.stride(-1) != 1:
            raise ValueError(
                f"{name} must be 3-D {q.dtype}, contiguous in its last dim: "
                f"{tuple(w.shape)} {w.dtype} strides {w.stride()}"
            )
    if not fits(qb_B, kv_A):
        raise ValueError(f"pool ranks {qb_B.shape[2]} / {kv_A.shape[1]} exceed {MAX_POOL_RANK}")
    if q.dim() != 2 or q.shape[0] != num_tokens or q.shape[1] != qb_B.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} != [{num_tokens}, {qb_B.shape[1]}] (q_b's B rows)")
    if q.shape[1] % num_heads or kv_B.shape[1] % num_heads:
        raise ValueError(
            f"q {tuple(q.shape)} / kv_B {tuple(kv_B.shape)} not split in {num_heads} heads"
        )
    if not 0 < nope_dim < min(q.shape[1], kv_B.shape[1]) // num_heads:
        raise ValueError(
            f"nope_dim {nope_dim} does not fit q {tuple(q.shape)} / kv_B {tuple(kv_B.shape)}"
        )
    if kv_A.shape[2] != lat or kv_B.shape[2] != kv_A.shape[1] or kv_A.shape[0] != qb_B.shape[0]:
        raise ValueError(
            f"kv_A {tuple(kv_A.shape)} / kv_B {tuple(kv_B.shape)} / qb_B {tuple(qb_B.shape)} are "
            f"not pools of one size for latent {lat}"
        )
    if lora.y.shape != (num_tokens, qb_B.shape[2]):
        raise ValueError(f"y {tuple(lora.y.shape)} != [{num_tokens}, {qb_B.shape[2]}]")
    if lora.kv_rank.shape != (kv_A.shape[0],) or lora.kv_rank.dtype != torch.int32:
        raise ValueError(
            f"kv_rank must be int32 [{kv_A.shape[0]}], got {tuple(lora.kv_rank.shape)}"
        )
    lora.segs.require_tokens(num_tokens)
