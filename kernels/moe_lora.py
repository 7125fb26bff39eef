"""MoE LoRA over the routed (token, expert) pairs of the base fused MoE.

The base fused MoE keeps, per pair (sorted by expert), the gate_up intermediate
`[P, S*moe_inter]` and the down output `[P, hidden]`; these kernels add the LoRA deltas in
place, before the activation and before the weighted combine:

    gate_up: inter[p]    += (x[tok(p)] · A_gu[slot, e]ᵀ) · B_gu[slot, e]ᵀ     (S slices)
    down:    down_out[p] += (act[p]    · A_d[slot, e]ᵀ)  · B_d[slot, e]ᵀ

with slot = token_slot[tok(p)], e = pair_expert[p]. A "shared outer" adapter stores gate_up's
A and down's B with an expert dim of 1: every expert reads index 0. The delta is computed
in the activation dtype from the LoRA weights alone, independent of how the base experts
are stored (bf16, FP8 block-scaled, INT8, 4-bit): quantization never touches LoRA.

Two kernel variants (`variant=`, docs/kernel_notes.md §7):
- "pairs" (decode, up to PAIRS_MAX_PAIRS pairs): one launch; a program per (pair, slice,
  column chunk) computes its rank-R intermediate in float32 registers (a GEMV with tl.sum,
  no 16-row dot padding, no key walk, no intermediate buffer) and adds B·y to its columns.
  Small batches split the columns over more programs, each recomputing the cheap shrink.
- "runs" (prefill): a program takes a block of BLOCK_P pairs and walks the distinct (slot,
  weight-expert) keys in it with tl.dot, shrink and expand as two launches through a
  float32 [P, S·R] buffer, split-K in the shrink. Given the base MoE's expert-sorted pair
  order (`pair_order`), a block is a run of one expert's pairs, in token order, so it holds
  one or two keys; in plain pair order (token-major) it holds up to BLOCK_P keys and each
  walks its own K loop (H100, 8192-token prefill of V2-Lite: 7.2 ms per MoE layer). Where
  a prompt step's blocks hold a few keys each, the shrink takes the first few in one K loop
  (`shrink_keys`).
Shapes: P pairs, E experts, S slices, R pool rank, K input features, N output per slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.lora_segments import (
    LoraSegments,
    live_rank_columns,
    rank_alignment,
    rank_load_bound,
)
from kernels.pdl import grid_dependency_control
from kernels.sgmv import (
    dot_precision,
    num_sms,
    plan_split_k,
    rank_block,
    shrink_loop,
    shrink_rank_tile,
    shrink_rows,
)

BLOCK_P = 16
# Pairs per block of the epilogue path's shrink: it walks the expert-sorted order, where a
# block of 64 holds about as few keys as one of 16 and reads each key's A a quarter as often.
EPILOGUE_BLOCK_P = 64
# Its K loop's pipeline depth (Triton's default: 3).
EPILOGUE_SHRINK_STAGES = 4
# Where a block holds several keys, its first few share one K loop
# (`_moe_lora_shrink_keys_kernel`): by the shrink's stacked slices, (mean rows per (adapter,
# expert) key from which, keys). A 64-pair block of keys of r rows holds about 1 + 63 / r of
# them. H100, V2-Lite experts, rank 16, the shrink alone (do_bench, L2 flushed, two rounds
# alternating; docs/benchmarks.md, thirtieth session), µs, a loop per key → joint: gate_up
# (2 slices) at 8192 tokens of 32 adapters (24 rows a key, 4 keys) 205 → 160, of 16 (48
# rows, 2 keys) 151 → 112, of 4 (192 rows) 82 → 65, of 1 (768 rows) 66 → 62-65; down (1
# slice) 122 → 108 at 24 rows, level at 48, 72-77 → 77-80 from 192 rows: a loop per key
# there. Below 16 rows a key (4096 × 32: 12; 2048 × 32: 6) 4 keys cover too few of a
# block's keys: level or slower in the one-off sweep.
SHRINK_KEYS_FROM_ROWS = {2: ((16.0, 4), (32.0, 2)), 1: ((16.0, 4), (32.0, 1))}
# The joint loop's K tile and pipeline depth (a [64, 4 · 32] A tile per stage).
SHRINK_KEYS_BLOCK_K = 64
SHRINK_KEYS_STAGES = 3
# "pairs" re-reads a key's weights once per pair (from L2 when pairs share it): right for
# decode, where nearly every pair has its own key; "auto" uses "runs" beyond this.
PAIRS_MAX_PAIRS = 4096
# The "pairs" shrink walks K in tiles of PAIRS_SHRINK_TILE weights (BLOCK_R × BLOCK_K),
# PAIRS_SHRINK_STAGES deep. H100, 8-layer V2-Lite decode step with 32 rank-16 adapters
# (lora_v14_moe_pairs_stages*_h100.log), unpipelined 8192-weight tiles → these: B=1 1198 →
# 1176 µs, B=64 4419 → 4388, B=256 6100 → 5952; 8192-weight tiles 2 deep were as fast at
# B=64 and slower at 1 and 256, 8 warps with twice the tiles slower everywhere.
PAIRS_SHRINK_TILE = 4096
PAIRS_SHRINK_STAGES = 3
# "pairs" programs per SM it aims for when splitting columns (None: one chunk per slice).
MOE_VARIANTS = {"runs": None, "pairs": 2}
DEFAULT_MOE_VARIANT = "auto"


@triton.jit
def _pair_keys(offs_p, P, pair_token_ptr, pair_expert_ptr, token_slot_ptr, W_EXPERTS):
    """(token, key) per pair: key = slot * W_EXPERTS + weight expert, -1 when no work."""
    mask_p = offs_p < P
    tok = tl.load(pair_token_ptr + offs_p, mask=mask_p, other=-1)
    expert = tl.load(pair_expert_ptr + offs_p, mask=mask_p, other=0)
    slot = tl.load(token_slot_ptr + tl.maximum(tok, 0), mask=tok >= 0, other=-1)
    weight_expert = tl.where(W_EXPERTS == 1, 0, expert)
    return tok, tl.where(slot >= 0, slot * W_EXPERTS + weight_expert, -1)


@triton.jit
def _block_pairs(block, order_ptr, order_len, P, ORDERED: tl.constexpr, BLOCK_P: tl.constexpr):
    """Pair ids [BLOCK_P] of pair block `block`: consecutive ids, or with ORDERED entries
    of the expert-sorted order (entries past it and its padding give P: no pair)."""
    rows = block * BLOCK_P + tl.arange(0, BLOCK_P)
    if ORDERED:
        return tl.load(order_ptr + rows, mask=rows < order_len, other=P)
    return rows


# Above every key (slot, or slot · experts + expert): ends a walk over a block's keys.
NO_KEY = tl.constexpr(2**30)


@triton.jit
def _next_key(key, last):
    """The least of `key` ([n] int32, -1 where a row has no work) above `last`, NO_KEY when
    none is: a block's keys walked in ascending order, from `last` = -1. One cross-warp
    reduction a key, where finding the first row not yet done took three."""
    return tl.min(tl.where(key > last, key, NO_KEY))


@triton.jit
def _shrink_key(
    x_ptr, a_ptr, y_ptr, x_row, offs_p, sel, key, slot_rank_ptr, rows, rank_index, r_start,
    k_lo, k_len, K, A_EXPERTS, stride_xm, stride_xk, stride_as, stride_ae, stride_ar,
    stride_ak, stride_yp, stride_yr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """y[rows `sel` of the block, `rows`] (+)= x[their rows, k_lo:k_lo+k_len] · A[key]ᵀ."""
    slot = key // A_EXPERTS
    rank = tl.load(slot_rank_ptr + slot)
    mask_r = rank_index < rank
    if r_start < rank:
        a_rows = (
            a_ptr + slot.to(tl.int64) * stride_as + (key % A_EXPERTS) * stride_ae
            + rows * stride_ar
        )  # fmt: skip
        acc = shrink_loop(  # [p, r]
            x_ptr, x_row, sel, a_rows, mask_r, k_lo, k_len, K, stride_xm, stride_xk, stride_ak,
            BLOCK_P, BLOCK_R, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
        y_ptrs = y_ptr + offs_p[:, None] * stride_yp + rows[None, :] * stride_yr
        y_mask = sel[:, None] & mask_r[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptrs, acc, mask=y_mask)
        else:
            tl.store(y_ptrs, acc, mask=y_mask)


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["P", "order_len"])
def _moe_lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    pair_token_ptr,
    pair_expert_ptr,
    token_slot_ptr,
    slot_rank_ptr,
    P,
    order_ptr,
    order_len,
    K,
    R,
    A_EXPERTS,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_yp,
    stride_yr,
    X_PER_PAIR: tl.constexpr,
    ORDERED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STACKED: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[pair, rows of rank tile pid_sr] (+)= x[pair's row, K split] · A[key]ᵀ for the pairs
    of one block, key by key (ascending); STACKED as in `shrink_rows`."""
    grid_dependency_control()
    pid_sr = tl.program_id(1)  # slice * rank_blocks + rank_block (0 when STACKED)
    offs_p = _block_pairs(tl.program_id(0), order_ptr, order_len, P, ORDERED, BLOCK_P)
    tok, key = _pair_keys(offs_p, P, pair_token_ptr, pair_expert_ptr, token_slot_ptr, A_EXPERTS)
    x_row = offs_p if X_PER_PAIR else tok
    rows, rank_index, r_start = shrink_rows(pid_sr, R, BLOCK_R, STACKED)
    k_lo = tl.program_id(2) * k_per_split
    run_key = _next_key(key, -1)
    while run_key < NO_KEY:
        _shrink_key(
            x_ptr, a_ptr, y_ptr, x_row, offs_p, key == run_key, run_key, slot_rank_ptr, rows,
            rank_index, r_start, k_lo, k_per_split, K, A_EXPERTS,
            stride_xm, stride_xk, stride_as, stride_ae, stride_ar, stride_ak, stride_yp,
            stride_yr, BLOCK_P, BLOCK_R, BLOCK_K, ATOMIC, DOT_PRECISION,
        )  # fmt: skip
        run_key = _next_key(key, run_key)


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["P", "order_len"])
def _moe_lora_shrink_keys_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    pair_token_ptr,
    pair_expert_ptr,
    token_slot_ptr,
    slot_rank_ptr,
    P,
    order_ptr,
    order_len,
    K,
    R,
    A_EXPERTS,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_yp,
    stride_yr,
    X_PER_PAIR: tl.constexpr,
    ORDERED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLICES: tl.constexpr,
    KEYS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_moe_lora_shrink_kernel` for one rank tile (the S·R rows of every slice) and no K
    split, with the block's first KEYS keys in one K loop: their A rows side by side along
    N, one [BLOCK_K, KEYS·BLOCK_R] load and one MMA an iteration, each pair's own key's
    columns picked after the loop. Keys past those (rare where KEYS fits the block) walk a
    loop each, as in `_moe_lora_shrink_kernel`."""
    grid_dependency_control()
    offs_p = _block_pairs(tl.program_id(0), order_ptr, order_len, P, ORDERED, BLOCK_P)
    tok, key = _pair_keys(offs_p, P, pair_token_ptr, pair_expert_ptr, token_slot_ptr, A_EXPERTS)
    x_row = offs_p if X_PER_PAIR else tok
    cols = tl.arange(0, KEYS * BLOCK_R)  # key group · BLOCK_R + A row of that key
    group, a_row = cols // BLOCK_R, cols % BLOCK_R
    rank_index = tl.where(a_row < SLICES * R, a_row % R, R)
    col_key = tl.full((KEYS * BLOCK_R,), NO_KEY, tl.int32)
    last = -1
    for i in tl.static_range(KEYS):
        last = _next_key(key, last)
        col_key = tl.where(group == i, last, col_key)
    live = col_key < NO_KEY
    col_slot = tl.where(live, col_key // A_EXPERTS, 0)
    mask_col = live & (rank_index < tl.load(slot_rank_ptr + col_slot, mask=live, other=0))
    a_cols = (
        a_ptr + col_slot.to(tl.int64) * stride_as
        + (col_key % A_EXPERTS).to(tl.int64) * stride_ae + a_row * stride_ar
    )  # fmt: skip
    joint = (key >= 0) & (key <= last)  # the pairs of the first KEYS keys
    rows = tl.arange(0, BLOCK_R)
    if tl.max(key) >= 0:  # padding blocks and blocks of base-model tokens skip the loop
        acc = shrink_loop(  # [p, key group · r]
            x_ptr, x_row, joint, a_cols, mask_col, 0, K, K, stride_xm, stride_xk, stride_ak,
            BLOCK_P, KEYS * BLOCK_R, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
        own = tl.where(col_key[None, :] == key[:, None], acc, 0.0)
        y = tl.sum(tl.reshape(own, (BLOCK_P, KEYS, BLOCK_R)), axis=1)  # [p, r]
        tl.store(
            y_ptr + offs_p[:, None] * stride_yp + rows[None, :] * stride_yr,
            y,
            mask=joint[:, None] & (rows < SLICES * R)[None, :],
        )
    # The keys past the joint ones: the rank index of each of `rows` (one tile of every slice).
    _, row_rank, _ = shrink_rows(0, R, BLOCK_R, SLICES)
    run_key = _next_key(key, last)
    while run_key < NO_KEY:
        _shrink_key(
            x_ptr, a_ptr, y_ptr, x_row, offs_p, key == run_key, run_key, slot_rank_ptr, rows,
            row_rank, 0, 0, K, K, A_EXPERTS, stride_xm, stride_xk, stride_as, stride_ae,
            stride_ar, stride_ak, stride_yp, stride_yr, BLOCK_P, BLOCK_R, BLOCK_K, False,
            DOT_PRECISION,
        )  # fmt: skip
        run_key = _next_key(key, run_key)


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["P", "order_len"])
def _moe_lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    pair_token_ptr,
    pair_expert_ptr,
    token_slot_ptr,
    slot_rank_ptr,
    P,
    order_ptr,
    order_len,
    R,
    N,
    B_EXPERTS,
    stride_yp,
    stride_yr,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_op,
    stride_on,
    ORDERED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    grid_dependency_control()
    n_blocks = tl.cdiv(N, BLOCK_N)
    slice_idx = tl.program_id(1) // n_blocks
    offs_n = (tl.program_id(1) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    cols = slice_idx * N + offs_n  # columns of out and rows of B
    offs_p = _block_pairs(tl.program_id(0), order_ptr, order_len, P, ORDERED, BLOCK_P)
    _, key = _pair_keys(offs_p, P, pair_token_ptr, pair_expert_ptr, token_slot_ptr, B_EXPERTS)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)  # [p, n]
    run_key = _next_key(key, -1)
    while run_key < NO_KEY:
        sel = key == run_key
        slot = run_key // B_EXPERTS
        rank = tl.load(slot_rank_ptr + slot)
        b_run = b_ptr + slot.to(tl.int64) * stride_bs + (run_key % B_EXPERTS) * stride_be
        load_rank = rank_load_bound(rank, RANK_ALIGN)
        for r in range(0, rank, BLOCK_R):
            offs_r = r + tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            y = tl.load(
                y_ptr + offs_p[:, None] * stride_yp + (slice_idx * R + offs_r)[None, :] * stride_yr,
                mask=sel[:, None] & mask_r[None, :],
                other=0.0,
            )  # [p, r]
            b = tl.load(
                b_run + cols[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=mask_n[None, :] & (offs_r < load_rank)[:, None],
                other=0.0,
            )  # [r, n]
            b = tl.where(mask_r[:, None], b, 0.0)
            acc = tl.dot(y.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
        run_key = _next_key(key, run_key)
    out_ptrs = out_ptr + offs_p[:, None] * stride_op + cols[None, :] * stride_on
    out_mask = (key >= 0)[:, None] & mask_n[None, :]
    prev = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (prev.to(tl.float32) + acc).to(prev.dtype), mask=out_mask)


@triton.jit
def _moe_lora_pair_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    pair_token_ptr,
    pair_expert_ptr,
    token_slot_ptr,
    slot_rank_ptr,
    K,
    N,
    R,
    A_EXPERTS,
    B_EXPERTS,
    cols_per_program,
    chunks,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_op,
    stride_on,
    NUM_SLICES: tl.constexpr,
    X_PER_PAIR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    SHRINK_STAGES: tl.constexpr,
):
    """out[p, slice cols of chunk] += B[slot, eB, cols, :rank] · (A[slot, eA, slice rows] · x)
    for one (pair, slice, column chunk); y [rank] stays in float32 registers.

    The shrink and the first tile of B are read before the wait for the previous kernel (the
    grouped GEMM whose output this adds to): they read only the pool's weights, the routing
    and x, which kernels before that GEMM wrote, and the GEMM's own wait made those complete
    before this kernel could launch (kernels.pdl). So they overlap the GEMM's last wave
    instead of following it."""
    item = tl.program_id(0)
    chunk = item % chunks
    slice_idx = (item // chunks) % NUM_SLICES
    pair = item // (chunks * NUM_SLICES)
    tok = tl.load(pair_token_ptr + pair)
    slot = tl.load(token_slot_ptr + tl.maximum(tok, 0))
    slot = tl.where(tok >= 0, slot, -1)
    rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    expert = tl.load(pair_expert_ptr + pair)
    x_row = x_ptr + (pair if X_PER_PAIR else tok).to(tl.int64) * stride_xm
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank  # all false without work: the loads below then read nothing
    a_rows = (
        _key_weights(a_ptr, slot, expert, A_EXPERTS, stride_as, stride_ae)
        + (slice_idx * R + offs_r) * stride_ar
    )  # [r]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)  # [r, k] partial products
    # Pipelined: the next K tiles of A are in flight while this one is multiplied.
    for k in tl.range(0, K, BLOCK_K, num_stages=SHRINK_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_row + offs_k * stride_xk, mask=mask_k & (rank > 0), other=0.0)  # [k]
        a = tl.load(
            a_rows[:, None] + offs_k[None, :] * stride_ak,
            mask=mask_r[:, None] & mask_k[None, :],
            other=0.0,
        )  # [r, k]
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [r]
    b_key = _key_weights(b_ptr, slot, expert, B_EXPERTS, stride_bs, stride_be)
    load_r = offs_r < rank_load_bound(rank, RANK_ALIGN)
    col_start = chunk * cols_per_program
    col_end = tl.minimum(col_start + cols_per_program, N)
    # [n, r]: the first tile of B, read before the wait too.
    b_next = _b_tile(
        b_key, slice_idx * N, col_start, col_end, offs_r, mask_r, load_r, stride_bn, stride_br,
        BLOCK_N,
    )  # fmt: skip
    grid_dependency_control()
    if rank > 0:
        out_row = out_ptr + pair.to(tl.int64) * stride_op
        for n in range(col_start, col_end, BLOCK_N):
            # The next tile of B is loaded before this one's read-modify-write of out (the
            # first one before the wait): its latency hides behind the out round trip.
            b = b_next
            b_next = _b_tile(
                b_key, slice_idx * N, n + BLOCK_N, col_end, offs_r, mask_r, load_r, stride_bn,
                stride_br, BLOCK_N,
            )  # fmt: skip
            delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1)  # [n]
            offs_n = n + tl.arange(0, BLOCK_N)
            out_ptrs = out_row + (slice_idx * N + offs_n) * stride_on
            mask_n = offs_n < col_end
            prev = tl.load(out_ptrs, mask=mask_n, other=0.0)
            tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(prev.dtype), mask=mask_n)


@triton.jit
def _key_weights(w_ptr, slot, expert, W_EXPERTS, stride_s, stride_e):
    """The first weight of key (slot, expert) in a [slots, E or 1, ...] pool buffer: slot
    -1 reads slot 0 (its loads are masked), and a shared-outer buffer (one expert) serves
    every expert."""
    weight_expert = tl.where(W_EXPERTS == 1, 0, expert).to(tl.int64)
    return w_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_s + weight_expert * stride_e


@triton.jit
def _b_tile(
    b_key, first_col, n, col_end, offs_r, mask_r, load_r, stride_bn, stride_br,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, r] rows first_col + n.. of one key's B (masked from col_end on: none when
    n ≥ col_end), read in the columns `load_r` (`rank_load_bound`) and zero outside
    `mask_r` (the slot's rank)."""
    offs_n = n + tl.arange(0, BLOCK_N)
    b = tl.load(
        b_key + (first_col + offs_n)[:, None] * stride_bn + offs_r[None, :] * stride_br,
        mask=(offs_n < col_end)[:, None] & load_r[None, :],
        other=0.0,
    )
    return tl.where(mask_r[None, :], b, 0.0)


@dataclass(frozen=True)
class MoeLoraEpilogue:
    """The routed experts' LoRA expand as the grouped GEMM adds it to its float32 tile:

        out[p, slice i cols] += y[p, i·R : i·R+rank] · B[slot, eB, slice i cols, :rank]ᵀ

    slot = token_slot[pair_token[p]] (-1: nothing added), rank = slot_rank[slot], eB = the
    pair's expert (0 when B's expert dim is 1: shared outer); y is fed to the MMA in B's
    dtype, as the "runs" expand does. Built by `moe_lora_epilogue` (which runs the shrink).

    y: [P, S·R] float32; b: [slots, E or 1, S·N, R] contiguous in R; pair_token: int32 [P]
    (-1 padding); token_slot: int32 [T]; slot_rank: int32 [slots].
    """

    y: Tensor
    b: Tensor
    pair_token: Tensor
    token_slot: Tensor
    slot_rank: Tensor

    @property
    def num_slices(self) -> int:
        return self.y.shape[1] // self.b.shape[3]

    def check(self, num_pairs: int, out_cols: int) -> None:
        """Raise unless this epilogue fits a GEMM output [num_pairs, out_cols]."""
        pool_rank = self.b.shape[3]
        if (
            self.y.dtype != torch.float32
            or self.y.shape[0] != num_pairs
            or self.y.shape[1] % pool_rank
            or self.b.dim() != 4
            or self.b.shape[2] != out_cols
            or out_cols % self.num_slices
            or self.b.stride(-1) != 1
            or self.pair_token.shape != (num_pairs,)
        ):
            raise ValueError(
                f"LoRA epilogue y {tuple(self.y.shape)} {self.y.dtype}, b {tuple(self.b.shape)}, "
                f"pair_token {tuple(self.pair_token.shape)} do not fit the GEMM output "
                f"[{num_pairs}, {out_cols}]"
            )

    def delta_ref(self, pairs: Tensor, expert: int) -> Tensor:
        """[len(pairs), S·N] float32: the term the GEMM adds to `pairs`, all of `expert`."""
        slot = _pair_slots(self.pair_token[pairs], self.token_slot)
        y = self.y[pairs].to(self.b.dtype).float()  # [n, S·R], rounded as the kernel feeds it
        return _expand_ref(y, self.b, slot, _experts(self.b, expert), self.slot_rank)


def sorted_row_slots(order: Tensor, block_m: int, lora: MoeLoraEpilogue) -> Tensor:
    """int32 [len(order) + tiles]: first token_slot[pair_token[p]] of each pair p of the
    GEMM's sorted pair order `order` (int32, padded with ids ≥ the pair count; -1 for
    padding and for tokens without an adapter), then each row tile's least slot (NO_KEY
    when none), tiles of block_m rows. The epilogue reads a tile's slots and its first
    slot each in one load."""
    rows = order.shape[0]
    tiles = rows // block_m
    out = torch.empty(rows + tiles, dtype=torch.int32, device=order.device)
    if tiles:
        fast(_sorted_row_slots_kernel)[(tiles,)](
            order, lora.pair_token, lora.token_slot, out, lora.pair_token.shape[0],
            BLOCK_M=block_m,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["num_pairs"])
def _sorted_row_slots_kernel(
    order_ptr, pair_token_ptr, token_slot_ptr, out_ptr, num_pairs, BLOCK_M: tl.constexpr
):
    grid_dependency_control()
    tile = tl.program_id(0)
    rows = tl.num_programs(0) * BLOCK_M  # one program a tile
    offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(order_ptr + offs)
    tok = tl.load(pair_token_ptr + pair, mask=pair < num_pairs, other=-1)
    slot = tl.load(token_slot_ptr + tl.maximum(tok, 0), mask=tok >= 0, other=-1)
    tl.store(out_ptr + offs, slot)
    tl.store(out_ptr + rows + tile, _next_key(slot, -1))


@triton.jit
def _pair_y(y_ptr, pair, slot, slice_idx, offs_r, R, stride_yp, wanted):
    """y [m, r] of `pair`'s rows in slice `slice_idx`, rank columns `offs_r`: zero past the
    pool rank, for rows without work, and everywhere unless `wanted`."""
    return tl.load(
        y_ptr + pair[:, None].to(tl.int64) * stride_yp + (slice_idx * R + offs_r)[None, :],
        mask=(slot >= 0)[:, None] & (offs_r < R)[None, :] & wanted,
        other=0.0,
    )


@triton.jit
def _slot_b(
    b_ptr, slot_rank_ptr, slot, expert, B_EXPERTS, stride_bs, stride_be, b_cols, b_mask, offs_r
):
    """B [r, n] of key (`slot`, `expert`) at `b_cols` (offsets, rank rows `offs_r`), zero past
    the slot's rank and everywhere when `slot` is NO_KEY. Every pool rank column is read and
    the dead ones zeroed, so the B load does not wait for the rank's."""
    live = slot < NO_KEY
    rank = tl.load(slot_rank_ptr + slot, mask=live, other=0)
    b_key = _key_weights(b_ptr, slot, expert, B_EXPERTS, stride_bs, stride_be)
    b = tl.load(b_key + b_cols, mask=b_mask & live, other=0.0)
    return tl.where((offs_r < rank)[:, None], b, 0.0)


@triton.jit
def first_pair_lora(
    pair,
    rows,
    expert,
    n_start,
    y_ptr,
    b_ptr,
    row_slot_ptr,
    first_slot_ptr,
    slot_rank_ptr,
    N,
    R,
    B_EXPERTS,
    stride_yp,
    stride_bs,
    stride_be,
    stride_bn,
    SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """What `add_pair_lora` needs first, loaded before the GEMM's K loop so that its
    latency hides behind the loop (a prompt-length tile is one program an SM: after the
    loop nothing else would cover it). `rows`: the tile's positions in the sorted pair
    order, whose slots `sorted_row_slots` stored with the tile's first slot (at
    `first_slot_ptr`): the first slot's B load waits on one load, where the chain pair →
    token → slot and a reduction held the K loop's first loads back.
    Returns (slot [m] of each row, -1 without work; the tile's first slice; its first
    slot, NO_KEY when none; y [m, r] of the slice's first rank block in B's dtype, zero
    for rows without work; the first slot's B [r, n] over the tile's columns of the
    slice, zero past the slot's rank)."""
    slot = tl.load(row_slot_ptr + rows)  # [m]
    first_slot = tl.load(first_slot_ptr)
    width = N // SLICES
    first_slice = tl.minimum(n_start // width, SLICES - 1)
    offs_r = tl.arange(0, BLOCK_R)
    y = _pair_y(y_ptr, pair, slot, first_slice, offs_r, R, stride_yp, True)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    in_slice = (offs_n >= first_slice * width) & (offs_n < (first_slice + 1) * width)
    b = _slot_b(
        b_ptr, slot_rank_ptr, first_slot, expert, B_EXPERTS, stride_bs, stride_be,
        offs_n[None, :] * stride_bn + offs_r[:, None], in_slice[None, :] & (offs_r < R)[:, None],
        offs_r,
    )  # fmt: skip
    return slot, first_slice, first_slot, y.to(b.dtype), b


@triton.jit
def add_pair_lora(
    acc,
    pair,
    expert,
    n_start,
    slot,
    first_slice,
    first_slot,
    first_y,
    first_b,
    y_ptr,
    b_ptr,
    slot_rank_ptr,
    N,
    R,
    B_EXPERTS,
    stride_yp,
    stride_bs,
    stride_be,
    stride_bn,
    SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc [m, n] (float32 tile of `expert`, rows `pair`, columns n_start + [0, BLOCK_N))
    plus the `MoeLoraEpilogue` term; slot .. first_b are `first_pair_lora`'s. Rows come in
    token order within an expert and the scheduler orders tokens by slot, so a tile holds
    a few slots: per slice and rank block, the tile's y columns are gathered once, then one
    masked MMA per distinct slot, in ascending slot order, against B rows the tile reads
    once. The first slice's first rank block starts from the prefetched y and first slot.

    Each further slot costs one cross-warp reduction (`_next_key`) and two independent
    loads (its rank and its B rows: every pool rank column is read and the ones past the
    slot's rank zeroed, so the B load need not wait for the rank). The y gather is kept out
    of that chain (y is zero past each slot's rank, so the pool rank bounds it)."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    width = N // SLICES
    for i in tl.static_range(SLICES):
        # Only the slices this column tile overlaps (a tile may straddle gate | up).
        if (n_start < (i + 1) * width) & (n_start + BLOCK_N > i * width):
            in_slice = (offs_n >= i * width) & (offs_n < (i + 1) * width)
            for r0 in range(0, R, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                prefetched = (i == first_slice) & (r0 == 0)
                y = _pair_y(y_ptr, pair, slot, i, offs_r, R, stride_yp, prefetched == 0)
                y = tl.where(prefetched, first_y, y.to(first_y.dtype))  # [m, r]
                # The first slot's step, from the prefetched tiles (adds zeros elsewhere:
                # one small MMA, where a branch would hold acc in two forms).
                y_run = tl.where((slot == first_slot)[:, None] & prefetched, y, 0.0)
                acc = tl.dot(y_run, first_b, acc, input_precision=DOT_PRECISION)
                last = tl.where(prefetched, first_slot, -1)
                b_cols = offs_n[None, :] * stride_bn + offs_r[:, None]  # [r, n]
                b_mask = in_slice[None, :] & (offs_r < R)[:, None]
                run_slot = _next_key(slot, last)
                while run_slot < NO_KEY:
                    b = _slot_b(
                        b_ptr, slot_rank_ptr, run_slot, expert, B_EXPERTS, stride_bs,
                        stride_be, b_cols, b_mask, offs_r,
                    )  # fmt: skip
                    y_run = tl.where((slot == run_slot)[:, None], y, 0.0)
                    acc = tl.dot(y_run, b, acc, input_precision=DOT_PRECISION)
                    run_slot = _next_key(slot, run_slot)
    return acc


def moe_lora_epilogue(
    x: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    *,
    x_per_pair: bool,
    pair_order: Tensor | None = None,
) -> MoeLoraEpilogue:
    """Run the shrink of `moe_lora_gate_up` (x per token) or `moe_lora_down` (x per pair)
    and return the expand for the grouped GEMM's epilogue (`grouped_gemm(lora=)`).

    Args as in `moe_lora_gate_up` / `moe_lora_down` (A, B the pool buffers, `x_per_pair`
    True for down); pair_order: the walk order of the shrink (result unchanged).
    """
    num_slices = _check_shrink(x, A, B, pair_token, pair_expert, x_per_pair)
    walk = _PairWalk.of(pair_token, pair_expert, segs, pair_order, EPILOGUE_BLOCK_P)
    # The routing's expert count (a shared-outer side has an expert dim of 1).
    rows = segs.rows_per_key(pair_token.shape[0], max(A.shape[1], B.shape[1]))
    keys = shrink_keys(rows, num_slices)
    y = _shrink_runs(x, A, walk, x_per_pair, num_slices, B.shape[3], EPILOGUE_SHRINK_STAGES, keys)
    return MoeLoraEpilogue(y, B, pair_token, segs.token_slot, segs.slot_rank)


def moe_lora_epilogue_ref(
    x: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    *,
    x_per_pair: bool,
    pair_order: Tensor | None = None,
) -> MoeLoraEpilogue:
    """Torch reference of `moe_lora_epilogue` (y in float32; pair_order is not read)."""
    _check_shrink(x, A, B, pair_token, pair_expert, x_per_pair)
    x_rows = x if x_per_pair else x[pair_token.clamp(min=0).long()]
    slot = _pair_slots(pair_token, segs.token_slot)
    y = _shrink_ref(x_rows, A, slot, pair_expert, segs.slot_rank, B.shape[3]).float()
    return MoeLoraEpilogue(y, B, pair_token, segs.token_slot, segs.slot_rank)


def _check_shrink(
    x: Tensor, A: Tensor, B: Tensor, pair_token: Tensor, pair_expert: Tensor, x_per_pair: bool
) -> int:
    """Validate the epilogue path's inputs; returns the slice count S."""
    num_pairs = pair_token.shape[0]
    out = torch.empty((num_pairs, B.shape[2]), device="meta")  # [P, S·N] shape only
    if x_per_pair and x.shape[0] != num_pairs:
        raise ValueError(f"x {tuple(x.shape)} must have one row per pair ({num_pairs})")
    return _check_moe(x, out, A, B, pair_token, pair_expert)[0]


def moe_lora_gate_up(
    x: Tensor,
    inter: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    *,
    variant: str = DEFAULT_MOE_VARIANT,
    pair_order: Tensor | None = None,
) -> Tensor:
    """Add the routed experts' gate_up LoRA delta to the per-pair intermediate, in place.

    Semantics: inter[p, i*N:(i+1)*N] += (x[tok] · A[slot, eA, i*R : i*R+rank]ᵀ)
    · B[slot, e, i*N:(i+1)*N, :rank]ᵀ, tok = pair_token[p], slot = token_slot[tok],
    e = pair_expert[p], eA = e (or 0 when A's expert dim is 1: shared outer).
    Computed in the activation dtype, independent of the base experts' quantization.

    Args:
        x: [T, hidden] MoE input, same dtype as A and B.
        inter: [P, S*N] gate_up output of the base MoE per pair, written in place.
        A: [slots, E or 1, S*R, hidden]; B: [slots, E, S*N, R]; S = 2 gated, 1 non-gated.
        pair_token int32 [P], -1 marks padding (skipped); pair_expert int32 or int64 [P].
        segs: this batch's segments (token_slot, slot_rank); slot -1 tokens do no work.
        variant: "auto" ("pairs" up to PAIRS_MAX_PAIRS pairs, else "runs") or a key of
            MOE_VARIANTS (all compute the same delta).
        pair_order: optional int32 [≥ P] pair ids grouped by expert, entries ≥ P skipped
            (the base MoE's `MoEAlignment.sorted_pair_ids`). "runs" walks its pair blocks
            in this order, so a block holds one or two (adapter, expert) keys instead of
            up to 16 (pair order is token-major: consecutive pairs have other experts).
    """
    segs.require_tokens(x.shape[0])
    return _moe_lora(x, inter, A, B, pair_token, pair_expert, segs, False, variant, pair_order)


def moe_lora_down(
    act: Tensor,
    down_out: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    *,
    variant: str = DEFAULT_MOE_VARIANT,
    pair_order: Tensor | None = None,
) -> Tensor:
    """Add the routed experts' down LoRA delta to the per-pair down output, in place.

    Semantics: down_out[p] += (act[p] · A[slot, e, :rank]ᵀ) · B[slot, eB, :, :rank]ᵀ,
    slot = token_slot[pair_token[p]], e = pair_expert[p], eB = e (or 0 when B's expert dim
    is 1: shared outer). Computed in the activation dtype, independent of base quantization.

    Args:
        act: [P, moe_inter] activated intermediate per pair, same dtype as A and B.
        down_out: [P, hidden] down output of the base MoE per pair, written in place.
        A: [slots, E, R, moe_inter]; B: [slots, E or 1, hidden, R].
        pair_token int32 [P], -1 marks padding (skipped); pair_expert int32 or int64 [P].
        segs: this batch's segments (token_slot, slot_rank); slot -1 tokens do no work.
        variant, pair_order: as in `moe_lora_gate_up`.
    """
    if act.shape[0] != pair_token.shape[0]:
        raise ValueError(
            f"act {tuple(act.shape)} must have one row per pair ({pair_token.shape[0]})"
        )
    return _moe_lora(act, down_out, A, B, pair_token, pair_expert, segs, True, variant, pair_order)


def _moe_lora(
    x: Tensor,
    out: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    x_per_pair: bool,
    variant: str,
    pair_order: Tensor | None,
) -> Tensor:
    num_pairs = pair_token.shape[0]
    num_slices, slice_width = _check_moe(x, out, A, B, pair_token, pair_expert)
    pool_rank = B.shape[3]
    if variant == "auto":
        variant = "pairs" if num_pairs <= PAIRS_MAX_PAIRS else "runs"
    programs_per_sm = MOE_VARIANTS[variant]
    if num_pairs == 0:
        return out
    if programs_per_sm is not None:
        target = programs_per_sm * num_sms(x.device)
        _moe_lora_pairs(x, out, A, B, pair_token, pair_expert, segs, x_per_pair, target)
        return out
    walk = _PairWalk.of(pair_token, pair_expert, segs, pair_order)
    y = _shrink_runs(x, A, walk, x_per_pair, num_slices, pool_rank)
    block_n = 128 if slice_width >= 2048 else 64
    fast(_moe_lora_expand_kernel)[(walk.blocks, num_slices * cdiv(slice_width, block_n))](
        y,
        B,
        out,
        *walk.meta,
        pool_rank,
        slice_width,
        B.shape[1],
        *y.stride(),
        *B.stride(),
        *out.stride(),
        ORDERED=walk.ordered,
        BLOCK_P=walk.block_p,
        BLOCK_N=block_n,
        BLOCK_R=rank_block(pool_rank),
        RANK_ALIGN=rank_alignment(pool_rank),
        DOT_PRECISION=dot_precision(B.dtype),
    )
    return out


@dataclass(frozen=True)
class _PairWalk:
    """How the "runs" kernels walk the pairs: blocks of BLOCK_P ids, consecutive or taken
    from the expert-sorted `pair_order` (ordered)."""

    meta: tuple  # the kernels' pair arguments, pair_token .. order_len
    ordered: bool
    blocks: int
    block_p: int

    @staticmethod
    def of(
        pair_token: Tensor,
        pair_expert: Tensor,
        segs: LoraSegments,
        pair_order: Tensor | None,
        block_p: int = BLOCK_P,
    ) -> _PairWalk:
        if pair_order is not None and (pair_order.dtype != torch.int32 or pair_order.dim() != 1):
            raise ValueError(
                f"pair_order must be 1-D int32, got {pair_order.dtype} {pair_order.dim()}-D"
            )
        num_pairs = pair_token.shape[0]
        order = pair_order if pair_order is not None else pair_token  # unread unless ordered
        order_len = order.shape[0] if pair_order is not None else num_pairs
        meta = (
            pair_token, pair_expert, segs.token_slot, segs.slot_rank, num_pairs, order, order_len
        )  # fmt: skip
        blocks = cdiv(order_len, block_p)
        return _PairWalk(meta, pair_order is not None, blocks, block_p)


def shrink_keys(rows_per_key: float, slices: int) -> int:
    """Keys of a pair block whose shrink shares one K loop (SHRINK_KEYS_FROM_ROWS), 1 for
    a loop per key, from the step's mean rows per (adapter, expert) key and the shrink's
    stacked slices (2: gate_up, 1: down)."""
    keys = 1
    for min_rows, joint in SHRINK_KEYS_FROM_ROWS.get(slices, ()):
        if rows_per_key >= min_rows:
            keys = joint
    return keys


def _shrink_runs(
    x: Tensor,
    A: Tensor,
    walk: _PairWalk,
    x_per_pair: bool,
    num_slices: int,
    pool_rank: int,
    num_stages: int = 3,
    keys: int = 1,
) -> Tensor:
    """y [P, S·R] float32 = per-pair shrink of every slice (zeros past each slot's rank);
    num_stages: the K loop's pipeline depth; keys: a block's keys that share one K loop
    (`shrink_keys`) where the shrink is one rank tile without a K split."""
    num_pairs = walk.meta[4]
    y = torch.zeros(num_pairs, num_slices * pool_rank, dtype=torch.float32, device=x.device)
    if num_pairs == 0:
        return y
    k_dim = x.shape[1]
    block_r, stacked = shrink_rank_tile(num_slices, pool_rank)
    rank_programs = 1 if stacked else num_slices * cdiv(pool_rank, block_r)
    block_k, k_per_split, split_k = plan_split_k(k_dim, walk.blocks * rank_programs)
    if keys > 1 and rank_programs == 1 and split_k == 1:
        fast(_moe_lora_shrink_keys_kernel)[(walk.blocks,)](
            x, A, y, *walk.meta, k_dim, pool_rank, A.shape[1], *x.stride(), *A.stride(),
            *y.stride(), X_PER_PAIR=x_per_pair, ORDERED=walk.ordered, BLOCK_P=walk.block_p,
            BLOCK_R=block_r, BLOCK_K=SHRINK_KEYS_BLOCK_K, SLICES=num_slices, KEYS=keys,
            DOT_PRECISION=dot_precision(x.dtype), num_stages=SHRINK_KEYS_STAGES,
        )  # fmt: skip
        return y
    fast(_moe_lora_shrink_kernel)[(walk.blocks, rank_programs, split_k)](
        x,
        A,
        y,
        *walk.meta,
        k_dim,
        pool_rank,
        A.shape[1],
        k_per_split,
        *x.stride(),
        *A.stride(),
        *y.stride(),
        X_PER_PAIR=x_per_pair,
        ORDERED=walk.ordered,
        BLOCK_P=walk.block_p,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        STACKED=stacked,
        ATOMIC=split_k > 1,
        DOT_PRECISION=dot_precision(x.dtype),
        num_stages=num_stages,
    )
    return y


def _moe_lora_pairs(
    x: Tensor,
    out: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    x_per_pair: bool,
    target_programs: int,
) -> None:
    """Launch the "pairs" kernel: P·S items, each slice's columns cut into as many chunks
    as bring the programs up to `target_programs` (a chunk recomputes the shrink)."""
    num_pairs, k_dim = pair_token.shape[0], x.shape[1]
    pool_rank = B.shape[3]
    num_slices = A.shape[2] // pool_rank
    slice_width = out.shape[1] // num_slices
    block_r = max(next_power_of_2(pool_rank), 16)
    wanted_chunks = max(1, target_programs // (num_pairs * num_slices))
    # Tiles of at most 8192 elements (64 float32 registers per thread at 4 warps), at least
    # 64 columns (a chunk's shrink costs as much as 4-8 column blocks).
    cols = next_power_of_2(cdiv(slice_width, wanted_chunks))
    block_n = min(8192 // block_r, max(cols, 64))
    n_blocks = cdiv(slice_width, block_n)
    chunks = min(n_blocks, wanted_chunks)
    cols_per_program = cdiv(n_blocks, chunks) * block_n
    chunks = cdiv(slice_width, cols_per_program)
    fast(_moe_lora_pair_kernel)[(num_pairs * num_slices * chunks,)](
        x, A, B, out, pair_token, pair_expert, segs.token_slot, segs.slot_rank,
        k_dim, slice_width, pool_rank, A.shape[1], B.shape[1], cols_per_program, chunks,
        *x.stride(), *A.stride(), *B.stride(), *out.stride(),
        NUM_SLICES=num_slices, X_PER_PAIR=x_per_pair,
        BLOCK_R=block_r,
        BLOCK_K=min(PAIRS_SHRINK_TILE // block_r, next_power_of_2(max(k_dim, 16))),
        BLOCK_N=block_n, RANK_ALIGN=rank_alignment(pool_rank), SHRINK_STAGES=PAIRS_SHRINK_STAGES,
    )  # fmt: skip


def moe_lora_gate_up_ref(
    x: Tensor,
    inter: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    *,
    pair_order: Tensor | None = None,
) -> Tensor:
    """Torch gather + bmm reference of `moe_lora_gate_up` (in A's dtype), in place.
    `pair_order` (the kernels' walk order) does not change the result and is not read."""
    return _moe_lora_ref(
        x[pair_token.clamp(min=0).long()], inter, A, B, pair_token, pair_expert, segs
    )


def moe_lora_down_ref(
    act: Tensor,
    down_out: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    *,
    pair_order: Tensor | None = None,
) -> Tensor:
    """Torch gather + bmm reference of `moe_lora_down` (in A's dtype), in place.
    `pair_order` (the kernels' walk order) does not change the result and is not read."""
    return _moe_lora_ref(act, down_out, A, B, pair_token, pair_expert, segs)


def _moe_lora_ref(
    x_rows: Tensor,
    out: Tensor,
    A: Tensor,
    B: Tensor,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
) -> Tensor:
    """out[p] += per-slice (x_rows[p] · A[slot, eA]ᵀ) · B[slot, eB]ᵀ over live rank columns."""
    slot = _pair_slots(pair_token, segs.token_slot)
    y = _shrink_ref(x_rows, A, slot, pair_expert, segs.slot_rank, B.shape[3])  # [P, S*R]
    out += _expand_ref(y, B, slot, _experts(B, pair_expert), segs.slot_rank).to(out.dtype)
    return out


def _pair_slots(pair_token: Tensor, token_slot: Tensor) -> Tensor:
    """int64 [P]: each pair's slot, -1 for padding pairs and tokens without an adapter."""
    token = pair_token.long()
    return torch.where(token >= 0, token_slot[token.clamp(min=0)].long(), -1)


def _experts(w: Tensor, pair_expert: Tensor | int) -> Tensor | int:
    """Index of each pair's expert in w's expert dim (0 for a shared-outer dim of 1)."""
    if w.shape[1] == 1:
        return 0
    return pair_expert.long() if isinstance(pair_expert, Tensor) else pair_expert


def _shrink_ref(
    x_rows: Tensor,
    A: Tensor,
    slot: Tensor,
    pair_expert: Tensor,
    slot_rank: Tensor,
    pool_rank: int,
) -> Tensor:
    """[P, S*R] in A's dtype: A[slot, eA] · x_rows[p] over live rank rows, 0 elsewhere."""
    num_slices = A.shape[2] // pool_rank
    keep = live_rank_columns(slot_rank, slot, pool_rank)  # [P, R]
    a = A[slot.clamp(min=0), _experts(A, pair_expert)]  # [P, S*R, K]
    a = torch.where(keep.repeat(1, num_slices)[:, :, None], a, 0)
    return torch.bmm(a, x_rows.to(A.dtype).unsqueeze(2)).squeeze(2)


def _expand_ref(
    y: Tensor, B: Tensor, slot: Tensor, expert: Tensor | int, slot_rank: Tensor
) -> Tensor:
    """[P, S*N] in y's dtype: per slice i, B[slot, expert, slice i cols, live ranks] ·
    y[p, i*R : (i+1)*R]."""
    pool_rank = B.shape[3]
    num_slices = y.shape[1] // pool_rank
    width = B.shape[2] // num_slices
    keep = live_rank_columns(slot_rank, slot, pool_rank)  # [P, R]
    b = torch.where(keep[:, None, :], B[slot.clamp(min=0), expert], 0).to(y.dtype)  # [P,S*N,R]
    parts = [
        torch.bmm(
            b[:, i * width : (i + 1) * width], y[:, i * pool_rank : (i + 1) * pool_rank, None]
        )
        for i in range(num_slices)
    ]  # [P, N, 1] each
    return torch.cat(parts, dim=1).squeeze(2)


def _check_moe(
    x: Tensor, out: Tensor, A: Tensor, B: Tensor, pair_token: Tensor, pair_expert: Tensor
) -> tuple[int, int]:
    """Validate shapes/dtypes/strides; returns (slices S, per-slice width N)."""
    if A.dim() != 4 or B.dim() != 4 or A.dtype != x.dtype or B.dtype != x.dtype:
        raise ValueError(
            f"A, B must be 4-D {x.dtype}: {tuple(A.shape)} {A.dtype}, {tuple(B.shape)} {B.dtype}"
        )
    if A.stride(-1) != 1 or B.stride(-1) != 1:
        raise ValueError("A and B must be contiguous in their last dim")
    pool_rank = B.shape[3]
    num_slices = A.shape[2] // pool_rank
    experts = max(A.shape[1], B.shape[1])
    if (
        A.shape[0] != B.shape[0]
        or A.shape[2] != num_slices * pool_rank
        or A.shape[3] != x.shape[1]
        or A.shape[1] not in (1, experts)
        or B.shape[1] not in (1, experts)
        or B.shape[2] != out.shape[1]
        or out.shape[1] % num_slices
    ):
        raise ValueError(
            f"A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
            f"x {tuple(x.shape)}, out {tuple(out.shape)}"
        )
    # The experts come as the router made them (int64) or as int32: converting them cost a
    # launch per MoE layer, and the kernels measured the same with either.
    if pair_token.dtype != torch.int32 or pair_expert.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"pair_token must be int32 and pair_expert int32 or int64, got "
            f"{pair_token.dtype} and {pair_expert.dtype}"
        )
    if pair_token.shape != pair_expert.shape or out.shape[0] != pair_token.shape[0]:
        raise ValueError(
            f"pairs: token {tuple(pair_token.shape)}, expert {tuple(pair_expert.shape)}, "
            f"out {tuple(out.shape)}"
        )
    return num_slices, out.shape[1] // num_slices
