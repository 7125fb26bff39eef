"""Fused MoE as explicit stages over (token, expert) pairs.

    route (inference_svc.layers.moe) → moe_align → grouped_gemm(w13) → silu_mul
    → grouped_gemm(w2) → moe_combine

A pair p = t·k + j is token t's j-th chosen expert. `moe_align` sorts pairs by expert and
pads each expert's run to a multiple of the GEMM's row tile, so one program multiplies a
tile of rows that all use the same expert. Intermediates are kept in pair order
([P, 2·I] after gate_up, [P, I] after SiLU·mul, [P, hidden] after down) so the MoE-LoRA
work can add per-pair deltas between stages. Each stage has a Triton launcher and a torch
reference `*_ref`; `fused_moe_ref` is an independent per-expert loop for end-to-end checks.

Shapes: T tokens, k experts per token, P = T·k pairs, E experts, K input width, N output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8 import (
    QuantizedRows,
    block_dequant_ref,
    group_dequant_fp8_ref,
    group_quant_fp8,
    group_quant_fp8_ref,
    launch_row_group_quant,
    row_group_tile,
    store_row_groups,
)
from kernels.host_math import cdiv, next_power_of_2
from kernels.int_quant import (
    int4_group_dequant_ref,
    int8_channel_dequant_ref,
    per_token_quant_int8,
    per_token_quant_int8_ref,
)
from kernels.launch import fast
from kernels.moe_lora import MoeLoraEpilogue, add_pair_lora, first_pair_lora, sorted_row_slots
from kernels.moe_routing import choose_rows
from kernels.pdl import grid_dependency_control
from kernels.sgmv import dot_precision, rank_block

# How grouped_gemm reads a weight (`scheme=`; None picks "float" / "block" by w_scale):
#   float:      w in a float dtype, no scale.
#   block:      w float or e4m3, times scale [E, N/bn, K/bk] (FP8 block-scaled).
#   w8a8:       w int8, scale [E, N, 1] per output channel (block (1, K)); activations are
#               quantized per row to int8 and the product accumulates in int32.
#   int4_group: w uint8 [E, N, ceil(K/2)] two nibbles per byte, scale [E, N, K/G]
#               (block (1, G)); weight-only, nibbles dequantized in registers.
#   block_a8:   "block" weights with activations quantized too, DeepSeek-V3's own scheme:
#               each row's K-group of bk values to e4m3 (`group_quant_fp8_ref`), e4m3 ×
#               e4m3 MMAs (twice bf16's tensor rate, no weight dequantization), each
#               product scaled by the row's group scale times the weight's block scale.
WEIGHT_SCHEMES = {"float": 0, "block": 1, "w8a8": 2, "int4_group": 3, "block_a8": 4}
# The grouped GEMM's row tiles: MoEAlignment's, or PairTiles whose experts the launch reads
# from the tiles' topk_ids or selects itself (TokenSelection).
ALIGNED_TILES = tl.constexpr(0)
PAIR_TILES = tl.constexpr(1)
SELECTING_PAIR_TILES = tl.constexpr(2)
# Schemes with e4m3 block-scaled weights (the FP8 tiles and row-tile rules apply).
FP8_BLOCK_SCHEMES = ("block", "block_a8")


@dataclass(frozen=True)
class MoEAlignment:
    """Pairs sorted by expert, each expert's run padded to a multiple of `block_m`.

    sorted_pair_ids: [max_padded] int32; padding entries hold P (an out-of-range pair id).
    block_expert_ids: [max_padded / block_m] int32; the expert of each row tile, or -1 for
        tiles past the last expert's run.
    expert_offsets: [E + 1] int32; run of expert e is sorted_pair_ids[offsets[e]:offsets[e+1]].
    expert_counts: [E] int32; real (unpadded) pairs of each expert.
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    expert_offsets: torch.Tensor
    expert_counts: torch.Tensor
    block_m: int
    num_pairs: int


@dataclass(frozen=True)
class PairTiles:
    """One row tile per pair instead of an alignment: tile j holds pair j alone (its other
    rows padding), of expert topk_ids.flat[j]. No alignment launch, and for one token, whose
    k pairs have k distinct experts, each expert's weights are read once, as with
    MoEAlignment's tiles; more tokens would read an expert's weights once per pair.

    topk_ids: [T, k] int64, as the router chose them (or filled by the launch that selects,
    `TokenSelection`).
    """

    topk_ids: torch.Tensor
    block_m: int

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()


