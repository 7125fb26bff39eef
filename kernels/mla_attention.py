"""MLA attention: absorbed decode over the paged latent cache, and causal prefill.

Decode (absorbed): each cached token is one row [c ⊕ k_rope] of width C + R shared by all
heads. With q_lat = q_nope · W_UK (per head, done by the caller):
    score[h, t] = (q_lat[h] · c[t] + q_rope[h] · k_rope[t]) · scale
    o_lat[h]    = Σ_t softmax_t(score[h]) · c[t]
and the caller maps o_lat through W_UV. Heads form the M dimension of the tile (all heads
share the same K/V rows), and long contexts are split over programs (split-K) whose partial
results are merged by their log-sum-exp.

Prefill (naive): K/V are expanded from the latent by kv_b, so this is ordinary causal
attention with query i of a chunk at absolute position offset + i.

Shapes: B sequences, H heads, C kv_lora_rank, R rope dim, S page size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import mla_decode_v3 as v3
from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.mla_decode_parts import (
    masked_tile,
    online_softmax_step,
    paged_rows,
    split_range,
)
from kernels.mla_lora import OutputCorrection, store_output_correction
from kernels.pdl import grid_dependency_control


def gather_paged_rows(
    kv_pool: torch.Tensor, page_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """The first `length` cached rows [length, C+R] of one sequence, in position order."""
    page_size = kv_pool.shape[1]
    pages = page_table_row[: cdiv(length, page_size)].long()
    return kv_pool[pages].reshape(-1, kv_pool.shape[-1])[:length]


def mla_decode_ref(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Semantics: o_lat[b,h] = Σ_t softmax_t(scale·(q_lat[b,h]·c[t] + q_rope[b,h]·k_rope[t])) c[t].

    Args:
        q_lat: [B, H, C]; q_rope: [B, H, R] (already rotated).
        kv_pool: [pages, S, C + R] latent cache of one layer.
        page_table: [B, max_pages] int32; context_lens: [B] int32 (tokens t < len attend).
    Returns: o_lat [B, H, C] in q_lat's dtype (float32 math).
    """
    latent_dim = q_lat.shape[-1]
    out = torch.empty_like(q_lat)
    for b, length in enumerate(context_lens.tolist()):
        rows = gather_paged_rows(kv_pool, page_table[b], length).float()  # [L, C+R]
        latent, k_rope = rows[:, :latent_dim], rows[:, latent_dim:]
        scores = (q_lat[b].float() @ latent.T + q_rope[b].float() @ k_rope.T) * scale  # [H, L]
        out[b] = (scores.softmax(dim=-1) @ latent).to(q_lat.dtype)
    return out


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, page_table_ptr, ctx_ptr, o_part_ptr, lse_part_ptr,
    BATCH_BUCKET, H, scale,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_kvp, stride_kvs, stride_ptb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    # Head blocks vary fastest: the programs of one sequence run together and share its
    # K/V rows through L2 instead of each reading them from memory (H=128: 8 blocks).
    grid_dependency_control()
    head_block, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < H
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    q_lat = masked_tile(
        q_lat_ptr + b * stride_qlb, heads * stride_qlh, head_mask, offs_c, C
    )  # [BLOCK_H, BLOCK_C]
    q_rope = masked_tile(
        q_rope_ptr + b * stride_qrb, heads * stride_qrh, head_mask, offs_r, R
    )  # [BLOCK_H, BLOCK_R]
    start, end = split_range(ctx_ptr, b, split, NUM_SPLITS, BLOCK_T)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < end
        row = paged_rows(
            page_table_ptr, b, stride_ptb, t, t_mask, stride_kvp, stride_kvs, PAGE_SIZE
        )
        latent = masked_tile(kv_ptr, row, t_mask, offs_c, C)  # [BLOCK_T, BLOCK_C]
        k_rope = masked_tile(kv_ptr + C, row, t_mask, offs_r, R)  # [BLOCK_T, BLOCK_R]
        s = tl.dot(q_lat, tl.trans(latent)) + tl.dot(q_rope, tl.trans(k_rope))
        p, alpha, m, denom = online_softmax_step(s, t_mask, scale, m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)

    has_tokens = start < end
    safe_denom = tl.where(has_tokens, denom, 1.0)
    lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
    o_base = o_part_ptr + b * stride_ob + split * stride_os
    tl.store(
        o_base + heads[:, None] * stride_oh + offs_c[None, :],
        acc / safe_denom[:, None],
        mask=head_mask[:, None] & (offs_c[None, :] < C),
    )
    tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


