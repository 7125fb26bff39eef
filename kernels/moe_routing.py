"""MoE expert selection from router logits: scores, top-k and weights in one launch.

The router's torch ops launch one kernel each: softmax, top-k and a scale for V2's greedy
routing; for `noaux_tc` sigmoid, the bias add, the top-k, a gather, a sum, a division and a
scale. At decode each is a few microseconds of latency per MoE layer. `select_experts` does
all of it in one program per block of tokens, a row of E scores in registers. On the H100
(bench/moe_routing.py, CUDA-graph replays, 64 tokens): DeepSeek-V2-Lite 14.3 → 8.4 µs,
Kimi-K2 26.2 → 15.6 µs, DeepSeek-V3 with its 8 groups 56.5 → 16.2 µs. The group limit
scores all groups in one pass over a [T, G, E/G] view, so it needs power-of-two layouts
(`groups_fit_kernel`); others keep the torch ops of `select_experts_ref`. (A first version
that scored each group with its own reductions was slower than the torch ops for V3: 82 µs.)

Methods (DeepSeek-V2/V3's `topk_method`):
    greedy:               softmax scores, the k best.
    group_limited_greedy: softmax scores; only experts in the `topk_group` groups with the
                          best max score stay (the others' scores become 0).
    noaux_tc:             sigmoid scores; choice = score + correction bias; groups ranked
                          by the sum of their two best choices; the k best choices among the
                          kept groups, weighted by their scores (not the bias).
Weights: renormalised to sum 1 (`norm_topk_prob`; greedy methods only when k > 1), else
multiplied by `routed_scaling_factor`; noaux_tc renormalises, then scales.

Shapes: T tokens, E experts, k = top_k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv, next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control

METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
# Whether the model's routers with expert groups select in the kernel (bench.kernel_variants
# patch "grouped_selection" turns it off: the torch ops, for A/B runs).
GROUPED_IN_KERNEL = True


def groups_fit_kernel(num_experts: int, n_group: int) -> bool:
    """The kernel's group limit needs power-of-two groups that fill the row of scores."""
    return n_group == 1 or (num_experts & (num_experts - 1) == 0 and n_group & (n_group - 1) == 0)


def kernel_selects(method: str, num_experts: int, n_group: int) -> bool:
    """Whether the model runs `select_experts` (on CUDA) for this router."""
    if method not in METHODS or not groups_fit_kernel(num_experts, n_group):
        return False
    return n_group == 1 or GROUPED_IN_KERNEL


