"""A gated MLP's gate_up LoRA expand and its SiLU·mul in one launch (prompt-length steps).

Apart, a long step's expand reads and rewrites all of gate_up's [T, 2I] product
(`sgmv_expand`'s read-modify-write), then SiLU·mul reads it again and writes [T, I]. Here
each item (a few consecutive segments × a column block of I) reads its gate and up tiles
once, adds each token's LoRA delta in float32, rounds both to the product's dtype (as the
expand stores them), applies SiLU·mul and writes only the activation: the expand's pass
over [T, 2I] (2 × T·2I elements) goes. V2-Lite's dense MLP at 8192 tokens: 717 MB less
traffic, ~169 µs at the H200's copy bandwidth, where the expand took ~404 µs.

Shapes: T tokens, I the intermediate width, S pool slots, R pool rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused_moe import silu_mul_ref, silu_times
from kernels.host_math import cdiv
from kernels.launch import fast
from kernels.lora_segments import LoraSegments, load_segment, rank_alignment, rank_load_bound
from kernels.pdl import grid_dependency_control
from kernels.sgmv import dot_precision, num_sms, rank_block, sgmv_expand_ref


@dataclass(frozen=True)
class ExpandSiluPlan:
    """A launch's plan: columns of I per item, programs an SM walking the items, the
    compile options, and consecutive segments per item (> 1: a slot's B tiles are loaded
    once for the segments of one adapter run the item holds; pool ranks of one rank tile
    only, others take 1)."""

    block_n: int = 128
    programs_per_sm: int = 4
    num_warps: int = 4
    num_stages: int = 1
    segments_per_item: int = 4


# What measured fastest at V2-Lite's prompt steps (H200, 16 rank-16 adapters of 512-token
# prompts, 24 plans: docs/benchmarks.md, thirty-ninth session): 128 × 16 tiles, 4 programs
# an SM, 4 segments an item; the dense MLP at 8192 tokens 274 µs against 457 for the two
# launches apart and 303-534 for the other 23 plans (8/16 programs an SM, 8 warps,
# 256-wide tiles, 1 segment an item).
DEFAULT_PLAN = ExpandSiluPlan()


@triton.jit
def _gate_up_b(
    b_slot, offs_n, mask_n, offs_r, rank, I, stride_bn, stride_br, RANK_ALIGN: tl.constexpr
):
    """B's gate and up tiles [r, n] of one slot, columns offs_n (and I + offs_n), zero from
    the slot's rank on."""
    b_mask = mask_n[None, :] & (offs_r < rank_load_bound(rank, RANK_ALIGN))[:, None]
    b_cols = b_slot + offs_r[:, None] * stride_br
    b_g = tl.load(b_cols + offs_n[None, :] * stride_bn, mask=b_mask, other=0.0)
    b_u = tl.load(b_cols + (I + offs_n)[None, :] * stride_bn, mask=b_mask, other=0.0)
    live_r = (offs_r < rank)[:, None]
    return tl.where(live_r, b_g, 0.0), tl.where(live_r, b_u, 0.0)


@triton.jit
def _gate_up_y(y_ptr, offs_t, mask_t, offs_r, rank, R, stride_yt, stride_yr):
    """y's gate and up rank columns [t, r] of tokens offs_t, zero from the rank on."""
    rows = y_ptr + offs_t[:, None] * stride_yt
    mask = mask_t[:, None] & (offs_r < rank)[None, :]
    y_g = tl.load(rows + offs_r[None, :] * stride_yr, mask=mask, other=0.0)
    y_u = tl.load(rows + (R + offs_r)[None, :] * stride_yr, mask=mask, other=0.0)
    return y_g, y_u


