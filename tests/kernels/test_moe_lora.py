"""MoE LoRA over routed pairs: Triton kernels vs the torch reference, and the reference vs
fp64 dense per-expert ΔW; gated / non-gated / shared-outer layouts and routing corners."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_lora
from kernels.fused_moe import moe_align_ref
from kernels.lora_segments import build_lora_segments
from kernels.moe_lora import (
    MOE_VARIANTS,
    moe_lora_down,
    moe_lora_down_ref,
    moe_lora_gate_up,
    moe_lora_gate_up_ref,
)
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    popular_slots,
    rank_mask,
)

HIDDEN, MOE_INTER, EXPERTS, TOP_K = 70, 24, 6, 2


def _routing(num_tokens, experts, top_k, gen, padding=3):  # type: ignore[no-untyped-def]
    """Pairs sorted by expert (as the base fused MoE keeps them), plus padding pairs (-1)."""
    scores = torch.rand(num_tokens, experts, generator=gen)
    chosen = scores.topk(top_k, dim=1).indices.flatten()  # [T*k]
    tokens = torch.arange(num_tokens).repeat_interleave(top_k)
    order = torch.argsort(chosen, stable=True)
    pair_token = torch.cat([tokens[order], torch.full((padding,), -1)]).int()
    pair_expert = torch.cat([chosen[order], torch.zeros(padding, dtype=torch.long)]).int()
    return pair_token, pair_expert


def _moe_pool(ranks, experts, rows_per_slice, cols, num_slices, pool_rank, side, poison):  # type: ignore[no-untyped-def]
    """A `[slots, E, S*R, in]` (side "A") or B `[slots, E, S*N, R]` (side "B") with dead
    rank rows/columns set to `poison`."""
    live = rank_mask(ranks, pool_rank, num_slices if side == "A" else 1)  # [slots, S*R | R]
    if side == "A":
        w = torch.randn(len(ranks), experts, num_slices * pool_rank, cols) / cols**0.5
        return torch.where(live[:, None, :, None], w, poison)
    w = torch.randn(len(ranks), experts, num_slices * rows_per_slice, pool_rank) / pool_rank**0.5
    return torch.where(live[:, None, None, :], w, poison)


def _moe_case(
    popularity,
    num_tokens,
    dtype,
    seed,
    *,
    gated=True,
    shared_outer=False,
    pool_rank=16,
    poison=0.0,
    experts=EXPERTS,
    top_k=TOP_K,
    padding=3,
):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ranks = mixed_ranks(5, pool_rank, gen)
    segs = build_lora_segments(popular_slots(popularity, num_tokens, 5, gen), ranks)
    pair_token, pair_expert = _routing(num_tokens, experts, top_k, gen, padding)
    slices = 2 if gated else 1
    outer = 1 if shared_outer else experts
    weights = {
        "A_gu": _moe_pool(ranks, outer, 0, HIDDEN, slices, pool_rank, "A", poison),
        "B_gu": _moe_pool(ranks, experts, MOE_INTER, 0, slices, pool_rank, "B", poison),
        "A_d": _moe_pool(ranks, experts, 0, MOE_INTER, 1, pool_rank, "A", poison),
        "B_d": _moe_pool(ranks, outer, HIDDEN, 0, 1, pool_rank, "B", poison),
    }
    num_pairs = pair_token.shape[0]
    acts = {
        "x": torch.randn(num_tokens, HIDDEN),
        "inter": torch.randn(num_pairs, slices * MOE_INTER),
        "act": torch.randn(num_pairs, MOE_INTER),
        "down": torch.randn(num_pairs, HIDDEN),
    }
    cast = {k: v.to(dtype) for k, v in {**weights, **acts}.items()}
    return segs, pair_token, pair_expert, cast


def _run_both(segs, pt, pe, t, dtype) -> None:  # type: ignore[no-untyped-def]
    """Every launcher variant against the float32 reference."""
    f32 = {k: v.float() for k, v in t.items()}
    exp_inter = moe_lora_gate_up_ref(
        f32["x"], f32["inter"].clone(), f32["A_gu"], f32["B_gu"], pt, pe, segs
    )
    exp_down = moe_lora_down_ref(
        f32["act"], f32["down"].clone(), f32["A_d"], f32["B_d"], pt, pe, segs
    )
    # Any walk order gives the same delta: a shuffle with out-of-range (padding) entries.
    num_pairs = pt.shape[0]
    shuffled = torch.randperm(num_pairs, generator=torch.Generator().manual_seed(num_pairs))
    padding = torch.full((3,), num_pairs)
    order = torch.cat([shuffled[:5], padding, shuffled[5:], padding]).int().to(pt.device)
    runs = [(variant, None) for variant in MOE_VARIANTS] + [("runs", order)]
    for variant, pair_order in runs:
        kwargs = {"variant": variant, "pair_order": pair_order}
        got_inter = moe_lora_gate_up(
            t["x"], t["inter"].clone(), t["A_gu"], t["B_gu"], pt, pe, segs, **kwargs
        )
        got_down = moe_lora_down(
            t["act"], t["down"].clone(), t["A_d"], t["B_d"], pt, pe, segs, **kwargs
        )
        assert_close(got_inter, exp_inter, dtype)
        assert_close(got_down, exp_down, dtype)


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_lora_matches_reference(popularity, dtype) -> None:  # type: ignore[no-untyped-def]
    segs, pt, pe, t = _moe_case(popularity, 19, dtype, seed=1)
    _run_both(segs, pt, pe, t, dtype)


@pytest.mark.parametrize(
    "gated,shared_outer",
    [(False, False), (True, True), (False, True)],
    ids=["non_gated", "shared_outer", "non_gated_shared_outer"],
)
def test_moe_lora_layouts(gated, shared_outer) -> None:  # type: ignore[no-untyped-def]
    segs, pt, pe, t = _moe_case(
        "zipf", 17, torch.float32, 2, gated=gated, shared_outer=shared_outer
    )
    _run_both(segs, pt, pe, t, torch.float32)


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_lora_never_reads_past_a_slot_rank(variant) -> None:  # type: ignore[no-untyped-def]
    segs, pt, pe, t = _moe_case("skewed", 15, torch.float32, 3, pool_rank=32, poison=float("nan"))
    got = moe_lora_gate_up(
        t["x"], t["inter"].clone(), t["A_gu"], t["B_gu"], pt, pe, segs, variant=variant
    )
    assert torch.isfinite(got).all()
    assert_close(
        got,
        moe_lora_gate_up_ref(t["x"], t["inter"], t["A_gu"], t["B_gu"], pt, pe, segs),
        torch.float32,
    )
    got = moe_lora_down(
        t["act"], t["down"].clone(), t["A_d"], t["B_d"], pt, pe, segs, variant=variant
    )
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("pool_rank", [12, 20])
def test_moe_lora_stacked_shrink_tile_with_padding_rows(pool_rank) -> None:  # type: ignore[no-untyped-def]
    """gate_up's two slices share one shrink tile (S·R rows padded to a power of two): the
    padding rows must read and write nothing, the rows past a slot's rank neither (NaN)."""
    segs, pt, pe, t = _moe_case(
        "zipf", 23, torch.float32, 4, pool_rank=pool_rank, poison=float("nan")
    )
    got = moe_lora_gate_up(
        t["x"], t["inter"].clone(), t["A_gu"], t["B_gu"], pt, pe, segs, variant="runs"
    )
    assert torch.isfinite(got).all()
    assert_close(
        got,
        moe_lora_gate_up_ref(t["x"], t["inter"], t["A_gu"], t["B_gu"], pt, pe, segs),
        torch.float32,
    )


