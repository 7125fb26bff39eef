"""The LoRA deltas the model's layers add, each on the pool buffers of one module instance.

Every function adds in place to the base layer's output and picks the Triton launcher on
CUDA, the torch reference on the CPU (names looked up at call time, so a CPU test can route
the model through the interpreted launchers). Tokens whose slot is -1 get nothing added.

Shape legend: T tokens, D decode tokens, H heads, C kv_lora_rank, P = T·k routed
(token, expert) pairs, S pool slots, R pool rank, E experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from inference_svc.layers.streams import lora_side_stream
from kernels.gated_expand import sgmv_expand_silu_mul, sgmv_expand_silu_mul_ref
from kernels.gemv import GemvLora, gemv_lora_shrink
from kernels.lora_segments import LoraSegments
from kernels.mla_lora import (
    OutputCorrection,
    mla_kv_b_lora_o,
    mla_kv_b_lora_o_ref,
    mla_kv_b_lora_q,
    mla_kv_b_lora_q_ref,
)
from kernels.mla_q_lora import QueryLora, q_b_expand_kv_b_q, q_b_expand_kv_b_q_ref
from kernels.mla_q_lora import fits as mla_q_lora_fits
from kernels.moe_lora import (
    PAIRS_MAX_PAIRS,
    MoeLoraEpilogue,
    moe_lora_down,
    moe_lora_down_ref,
    moe_lora_epilogue,
    moe_lora_epilogue_ref,
    moe_lora_gate_up,
    moe_lora_gate_up_ref,
)
from kernels.sgmv import sgmv_expand, sgmv_expand_ref, sgmv_shrink, sgmv_shrink_ref


@dataclass(frozen=True)
class LoraWeights:
    """One module instance's pool buffers (views, so slot loads show through).

    a: [S, stack·R, in] (MoE: [S, E, stack·R, in]); b: [S, out, R] (MoE: [S, E, out, R]);
    rank: int32 [S] each slot's rank in this module, 0 where its adapter does not target it;
    carrier: [out + S·stack·R, in] the module's base weight above `a` viewed flat, where the
    pool carries it (`LoraPool.carry_base_weights`), else None.
    """

    a: Tensor
    b: Tensor
    rank: Tensor
    carrier: Tensor | None = None

    def segments(self, segs: LoraSegments) -> LoraSegments:
        """The batch's segments as this module's kernels read them: tokens of adapters
        that do not target the module do no work (their pool weights are zeros)."""
        return segs.with_slot_rank(self.rank)


@dataclass(frozen=True)
class PendingLinearLora:
    """A linear module's LoRA shrink, issued before the module's base matmul.

    y: [T, S·R] the intermediate (float32 on CUDA); with `every_slot` [T, slots·S·R],
    every slot's shrink of every token, the tail of the product with the carrier
    (`product_with_lora`); stream: the side stream it is computed on (None: the current
    stream, already ordered); segments: the batch's segments as this module's kernels read
    them (`LoraWeights.segments`), made once for shrink and expand.
    """

    y: Tensor
    stream: torch.cuda.Stream | None
    segments: LoraSegments
    every_slot: bool = False


# Largest captured step whose linear shrinks run on the side stream. A longer step's base
# matmul fills the GPU by itself, so the fork and join only add host work (two stream
# switches and two event waits per module, ~190 modules per step: H100 host profile of a
# 8192-token prefill step with 32 adapters, bench.serve_offline --profile-kind host).
SIDE_STREAM_MAX_TOKENS = 1024


def shrinks_beside_product(segs: LoraSegments, num_tokens: int) -> bool:
    """Whether a step's linear shrinks fork to the LoRA side stream: only while a CUDA graph
    (a decode step) is captured, where the fork and join cost no host time at replay. An
    eager step is bound by its launches, so there they only added host time: H200, one
    512-token prompt beside 32 decodes, 27 layers, 8 rank-16 adapters, prompt steps
    alternating one by one, medians of 20 a side in three rounds: 100.8 / 121.0 / 132.0 ms
    forked against 76.7 / 98.2 / 108.2 not, on 19.7 ms of GPU work (docs/benchmarks.md,
    forty-third session)."""
    return num_tokens <= SIDE_STREAM_MAX_TOKENS and segs.capturing()


# The side stream's shrink in 2 programs an SM (SGMV "planned_p2") instead of 8. Its grid runs
# beside the base matmul: with 8 an SM it outlasted the product and the expand waited on it
# (H200 B=64 × 32 trace, qkv_a: shrink 8.7 µs against cuBLAS's 6.7); alone, 8 an SM is faster
# (bench.lora_kernels --targets: 8.4 against 8.8 µs). H200, 8-layer decode step (bench.
# lora_decode_overhead, 2 pairs in one call against "planned"): B=64 × 32 3373.0 / 3373.7 →
# 3317.2 / 3315.2 µs, B=256 × 32 4690.3 / 4683.0 → 4693.2 / 4700.3.
SIDE_SHRINK_VARIANT = "planned_p2"


def start_linear_lora(
    x: Tensor, weights: LoraWeights, segs: LoraSegments, num_slices: int
) -> PendingLinearLora:
    """Semantics: y[t, i·R + r] = A[slot(t), i·R + r] · x[t] (the shrink of every slice).

    In a captured decode step (`shrinks_beside_product`) the shrink (and the zeroing of y)
    runs on the LoRA side stream, beside the base matmul the caller issues next: both are
    latency-bound and use a fraction of the SMs, so the shrink's launches are hidden
    instead of added to the chain.
    `finish_linear_lora` joins the streams before it adds the expand.
    Args: x [T, in]; num_slices: stacked slices S of the module.
    """
    segments = weights.segments(segs)
    if not x.is_cuda:
        return PendingLinearLora(
            sgmv_shrink_ref(x, weights.a, segments, num_slices), None, segments
        )
    # Allocated on the current stream, which waits for the side stream before it frees y.
    # Only the expand reads y, and only its live entries: the shrink zeroes it only where
    # it adds split-K partial sums (a long eager step skips one memset per module).
    y = torch.empty(x.shape[0], weights.a.shape[1], dtype=torch.float32, device=x.device)
    side = lora_side_stream(x.device) if shrinks_beside_product(segments, x.shape[0]) else None
    if side is None:
        # No stream context at all: entering one (even for the current stream) costs host
        # time in every module of an eager step.
        sgmv_shrink(x, weights.a, segments, num_slices, out=y, zero_unused=False)
        return PendingLinearLora(y, None, segments)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        sgmv_shrink(
            x, weights.a, segments, num_slices, out=y, zero_unused=False,
            variant=SIDE_SHRINK_VARIANT,
        )  # fmt: skip
    return PendingLinearLora(y, side, segments)


# Largest step whose carried linears take their shrink inside the base product: it adds
# S·stack·R columns to the product, free where the product reads its weight (a decode
# step), not where it computes (a prompt chunk).
SHRINK_IN_PRODUCT_MAX_TOKENS = 256


def shrinks_in_product(weights: LoraWeights, num_tokens: int) -> bool:
    """Whether a step of `num_tokens` multiplies by the carrier (`product_with_lora`): the
    module's weight is carried, the step is short, and it has at least as many tokens as
    the pool has slots. The product reads every slot's A rows, the side-stream shrink only
    those of the step's adapters, so a step that cannot use most slots keeps the shrink.
    H200, 8-layer decode steps with 32 rank-16 adapters in a 32-slot pool, means of two
    alternating runs (docs/benchmarks.md, fortieth session): B=64 / 128 / 256 −33 / −43 /
    −69 µs; adapters off the routed experts −63 / −63 / −109 µs; with every module carried,
    B=16 × 8 adapters (a one-off bound: 8 of 32 slots used) lost 20-30 µs."""
    slots = weights.a.shape[0]
    return weights.carrier is not None and slots <= num_tokens <= SHRINK_IN_PRODUCT_MAX_TOKENS


def product_with_lora(
    x: Tensor, weights: LoraWeights, segs: LoraSegments
) -> tuple[Tensor, PendingLinearLora]:
    """Where `shrinks_in_product`: x [T, in] · carrierᵀ, one product that is the base output
    [T, out] (a view whose rows are strided by the carrier's width) and every slot's shrink
    of every token, rounded to x's dtype as the kernels round y before their expand. The
    side stream's shrink launch and its join go; `finish_linear_lora` adds the expand."""
    out_features = weights.b.shape[1]
    product = F.linear(x, weights.carrier)  # [T, out + S·stack·R]
    pending = PendingLinearLora(
        product[:, out_features:], None, weights.segments(segs), every_slot=True
    )
    return product[:, :out_features], pending


def finish_linear_lora(
    pending: PendingLinearLora, out: Tensor, weights: LoraWeights, slice_offsets: Sequence[int]
) -> None:
    """Semantics: out[t, o_i:o_i+1] += B_i[slot(t)] · y_i[t] per stacked slice i.

    Args:
        out: [T, out] the linear's output, written in place.
        slice_offsets: S+1 column offsets of the stacked slices (0 first, out last).
    """
    args = (pending.y, weights.b, out, pending.segments, slice_offsets)
    if not out.is_cuda:
        sgmv_expand_ref(*args, y_every_slot=pending.every_slot)
        return
    if pending.stream is not None:
        torch.cuda.current_stream(out.device).wait_stream(pending.stream)
    sgmv_expand(*args, y_every_slot=pending.every_slot)


# Steps of at least this many tokens add a gated MLP's gate_up LoRA expand in the launch of
# its SiLU·mul (kernels.gated_expand): the expand's read-modify-write of the [T, 2I] product
# goes. Measured in docs/benchmarks.md (thirty-ninth session).
GATE_UP_EXPAND_WITH_SILU_MIN_TOKENS = 4096


def expands_gate_up_with_silu(num_tokens: int) -> bool:
    """Whether a gated MLP's step of `num_tokens` takes `finish_gate_up_lora_with_silu`."""
    return num_tokens >= GATE_UP_EXPAND_WITH_SILU_MIN_TOKENS


def finish_gate_up_lora_with_silu(
    pending: PendingLinearLora, gate_up: Tensor, weights: LoraWeights
) -> Tensor:
    """`finish_linear_lora` of a gated MLP's gate_up, then SiLU·mul, in one launch on CUDA:
    act[t] = silu(g) · u for g | u = gate_up[t] + B[slot] · y[t] (rounded to gate_up's dtype
    first, as the expand stores it); gate_up [T, 2I] is read, not written. Returns [T, I]."""
    if not gate_up.is_cuda:
        return sgmv_expand_silu_mul_ref(pending.y, weights.b, gate_up, pending.segments)
    if pending.stream is not None:
        torch.cuda.current_stream(gate_up.device).wait_stream(pending.stream)
    return sgmv_expand_silu_mul(pending.y, weights.b, gate_up, pending.segments)


# A one-token step's linears and absorbed kv_b products run in kernels.gemv with their LoRA:
# a linear's shrink is a GEMV launched just before its product, whose epilogue adds the
# expand; kv_b's corrections ride in the per-head products' epilogues. False: cuBLAS with
# the shrink on the side stream, the expand and the corrections as their own launches.
ONE_TOKEN_LORA_IN_GEMV = True


def one_token_linear_lora(
    x: Tensor,
    weights: LoraWeights,
    segs: LoraSegments,
    slice_offsets: Sequence[int],
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> GemvLora:
    """The LoRA of a linear whose one-token product runs in `kernels.gemv`: launches the
    shrink (y = A[slot] · x̂, x̂ normed or gated as the product forms it) and returns the
    expand for the product's epilogue. Issued right before the product, so the product's
    weight reads overlap the shrink (PDL).
    Args: x [1, in]; slice_offsets: S+1 column offsets of the stacked slices.
    """
    segs.require_tokens(1)
    y = gemv_lora_shrink(
        x, weights.a, segs.token_slot, weights.rank, len(slice_offsets) - 1, norm_weight, eps, gated
    )
    return GemvLora(
        segs.token_slot, weights.rank, weights.b.unsqueeze(1), y=y,
        slice_offsets=tuple(slice_offsets[1:-1]),
    )  # fmt: skip


def one_token_kv_b_lora(
    weights: LoraWeights, segs: LoraSegments, num_heads: int, nope_dim: int
) -> tuple[GemvLora, GemvLora]:
    """kv_b's absorbed corrections of one decode token as the per-head products' epilogues
    (`kernels.gemv.gemv_per_head`), for q_lat = q_nope · W_UK and out = o_lat · W_UVᵀ:

        q_lat[h] += (q_nope[h] · B_k[s, h]) · A[s],   out[h] += B_v[s, h] · (A[s] · o_lat[h])

    A [S, R, C], B [S, H·(n+v), R] (`set_kv_b_absorbed_q`, `add_kv_b_absorbed_o`)."""
    b_heads = weights.b.unflatten(1, (num_heads, -1))  # [S, H, n+v, R]
    a_cols = weights.a.transpose(1, 2).unsqueeze(1)  # [S, 1, C, R]
    q = GemvLora(segs.token_slot, weights.rank, a_cols, u_weight=b_heads[:, :, :nope_dim])
    o = GemvLora(segs.token_slot, weights.rank, b_heads[:, :, nope_dim:], u_weight=a_cols)
    return q, o


def set_kv_b_absorbed_q(
    q_nope: Tensor, q_lat: Tensor, weights: LoraWeights, segs: LoraSegments
) -> None:
    """Semantics: q_lat[t,h] = (q_nope[t,h] · B_k[slot,h]) · A[slot], zeros for tokens
    without an adapter; the caller adds q_nope · W_UK onto it (absorbed decode query).

    On CUDA the "prefetch" kernel: it follows the latent-cache write, a Triton kernel, so
    its weight reads overlap that kernel's run (kernels.mla_lora).
    Args: q_nope [D, H, nope]; q_lat [D, H, C] overwritten.
    """
    segs = weights.segments(segs)
    if q_nope.is_cuda:
        mla_kv_b_lora_q(
            q_nope, q_lat, weights.a, weights.b, segs, variant="prefetch", accumulate=False
        )
    else:
        mla_kv_b_lora_q_ref(q_nope, q_lat, weights.a, weights.b, segs, accumulate=False)


# A decode step's q_b LoRA expand and kv_b's absorbed query correction in one launch
# (kernels.mla_q_lora): the correction reads only the expanded q_nope, so its own launch
# after the latent-cache write goes. False: the two launches (bench.lora_decode_overhead
# kernel set "q_b_kv_b_q_separate").
Q_B_EXPAND_WITH_KV_B_Q = True


def fuses_q_b_lora_with_kv_b_q(q_b: LoraWeights, kv_b: LoraWeights) -> bool:
    """Whether a decode step whose q_b and kv_b both have pool views takes
    `finish_q_b_lora_with_kv_b_q` (pool ranks within the kernel's tiles)."""
    return Q_B_EXPAND_WITH_KV_B_Q and mla_q_lora_fits(q_b.b, kv_b.a)


def finish_q_b_lora_with_kv_b_q(
    pending: PendingLinearLora,
    q: Tensor,
    q_b: LoraWeights,
    kv_b: LoraWeights,
    q_lat: Tensor,
    nope_dim: int,
) -> None:
    """`finish_linear_lora` of q_b and `set_kv_b_absorbed_q` together, for a step whose
    every token decodes: q[t] += B_q[slot] · y[t], then q_lat[t,h] = (q_nope[t,h] ·
    B_k[slot,h]) · A[slot] from the expanded q_nope, zeros for tokens without kv_b's LoRA.

    Args: q [T, H·(nope+rope)] q_b's output, in place; q_lat [T, H, C] overwritten.
    """
    if q.is_cuda and pending.stream is not None:
        torch.cuda.current_stream(q.device).wait_stream(pending.stream)
    apply = q_b_expand_kv_b_q if q.is_cuda else q_b_expand_kv_b_q_ref
    lora = QueryLora(pending.y, q_b.b, pending.segments, kv_b.a, kv_b.b, kv_b.rank, nope_dim)
    apply(q, q_lat, lora)


# A decode step whose attention runs the split merge (kernels.mla_attention.decode_merges)
# has the merge write kv_b's output correction, and W_UV's product is added onto it: one
# launch fewer a layer. False: the correction's own launch after the product
# (bench.lora_decode_overhead kernel set "kv_b_o_separate").
KV_B_O_IN_MERGE = True


def kv_b_absorbed_o_in_merge(
    o: Tensor, weights: LoraWeights, segs: LoraSegments
) -> OutputCorrection:
    """kv_b's output correction for the attention's merge to write into o [D, H, v]:
    o[t,h] = (o_lat[t,h] · A[slot]ᵀ) · B_v[slot,h]ᵀ, zeros for tokens without the adapter."""
    return OutputCorrection(o, weights.a, weights.b, weights.segments(segs))


def add_kv_b_absorbed_o(o_lat: Tensor, o: Tensor, weights: LoraWeights, segs: LoraSegments) -> None:
    """Semantics: o[t,h] += (o_lat[t,h] · A[slot]ᵀ) · B_v[slot,h]ᵀ (absorbed decode output).

    Args: o_lat [D, H, C]; o [D, H, v] written in place.
    """
    apply = mla_kv_b_lora_o if o_lat.is_cuda else mla_kv_b_lora_o_ref
    apply(o_lat, o, weights.a, weights.b, weights.segments(segs))


# Where the routed experts' LoRA expand runs. "auto": inside the grouped GEMM (its tile gets
# y·Bᵀ before it is stored) for batches of more than PAIRS_MAX_PAIRS pairs whose tiles see
# few adapters, where a separate expand re-reads and rewrites every per-pair intermediate;
# after the GEMM otherwise ("pairs" at decode: one launch for shrink and expand). "always" /
# "never" force one path (tests, A/B benchmarks).
MOE_LORA_IN_GEMM = "auto"
# Mean rows of one (expert, adapter run) below which "auto" keeps the expand after the
# GEMM: each adapter in a tile costs the epilogue one serial masked MMA. Rows per key =
# the token-weighted mean adapter run × top_k / experts (decode rows beside long prompts
# add a tile of many adapters per expert, not a smaller mean for every tile). H100, MoE
# stage of 1024-4096 tokens in runs of 16-64 adapters (bench.moe_lora_prefill's stage,
# twenty-eighth session, two rounds; after ÷ in-GEMM time): bf16 experts 1.04-1.22× from
# 6 rows per key, 0.94-0.97× at 3, 0.85-0.87× at 1.5; FP8 (128-column tiles: twice the
# epilogues) 1.08-1.09× at 24, 1.00-1.02× at 12, 0.88-0.93× at 6. (The bf16 bound was 16,
# from older code's 0.95× at 6.) Quantized schemes other than FP8 are unmeasured: FP8's.
MOE_LORA_IN_GEMM_MIN_ROWS = {"float": 5, "quantized": 12}


def moe_lora_in_gemm(segs: LoraSegments, top_k: int, num_experts: int, quantized: bool) -> bool:
    """Whether this batch adds its routed-expert LoRA expand in the grouped GEMM's epilogue
    (`start_moe_lora`) rather than with the kernels after it (`add_moe_*`). Reads only host
    counts, so a captured decode graph keeps the choice of its capture (after the GEMM)."""
    if MOE_LORA_IN_GEMM != "auto":
        return MOE_LORA_IN_GEMM == "always"
    if segs.num_tokens * top_k <= PAIRS_MAX_PAIRS:
        return False
    rows_per_key = segs.rows_per_key(segs.num_tokens * top_k, num_experts)
    return rows_per_key >= MOE_LORA_IN_GEMM_MIN_ROWS["quantized" if quantized else "float"]


@contextlib.contextmanager
def moe_lora_placement(where: str) -> Iterator[None]:
    """Force MOE_LORA_IN_GEMM to `where` ("always" / "never") inside the block (warm-up
    compiles both paths for the step shapes where "auto" may take either)."""
    global MOE_LORA_IN_GEMM
    saved, MOE_LORA_IN_GEMM = MOE_LORA_IN_GEMM, where
    try:
        yield
    finally:
        MOE_LORA_IN_GEMM = saved


def start_moe_lora(
    a: Tensor,
    weights: LoraWeights,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    pair_order: Tensor,
    *,
    per_pair: bool,
) -> MoeLoraEpilogue:
    """Run the routed experts' LoRA shrink and return its expand for the grouped GEMM the
    caller runs next (`grouped_gemm(lora=)`), when `moe_lora_in_gemm` says so.

    Args: a: the GEMM's input, x [T, hidden] (gate_up) or act [P, I] (down, per_pair);
    pair_token int32 [P]; pair_expert int32 or int64 [P]; pair_order as in `add_moe_gate_up`.
    """
    make = moe_lora_epilogue if a.is_cuda else moe_lora_epilogue_ref
    return make(
        a, weights.a, weights.b, pair_token, pair_expert, weights.segments(segs),
        x_per_pair=per_pair, pair_order=pair_order,
    )  # fmt: skip


def add_moe_gate_up(
    x: Tensor,
    inter: Tensor,
    weights: LoraWeights,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    pair_order: Tensor,
) -> None:
    """Semantics: inter[p] += B[slot, e] · (A[slot, e] · x[tok(p)]) per gate/up slice.

    Args: x [T, hidden]; inter [P, 2·I] per-pair gate_up output, written in place;
    pair_token int32 [P]; pair_expert int32 or int64 [P]; pair_order: the base MoE's
    expert-sorted pair ids (the kernels walk long batches in it; it does not change the result).
    """
    apply = moe_lora_gate_up if x.is_cuda else moe_lora_gate_up_ref
    segs = weights.segments(segs)
    apply(x, inter, weights.a, weights.b, pair_token, pair_expert, segs, pair_order=pair_order)


def add_moe_down(
    act: Tensor,
    down_out: Tensor,
    weights: LoraWeights,
    pair_token: Tensor,
    pair_expert: Tensor,
    segs: LoraSegments,
    pair_order: Tensor,
) -> None:
    """Semantics: down_out[p] += B[slot, e] · (A[slot, e] · act[p]) before the combine.

    Args: act [P, I]; down_out [P, hidden] written in place; pair_token / pair_expert [P];
    pair_order as in `add_moe_gate_up`.
    """
    apply = moe_lora_down if act.is_cuda else moe_lora_down_ref
    segs = weights.segments(segs)
    apply(act, down_out, weights.a, weights.b, pair_token, pair_expert, segs, pair_order=pair_order)