# Splits a merge program loads per step, as one [chunk, BLOCK_C] tile of partials rather
# than one row at a time: from MERGE_WHOLE_TILE_MIN_SPLITS splits (batches of ≤ 8 make
# 33-64) a tile of the most a decode kernel makes, so all in one step; fewer in chunks of
# MERGE_SPLIT_CHUNK (a tile of mostly masked rows cost more than it saved there). Two
# compiled variants, both met by the graph capture's batch sizes.
MERGE_SPLIT_CHUNK = 8
MERGE_WHOLE_TILE_MIN_SPLITS = 17
# Programs below which the merge cuts a head's latent columns into 128-wide blocks (batch 1:
# 16 heads are 16 programs otherwise); from there one program takes the whole row.
MERGE_MIN_PROGRAMS = 264
MERGE_NARROW_BLOCK_C = 128


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_merge_kernel(
    o_part_ptr, lse_part_ptr, out_ptr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    corr_o_ptr, corr_a_ptr, corr_bv_ptr, token_slot_ptr, slot_rank_ptr, V,
    stride_cot, stride_coh, stride_cas, stride_car, stride_cbs, stride_cbh, stride_cbv,
    BLOCK_V: tl.constexpr, RANK_CHUNK: tl.constexpr, B_RANK_ALIGN: tl.constexpr,
    C: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_CHUNK: tl.constexpr, num_splits,
    CORRECT: tl.constexpr,
):  # fmt: skip
    """out[b, h, column block] = Σ_s w_s · o_part[b, h, s] / Σ_s w_s, w_s = exp(lse_s − max).
    CORRECT (whole rows: BLOCK_C ≥ C): also writes kv_b's output correction of the row
    (`kernels.mla_lora.store_output_correction`; the corr_* arguments)."""
    grid_dependency_control()
    b, h, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lse_row = lse_part_ptr + b * stride_lb + h * stride_lh
    offs_chunk = tl.arange(0, SPLIT_CHUNK)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    # Typed loop-carried values: the split count is a run-time loop bound.
    lse_max = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        offs_s = s0 + offs_chunk
        lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, tl.max(lse, axis=0))
    # Every split empty (context 0): the weights below are all 0 and o_lat is 0.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros((BLOCK_C,), tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        offs_s = s0 + offs_chunk
        lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        weight = tl.exp(lse - lse_max)  # [s], 0 for empty splits (lse = -inf)
        # An empty split's partials are not read (kernels.mla_decode_v3 leaves them unwritten).
        live = lse > float("-inf")
        part = tl.load(
            o_part_ptr
            + b * stride_ob
            + h * stride_oh
            + offs_s[:, None] * stride_os
            + offs_c[None, :],
            mask=live[:, None] & mask_c[None, :],
            other=0.0,
        )  # [s, c]
        acc += tl.sum(weight[:, None] * part, axis=0)
        total += tl.sum(weight, axis=0)
    o_lat = (acc / tl.where(total > 0.0, total, 1.0)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + offs_c, o_lat, mask=mask_c)
    if CORRECT:
        store_output_correction(
            o_lat.to(tl.float32), offs_c, mask_c, b, h,
            corr_o_ptr, corr_a_ptr, corr_bv_ptr, token_slot_ptr, slot_rank_ptr, V,
            stride_cot, stride_coh, stride_cas, stride_car, stride_cbs, stride_cbh, stride_cbv,
            BLOCK_V, RANK_CHUNK, B_RANK_ALIGN,
        )  # fmt: skip


