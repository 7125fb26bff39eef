"""y = x·Wᵀ for a few rows (decode steps): stream the weight across every SM.

At a decode step the dense projections (attention's qkv_a, q_b, o; the shared experts'
gate_up and down) multiply 1-256 rows by a 2-24 MB weight. The time floor is the weight's
bytes over the copy bandwidth, and cuBLAS measured ~2.7× above it at 64 rows
(docs/benchmarks.md, "decode step by kernel"): too few output tiles to keep 132 SMs
streaming. Here narrow column tiles and a split of K give every SM a share of the weight;
the splits' fp32 partials are summed by the tile's last program to arrive (a counter per
tile, reset by that program), so the product stays one launch and deterministic (the
splits are summed in a fixed order).

Shape legend: M rows, N output features, K input features; S splits of K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.host_math import cdiv


@dataclass(frozen=True)
class SkinnyTiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


# Per row bucket (the smallest bucket ≥ M): the plan `skinny_linear` uses by default.
DEFAULT_TILES = {
    16: SkinnyTiles(16, 32, 256, 2),
    64: SkinnyTiles(64, 32, 128, 2),
}
# Rows above which the model keeps cuBLAS (`use_skinny_linear`).
SKINNY_MAX_ROWS = max(DEFAULT_TILES)
# Tiles that split K count their arrivals here; each launch's programs reset what they use.
_MAX_COUNTED_TILES = 1 << 14
_counters: dict[torch.device, torch.Tensor] = {}


def skinny_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Semantics: y[M, N] = x[M, K] · w[N, K]ᵀ, fp32 accumulation, rounded to x's dtype."""
    return F.linear(x, w)


def use_skinny_linear(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the model's Linear takes `skinny_linear` for this product (CUDA, 16-bit
    weights, at most SKINNY_MAX_ROWS rows)."""
    return (
        x.is_cuda
        and 0 < x.shape[0] <= SKINNY_MAX_ROWS
        and x.dim() == 2
        and w.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == w.dtype
    )


def default_skinny_tiles(rows: int) -> SkinnyTiles:
    for bucket in sorted(DEFAULT_TILES):
        if rows <= bucket:
            return DEFAULT_TILES[bucket]
    return DEFAULT_TILES[max(DEFAULT_TILES)]


# Row counts unspecialised: one compile per tile plan, not per batch-size class.
@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = split * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # part [S, M, N] fp32; the counter's acq_rel add publishes this split's partial and,
        # for the last to arrive, makes the others' visible.
        tile_offsets = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + split * M * N + tile_offsets, acc, mask=out_mask)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1)
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(
                    part_ptr + s * M * N + tile_offsets, mask=out_mask, other=0.0,
                    cache_modifier=".cg",
                )  # fmt: skip
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(count_ptr + tile, 0)


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > _MAX_COUNTED_TILES:
        raise ValueError(f"{tiles} output tiles split along K; at most {_MAX_COUNTED_TILES}")
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: run it once before capturing a CUDA graph")
        counters = _counters[device] = torch.zeros(
            _MAX_COUNTED_TILES, dtype=torch.int32, device=device
        )
    return counters


def skinny_linear(
    x: torch.Tensor, w: torch.Tensor, tiles: SkinnyTiles | None = None
) -> torch.Tensor:
    """Triton version of `skinny_linear_ref`. x [M, K] and w [N, K], unit stride in K.

    Launches on one stream at a time share the tile counters (the model's base matmuls
    all run on the step's stream).
    """
    rows, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype}: need one dtype, "
            "a shared K and unit stride in K"
        )
    tiles = tiles or default_skinny_tiles(rows)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    grid = (cdiv(n, tiles.block_n), cdiv(rows, tiles.block_m), tiles.split_k)
    if tiles.split_k > 1:
        part = torch.empty((tiles.split_k, rows, n), dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, grid[0] * grid[1])
    else:
        part = counters = y  # never read
    _skinny_linear_kernel[grid](
        x, w, y, part, counters, rows, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y