def test_router_int64_experts_are_read_as_they_come() -> None:
    """The model passes the router's int64 expert ids without converting them; every
    variant gives the same delta as with int32 ids."""
    segs, pt, pe, t = _moe_case("zipf", 13, torch.float32, seed=9)
    assert pe.dtype == torch.int32
    _run_both(segs, pt, pe.long(), t, torch.float32)


def test_pairs_kernel_with_columns_split_over_programs() -> None:
    """A decode step of 2 tokens: the "pairs" launch cuts each slice's columns into chunks
    (each recomputing the shrink) when there are fewer items than programs wanted."""
    segs, pt, pe, t = _moe_case("distinct", 2, torch.float32, 8, padding=1)
    f32 = {k: v.float() for k, v in t.items()}
    for x, out, a, b, per_pair, ref in (
        ("x", "inter", "A_gu", "B_gu", False, moe_lora_gate_up_ref),
        ("act", "down", "A_d", "B_d", True, moe_lora_down_ref),
    ):
        got = t[out].clone()
        # 64 programs wanted for 5 pairs: down's 70 columns go to 2 programs of 64.
        moe_lora._moe_lora_pairs(t[x], got, t[a], t[b], pt, pe, segs, per_pair, 64)
        expected = ref(f32[x], f32[out].clone(), f32[a], f32[b], pt, pe, segs)
        assert_close(got, expected, torch.float32)


def test_every_token_on_one_expert_with_one_adapter() -> None:
    """A prefill-like run: 40 pairs of one (slot, expert) key span 3 pair blocks; the other
    experts are empty."""
    segs, pt, pe, t = _moe_case("identical", 40, torch.float32, 4, experts=1, top_k=1)
    _run_both(segs, pt, pe, t, torch.float32)