@triton.jit
def _expand_silu_mul_kernel(
    y_ptr,
    b_ptr,
    gate_up_ptr,
    act_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    num_segments_ptr,
    n_blocks,
    I,
    R,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_gt,
    stride_at,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEGS_PER_ITEM: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """A fixed grid walks the (group of SEGS_PER_ITEM live segments, column block) items;
    every token gets its activation, tokens of segments without work (rank 0) without a
    delta. SEGS_PER_ITEM > 1 needs BLOCK_R ≥ R: the B tiles stay while the slot does."""
    grid_dependency_control()
    num_segments = tl.load(num_segments_ptr)
    last = tl.cdiv(num_segments, SEGS_PER_ITEM) * n_blocks
    offs_r0 = tl.arange(0, BLOCK_R)
    for item in range(tl.program_id(0), last, tl.num_programs(0)):
        offs_n = (item % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        first = (item // n_blocks) * SEGS_PER_ITEM
        held = -1  # the slot whose B tiles b_g, b_u hold (SEGS_PER_ITEM > 1)
        b_g = tl.zeros((BLOCK_R, BLOCK_N), dtype=b_ptr.dtype.element_ty)
        b_u = tl.zeros((BLOCK_R, BLOCK_N), dtype=b_ptr.dtype.element_ty)
        for seg in range(first, tl.minimum(first + SEGS_PER_ITEM, num_segments)):
            slot, rank, t_start, t_end = load_segment(
                seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr
            )
            offs_t = t_start + tl.arange(0, BLOCK_T)
            mask_t = offs_t < t_end
            mask = mask_t[:, None] & mask_n[None, :]
            rows = gate_up_ptr + offs_t.to(tl.int64)[:, None] * stride_gt
            gate = tl.load(rows + offs_n[None, :], mask=mask, other=0.0)  # [t, n]
            up = tl.load(rows + (I + offs_n)[None, :], mask=mask, other=0.0)  # [t, n]
            if rank > 0:
                # The products accumulate onto the stored values: prev + Σ_r rounded once,
                # as the expand stores gate_up (and no second pair of float32 tiles).
                acc_g = gate.to(tl.float32)
                acc_u = up.to(tl.float32)
                b_slot = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
                if SEGS_PER_ITEM > 1:
                    if slot != held:
                        b_g, b_u = _gate_up_b(
                            b_slot, offs_n, mask_n, offs_r0, rank, I, stride_bn, stride_br,
                            RANK_ALIGN,
                        )  # fmt: skip
                        held = slot
                    y_g, y_u = _gate_up_y(
                        y_ptr, offs_t, mask_t, offs_r0, rank, R, stride_yt, stride_yr
                    )
                    acc_g = tl.dot(y_g.to(b_g.dtype), b_g, acc_g, input_precision=DOT_PRECISION)
                    acc_u = tl.dot(y_u.to(b_u.dtype), b_u, acc_u, input_precision=DOT_PRECISION)
                else:
                    for r in range(0, rank, BLOCK_R):
                        offs_r = r + offs_r0
                        y_g, y_u = _gate_up_y(
                            y_ptr, offs_t, mask_t, offs_r, rank, R, stride_yt, stride_yr
                        )
                        b_g, b_u = _gate_up_b(
                            b_slot, offs_n, mask_n, offs_r, rank, I, stride_bn, stride_br,
                            RANK_ALIGN,
                        )  # fmt: skip
                        acc_g = tl.dot(y_g.to(b_g.dtype), b_g, acc_g, input_precision=DOT_PRECISION)
                        acc_u = tl.dot(y_u.to(b_u.dtype), b_u, acc_u, input_precision=DOT_PRECISION)
                gate = acc_g.to(gate.dtype)
                up = acc_u.to(up.dtype)
            act = silu_times(gate, up)
            act_rows = act_ptr + offs_t.to(tl.int64)[:, None] * stride_at
            tl.store(act_rows + offs_n[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


def sgmv_expand_silu_mul(
    y: Tensor,
    B: Tensor,
    gate_up: Tensor,
    segs: LoraSegments,
    *,
    plan: ExpandSiluPlan = DEFAULT_PLAN,
) -> Tensor:
    """Semantics: silu_mul_ref(g) for g = gate_up after `sgmv_expand(y, B, g, segs, [0, I,
    2I])` (the expand's rounding to gate_up's dtype included); gate_up itself is not
    written.

    Args:
        y: [T, 2R] the gate_up shrink's output (float32 or B's dtype), gate then up.
        B: [S, 2I, R] the pool's gate_up B, contiguous in R.
        gate_up: [T, 2I] the base product, contiguous rows.
        plan: the launch's plan (benchmarks compare others).
    Returns: [T, I] in gate_up's dtype.
    """
    num_tokens, width = gate_up.shape
    _check(y, B, gate_up, segs)
    inter, pool_rank = width // 2, B.shape[2]
    act = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return act
    block_r = rank_block(pool_rank)
    segs_per_item = plan.segments_per_item if block_r >= pool_rank else 1
    n_blocks = cdiv(inter, plan.block_n)
    items = cdiv(segs.grid_segments(), segs_per_item) * n_blocks
    programs = min(items, plan.programs_per_sm * num_sms(gate_up.device))
    fast(_expand_silu_mul_kernel)[(programs,)](
        y, B, gate_up, act, segs.seg_indptr, segs.seg_slot, segs.slot_rank, segs.num_segments,
        n_blocks, inter, pool_rank, *y.stride(), *B.stride(), gate_up.stride(0), act.stride(0),
        BLOCK_T=segs.max_seg_len, BLOCK_N=plan.block_n, BLOCK_R=block_r,
        SEGS_PER_ITEM=segs_per_item, RANK_ALIGN=rank_alignment(pool_rank),
        DOT_PRECISION=dot_precision(B.dtype), num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )  # fmt: skip
    return act


def sgmv_expand_silu_mul_ref(y: Tensor, B: Tensor, gate_up: Tensor, segs: LoraSegments) -> Tensor:
    """Torch reference of `sgmv_expand_silu_mul`: the two references in turn, on a copy."""
    _check(y, B, gate_up, segs)
    inter = gate_up.shape[1] // 2
    expanded = sgmv_expand_ref(y, B, gate_up.clone(), segs, [0, inter, 2 * inter])
    return silu_mul_ref(expanded)


def _check(y: Tensor, B: Tensor, gate_up: Tensor, segs: LoraSegments) -> None:
    """Validate shapes and layouts (messages name the mismatch)."""
    num_tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [T, 2I] with unit-stride rows")
    if B.dim() != 3 or B.shape[1] != width or B.stride(2) != 1 or B.dtype != gate_up.dtype:
        raise ValueError(
            f"B {tuple(B.shape)} {B.dtype} must be [S, {width}, R] {gate_up.dtype}, contiguous in R"
        )
    if y.shape != (num_tokens, 2 * B.shape[2]):
        raise ValueError(f"y {tuple(y.shape)} != [{num_tokens}, {2 * B.shape[2]}]")
    segs.require_tokens(num_tokens)
