"""Pieces shared by the absorbed MLA decode kernels (v2 in `mla_attention`, `mla_decode_v3`).

Inlined by Triton: using them costs nothing against writing them out in each kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_range(ctx_ptr, b, split, num_splits, BLOCK_T: tl.constexpr):
    """Token range [start, end) of split `split` of sequence b: whole BLOCK_T tiles, so at
    most the last split of a sequence is partial; trailing splits may be empty.
    `num_splits` may be a run-time value (one compiled kernel for every split count)."""
    ctx = tl.load(ctx_ptr + b)
    per_split = (ctx + num_splits - 1) // num_splits
    split_len = (per_split + BLOCK_T - 1) // BLOCK_T * BLOCK_T
    start = split * split_len
    return start, tl.minimum(start + split_len, ctx)


@triton.jit
def masked_tile(base, rows, row_mask, cols, n_cols):
    """Loads base[rows, cols] → [len(rows), len(cols)]; rows off `row_mask` or cols ≥ n_cols
    read 0. `base` + rows are row pointers, cols element offsets within a row."""
    return tl.load(
        base + rows[:, None] + cols[None, :],
        mask=row_mask[:, None] & (cols[None, :] < n_cols),
        other=0.0,
    )


@triton.jit
def online_softmax_step(s, t_mask, scale, m, denom):
    """One tile of scores s [BLOCK_H, BLOCK_T] into the running max m and denominator:
    returns p = exp(s·scale − m_new) (0 off `t_mask`), alpha (rescale of the old acc),
    m_new, denom_new."""
    s = tl.where(t_mask[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def paged_rows(page_table_ptr, b, stride_ptb, t, t_mask, stride_kvp, stride_kvs, PAGE_SIZE):
    """Element offsets [len(t)] of cached tokens t of sequence b in the paged pool."""
    page = tl.load(page_table_ptr + b * stride_ptb + t // PAGE_SIZE, mask=t_mask, other=0)
    return page.to(tl.int64) * stride_kvp + (t % PAGE_SIZE) * stride_kvs