def test_runs_walk_the_base_moe_expert_order() -> None:
    """As the model calls it: pairs token-major (p = t·k + j, the base MoE's intermediate
    rows), walked in the base fused MoE's expert-sorted, block-padded order."""
    num_tokens = 37
    segs, _, _, t = _moe_case("zipf", num_tokens, torch.float32, seed=8, padding=0)
    gen = torch.Generator().manual_seed(8)
    topk_ids = torch.rand(num_tokens, EXPERTS, generator=gen).topk(TOP_K, dim=1).indices
    pt = (torch.arange(num_tokens * TOP_K) // TOP_K).int()
    pe = topk_ids.flatten().int()
    order = moe_align_ref(topk_ids, EXPERTS, block_m=16).sorted_pair_ids
    assert order.shape[0] > pt.shape[0]  # padded runs: entries ≥ P are skipped
    expected = moe_lora_gate_up_ref(t["x"], t["inter"].clone(), t["A_gu"], t["B_gu"], pt, pe, segs)
    got = moe_lora_gate_up(
        t["x"], t["inter"].clone(), t["A_gu"], t["B_gu"], pt, pe, segs,
        variant="runs", pair_order=order,
    )  # fmt: skip
    assert_close(got, expected, torch.float32)
    expected = moe_lora_down_ref(t["act"], t["down"].clone(), t["A_d"], t["B_d"], pt, pe, segs)
    got = moe_lora_down(
        t["act"], t["down"].clone(), t["A_d"], t["B_d"], pt, pe, segs,
        variant="runs", pair_order=order,
    )  # fmt: skip
    assert_close(got, expected, torch.float32)


def test_reference_equals_dense_delta_in_fp64() -> None:
    segs, pt, pe, t = _moe_case("distinct", 9, torch.float64, 5, shared_outer=True)
    got = moe_lora_gate_up_ref(t["x"], t["inter"].clone(), t["A_gu"], t["B_gu"], pt, pe, segs)
    expected = t["inter"].clone()
    pool_rank = t["B_gu"].shape[3]
    for p, (tok, e) in enumerate(zip(pt.tolist(), pe.tolist(), strict=True)):
        slot = int(segs.token_slot[tok]) if tok >= 0 else -1
        if slot < 0:
            continue
        rank = int(segs.slot_rank[slot])
        for i in range(2):
            a = t["A_gu"][slot, 0, i * pool_rank : i * pool_rank + rank]  # shared outer
            b = t["B_gu"][slot, e, i * MOE_INTER : (i + 1) * MOE_INTER, :rank]
            expected[p, i * MOE_INTER : (i + 1) * MOE_INTER] += (b @ a) @ t["x"][tok]
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_launchers_reject_mismatched_shapes() -> None:
    segs, pt, pe, t = _moe_case("distinct", 5, torch.float32, 6)
    with pytest.raises(ValueError, match="do not fit"):
        moe_lora_gate_up(t["x"][:, :-1], t["inter"], t["A_gu"], t["B_gu"], pt, pe, segs)
    with pytest.raises(ValueError, match="pair_token must be int32"):
        moe_lora_down(t["act"], t["down"], t["A_d"], t["B_d"], pt.long(), pe, segs)
    with pytest.raises(ValueError, match="pair_expert int32 or int64, got .* torch.int16"):
        moe_lora_down(t["act"], t["down"], t["A_d"], t["B_d"], pt, pe.short(), segs)
    with pytest.raises(ValueError, match="one row per pair"):
        moe_lora_down(t["act"][:-1], t["down"], t["A_d"], t["B_d"], pt, pe, segs)


# ---- GPU (bf16, compiled, DeepSeek-V3 expert shapes) ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_moe_lora_bf16_gpu(popularity, num_tokens, variant) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(7)
    hidden, moe_inter, experts, top_k, pool_rank = 7168, 2048, 32, 8, 16
    ranks = mixed_ranks(8, pool_rank, gen)
    segs = build_lora_segments(popular_slots(popularity, num_tokens, 8, gen), ranks, device="cuda")
    pt, pe = (v.cuda() for v in _routing(num_tokens, experts, top_k, gen))
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    A = _moe_pool(ranks, experts, 0, hidden, 2, pool_rank, "A", 0.0).to(**bf16)
    B = _moe_pool(ranks, experts, moe_inter, 0, 2, pool_rank, "B", 0.0).to(**bf16)
    x = torch.randn(num_tokens, hidden, generator=gen).to(**bf16)
    inter = torch.randn(pt.shape[0], 2 * moe_inter, generator=gen).to(**bf16)
    expected = moe_lora_gate_up_ref(x.float(), inter.float(), A.float(), B.float(), pt, pe, segs)
    got = moe_lora_gate_up(x, inter.clone(), A, B, pt, pe, segs, variant=variant)
    assert_close(got, expected, torch.bfloat16)
    if variant == "runs":  # the base MoE's expert order (here: the pairs' reverse + padding)
        order = torch.cat([torch.arange(pt.shape[0] - 1, -1, -1), torch.full((5,), pt.shape[0])])
        got = moe_lora_gate_up(
            x, inter.clone(), A, B, pt, pe, segs, variant="runs", pair_order=order.int().cuda()
        )
        assert_close(got, expected, torch.bfloat16)