@dataclass(frozen=True)
class TokenSelection:
    """One token's expert selection done by the grouped GEMM over `PairTiles` instead of a
    launch before it: every program chooses from the router's `logits` [1, E] float32 as
    `moe_routing.select_experts` does (the same jitted `choose_rows`: the same ids, the
    weights to float32 rounding), takes its pair's expert, and program (0, 0) stores
    `weights` [1, k] float32 and the tiles' `topk_ids`.

    bias: noaux_tc's correction bias [E] (None otherwise); constexprs:
    `moe_routing.selection_constexprs` for the router.
    """

    logits: torch.Tensor
    bias: torch.Tensor | None
    scaling: float
    constexprs: dict[str, object]
    weights: torch.Tensor


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound of the padded length (fixed per batch size: CUDA-graph safe)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Semantics: stable-sort pairs p by topk_ids.flat[p], pad each expert's run to block_m.

    Plain torch ops without host synchronisation (~35 small kernels on a GPU), so it runs
    and is captured in CUDA graphs on either device; `moe_align` does the same in one
    Triton launch.
    Args:
        topk_ids: [T, k] integer expert ids in [0, E).
    """
    flat = topk_ids.flatten().long()  # [P]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    zero = torch.zeros(1, dtype=torch.long, device=device)
    offsets = torch.cat([zero, padded.cumsum(0)])  # [E+1]
    unpadded_offsets = torch.cat([zero, counts.cumsum(0)[:-1]])  # [E]
    order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert
    experts_sorted = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - unpadded_offsets[experts_sorted]
    total = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[offsets[experts_sorted] + rank_in_expert] = order.to(torch.int32)
    tile_starts = torch.arange(0, total, block_m, device=device)
    block_experts = torch.searchsorted(offsets[1:], tile_starts, right=True)
    block_experts = torch.where(tile_starts < offsets[-1], block_experts, -1)
    return MoEAlignment(
        sorted_pair_ids=sorted_ids,
        block_expert_ids=block_experts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
        expert_counts=counts.to(torch.int32),
        block_m=block_m,
        num_pairs=num_pairs,
    )


@triton.jit
def _store_expert_runs(
    counts, is_expert, bins, counts_ptr, offsets_ptr, block_experts_ptr, num_tiles,
    BLOCK_M: tl.constexpr, TILE_BLOCK: tl.constexpr,
):  # fmt: skip
    """From the pairs per expert bin (0 outside the experts): store the counts, the padded
    runs' offsets and each row tile's expert; returns each expert's padded run start."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)  # inclusive: end of each expert's padded run
    tl.store(counts_ptr + bins, counts, mask=is_expert)
    tl.store(offsets_ptr + 1 + bins, padded_end, mask=is_expert)
    tl.store(offsets_ptr + bins, 0, mask=bins == 0)
    # Tile → expert: the number of padded runs that end at or before the tile's start.
    run_ends = tl.where(is_expert, padded_end, 2147483647)
    used = tl.max(padded_end, 0)
    for t0 in range(0, num_tiles, TILE_BLOCK):
        tiles = t0 + tl.arange(0, TILE_BLOCK)
        first_row = tiles * BLOCK_M
        owner = tl.sum((run_ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < used, owner, -1)
        tl.store(block_experts_ptr + tiles, owner, mask=tiles < num_tiles)
    return padded_end - padded


@triton.jit
def _sort_and_scatter(
    expert, counts, local, first_pair, bins, starts_ptr, base_ptr, sorted_ids_ptr, num_experts,
    BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr,
):  # fmt: skip
    """Stably scatter one program's pairs (lane `local` is pair first_pair + local, of
    `expert`; lanes of expert ≥ num_experts are padding) to rows base[e] + their rank among
    the program's pairs of expert e. counts: the program's pairs per bin. Values another
    lane needs (the in-program starts; base, stored by the caller) go through global
    memory, ordered by a block-wide barrier."""
    tl.store(starts_ptr + bins, tl.cumsum(counts, 0) - counts)
    tl.debug_barrier()
    keys = tl.sort(expert * BLOCK + local)  # stable by expert: lane ids break ties
    sorted_expert = keys >> LOG2_BLOCK
    in_range = sorted_expert < num_experts
    start = tl.load(starts_ptr + sorted_expert, mask=in_range, other=0)
    base = tl.load(base_ptr + sorted_expert, mask=in_range, other=0)
    pair = first_pair + (keys & (BLOCK - 1))
    tl.store(sorted_ids_ptr + base + local - start, pair, mask=in_range)


@triton.jit
def align_in_one_program(
    ids_ptr, sorted_ids_ptr, block_experts_ptr, offsets_ptr, counts_ptr, starts_ptr,
    num_pairs, num_experts, total, num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, LOG2_BLOCK_P: tl.constexpr,
    NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr, TILE_BLOCK: tl.constexpr,
):  # fmt: skip
    """`moe_align` of P ≤ BLOCK_P pairs by one program: they fit in registers, so counting,
    the scan and a stable sort happen on-chip."""
    offs_p = tl.arange(0, BLOCK_P)
    real = offs_p < num_pairs
    expert = tl.load(ids_ptr + offs_p, mask=real, other=0).to(tl.int32)
    expert = tl.where(real, expert, num_experts)  # padding lanes count in bin E, sort last
    counts = tl.histogram(expert, NUM_BINS)  # [NUM_BINS]
    bins = tl.arange(0, NUM_BINS)
    is_expert = bins < num_experts
    _store_expert_runs(
        tl.where(is_expert, counts, 0), is_expert, bins, counts_ptr, offsets_ptr,
        block_experts_ptr, num_tiles, BLOCK_M, TILE_BLOCK,
    )  # fmt: skip
    for f0 in range(0, total, FILL_BLOCK):
        fill = f0 + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_ids_ptr + fill, num_pairs, mask=fill < total)
    # Each expert's pairs start at its padded run (offsets, stored above).
    _sort_and_scatter(
        expert, counts, offs_p, 0, bins, starts_ptr, offsets_ptr, sorted_ids_ptr, num_experts,
        BLOCK_P, LOG2_BLOCK_P,
    )  # fmt: skip


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["num_pairs", "total", "num_tiles"])
def _moe_align_kernel(
    ids_ptr, sorted_ids_ptr, block_experts_ptr, offsets_ptr, counts_ptr, starts_ptr,
    num_pairs, num_experts, total, num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, LOG2_BLOCK_P: tl.constexpr,
    NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr, TILE_BLOCK: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    align_in_one_program(
        ids_ptr, sorted_ids_ptr, block_experts_ptr, offsets_ptr, counts_ptr, starts_ptr,
        num_pairs, num_experts, total, num_tiles,
        BLOCK_M, BLOCK_P, LOG2_BLOCK_P, NUM_BINS, FILL_BLOCK, TILE_BLOCK,
    )  # fmt: skip


# Largest pair count aligned in one program (registers hold every pair). Larger batches
# are aligned in chunks by three launches: chunks of ALIGN_DECODE_CHUNK_PAIRS pairs up to
# ALIGN_DECODE_MAX_PAIRS pairs, of ALIGN_CHUNK_PAIRS above (prefill steps; more, up to
# ALIGN_MAX_CHUNK_PAIRS, when the chunk count would pass what the offsets program holds:
# ALIGN_CELLS chunk × expert-bin counts); beyond that the torch ops. Smaller chunks sort
# faster (each program sorts its chunk): 1024-pair chunks for V2-Lite's 64 experts, 2048 for
# V3's 256 at an 8192-token step. At V2-Lite's B=256 decode (1536 pairs) one program took
# 23 µs per MoE layer; three chunks of 512 made the 27-layer step 0.29-0.31 ms faster
# (bf16 and both FP8 schemes, H100, model_decode_*_v8_h100.json), B=64 (384 pairs, one
# program either way) unchanged.
MAX_SINGLE_PROGRAM_PAIRS = 512
ALIGN_DECODE_CHUNK_PAIRS = 512
ALIGN_DECODE_MAX_PAIRS = 4096
ALIGN_CHUNK_PAIRS = 1024
ALIGN_MAX_CHUNK_PAIRS = 4096
ALIGN_CELLS = 16384


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Triton version of `moe_align_ref` (same arguments and result): one launch up to
    MAX_SINGLE_PROGRAM_PAIRS pairs, three (`_moe_align_chunked`) while `_align_chunk`
    finds a chunk size, `moe_align_ref` beyond.
    """
    num_pairs, device = topk_ids.numel(), topk_ids.device
    chunk = _align_chunk(num_pairs, num_experts) if num_pairs > MAX_SINGLE_PROGRAM_PAIRS else 0
    if num_pairs == 0 or chunk is None:
        return moe_align_ref(topk_ids, num_experts, block_m)
    flat = topk_ids.flatten()
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    if chunk:
        return _moe_align_chunked(flat, num_experts, block_m, chunk)
    align, args, constexprs = one_program_alignment(num_pairs, num_experts, block_m, device)
    fast(_moe_align_kernel)[(1,)](flat, *args, **constexprs)
    return align


def one_program_alignment(
    num_pairs: int, num_experts: int, block_m: int, device: torch.device
) -> tuple[MoEAlignment, tuple, dict[str, int]]:
    """The result buffers of aligning num_pairs ≤ MAX_SINGLE_PROGRAM_PAIRS pairs in one
    program (the callers check the bound), and `align_in_one_program`'s arguments after
    ids_ptr: (run-time in signature order, constexpr and launch options by name)."""
    total = max_padded_pairs(num_pairs, num_experts, block_m)
    num_tiles = total // block_m
    sorted_ids = torch.empty(total, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    num_bins = _align_bins(num_experts)
    starts = torch.empty(num_bins, dtype=torch.int32, device=device)  # scratch
    block_p = max(16, next_power_of_2(num_pairs))
    args = (sorted_ids, block_experts, offsets, counts, starts, num_pairs, num_experts, total,
            num_tiles)  # fmt: skip
    constexprs = {
        "BLOCK_M": block_m, "BLOCK_P": block_p, "LOG2_BLOCK_P": block_p.bit_length() - 1,
        "NUM_BINS": num_bins, "FILL_BLOCK": 1024, "TILE_BLOCK": 32,
        "num_warps": 8 if block_p >= 1024 else 4,
    }  # fmt: skip
    align = MoEAlignment(sorted_ids, block_experts, offsets, counts, block_m, num_pairs)
    return align, args, constexprs


def _align_bins(num_experts: int) -> int:
    return next_power_of_2(num_experts + 1)  # bin E counts the padding lanes


def _align_chunk(num_pairs: int, num_experts: int) -> int | None:
    """Pairs per chunk of the chunked alignment, None when even the largest chunks are
    too many for the offsets program."""
    max_chunks = ALIGN_CELLS // _align_bins(num_experts)
    chunk = ALIGN_DECODE_CHUNK_PAIRS if num_pairs <= ALIGN_DECODE_MAX_PAIRS else ALIGN_CHUNK_PAIRS
    while cdiv(num_pairs, chunk) > max_chunks and chunk < ALIGN_MAX_CHUNK_PAIRS:
        chunk *= 2
    return chunk if cdiv(num_pairs, chunk) <= max_chunks else None


def _moe_align_chunked(
    flat: torch.Tensor, num_experts: int, block_m: int, chunk: int
) -> MoEAlignment:
    """`moe_align` of more pairs than one program holds: per-chunk expert counts (and the
    sentinel fill), then one program turns them into run offsets and each chunk's first
    row per expert, then each chunk sorts its pairs and scatters them. A chunk's pairs land
    after every earlier chunk's pairs of the same expert, so the order stays stable."""
    num_pairs, device = flat.numel(), flat.device
    total = max_padded_pairs(num_pairs, num_experts, block_m)
    num_tiles = total // block_m
    num_chunks = cdiv(num_pairs, chunk)
    num_bins = _align_bins(num_experts)
    sorted_ids = torch.empty(total, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    # Scratch: per chunk and bin its count, its first row, and its in-chunk start.
    scratch = torch.empty(3, num_chunks, num_bins, dtype=torch.int32, device=device)
    chunk_counts, chunk_base, chunk_starts = scratch.unbind(0)
    common = {"CHUNK": chunk, "NUM_BINS": num_bins, "num_warps": 8}
    fast(_moe_chunk_count_kernel)[(num_chunks,)](
        flat, chunk_counts, sorted_ids, num_pairs, num_experts, total, FILL_BLOCK=1024, **common
    )
    fast(_moe_chunk_offsets_kernel)[(1,)](
        chunk_counts, chunk_base, block_experts, offsets, counts,
        num_chunks, num_experts, num_tiles,
        BLOCK_M=block_m, MAX_CHUNKS=ALIGN_CELLS // num_bins, TILE_BLOCK=32, **common,
    )  # fmt: skip
    fast(_moe_chunk_scatter_kernel)[(num_chunks,)](
        flat, chunk_base, chunk_starts, sorted_ids, num_pairs, num_experts,
        LOG2_CHUNK=chunk.bit_length() - 1, **common,
    )  # fmt: skip
    return MoEAlignment(sorted_ids, block_experts, offsets, counts, block_m, num_pairs)


@triton.jit(do_not_specialize=["num_pairs", "total"])
def _moe_chunk_count_kernel(
    ids_ptr, chunk_counts_ptr, sorted_ids_ptr, num_pairs, num_experts, total,
    CHUNK: tl.constexpr, NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    real = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=real, other=0).to(tl.int32)
    expert = tl.where(real, expert, num_experts)  # padding lanes count in bin E
    bins = tl.arange(0, NUM_BINS)
    tl.store(chunk_counts_ptr + chunk * NUM_BINS + bins, tl.histogram(expert, NUM_BINS))
    # This chunk's share of the sentinel fill (the scatter kernel, launched later, overwrites).
    share = tl.cdiv(total, tl.num_programs(0))
    for f0 in range(chunk * share, (chunk + 1) * share, FILL_BLOCK):
        fill = f0 + tl.arange(0, FILL_BLOCK)
        tl.store(
            sorted_ids_ptr + fill, num_pairs, mask=(fill < total) & (fill < (chunk + 1) * share)
        )


@triton.jit(do_not_specialize=["num_chunks", "num_tiles"])
def _moe_chunk_offsets_kernel(
    chunk_counts_ptr, chunk_base_ptr, block_experts_ptr, offsets_ptr, counts_ptr,
    num_chunks, num_experts, num_tiles,
    BLOCK_M: tl.constexpr, MAX_CHUNKS: tl.constexpr, NUM_BINS: tl.constexpr,
    CHUNK: tl.constexpr, TILE_BLOCK: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    chunks = tl.arange(0, MAX_CHUNKS)
    bins = tl.arange(0, NUM_BINS)
    is_expert = bins < num_experts
    cell = chunks[:, None] * NUM_BINS + bins[None, :]
    live = (chunks < num_chunks)[:, None] & is_expert[None, :]
    per_chunk = tl.load(chunk_counts_ptr + cell, mask=live, other=0)  # [MAX_CHUNKS, NUM_BINS]
    run_start = _store_expert_runs(
        tl.sum(per_chunk, axis=0), is_expert, bins, counts_ptr, offsets_ptr,
        block_experts_ptr, num_tiles, BLOCK_M, TILE_BLOCK,
    )  # fmt: skip
    earlier_chunks = tl.cumsum(per_chunk, 0) - per_chunk  # same expert, earlier chunks
    tl.store(chunk_base_ptr + cell, run_start[None, :] + earlier_chunks, mask=live)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_chunk_scatter_kernel(
    ids_ptr, chunk_base_ptr, chunk_starts_ptr, sorted_ids_ptr, num_pairs, num_experts,
    CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    real = chunk * CHUNK + local < num_pairs
    expert = tl.load(ids_ptr + chunk * CHUNK + local, mask=real, other=0).to(tl.int32)
    expert = tl.where(real, expert, num_experts)
    row = chunk * NUM_BINS  # this chunk's row of the per-chunk scratch
    _sort_and_scatter(
        expert, tl.histogram(expert, NUM_BINS), local, chunk * CHUNK, tl.arange(0, NUM_BINS),
        chunk_starts_ptr + row, chunk_base_ptr + row, sorted_ids_ptr, num_experts,
        CHUNK, LOG2_CHUNK,
    )  # fmt: skip


# FP8 block-scaled experts at decode batches up to this many pairs take half the row
# tile: their K tiles convert every weight element to bf16 once per row tile, and at 32
# rows instead of 64 (V2-Lite B=256) the GEMMs ran 1.26× (gate_up) / 1.19× (down) faster,
# at 16 instead of 32 (B=128) 1.07× / 1.05× (H100, bench.grouped_gemm_tiles --decode);
# bf16 showed no difference (≤ 2 %). Measured up to 1536 pairs.
FP8_HALF_ROWS_MAX_PAIRS = 2048


def moe_block_m(num_pairs: int, num_experts: int, scheme: str = "float") -> int:
    """Row tile of the grouped GEMM for a batch: one tile per expert's run where possible.

    Each extra tile of one expert re-reads that expert's weights, so the tile grows with
    the mean pairs per expert (×1.5 for uneven routing); padded rows cost only FLOPs,
    which decode has to spare: 16 while 1.5 × mean ≤ 16 (V2-Lite decode B ≤ 113), 32 while
    ≤ 32 (B ≤ 227), 64 while < 128, then 128 (V2-Lite prefill steps from ~910 tokens),
    where the 128-row tiles with `PREFILL_TILES` ran the 8192-token step's expert GEMMs
    1.8-2.5× faster (bf16) than 64-row ones; at 512 tokens 64 rows were as fast or faster
    (H100, bench.grouped_gemm_tiles). scheme: the experts' weight scheme (see
    FP8_HALF_ROWS_MAX_PAIRS).
    """
    want = max(1, int(1.5 * num_pairs / max(1, num_experts)))
    if want >= 128:
        return 128
    block_m = int(min(64, max(16, next_power_of_2(want))))
    if scheme in FP8_BLOCK_SCHEMES and num_pairs <= FP8_HALF_ROWS_MAX_PAIRS:
        return max(16, block_m // 2)
    return block_m


def _dequant_expert(
    w: torch.Tensor, scale: torch.Tensor | None, block, scheme: str, e: int, k: int
) -> torch.Tensor:
    """Expert e's weight as float32 [N, K] under `scheme`."""
    if scheme == "float":
        return w[e].float()
    if scheme in FP8_BLOCK_SCHEMES:
        return block_dequant_ref(w[e], scale[e], block)
    if scheme == "w8a8":
        return int8_channel_dequant_ref(w[e], scale[e])
    return int4_group_dequant_ref(w[e], scale[e], k, block[1])


def weight_scheme(scheme: str | None, w_scale: torch.Tensor | None) -> str:
    """The WEIGHT_SCHEMES name of a weight: `scheme`, or by its scale (none: float, else block)."""
    scheme = scheme or ("float" if w_scale is None else "block")
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r} (known: {sorted(WEIGHT_SCHEMES)})")
    if (w_scale is None) != (scheme == "float"):
        raise ValueError(f"weight scheme {scheme!r} with w_scale {w_scale is not None}")
    return scheme


def grouped_gemm_ref(
    a: torch.Tensor,
    w: torch.Tensor,
    align: MoEAlignment,
    rows_per_a: int,
    w_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    scheme: str | None = None,
    lora: MoeLoraEpilogue | None = None,
    gated_out: bool = False,
    role: str = "gate_up",
) -> torch.Tensor:
    """Semantics: out[p] = a[p // rows_per_a] @ W[expert(p)]ᵀ (+ lora's term) for every
    real pair p, rounded once to a's dtype; `gated_out`: W is gate ⊕ up and the result
    is silu_mul_ref(out) [P, N/2] (the activation of the rounded product). `role` picks
    the kernel's tile plan (`default_tiles`) and is only checked here.

    Under "w8a8" `a` is first rounded per row to int8 (`per_token_quant_int8_ref`), under
    "block_a8" per row and K-group of bk to e4m3 (`group_quant_fp8_ref`), as the kernel
    does; W is dequantized per `scheme` (see WEIGHT_SCHEMES).
    Args:
        a: [P / rows_per_a, K] activations (tokens for gate_up: rows_per_a = k; pairs for
            down: rows_per_a = 1).
        w: [E, N, K] expert weights (float, or e4m3 with `w_scale` [E, N/bn, K/bk], or the
            integer layouts of WEIGHT_SCHEMES).
    Returns: [P, N] in a's dtype, float32 accumulation.
    """
    scheme = weight_scheme(scheme, w_scale)
    check_role(role)
    k = a.shape[-1]
    a_float = a.float()
    if scheme == "w8a8":
        a_q, a_scale = per_token_quant_int8_ref(a)
        a_float = a_q.float() * a_scale[:, None]
    elif scheme == "block_a8":
        a_float = group_dequant_fp8_ref(*group_quant_fp8_ref(a, block[1]), block[1])
    out = torch.zeros((align.num_pairs, w.shape[1]), dtype=a.dtype, device=a.device)
    if lora is not None:
        lora.check(align.num_pairs, w.shape[1])
    offsets, counts = align.expert_offsets.tolist(), align.expert_counts.tolist()
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = align.sorted_pair_ids[offsets[e] : offsets[e] + count].long()
        weight = _dequant_expert(w, w_scale, block, scheme, e, k)  # [N, K]
        tile = a_float[pairs // rows_per_a] @ weight.T  # [n, N] float32
        if lora is not None:
            tile += lora.delta_ref(pairs, e)
        out[pairs] = tile.to(a.dtype)
    return silu_mul_ref(out) if gated_out else out


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, s_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr,
    pair_ids_ptr, sel_logits_ptr, sel_bias_ptr, sel_weights_ptr, num_experts, sel_scaling,
    N, K, num_pairs, rows_per_a,
    stride_am, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    ly_ptr, lb_ptr, l_row_slot_ptr, l_slot_rank_ptr, LORA_R, LORA_B_EXPERTS,
    stride_ly, stride_lbs, stride_lbe, stride_lbn,
    BN: tl.constexpr, BK: tl.constexpr, SCHEME: tl.constexpr, SCALE_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LORA_SLICES: tl.constexpr, LORA_BLOCK_R: tl.constexpr,
    LORA_DOT: tl.constexpr, BASE_DOT: tl.constexpr, TILES: tl.constexpr,
    SEL_TOP_K: tl.constexpr, SEL_METHOD: tl.constexpr, SEL_N_GROUP: tl.constexpr,
    SEL_TOPK_GROUP: tl.constexpr, SEL_NORM: tl.constexpr, SEL_NORM_EPS: tl.constexpr,
    SEL_BLOCK_E: tl.constexpr, SEL_BLOCK_K: tl.constexpr, GATED_OUT: tl.constexpr,
):  # fmt: skip
    # GATED_OUT: w is gate ⊕ up [E, 2N, K] (N the output's width) and the tile stores
    # silu(gate)·up; its columns interleave the two halves' rows, gate j at 2j, up j at 2j+1.
    # SCHEME: 0 float, 1 block-scaled, 2 w8a8, 3 int4_group, 4 block_a8 (WEIGHT_SCHEMES).
    # LORA_SLICES > 0: add the MoeLoraEpilogue (l*/L* arguments) to the tile before rounding.
    # TILES (ROW_TILES): the alignment's tiles, or PairTiles with the pairs' experts read
    # from pair_ids or selected here (TokenSelection: sel_* arguments).
    grid_dependency_control()
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if TILES == ALIGNED_TILES:
        expert = tl.load(block_experts_ptr + pid_m)
        if expert < 0:
            return
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        if TILES == SELECTING_PAIR_TILES:
            expert = _selected_expert(
                sel_logits_ptr, sel_bias_ptr, sel_weights_ptr, pair_ids_ptr, num_experts,
                sel_scaling, pid_m, (pid_m == 0) & (pid_n == 0),
                SEL_TOP_K, SEL_METHOD, SEL_N_GROUP, SEL_TOPK_GROUP, SEL_NORM, SEL_NORM_EPS,
                SEL_BLOCK_E, SEL_BLOCK_K,
            )  # fmt: skip
        else:
            expert = tl.load(pair_ids_ptr + pid_m)
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)  # pair pid_m, padding
    real = pair < num_pairs
    a_row = pair // rows_per_a
    if GATED_OUT:
        j = tl.arange(0, BLOCK_N)
        out_col = pid_n * (BLOCK_N // 2) + j // 2
        # weight rows: gate row out_col at even j, up row N + out_col at odd j (rows past
        # the output's columns are read, or masked past 2N, and never stored).
        offs_n = out_col + (j % 2) * N
        rows_n = 2 * N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_n = N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    if SCHEME == 2:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LORA_SLICES > 0:
        # `sorted_row_slots`: the rows' slots (one row tile a program), then a slot a tile.
        l_first_slot_ptr = l_row_slot_ptr + tl.num_programs(0) * BLOCK_M + pid_m
        l_slot, l_first_slice, l_first_slot, l_first_y, l_first_b = first_pair_lora(
            pair, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), expert, pid_n * BLOCK_N,
            ly_ptr, lb_ptr, l_row_slot_ptr, l_first_slot_ptr, l_slot_rank_ptr,
            N, LORA_R, LORA_B_EXPERTS, stride_ly, stride_lbs, stride_lbe, stride_lbn,
            LORA_SLICES, BLOCK_N, LORA_BLOCK_R,
        )  # fmt: skip
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(
            a_ptr + a_row[:, None].to(tl.int64) * stride_am + k[None, :],
            mask=real[:, None] & (k[None, :] < K),
            other=0.0,
        )
        w_mask = (offs_n[None, :] < rows_n) & (k[:, None] < K)
        if SCHEME == 3:
            # Each byte holds k = 2j (low nibble) and 2j + 1 (high); a K-tile reads its
            # bytes twice (from L1) and picks the nibble by k's parity.
            packed = tl.load(
                w_base + offs_n[None, :] * stride_wn + k[:, None] // 2, mask=w_mask, other=0
            )  # [BLOCK_K, BLOCK_N] uint8
            nibble = (packed >> ((k[:, None] % 2) * 4).to(tl.uint8)) & 0xF
            b = nibble.to(tl.int32) - 8
        else:
            b = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        if SCHEME == 2:
            acc += tl.dot(a, b, out_dtype=tl.int32)
        elif SCHEME == 0:
            acc += tl.dot(a, b, input_precision=BASE_DOT)
        elif SCHEME == 4:
            # a is e4m3 with one scale per row and K-group of BK (BLOCK_K divides BK): the
            # e4m3 × e4m3 product is exact in float32, then scaled by both blocks' scales.
            s = tl.load(
                s_base + (offs_n // BN) * stride_sn + k0 // BK, mask=offs_n < rows_n, other=0.0
            )
            a_s = tl.load(a_scale_ptr + a_row.to(tl.int64) * stride_as + k0 // BK, mask=real)
            if BLOCK_K >= 32:
                acc += tl.dot(a, b) * (a_s[:, None] * s[None, :])
            else:  # e4m3 MMAs take K tiles of 32; fp16 holds every e4m3 value exactly
                acc += tl.dot(a.to(tl.float16), b.to(tl.float16)) * (a_s[:, None] * s[None, :])
        else:
            # BLOCK_K divides BK: the tile lies in one scale block (or group) along K.
            s = tl.load(
                s_base + (offs_n // BN) * stride_sn + k0 // BK, mask=offs_n < rows_n, other=0.0
            )
            if SCALE_TILES:
                # Scale the weight tile, then chain the MMA into acc: Hopper overlaps a
                # chained MMA with the next tile's loads, where scaling each product must
                # wait for its MMA and pass over acc (the dequantized weight is rounded to
                # a's dtype, as a checkpoint in that dtype would be).
                b = (b.to(tl.float32) * s[None, :]).to(a.dtype)
                acc = tl.dot(a, b, acc, input_precision=BASE_DOT)
            else:
                acc += tl.dot(a, b.to(a.dtype), input_precision=BASE_DOT) * s[None, :]
    if SCHEME == 2:
        a_scale = tl.load(a_scale_ptr + a_row, mask=real, other=0.0)  # [BLOCK_M]
        w_scale = tl.load(s_base + offs_n * stride_sn, mask=offs_n < rows_n, other=0.0)
        result = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    else:
        result = acc
    if LORA_SLICES > 0:
        result = add_pair_lora(
            result, pair, expert, pid_n * BLOCK_N,
            l_slot, l_first_slice, l_first_slot, l_first_y, l_first_b,
            ly_ptr, lb_ptr, l_slot_rank_ptr,
            N, LORA_R, LORA_B_EXPERTS, stride_ly, stride_lbs, stride_lbe, stride_lbn,
            LORA_SLICES, BLOCK_N, LORA_BLOCK_R, LORA_DOT,
        )  # fmt: skip
    result = result.to(out_ptr.dtype.element_ty)
    if GATED_OUT:
        # Gate and up rounded as stored, then the activation as silu_mul computes it.
        gate, up = tl.split(tl.reshape(result, (BLOCK_M, BLOCK_N // 2, 2)))
        result = silu_times(gate, up).to(out_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_N / 2]
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # the output's columns
    tl.store(
        out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        result,
        mask=real[:, None] & (offs_n[None, :] < N),
    )  # fmt: skip


@triton.jit
def _selected_expert(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, scaling, pair, store,
    TOP_K: tl.constexpr, METHOD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, NORM_EPS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The expert of `pair` (< TOP_K) of a one-token step, chosen from the router's logits
    [1, E]; with `store`, the token's weights and ids [1, k] are stored too. The ids are
    the selection kernels'; the weights equal theirs to float32 rounding (the softmax's
    sum may be reduced in another order in this kernel's layout)."""
    weights, ids = choose_rows(
        logits_ptr, bias_ptr, tl.arange(0, 1), 1, num_experts, 0, scaling,
        TOP_K, METHOD, N_GROUP, TOPK_GROUP, NORM, NORM_EPS, BLOCK_E, BLOCK_K,
    )  # fmt: skip
    k_cols = tl.arange(0, BLOCK_K)[None, :]
    if store:
        tl.store(weights_ptr + k_cols, weights, mask=k_cols < TOP_K)
        tl.store(ids_ptr + k_cols, ids, mask=k_cols < TOP_K)
    return tl.sum(tl.where(k_cols == pair, ids, 0))


def _stored_k(k: int, scheme: str) -> int:
    """Width of the stored weight's last dim for logical K."""
    return cdiv(k, 2) if scheme == "int4_group" else k


@dataclass(frozen=True)
class GemmTiles:
    """Column/K tiles and the launch shape of the grouped GEMM (the row tile is the
    alignment's block_m)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Up to 64-row tiles (decode, short prefills) small column tiles and many programs: the
# weights' bandwidth bounds them, and at 512 tokens no larger plan was faster. 128-row
# tiles (long prefills) by scheme and GEMM (`GEMM_ROLES`): what measured fastest on the
# H100 at V2-Lite's prompt steps (2048-16384 tokens), without LoRA and with the MoE LoRA
# epilogue. bf16: 256 × 64 tiles (`bench.grouped_gemm_tiles`: gate_up 1.78×, down 2.47×
# over 64 × 64), pipelined 4 deep (down, twenty-ninth session: −4 to −12 %; gate_up,
# thirty-first session, the MoE stage −2 to −4 % in all eight alternating pairs). FP8
# block-scaled with bf16 activations: 256 × 64 tiles 4 deep (twenty-ninth session, against
# 128 × 128 × 3: gate_up −6 / −14 to −17 % with LoRA, down −13 / −22 % at 8192 tokens;
# half the column tiles halve the LoRA epilogues); without the epilogue gate_up keeps
# 128-wide column tiles (`PREFILL_TILES_WITHOUT_LORA`, thirty-first session: −4 to −11 %
# at 8192 tokens, −9 % at 2048; with the epilogue they were +33 to +41 %). e4m3
# activations keep 128 × 128 (256-wide tiles ran 2.9× slower). w8a8, int4 not measured.
DEFAULT_TILES = GemmTiles()
GEMM_ROLES = ("gate_up", "down")
_WIDE_PREFILL = GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=4)  # bf16, FP8
_A8_PREFILL = GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3)
PREFILL_TILES: dict[str, dict[str, GemmTiles]] = {
    "float": {"gate_up": _WIDE_PREFILL, "down": _WIDE_PREFILL},
    "block": {"gate_up": _WIDE_PREFILL, "down": _WIDE_PREFILL},
    "block_a8": {"gate_up": _A8_PREFILL, "down": _A8_PREFILL},
}
# Prefill plans of GEMMs without the MoE LoRA epilogue, where they differ.
PREFILL_TILES_WITHOUT_LORA: dict[str, dict[str, GemmTiles]] = {
    "block": {"gate_up": GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4)},
}


# Up to 64-row tiles, by scheme and row tile, where a plan beat DEFAULT_TILES at V2-Lite
# decode batches (H100, `bench.grouped_gemm_tiles --decode`, 64 / 128 / 256 tokens give
# row tiles 16 / 32 / 64): FP8 block-scaled K tiles of the whole 128-wide scale block read
# the weights at 2.1-2.4 TB/s instead of 1.6-1.8 (gate_up 1.37× / 1.29×, down 1.30× /
# 1.28× at 16 / 32 rows; 128-wide columns 1.07× / 1.13× at 64 rows); bf16 K tiles of 128
# 1.04-1.08× at 16 and 32 rows, nothing faster at 64. The rest keep DEFAULT_TILES.
DECODE_TILES: dict[str, dict[int, GemmTiles]] = {
    "block": {
        16: GemmTiles(block_n=32, block_k=128, num_warps=4, num_stages=4),
        32: GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
        64: GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=3),
    },
    "float": {
        16: GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
        32: GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3),
    },
    # e4m3 activations (`grouped_gemm_decode_a8_h100.json`): "block"'s 16-row plan ran down
    # at 0.132 ms against 0.086 for n64 s4, which is within 3 % of the best for gate_up too.
    "block_a8": {
        16: GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
        32: GemmTiles(block_n=32, block_k=128, num_warps=4, num_stages=4),
        64: GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=3),
    },
}


# FP8 block-scaled row tiles from this size scale each weight tile before its MMA and chain
# the MMA into the accumulator (prefill: compute-bound, the MMAs must overlap the loads);
# smaller tiles (decode: bandwidth-bound, a 16-row accumulator) scale each product, a
# pass over 16 rows instead of over the K × N weight tile.
SCALE_TILES_MIN_ROWS = 128


def check_role(role: str) -> None:
    """Raise unless `role` names one of the MoE's grouped GEMMs (GEMM_ROLES)."""
    if role not in GEMM_ROLES:
        raise ValueError(f"unknown grouped GEMM role {role!r} (known: {GEMM_ROLES})")


def default_tiles(
    block_m: int, scheme: str, role: str = "gate_up", with_lora: bool = False
) -> GemmTiles:
    """The plan of a `role` GEMM (GEMM_ROLES) over row tiles of block_m under `scheme`,
    `with_lora`: with the MoE LoRA epilogue (prompt-length tiles pay it per column tile)."""
    check_role(role)
    if block_m >= 128:
        without = PREFILL_TILES_WITHOUT_LORA.get(scheme, {}).get(role)
        if without is not None and not with_lora:
            return without
        return PREFILL_TILES.get(scheme, {}).get(role, DEFAULT_TILES)
    return DECODE_TILES.get(scheme, {}).get(block_m, DEFAULT_TILES)


def grouped_gemm(
    a: torch.Tensor | QuantizedRows,
    w: torch.Tensor,
    align: MoEAlignment | PairTiles,
    rows_per_a: int,
    w_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    scheme: str | None = None,
    tiles: GemmTiles | None = None,
    lora: MoeLoraEpilogue | None = None,
    selection: TokenSelection | None = None,
    gated_out: bool = False,
    role: str = "gate_up",
) -> torch.Tensor:
    """Triton version of `grouped_gemm_ref` (same arguments and result), over the
    alignment's row tiles or over `PairTiles` (then without `lora`); with `selection`
    (PairTiles of one token) the launch selects the experts too and stores them;
    `gated_out` (without `lora`): the SiLU·mul in the epilogue, no gate_up round trip and
    no launch of its own (each tile holds matching gate and up columns).

    "w8a8" quantizes `a` per row with `per_token_quant_int8` first (one extra launch),
    "block_a8" per row and K-group of bk with `group_quant_fp8` (one extra launch) unless
    `a` comes quantized so already (QuantizedRows, e.g. from `silu_mul_quant_fp8`).
    "block" (FP8) row tiles of SCALE_TILES_MIN_ROWS and more round each dequantized weight
    tile to a's dtype before its MMA (the reference keeps the scaled weight in float32).
    tiles: None picks `default_tiles(align.block_m, scheme, role, lora is not None)` (role:
    which of the MoE's GEMMs this is); a scale block along K must be a multiple of the K
    tile (the FP8 and int4 schemes use min(tiles.block_k, BK)).
    """
    scheme = weight_scheme(scheme, w_scale)
    tiles = tiles or default_tiles(align.block_m, scheme, role, lora is not None)
    num_experts, n, stored_k = w.shape
    a_scale = None  # the activations' scales (w8a8, block_a8)
    if isinstance(a, QuantizedRows):
        if scheme != "block_a8":
            raise ValueError(f"quantized activations are block_a8's input, not {scheme!r}'s")
        a, a_scale, out_dtype = a
    else:
        out_dtype = a.dtype
    k = a.shape[-1]
    if stored_k != _stored_k(k, scheme) or a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"a {tuple(a.shape)} / w {tuple(w.shape)}: K mismatch or strided K")
    bn, bk = block if block is not None else (1, 1)  # unused without a scale
    if w_scale is not None and w_scale.shape != (
        num_experts,
        cdiv(n, bn),
        cdiv(k, bk),
    ):
        raise ValueError(f"w_scale {tuple(w_scale.shape)} does not match w / block {block}")
    if scheme in (*FP8_BLOCK_SCHEMES, "int4_group"):
        block_k = min(tiles.block_k, bk)
        if bk % block_k:
            raise ValueError(f"scale block {bk} along K must be a multiple of {block_k}")
    else:
        block_k = tiles.block_k
    if gated_out and (lora is not None or n % 2 or tiles.block_n < 2):
        raise ValueError(
            f"a gated output takes gate ⊕ up weights of even width, column tiles of 2 or more "
            f"and no LoRA: w {tuple(w.shape)}, block_n {tiles.block_n}, lora {lora is not None}"
        )
    out_n = n // 2 if gated_out else n
    out = torch.empty((align.num_pairs, out_n), dtype=out_dtype, device=a.device)
    if scheme == "w8a8":
        a, a_scale = per_token_quant_int8(a)
    elif scheme == "block_a8" and a_scale is None:
        a, a_scale = group_quant_fp8(a, bk)
    a_scale = a_scale if a_scale is not None else w  # unused pointer without scales
    scale = w_scale if w_scale is not None else w  # unused pointer for "float"
    block_n = tiles.block_n
    out_block = block_n // 2 if gated_out else block_n  # output columns a program stores
    row_tiles, tile_args, tile_constexprs = _row_tile_arguments(align, selection, lora, out)
    fast(_grouped_gemm_kernel)[(row_tiles, cdiv(out_n, out_block))](
        a, a_scale, w, scale, out, *tile_args, out_n, k, align.num_pairs, rows_per_a,
        a.stride(0), a_scale.stride(0) if scheme == "block_a8" else 0, w.stride(0), w.stride(1),
        scale.stride(0) if w_scale is not None else 0,
        scale.stride(1) if w_scale is not None else 0,
        out.stride(0),
        *_lora_arguments(lora, out, align, n),
        BN=bn, BK=bk, SCHEME=WEIGHT_SCHEMES[scheme],
        SCALE_TILES=scheme == "block" and align.block_m >= SCALE_TILES_MIN_ROWS,
        BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        LORA_SLICES=lora.num_slices if lora is not None else 0,
        LORA_BLOCK_R=rank_block(lora.b.shape[3]) if lora is not None else 16,
        LORA_DOT=dot_precision(lora.b.dtype if lora is not None else a.dtype),
        # float32 activations multiply in float32, not tf32 (the integer schemes' and e4m3's
        # products are exact either way; this reaches only float and FP8-weight tiles).
        BASE_DOT=dot_precision(a.dtype),
        **tile_constexprs, GATED_OUT=gated_out, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


# The SEL_* constexprs of launches that do not select (never read).
_NO_SELECTION = {
    "SEL_TOP_K": 1, "SEL_METHOD": 0, "SEL_N_GROUP": 1, "SEL_TOPK_GROUP": 1, "SEL_NORM": False,
    "SEL_NORM_EPS": 0.0, "SEL_BLOCK_E": 16, "SEL_BLOCK_K": 1,
}  # fmt: skip


def _row_tile_arguments(
    align: MoEAlignment | PairTiles,
    selection: TokenSelection | None,
    lora: MoeLoraEpilogue | None,
    out: torch.Tensor,
) -> tuple[int, tuple, dict[str, object]]:
    """The launch's row tiles (the grid's first dim), the kernel's row-tile arguments
    (sorted_ids, block_experts, pair_ids, sel_logits, sel_bias, sel_weights, num_experts,
    sel_scaling) and its TILES and SEL_* constexprs; placeholders (out) are never read."""
    if isinstance(align, MoEAlignment):
        if selection is not None:
            raise ValueError("a TokenSelection selects for PairTiles, not for an alignment")
        experts = align.block_expert_ids
        args = (align.sorted_pair_ids, experts, out, out, out, out, 0, 1.0)
        return experts.numel(), args, {"TILES": ALIGNED_TILES.value, **_NO_SELECTION}
    ids = align.topk_ids
    if lora is not None or ids.dtype != torch.int64 or not ids.is_contiguous():
        raise ValueError(
            f"PairTiles take contiguous int64 topk_ids and no LoRA: ids {tuple(ids.shape)} "
            f"{ids.dtype}, lora {lora is not None}"
        )
    if selection is None:
        args = (out, out, ids, out, out, out, 0, 1.0)
        return ids.numel(), args, {"TILES": PAIR_TILES.value, **_NO_SELECTION}
    logits, weights = selection.logits, selection.weights
    if logits.shape[0] != 1 or ids.shape != weights.shape or ids.shape[0] != 1:
        raise ValueError(
            f"a TokenSelection is one token's: logits {tuple(logits.shape)}, weights "
            f"{tuple(weights.shape)}, ids {tuple(ids.shape)}"
        )
    bias = selection.bias if selection.bias is not None else logits
    args = (out, out, ids, logits, bias, weights, logits.shape[1], float(selection.scaling))
    constexprs = {f"SEL_{name}": value for name, value in selection.constexprs.items()}
    return ids.numel(), args, {"TILES": SELECTING_PAIR_TILES.value, **constexprs}


def _lora_arguments(
    lora: MoeLoraEpilogue | None, out: torch.Tensor, align: MoEAlignment | PairTiles, n: int
) -> tuple:
    """The kernel's l*/L* arguments: the epilogue's tensors and strides with the slots of
    the alignment's sorted rows (one launch), or placeholders (never read: LORA_SLICES 0)
    without one. Only an alignment's row tiles take LoRA (`_row_tile_arguments`)."""
    if lora is None:
        return (out, out, out, out, 0, 1, 0, 0, 0, 0)
    lora.check(align.num_pairs, n)
    b = lora.b
    return (
        lora.y, b, sorted_row_slots(align.sorted_pair_ids, align.block_m, lora),
        lora.slot_rank, b.shape[3], b.shape[1], lora.y.stride(0), b.stride(0), b.stride(1),
        b.stride(2),
    )  # fmt: skip


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: [R, 2I] → silu(g) · u, where g, u = gate_up[:, :I], gate_up[:, I:]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate_up.dtype)


@triton.jit
def silu_times(g, u):
    """silu(g) · u in float32 from the stored gate and up values (shared by the kernels
    that apply the activation, so they all round alike)."""
    g = g.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u.to(tl.float32)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    grid_dependency_control()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    out = silu_times(g, u)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of `silu_mul_ref`."""
    rows, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [R, 2I], unit-stride")
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, next_power_of_2(inter))
        grid = (rows, cdiv(inter, block))
        fast(_silu_mul_kernel)[grid](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out


def silu_mul_quant_fp8_ref(gate_up: torch.Tensor, group: int) -> QuantizedRows:
    """Semantics: group_quant_fp8_ref(silu_mul_ref(gate_up), group): the activation rounded
    to gate_up's dtype, then quantized per row and K-group (a block_a8 GEMM's input)."""
    return QuantizedRows(*group_quant_fp8_ref(silu_mul_ref(gate_up), group), gate_up.dtype)


# Per-step row counts unspecialised, as the quantizer's.
@triton.jit(do_not_specialize=["M"])
def _silu_mul_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, M, inter, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, MIN_AMAX: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    # The quantizer's tile of the activation [M, inter]; gate_up [M, 2·inter] gives it.
    grid_dependency_control()
    rows, cols, mask = row_group_tile(M, inter, GROUP, BLOCK_M)
    gate = x_ptr + rows[:, None] * stride_x + cols[None, :]
    g = tl.load(gate, mask=mask, other=0.0)
    u = tl.load(gate + inter, mask=mask, other=0.0)
    act = silu_times(g, u).to(x_ptr.dtype.element_ty).to(tl.float32)
    store_row_groups(act, q_ptr, s_ptr, rows, cols, mask, M, stride_q, stride_s, MIN_AMAX, QMAX)


def silu_mul_quant_fp8(gate_up: torch.Tensor, group: int) -> QuantizedRows:
    """Triton version of `silu_mul_quant_fp8_ref` (bit for bit): one launch instead of
    `silu_mul` then `group_quant_fp8`, and the bf16 activation never stored."""
    rows, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [R, 2I], unit-stride")
    q, scale = launch_row_group_quant(_silu_mul_quant_fp8_kernel, gate_up, width // 2, group)
    return QuantizedRows(q, scale, gate_up.dtype)


def moe_combine_ref(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t] = Σ_j topk_weights[t, j] · pair_out[t·k + j] (float32 sum).

    Args:
        pair_out: [T·k, H]; topk_weights: [T, k] float32. Returns [T, H] in pair_out's dtype.
    """
    tokens, k = topk_weights.shape
    weighted = (
        pair_out.float().view(tokens, k, pair_out.shape[-1]) * topk_weights.float()[:, :, None]
    )
    return weighted.sum(dim=1).to(pair_out.dtype)


@triton.jit
def weighted_pair_sum(y_ptr, w_ptr, token, cols, mask, stride_y, TOPK: tl.constexpr):
    """Σ_j w[token, j] · y[token·k + j, cols] in float32, j in order: the combine's sum,
    shared by every kernel that combines so they all round alike."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    # Unrolled: the k weight and row loads are independent, so all go out at once (a run-time
    # loop issued them one iteration at a time). H100, 27-layer V2-Lite step against the run-
    # time loop, two runs each in one call: B = 1 2.734 / 2.735 → 2.717 / 2.714 ms, 64
    # 13.191 / 13.183 → 13.137 / 13.118, 256 16.665 / 16.678 → 16.658 / 16.662.
    for j in tl.static_range(TOPK):
        weight = tl.load(w_ptr + token * TOPK + j)
        y = tl.load(y_ptr + (token * TOPK + j) * stride_y + cols, mask=mask, other=0.0)
        acc += weight * y.to(tl.float32)
    return acc


@triton.jit
def _moe_combine_kernel(
    y_ptr, w_ptr, out_ptr, hidden, stride_y, stride_o, TOPK: tl.constexpr, BLOCK: tl.constexpr
):
    grid_dependency_control()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = weighted_pair_sum(y_ptr, w_ptr, token, cols, mask, stride_y, TOPK)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Triton version of `moe_combine_ref`."""
    tokens, k = topk_weights.shape
    hidden = pair_out.shape[-1]
    if pair_out.shape[0] != tokens * k or pair_out.stride(-1) != 1:
        raise ValueError(f"pair_out {tuple(pair_out.shape)} is not [T·k, H] for T={tokens}, k={k}")
    weights = topk_weights.float().contiguous()
    out = torch.empty((tokens, hidden), dtype=pair_out.dtype, device=pair_out.device)
    if tokens:
        block = min(1024, next_power_of_2(hidden))
        grid = (tokens, cdiv(hidden, block))
        fast(_moe_combine_kernel)[grid](
            pair_out, weights, out, hidden, pair_out.stride(0), out.stride(0), TOPK=k, BLOCK=block
        )
    return out


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Semantics: y[t] = Σ_j w[t,j] · W2[e]·(silu(G[e]·x[t]) ⊙ U[e]·x[t]), e = topk_ids[t, j].

    A per-expert loop independent of the staged path, in float32. w13 [E, 2I, K] = G ⊕ U,
    w2 [E, K, I] (float weights). Returns [T, K] in x's dtype.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = silu_mul_ref(x[token].float() @ w13[e].float().T)
        y = h @ w2[e].float().T
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