def _prune_head_blocks(configs, named_args, **kwargs):
    """Head tiles wider than the (power-of-two-rounded) head count only waste registers."""
    heads = max(16, next_power_of_2(named_args["H"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= heads]


# Launch configurations raced once per (batch rounded up to a power of two, H, splits) on
# the first CUDA call, i.e. during the warm-up before graph capture; the bucket keeps eager
# steps of new batch sizes from re-tuning. The first is the v1 configuration (BLOCK_T 16 for
# C=512, Triton's default 4 warps / 3 stages); the others tile more tokens per iteration
# (fewer serial steps of a latency-bound loop) or more heads per program (H=128 reads each
# K/V row once per 32/64 heads instead of per 16).
MLA_DECODE_CONFIGS = [
    triton.Config({"BLOCK_H": 16, "BLOCK_T": 16}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_H": 16, "BLOCK_T": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_H": 16, "BLOCK_T": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_H": 32, "BLOCK_T": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_H": 64, "BLOCK_T": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_H": 64, "BLOCK_T": 64}, num_warps=8, num_stages=2),
]
_mla_decode_tuned = triton.autotune(
    MLA_DECODE_CONFIGS,
    key=["BATCH_BUCKET", "H", "NUM_SPLITS"],
    prune_configs_by={"early_config_prune": _prune_head_blocks},
)(_mla_decode_kernel)


def default_num_splits(batch: int, heads: int) -> int:
    """Split-K factor from the launch shape only (so a captured CUDA graph stays valid).

    Aims at ~2 programs per SM of an H100/H200 (132 SMs) counting 64 heads per program
    (the widest tuned head tile); at most 16 splits.
    """
    programs = batch * cdiv(heads, 64)
    return max(1, min(16, cdiv(264, programs)))


MLA_DECODE_VARIANTS = ("v2", "v3")
# Up to this many heads v3 is the faster kernel: H100, 2026-11-22 (bench.kernels_base
# --mla-variants), H16 v3 ÷ v2 = 0.87 at B256 ctx512, 0.73 at B64 ctx4096, 1.4 at B1 ctx512
# (12 → 18 µs); H128 v2 wins at ctx 4096 (411 vs 510 µs at B64). docs/benchmarks.md.
V3_MAX_HEADS = 32


def default_decode_variant(heads: int) -> str:
    """The measured-faster decode kernel for this head count (see V3_MAX_HEADS)."""
    return "v3" if heads <= V3_MAX_HEADS else "v2"


class DecodePlan(NamedTuple):
    """What `mla_decode` launches for a shape: the kernel variant, its tile plan (None: v2
    races its configurations) and the split count."""

    variant: str
    config: triton.Config | None
    splits: int

    @property
    def merges(self) -> bool:
        """Whether the split merge runs (v2 always merges; v3 writes `out` itself from one
        split), so it can write kv_b's output correction."""
        return self.variant == "v2" or self.splits > 1


def decode_plan(
    batch: int,
    heads: int,
    latent_dim: int,
    variant: str | None = None,
    config: triton.Config | None = None,
    num_splits: int | None = None,
) -> DecodePlan:
    """`mla_decode`'s choices for a launch shape; None takes each default."""
    variant = variant or default_decode_variant(heads)
    if variant not in MLA_DECODE_VARIANTS:
        raise ValueError(f"unknown MLA decode variant {variant!r}; known: {MLA_DECODE_VARIANTS}")
    if variant == "v3":
        config = config or v3.default_v3_config(heads)
        return DecodePlan(
            variant, config, num_splits or v3.v3_num_splits(batch, heads, latent_dim, config)
        )
    return DecodePlan(variant, config, num_splits or default_num_splits(batch, heads))


def decode_merges(batch: int, heads: int, latent_dim: int) -> bool:
    """Whether `mla_decode` with its defaults runs the split merge for this launch shape
    (so it can write kv_b's output correction, `correction`)."""
    return decode_plan(batch, heads, latent_dim).merges


def mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: triton.Config | None = None,
    variant: str | None = None,
    correction: OutputCorrection | None = None,
) -> torch.Tensor:
    """Triton version of `mla_decode_ref` (same arguments; `num_splits` = split-K factor).

    `variant`: "v2" (`_mla_decode_kernel`) or "v3" (`kernels.mla_decode_v3`: output latent
    split over programs, no merge launch when one split suffices); None picks
    `default_decode_variant(heads)`.
    `config`: the tile plan. v2: one of MLA_DECODE_CONFIGS; None races them once per shape
    on CUDA and runs the v1 configuration MLA_DECODE_CONFIGS[0] elsewhere (interpreter).
    v3: one of MLA_DECODE_V3_CONFIGS; None takes `default_v3_config(heads)`.
    `correction`: kv_b's output correction, written by the split merge (a launch that has
    no merge, `decode_merges` false, refuses it).
    """
    batch, heads, latent_dim = q_lat.shape
    plan = decode_plan(batch, heads, latent_dim, variant, config, num_splits)
    variant, config, splits = plan
    rope_dim = q_rope.shape[-1]
    pages, page_size, width = kv_pool.shape
    if width != latent_dim + rope_dim or q_rope.shape[:2] != (batch, heads):
        raise ValueError(
            f"q_lat {tuple(q_lat.shape)}, q_rope {tuple(q_rope.shape)}, kv_pool "
            f"{tuple(kv_pool.shape)}: need kv width C + R"
        )
    if page_table.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("page_table / context_lens must have one row per sequence")
    if q_lat.stride(-1) != 1 or q_rope.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("q_lat, q_rope and kv_pool need unit stride in the last dim")
    args = (q_lat, q_rope, kv_pool, page_table, context_lens, scale)
    out = torch.empty_like(q_lat)
    if not plan.merges and correction is not None:
        raise ValueError(f"{batch} sequences of {heads} heads take one split: no merge to write in")
    if batch == 0:
        return out
    if not plan.merges:  # the v3 kernel normalises and writes `out` itself
        v3.launch_mla_decode_v3(*args, out, None, None, config)
        return out
    o_part = torch.empty(
        (batch, heads, splits, latent_dim), dtype=torch.float32, device=q_lat.device
    )
    lse_part = torch.empty((batch, heads, splits), dtype=torch.float32, device=q_lat.device)
    if variant == "v3":
        v3.launch_mla_decode_v3(*args, out, o_part, lse_part, config)
    else:
        _launch_v2(*args, o_part, lse_part, config)
    merge_splits(o_part, lse_part, out, correction)
    return out


def merge_splits(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    correction: OutputCorrection | None = None,
) -> None:
    """out [B, H, C] = the softmax-weighted merge of the splits' partials o_part
    [B, H, splits, C] fp32 by their lse_part [B, H, splits]; a split whose lse is −inf is
    empty and its partials are never read (they may hold anything). With `correction`, each
    program takes a whole row and also writes kv_b's output correction of it."""
    batch, heads, splits, latent_dim = o_part.shape
    chunk = v3.MAX_SPLITS if splits >= MERGE_WHOLE_TILE_MIN_SPLITS else MERGE_SPLIT_CHUNK
    block_c = next_power_of_2(latent_dim)
    if batch * heads < MERGE_MIN_PROGRAMS and correction is None:
        block_c = min(block_c, MERGE_NARROW_BLOCK_C)
    if correction is None:
        corr = OutputCorrection.unused_kernel_args(out)
    else:
        correction.check(out.shape, out.dtype)
        corr = correction.kernel_args()
    fast(_mla_decode_merge_kernel)[(batch, heads, cdiv(latent_dim, block_c))](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        *corr,
        C=latent_dim, BLOCK_C=block_c, SPLIT_CHUNK=chunk, num_splits=splits,
        CORRECT=correction is not None,
    )  # fmt: skip


def _launch_v2(
    q_lat, q_rope, kv_pool, page_table, context_lens, scale, o_part, lse_part, config
) -> None:
    """`_mla_decode_kernel` into the partials o_part [B, H, splits, C] / lse_part [B, H, splits]."""
    batch, heads, latent_dim = q_lat.shape
    splits = o_part.shape[2]
    block_c = next_power_of_2(latent_dim)
    block_r = max(16, next_power_of_2(q_rope.shape[-1]))
    args = (
        q_lat, q_rope, kv_pool, page_table, context_lens, o_part, lse_part,
        next_power_of_2(batch), heads, scale,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), page_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
    )  # fmt: skip
    shape = {"C": latent_dim, "R": q_rope.shape[-1], "BLOCK_C": block_c, "BLOCK_R": block_r,
             "PAGE_SIZE": kv_pool.shape[1], "NUM_SPLITS": splits}  # fmt: skip

    def grid(meta):
        return (cdiv(heads, meta["BLOCK_H"]), splits, batch)

    if config is None and q_lat.is_cuda:
        _mla_decode_tuned[grid](*args, **shape)
        return
    config = config or MLA_DECODE_CONFIGS[0]
    block_t = config.kwargs["BLOCK_T"]
    if config is MLA_DECODE_CONFIGS[0] and block_c <= 256:
        block_t = 32  # v1's rule for narrow latents
    fast(_mla_decode_kernel)[grid](
        *args, **shape, BLOCK_H=config.kwargs["BLOCK_H"], BLOCK_T=block_t,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def mla_prefill_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int
) -> torch.Tensor:
    """Semantics: out[i,h] = Σ_{j ≤ offset+i} softmax_j(scale · q[i,h]·k[j,h]) v[j,h].

    Args:
        q: [Tq, H, D]; k: [Tk, H, D]; v: [Tk, H, Dv]; query i sits at position offset + i.
    Returns: [Tq, H, Dv] in q's dtype (float32 math).
    """
    tq, tk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, Tq, Tk]
    allowed = torch.arange(tk, device=q.device)[None, :] <= (
        offset + torch.arange(tq, device=q.device)[:, None]
    )
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v.float()).to(q.dtype)