_NORM_EPS = 1e-20  # the reference's: a zero weight sum must not divide by zero


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, top2: bool) -> torch.Tensor:
    """[T, E] bool: experts in the `topk_group` best of `n_group` groups, a group scored by
    its best choice (or its two best, summed)."""
    grouped = choice.view(choice.shape[0], n_group, choice.shape[1] // n_group)  # [T, G, E/G]
    if top2:
        scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        scores = grouped.max(dim=-1).values
    best = scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand_as(grouped).reshape_as(choice)


def select_experts_ref(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    scaling: float = 1.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics (module docstring). logits [T, E] float32, bias [E] (noaux_tc).
    Returns: weights [T, k] float32, ids [T, k] int64 (in no particular order)."""
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + bias
        if n_group > 1:
            choice = choice.masked_fill(
                ~_group_mask(choice, n_group, topk_group, top2=True), float("-inf")
            )
        ids = choice.topk(top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
        return weights * scaling, ids
    scores = logits.softmax(dim=-1)
    if method == "group_limited_greedy":
        scores = scores.masked_fill(~_group_mask(scores, n_group, topk_group, top2=False), 0.0)
    weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    # DeepSeek-V2 either renormalises the top-k weights or scales them, never both.
    if top_k > 1 and norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS), ids
    return weights * scaling, ids


@triton.jit
def _best_groups(
    choice, cols, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr,
):  # fmt: skip
    """[BLOCK_T, BLOCK_E] bool: the experts of each row's TOPK_GROUP best groups; a group
    scores its best choice, or its two best summed (TOP2). Groups fill the row exactly."""
    GROUP_SIZE: tl.constexpr = BLOCK_E // N_GROUP
    grouped = tl.reshape(choice, (BLOCK_T, N_GROUP, GROUP_SIZE))  # all groups in one pass
    group_score = tl.max(grouped, axis=2)  # [BLOCK_T, G]
    if TOP2 and GROUP_SIZE > 1:
        first = tl.argmax(grouped, axis=2)
        in_group = tl.arange(0, GROUP_SIZE)[None, None, :]
        group_score += tl.max(tl.where(in_group == first[:, :, None], float("-inf"), grouped), 2)
    group_of = cols // GROUP_SIZE
    group_cols = tl.arange(0, N_GROUP)
    keep = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(group_score, axis=1)
        keep = keep | (group_of[None, :] == best[:, None])
        group_score = tl.where(group_cols[None, :] == best[:, None], float("-inf"), group_score)
    return keep


@triton.jit
def choose_rows(
    logits_ptr, bias_ptr, rows, num_tokens, num_experts, stride_l, scaling,
    TOP_K: tl.constexpr, METHOD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, NORM_EPS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The experts of `rows` [BLOCK_T] (rows ≥ num_tokens choose from row 0's logits):
    weights [BLOCK_T, BLOCK_K] float32 and ids [BLOCK_T, BLOCK_K] int64, column j < TOP_K
    the j-th choice. Shared by every kernel that selects, so they all choose alike."""
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < num_experts
    rows64 = tl.where(rows < num_tokens, rows, 0).to(tl.int64)  # rows past T read row 0
    logit = tl.load(
        logits_ptr + rows64[:, None] * stride_l + cols[None, :],
        mask=col_ok[None, :],
        other=float("-inf"),
    )
    if METHOD == 2:
        scores = tl.sigmoid(logit)  # padding columns: 0
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
        choice = tl.where(col_ok[None, :], scores + bias[None, :], float("-inf"))
    else:
        exps = tl.exp(logit - tl.max(logit, axis=1)[:, None])  # padding columns: 0
        scores = exps / tl.sum(exps, axis=1)[:, None]
        choice = tl.where(col_ok[None, :], scores, float("-inf"))
    if N_GROUP > 1:
        keep = _best_groups(
            choice, cols, rows.shape[0], BLOCK_E, N_GROUP, TOPK_GROUP, METHOD == 2
        )  # fmt: skip
        if METHOD == 2:
            choice = tl.where(keep, choice, float("-inf"))
        else:  # the reference zeroes the other groups' scores, then takes the top-k
            scores = tl.where(keep, scores, 0.0)
            choice = scores
    # A NaN score (a row that overflowed, or a padding row of a replayed graph) ranks first,
    # as torch.topk ranks it: compared as NaN, argmax's reduction could keep a padding
    # column's -inf and its index, an expert id past the last expert (E not a power of two).
    choice = tl.where(col_ok[None, :] & (choice != choice), float("inf"), choice)
    k_cols = tl.arange(0, BLOCK_K)
    weights = tl.zeros((rows.shape[0], BLOCK_K), tl.float32)
    ids = tl.zeros((rows.shape[0], BLOCK_K), tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)  # ties: the lowest expert id
        hit = cols[None, :] == best[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(k_cols[None, :] == j, weight[:, None], weights)
        ids = tl.where(k_cols[None, :] == j, best.to(tl.int64)[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + NORM_EPS)
    if METHOD == 2 or not NORM:
        weights = weights * scaling
    return weights, ids


@triton.jit
def select_rows(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_experts, stride_l, scaling,
    TOP_K: tl.constexpr, METHOD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, NORM_EPS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Select the experts of `rows` [BLOCK_T] (those < num_tokens) and store their weights
    and ids [T, k] (`choose_rows`)."""
    weights, ids = choose_rows(
        logits_ptr, bias_ptr, rows, num_tokens, num_experts, stride_l, scaling,
        TOP_K, METHOD, N_GROUP, TOPK_GROUP, NORM, NORM_EPS, BLOCK_E, BLOCK_K,
    )  # fmt: skip
    row_ok = rows < num_tokens
    k_cols = tl.arange(0, BLOCK_K)
    out = tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * TOP_K + k_cols[None, :]
    mask = row_ok[:, None] & (k_cols[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


# Per-step token counts unspecialised: no compile per count class mid-serving.
@triton.jit(do_not_specialize=["num_tokens"])
def _select_experts_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_l, scaling,
    TOP_K: tl.constexpr, METHOD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, NORM_EPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    select_rows(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_experts, stride_l,
        scaling, TOP_K, METHOD, N_GROUP, TOPK_GROUP, NORM, NORM_EPS, BLOCK_E, BLOCK_K,
    )  # fmt: skip


def select_experts(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    scaling: float = 1.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `select_experts_ref` (same arguments and result; ids in order of
    choice, best first). Groups must be powers of two filling the experts
    (`groups_fit_kernel`)."""
    check_selection(logits, method, n_group, bias)
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    block_t = selection_rows_per_program(experts)
    fast(_select_experts_kernel)[(cdiv(tokens, block_t),)](
        logits, bias if bias is not None else logits, weights, ids, tokens, experts,
        logits.stride(0), float(scaling), BLOCK_T=block_t,
        **selection_constexprs(experts, top_k, method, n_group, topk_group, norm_topk_prob),
    )  # fmt: skip
    return weights, ids


def check_selection(
    logits: torch.Tensor, method: str, n_group: int, bias: torch.Tensor | None
) -> None:
    """What every selecting kernel requires of its arguments (ValueError otherwise)."""
    if method not in METHODS:
        raise ValueError(f"unknown routing method {method!r} (known: {sorted(METHODS)})")
    if not groups_fit_kernel(logits.shape[1], n_group):
        raise ValueError(
            f"{n_group} groups of {logits.shape[1]} experts: the kernel's group limit needs "
            "power-of-two groups (select_experts_ref takes any)"
        )
    if (bias is None) != (method != "noaux_tc"):
        raise ValueError("noaux_tc takes a correction bias; the greedy methods none")
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype}: want float32 [T, E]")


def selection_rows_per_program(num_experts: int) -> int:
    """Tokens one program selects for: a row of E scores per token in registers, so fewer
    tokens per program for wide routers."""
    return max(1, min(16, 4096 // next_power_of_2(num_experts)))


def selection_constexprs(
    num_experts: int, top_k: int, method: str, n_group: int, topk_group: int, norm_topk_prob: bool
) -> dict[str, object]:
    """`select_rows`' compile-time arguments for a router."""
    return {
        "TOP_K": top_k, "METHOD": METHODS[method], "N_GROUP": n_group, "TOPK_GROUP": topk_group,
        # The greedy methods renormalise only when k > 1 (a lone weight is left as it is).
        "NORM": norm_topk_prob and (top_k > 1 or method == "noaux_tc"), "NORM_EPS": _NORM_EPS,
        "BLOCK_E": next_power_of_2(num_experts), "BLOCK_K": next_power_of_2(top_k),
    }  # fmt: skip
