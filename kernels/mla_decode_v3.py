"""Absorbed MLA decode, v3: the output latent split over programs, one launch at large batch.

Same function as `mla_attention.mla_decode_ref` (o_lat[b,h] = Σ_t softmax_t(scores) c[t]).
What changes against v2 (`mla_attention._mla_decode_kernel`), and why:

- **Output columns split over programs (BLOCK_CV < C).** A program still computes the full
  scores of its head block (the q·c dot over all C columns) but accumulates only BLOCK_CV
  of the C output columns: acc [BLOCK_H, BLOCK_CV] fp32 instead of [BLOCK_H, C]. At 64 heads
  and 4 warps (one warpgroup, M = 64 wgmma tiles) acc [64, 512] would need 256 registers a
  thread; [64, 256] needs 128. The score dot walks the C columns in BLOCK_CV chunks, its own
  chunk first, so the latent rows it loads for its own chunk feed the P·c dot too: no row
  is loaded twice by one program. The sibling programs of a head block (C / BLOCK_CV of
  them) run next to each other (fastest grid axis) and share the rows through L2.
- **One launch when one split suffices.** With one split the program normalises and
  writes o_lat in the output dtype itself: no fp32 partials (B·H·C·4 bytes written and read
  again, +22% traffic over the latent cache at V2-Lite's 16 heads, context 512) and no merge
  launch. The split count is a function of the launch shape only (CUDA graphs) and aims at
  ~2 programs per SM, rounding down, so a batch that fills the GPU gets one split.
- Sequences with no cached token (context 0) give o_lat = 0, as the reference.
- The split count is a run-time argument: as a compile-time constant every new count (a
  mixed prefill + decode step has any decode batch size, so any of ~20 counts) compiled
  the kernel again, ~15 s in the first minute of serving on the H100 (2026-11-24).

Shapes: B sequences, H heads, C kv_lora_rank, R rope dim, S page size, T tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.mla_decode_parts import (
    masked_tile,
    online_softmax_step,
    paged_rows,
    split_range,
)
from kernels.pdl import grid_dependency_control

# ~2 resident programs on each of an H100/H200's 132 SMs.
TARGET_PROGRAMS = 264
MAX_SPLITS = 64
# fp32 partials of one sequence (H × splits × C × 4 bytes) at most this: 64 splits at 16
# heads, 8 at 128, whose write + read already cost as much as ~1.8k tokens of cache rows.
PARTIAL_BYTES_PER_SEQUENCE = 2 << 20


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_v3_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, page_table_ptr, ctx_ptr, out_ptr, o_part_ptr, lse_part_ptr,
    H, scale,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_kvp, stride_kvs, stride_ptb,
    stride_outb, stride_outh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    C: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CV: tl.constexpr,
    num_splits, SINGLE_SPLIT: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    C_BLOCKS: tl.constexpr = (C + BLOCK_CV - 1) // BLOCK_CV
    # Column blocks vary fastest, then head blocks: every program of one sequence runs at
    # the same time and reads its latent rows from L2 after the first one fetched them.
    c_block, head_block = tl.program_id(0) % C_BLOCKS, tl.program_id(0) // C_BLOCKS
    split, b = tl.program_id(1), tl.program_id(2)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < H
    offs_v = c_block * BLOCK_CV + tl.arange(0, BLOCK_CV)  # this program's output columns
    offs_r = tl.arange(0, BLOCK_R)
    q_base, q_rows = q_lat_ptr + b * stride_qlb, heads * stride_qlh
    q_own = masked_tile(q_base, q_rows, head_mask, offs_v, C)  # [BLOCK_H, BLOCK_CV]
    q_rope = masked_tile(
        q_rope_ptr + b * stride_qrb, heads * stride_qrh, head_mask, offs_r, R
    )  # [BLOCK_H, BLOCK_R]
    start, end = split_range(ctx_ptr, b, split, num_splits, BLOCK_T)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_CV), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < end
        row = paged_rows(
            page_table_ptr, b, stride_ptb, t, t_mask, stride_kvp, stride_kvs, PAGE_SIZE
        )
        latent_own = masked_tile(kv_ptr, row, t_mask, offs_v, C)  # [BLOCK_T, BLOCK_CV]
        k_rope = masked_tile(kv_ptr + C, row, t_mask, offs_r, R)  # [BLOCK_T, BLOCK_R]
        s = tl.dot(q_own, tl.trans(latent_own)) + tl.dot(q_rope, tl.trans(k_rope))
        for j in tl.static_range(1, C_BLOCKS):
            # The other column blocks only feed the scores. Their q chunk is loop-invariant
            # (L1-resident, or hoisted into shared memory by the compiler for wgmma).
            offs_o = (c_block + j) % C_BLOCKS * BLOCK_CV + tl.arange(0, BLOCK_CV)
            q_other = masked_tile(q_base, q_rows, head_mask, offs_o, C)  # [BLOCK_H, BLOCK_CV]
            latent_other = masked_tile(kv_ptr, row, t_mask, offs_o, C)  # [BLOCK_T, BLOCK_CV]
            s += tl.dot(q_other, tl.trans(latent_other))
        p, alpha, m, denom = online_softmax_step(s, t_mask, scale, m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent_own.dtype), latent_own)

    has_tokens = start < end
    safe_denom = tl.where(has_tokens, denom, 1.0)
    store_mask = head_mask[:, None] & (offs_v[None, :] < C)
    if SINGLE_SPLIT:
        out = out_ptr + b * stride_outb + heads[:, None] * stride_outh + offs_v[None, :]
        tl.store(out, (acc / safe_denom[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # An empty split (a short sequence's trailing ones) writes only its lse of -inf,
        # and the merge reads none of its partials.
        o_base = o_part_ptr + b * stride_ob + split * stride_os
        tl.store(
            o_base + heads[:, None] * stride_oh + offs_v[None, :],
            acc / safe_denom[:, None],
            mask=store_mask & has_tokens,
        )
        lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
        # Every column block computed the same lse; the first one writes it.
        tl.store(
            lse_part_ptr + b * stride_lb + heads * stride_lh + split,
            lse,
            mask=head_mask & (c_block == 0),
        )


def tile_plan(block_h: int, block_t: int, block_cv: int, warps: int, stages: int) -> triton.Config:
    """A launch configuration of `_mla_decode_v3_kernel`."""
    meta = {"BLOCK_H": block_h, "BLOCK_T": block_t, "BLOCK_CV": block_cv}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


# Tile plans, named for the bench; registers / shared memory from tools/triton_sass.py
# (sm_90, bf16, C 512, one split; none spills). BLOCK_CV 512 is v2's layout.
# - h16_*: V2-Lite's 16 heads, memory-bound: M = 16 mma.sync tiles. t32: 226 regs, 55 KB,
#   2 programs per SM; t16: 196 regs, 37 KB; t64_w8: 181 regs × 8 warps, 92 KB, 1 per SM;
#   t32_cv256: 167 regs (acc halved), 3 per SM, but the score dot and the rows' L2 reads
#   twice.
# - h64_* / h128_*: DeepSeek-V3 / Kimi-K2's 128 heads, compute-bound: M = 64 wgmma tiles
#   (HGMMA), q in shared memory (72 KB per 64 heads), 1 program per SM. t32_cv512_w8: two
#   warpgroups each holding half of acc and both computing the same scores (v2's widest
#   layout), 245 regs; t32_cv256: one warpgroup, half of C per program, 255 regs;
#   h128_t16_cv256_w8: all 128 heads per program, one warpgroup per 64 of them (no repeated
#   scores inside the program), half of C, 205 regs, 180 KB.
MLA_DECODE_V3_CONFIGS = {
    "h16_t32": tile_plan(16, 32, 512, 4, 2),
    "h16_t16": tile_plan(16, 16, 512, 4, 3),
    "h16_t64_w8": tile_plan(16, 64, 512, 8, 2),
    "h16_t32_cv256": tile_plan(16, 32, 256, 4, 3),
    "h64_t32_cv512_w8": tile_plan(64, 32, 512, 8, 2),
    "h64_t32_cv256": tile_plan(64, 32, 256, 4, 2),
    "h128_t16_cv256_w8": tile_plan(128, 16, 256, 8, 2),
}


def default_v3_config(heads: int) -> triton.Config:
    """The tile plan for a head count (the bench's per-plan rows are to confirm these)."""
    return MLA_DECODE_V3_CONFIGS["h16_t32" if heads <= 32 else "h64_t32_cv512_w8"]


def v3_programs_per_split(batch: int, heads: int, latent_dim: int, config: triton.Config) -> int:
    column_blocks = cdiv(latent_dim, min(config.kwargs["BLOCK_CV"], latent_dim))
    return batch * cdiv(heads, config.kwargs["BLOCK_H"]) * column_blocks


def v3_max_splits(heads: int, latent_dim: int) -> int:
    return max(1, min(MAX_SPLITS, PARTIAL_BYTES_PER_SEQUENCE // (heads * latent_dim * 4)))


def v3_num_splits(batch: int, heads: int, latent_dim: int, config: triton.Config) -> int:
    """Split-K factor from the launch shape only (so a captured CUDA graph stays valid):
    ~TARGET_PROGRAMS programs, rounding down so a full batch gets one split (one launch)."""
    programs = v3_programs_per_split(batch, heads, latent_dim, config)
    return max(1, min(v3_max_splits(heads, latent_dim), TARGET_PROGRAMS // programs))


def launch_mla_decode_v3(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    o_part: torch.Tensor | None,
    lse_part: torch.Tensor | None,
    config: triton.Config,
) -> None:
    """Runs the v3 kernel into `out` [B, H, C] (one split: o_part/lse_part None) or into the
    partials o_part [B, H, splits, C] fp32 / lse_part [B, H, splits] (the caller merges)."""
    batch, heads, latent_dim = q_lat.shape
    splits = 1 if o_part is None else o_part.shape[2]
    block_h, block_cv = config.kwargs["BLOCK_H"], config.kwargs["BLOCK_CV"]
    block_cv = min(block_cv, max(16, next_power_of_2(latent_dim)))
    part, lse = (out, out) if o_part is None else (o_part, lse_part)  # unused when unsplit
    grid = (cdiv(heads, block_h) * cdiv(latent_dim, block_cv), splits, batch)
    fast(_mla_decode_v3_kernel)[grid](
        q_lat, q_rope, kv_pool, page_table, context_lens, out, part, lse,
        heads, scale,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        part.stride(0), part.stride(1), part.stride(2) if o_part is not None else 0,
        lse.stride(0), lse.stride(1),
        C=latent_dim, R=q_rope.shape[-1], BLOCK_R=max(16, next_power_of_2(q_rope.shape[-1])),
        PAGE_SIZE=kv_pool.shape[1], BLOCK_H=block_h, BLOCK_T=config.kwargs["BLOCK_T"],
        BLOCK_CV=block_cv, num_splits=splits, SINGLE_SPLIT=o_part is None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
