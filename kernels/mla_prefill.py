"""MLA prefill attention over many sequences in one launch (flash-style, causal).

Shape legend: Tq query rows of the step, Tk context rows of a group of prefill sequences
(gathered from the paged latent cache and expanded through kv_b), H heads, n
qk_nope_head_dim, R qk_rope_head_dim (one rope key per row, shared by every head), v
v_head_dim.

Sequence b's new tokens are query rows [query_start_loc[b], query_start_loc[b+1]); its
cached context (its new tokens included) is key rows [context_start_loc[b] -
context_start_loc[first], +context_lens[b]) of the group that starts at sequence `first`.
Query i of b sits at position context_lens[b] - query_len[b] + i and attends keys 0..that.

Why one kernel: attention per sequence through torch cost ~7 launches per sequence and
layer (the K concatenation with the broadcast rope key, V padding, the SDPA call, the
output copy), which made an eager prefill step host-bound. This kernel reads q_nope /
q_rope / k_nope / v as strided views and the rope key once per row, so nothing is
concatenated or padded, and writes its output rows in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.mla_attention import mla_prefill_ref
from kernels.pdl import grid_dependency_control

# Query rows per reference call: bounds its [H, rows, context] float32 score matrix (the
# CPU serving path runs the reference).
REF_QUERY_CHUNK = 2048
BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # key rows per iteration
NUM_WARPS = 4
NUM_STAGES = 2


def mla_prefill_varlen_ref(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    first: int,
    end: int,
    scale: float,
    *,
    max_query_len: int,
) -> None:
    """Semantics of `mla_prefill_varlen`: per sequence b in [first, end), causal attention
    of its query rows over its key rows, written to out's rows of b (float32 math).
    Raises if a query is longer than `max_query_len` (the kernel's grid would miss rows).

    Args:
        q_nope: [Tq, H, n]; q_rope: [Tq, H, R] (rotated); out: [Tq, H, v] (written).
        k_nope: [Tk, H, n]; k_rope: [Tk, R]; v: [Tk, H, v].
        query_start_loc: [B + 1] int32; context_start_loc: [B + 1] int32; context_lens: [B].
    """
    q_starts = query_start_loc.tolist()
    k_starts = context_start_loc.tolist()
    contexts = context_lens.tolist()
    heads = q_nope.shape[1]
    for b in range(first, end):
        q0, q1 = q_starts[b], q_starts[b + 1]
        k0 = k_starts[b] - k_starts[first]
        k1 = k0 + contexts[b]
        if q1 - q0 > max_query_len:
            raise ValueError(f"sequence {b} has {q1 - q0} query rows > {max_query_len}")
        q = torch.cat([q_nope[q0:q1], q_rope[q0:q1]], dim=-1)  # [q, H, n+R]
        k = torch.cat([k_nope[k0:k1], k_rope[k0:k1, None].expand(-1, heads, -1)], dim=-1)
        offset = contexts[b] - (q1 - q0)  # position of query row q0
        for c0 in range(q0, q1, REF_QUERY_CHUNK):
            c1 = min(q1, c0 + REF_QUERY_CHUNK)
            visible = offset + c1 - q0  # keys the chunk's last query sees
            out[c0:c1] = mla_prefill_ref(
                q[c0 - q0 : c1 - q0], k[:visible], v[k0 : k0 + visible], scale, offset + c0 - q0
            )


def mla_prefill_varlen(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    first: int,
    end: int,
    scale: float,
    *,
    max_query_len: int,
) -> None:
    """Triton path of `mla_prefill_varlen_ref`, one launch for sequences [first, end).

    max_query_len: the longest query among them, from the host's copy of the batch (it
    sizes the grid; programs past a shorter sequence's rows return at once).
    """
    for name, t in (("q_nope", q_nope), ("q_rope", q_rope), ("k_nope", k_nope), ("v", v)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [rows, heads, dim] with unit last stride")
    if k_rope.dim() != 2 or k_rope.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("k_rope must be [rows, R] and out [rows, heads, v], unit last stride")
    if end <= first:
        return
    heads, nope, rope, v_dim = q_nope.shape[1], q_nope.shape[2], q_rope.shape[2], v.shape[2]
    grid = (cdiv(max_query_len, BLOCK_M), end - first, heads)
    fast(_mla_prefill_kernel)[grid](
        q_nope, q_rope, k_nope, k_rope, v, out,
        query_start_loc, context_start_loc, context_lens, first,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_rope.stride(0),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # exp2 domain
        NOPE=nope, ROPE=rope, V_DIM=v_dim,
        NOPE_P=_padded(nope), ROPE_P=_padded(rope), V_P=_padded(v_dim),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip


def _padded(dim: int) -> int:
    """A power of two ≥ 16 (tl.dot's smallest inner size) holding `dim`."""
    return max(16, next_power_of_2(dim))


# The group's first sequence changes every call: one compiled kernel for all of them.
@triton.jit(do_not_specialize=["first"])
def _mla_prefill_kernel(
    qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, out_ptr,
    q_start_ptr, k_start_ptr, ctx_len_ptr, first,
    s_qn_t, s_qn_h, s_qr_t, s_qr_h, s_kn_t, s_kn_h, s_kr_t, s_v_t, s_v_h, s_o_t, s_o_h,
    qk_scale,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr,
    NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, V_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    m_block = tl.program_id(0)
    seq = first + tl.program_id(1)
    head = tl.program_id(2)
    q0 = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q0
    if m_block * BLOCK_M >= q_len:
        return
    context = tl.load(ctx_len_ptr + seq)
    k0 = tl.load(k_start_ptr + seq) - tl.load(k_start_ptr + first)
    offset = context - q_len  # position of query row 0

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query rows of this sequence
    row_ok = rows < q_len
    dn = tl.arange(0, NOPE_P)
    dr = tl.arange(0, ROPE_P)
    dv = tl.arange(0, V_P)
    q_rows = (q0 + rows).to(tl.int64)
    qn = tl.load(
        qn_ptr + q_rows[:, None] * s_qn_t + head * s_qn_h + dn[None, :],
        mask=row_ok[:, None] & (dn < NOPE)[None, :], other=0.0,
    )  # [BM, n]  # fmt: skip
    qr = tl.load(
        qr_ptr + q_rows[:, None] * s_qr_t + head * s_qr_h + dr[None, :],
        mask=row_ok[:, None] & (dr < ROPE)[None, :], other=0.0,
    )  # [BM, R]  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_P], dtype=tl.float32)
    # Keys past the block's last query position are masked for every row: not visited.
    visible = tl.minimum(context, offset + (m_block + 1) * BLOCK_M)
    for start in range(0, visible, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # [BN] key rows of this sequence
        col_ok = cols < visible
        k_rows = (k0 + cols).to(tl.int64)
        kn = tl.load(
            kn_ptr + k_rows[None, :] * s_kn_t + head * s_kn_h + dn[:, None],
            mask=col_ok[None, :] & (dn < NOPE)[:, None], other=0.0,
        )  # [n, BN]  # fmt: skip
        kr = tl.load(
            kr_ptr + k_rows[None, :] * s_kr_t + dr[:, None],
            mask=col_ok[None, :] & (dr < ROPE)[:, None], other=0.0,
        ).to(qr.dtype)  # [R, BN]  # fmt: skip
        scores = tl.dot(qn, kn) + tl.dot(qr, kr)  # [BM, BN] float32
        # Row 0's position is ≥ 0, so every row keeps key 0: no row is all -inf.
        allowed = (cols[None, :] <= offset + rows[:, None]) & col_ok[None, :]
        scores = tl.where(allowed, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vv = tl.load(
            v_ptr + k_rows[:, None] * s_v_t + head * s_v_h + dv[None, :],
            mask=col_ok[:, None] & (dv < V_DIM)[None, :], other=0.0,
        )  # [BN, v]  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * s_o_t + head * s_o_h + dv[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dv < V_DIM)[None, :],
    )
