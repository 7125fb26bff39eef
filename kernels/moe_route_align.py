"""Expert selection and the alignment of its (token, expert) pairs in one launch, for
decode-sized steps.

Routing a MoE layer was three dependent launches before the first grouped GEMM: the router
GEMM, `moe_routing.select_experts`, `fused_moe.moe_align`. At one token each is a few µs of
latency on the step's critical path (H100, graphed V2-Lite B=1 step: selection ~3.3 µs,
alignment ~2.3 µs after their predecessors). Up to `selection_rows_per_program` tokens the
selection is one program, and up to MAX_SINGLE_PROGRAM_PAIRS pairs so is the alignment:
here one program does both, the ids passing from the first to the second through global
memory behind a block-wide barrier. Both halves are the jitted functions the two kernels
run, so the results are theirs exactly.

Shapes: T tokens, E experts, k = top_k, P = T·k pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused_moe import (
    MAX_SINGLE_PROGRAM_PAIRS,
    MoEAlignment,
    align_in_one_program,
    one_program_alignment,
)
from kernels.launch import fast
from kernels.moe_routing import (
    check_selection,
    groups_fit_kernel,
    select_rows,
    selection_constexprs,
    selection_rows_per_program,
)
from kernels.pdl import grid_dependency_control


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["num_tokens", "num_pairs", "total", "num_tiles"])
def _select_align_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_l, scaling,
    sorted_ids_ptr, block_experts_ptr, offsets_ptr, counts_ptr, starts_ptr,
    num_pairs, num_experts, total, num_tiles,
    TOP_K: tl.constexpr, METHOD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, NORM_EPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, LOG2_BLOCK_P: tl.constexpr,
    NUM_BINS: tl.constexpr, FILL_BLOCK: tl.constexpr, TILE_BLOCK: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    select_rows(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr, tl.arange(0, BLOCK_T), num_tokens,
        num_experts, stride_l, scaling, TOP_K, METHOD, N_GROUP, TOPK_GROUP, NORM, NORM_EPS,
        BLOCK_E, BLOCK_K,
    )  # fmt: skip
    tl.debug_barrier()  # the ids just stored are read back by other lanes
    align_in_one_program(
        ids_ptr, sorted_ids_ptr, block_experts_ptr, offsets_ptr, counts_ptr, starts_ptr,
        num_pairs, num_experts, total, num_tiles,
        BLOCK_M, BLOCK_P, LOG2_BLOCK_P, NUM_BINS, FILL_BLOCK, TILE_BLOCK,
    )  # fmt: skip


def select_and_align_fits(num_tokens: int, num_experts: int, top_k: int, n_group: int) -> bool:
    """Whether one program selects for all the tokens and aligns all their pairs."""
    return (
        groups_fit_kernel(num_experts, n_group)
        and 0 < num_tokens <= selection_rows_per_program(num_experts)
        and num_tokens * top_k <= MAX_SINGLE_PROGRAM_PAIRS
    )


def select_and_align(
    logits: Tensor,
    top_k: int,
    method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    bias: Tensor | None,
    block_m: int,
) -> tuple[Tensor, Tensor, MoEAlignment]:
    """Semantics: weights, ids = select_experts(logits, top_k, method, n_group, topk_group,
    norm_topk_prob, scaling, bias); (weights, ids, moe_align(ids, E, block_m)), in one
    launch. logits [T, E] float32 → weights [T, k] float32, ids [T, k] int64, alignment."""
    tokens, experts = logits.shape
    check_selection(logits, method, n_group, bias)
    if not select_and_align_fits(tokens, experts, top_k, n_group):
        raise ValueError(
            f"{tokens} tokens × top-{top_k} of {experts} experts in {n_group} groups: more "
            "than one program selects and aligns (use select_experts and moe_align)"
        )
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    align, align_args, align_constexprs = one_program_alignment(
        tokens * top_k, experts, block_m, logits.device
    )
    fast(_select_align_kernel)[(1,)](
        logits, bias if bias is not None else logits, weights, ids, tokens, logits.stride(0),
        float(scaling), *align_args,
        BLOCK_T=selection_rows_per_program(experts),
        **selection_constexprs(experts, top_k, method, n_group, topk_group, norm_topk_prob),
        **align_constexprs,
    )  # fmt: skip
    return weights, ids, align
