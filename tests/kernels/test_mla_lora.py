"""Absorbed MLA kv_b LoRA: Triton kernels vs the torch reference, and the reference vs the
fp64 dense ΔW = B·A folded into W_UK / W_UV (what the naive, unabsorbed path applies)."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_segments import LoraSegmentsConfig, allocate_lora_segments, build_lora_segments
from kernels.mla_lora import (
    MLA_VARIANTS,
    mla_kv_b_lora_o,
    mla_kv_b_lora_o_ref,
    mla_kv_b_lora_q,
    mla_kv_b_lora_q_ref,
)
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    pool_A,
    pool_B,
    popular_slots,
)

# Tiny odd MLA: H heads, D = nope, ROPE, V = v_head_dim, C = kv_lora_rank.
H, D, ROPE, V, C = 3, 24, 8, 20, 40


def _mla_case(popularity, num_tokens, pool_rank, dtype, seed, poison=0.0, dims=(H, D, ROPE, V, C)):  # type: ignore[no-untyped-def]
    heads, nope, rope, v_dim, lat = dims
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ranks = mixed_ranks(5, pool_rank, gen)
    segs = build_lora_segments(popular_slots(popularity, num_tokens, 5, gen), ranks)
    A = pool_A(ranks, 1, pool_rank, lat, poison).to(dtype)  # [slots, R, C]
    B = pool_B(ranks, heads * (nope + v_dim), pool_rank, poison).to(dtype)  # [slots, H*(D+V), R]
    q = torch.randn(num_tokens, heads, nope + rope).to(dtype)
    q_nope = q[:, :, :nope]  # strided view, as the model slices it
    q_lat = torch.randn(num_tokens, heads, lat).to(dtype)
    o_lat = torch.randn(num_tokens, heads, lat).to(dtype)
    o = torch.randn(num_tokens, heads * v_dim).to(dtype).view(num_tokens, heads, v_dim)
    return segs, A, B, q_nope, q_lat, o_lat, o


def _dense_kv_b_delta(A, B, segs, q_nope, o_lat, v_dim):  # type: ignore[no-untyped-def]
    """fp64: ΔW = B[:, :rank]·A[:rank] per token's slot, split into k and v parts per head."""
    num_tokens, heads, nope = q_nope.shape
    dq = torch.zeros(num_tokens, heads, A.shape[2], dtype=torch.float64)
    do = torch.zeros(num_tokens, heads, v_dim, dtype=torch.float64)
    for t, slot in enumerate(segs.token_slot[:num_tokens].tolist()):
        if slot < 0:
            continue
        rank = int(segs.slot_rank[slot])
        delta_w = (B[slot, :, :rank].double() @ A[slot, :rank].double()).view(
            heads, nope + v_dim, -1
        )
        dq[t] = torch.einsum("hd,hdc->hc", q_nope[t].double(), delta_w[:, :nope])
        do[t] = torch.einsum("hc,hvc->hv", o_lat[t].double(), delta_w[:, nope:])
    return dq, do


@pytest.mark.parametrize("variant", MLA_VARIANTS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_b_lora_matches_reference(popularity, dtype, variant) -> None:  # type: ignore[no-untyped-def]
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case(popularity, 21, 16, dtype, seed=1)
    f32 = [t.float() for t in (A, B, q_nope, q_lat, o_lat, o)]
    expected_q = mla_kv_b_lora_q_ref(f32[2], f32[3].clone(), f32[0], f32[1], segs)
    expected_o = mla_kv_b_lora_o_ref(f32[4], f32[5].clone(), f32[0], f32[1], segs)
    got_q = mla_kv_b_lora_q(q_nope, q_lat, A, B, segs, variant=variant)
    assert_close(got_q, expected_q, dtype)
    assert_close(mla_kv_b_lora_o(o_lat, o, A, B, segs, variant=variant), expected_o, dtype)


@pytest.mark.parametrize("variant", MLA_VARIANTS)
def test_grid_sized_for_capacity_with_few_live_segments(variant, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A CUDA-graph replay's view: the grid is planned for 40 segments of capacity while a
    few are live (v1 starts 40 × H programs, most of them empty)."""
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case("zipf", 9, 16, torch.float32, 8)
    big = allocate_lora_segments(LoraSegmentsConfig(max_tokens=40, num_slots=5), "cpu")
    segs = build_lora_segments(segs.token_slot[:9].tolist(), segs.slot_rank, out=big)
    monkeypatch.setattr(type(segs), "grid_segments", lambda self: self.max_segments)
    q_exp = mla_kv_b_lora_q_ref(q_nope, q_lat.clone(), A, B, segs)
    o_exp = mla_kv_b_lora_o_ref(o_lat, o.clone(), A, B, segs)
    assert_close(mla_kv_b_lora_q(q_nope, q_lat, A, B, segs, variant=variant), q_exp, torch.float32)
    assert_close(mla_kv_b_lora_o(o_lat, o, A, B, segs, variant=variant), o_exp, torch.float32)


@pytest.mark.parametrize("variant", MLA_VARIANTS)
def test_kv_b_lora_never_reads_past_a_slot_rank(variant) -> None:  # type: ignore[no-untyped-def]
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case(
        "zipf", 13, 32, torch.float32, 2, poison=float("nan")
    )
    q_got = mla_kv_b_lora_q(q_nope, q_lat.clone(), A, B, segs, variant=variant)
    o_got = mla_kv_b_lora_o(o_lat, o.clone(), A, B, segs, variant=variant)
    assert torch.isfinite(q_got).all() and torch.isfinite(o_got).all()
    assert_close(q_got, mla_kv_b_lora_q_ref(q_nope, q_lat, A, B, segs), torch.float32)
    assert_close(o_got, mla_kv_b_lora_o_ref(o_lat, o, A, B, segs), torch.float32)


@pytest.mark.parametrize("variant", MLA_VARIANTS)
def test_long_segments_and_wide_latent(variant) -> None:  # type: ignore[no-untyped-def]
    """40 tokens of one adapter span 3 segments; C=300 spans 3 latent blocks."""
    dims = (2, 24, 8, 20, 300)
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case(
        "identical", 40, 16, torch.float32, 3, dims=dims
    )
    assert segs.num_live_segments == 3
    q_exp = mla_kv_b_lora_q_ref(q_nope, q_lat.clone(), A, B, segs)
    o_exp = mla_kv_b_lora_o_ref(o_lat, o.clone(), A, B, segs)
    assert_close(mla_kv_b_lora_q(q_nope, q_lat, A, B, segs, variant=variant), q_exp, torch.float32)
    assert_close(mla_kv_b_lora_o(o_lat, o, A, B, segs, variant=variant), o_exp, torch.float32)


@pytest.mark.parametrize("variant", MLA_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_without_accumulate_the_query_correction_overwrites_every_row(variant, dtype) -> None:  # type: ignore[no-untyped-def]
    """accumulate=False (the decode path: W_UK's product is added after): every row is
    written, tokens without an adapter with zeros, whatever the buffer held (here NaN)."""
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case("zipf", 19, 16, dtype, 12)
    base = segs.token_slot[:19] == -1
    assert base.any() and not base.all()
    got = mla_kv_b_lora_q(
        q_nope, torch.full_like(q_lat, float("nan")), A, B, segs, variant=variant, accumulate=False
    )
    zeros = torch.zeros_like(q_lat, dtype=torch.float32)
    expected = mla_kv_b_lora_q_ref(q_nope.float(), zeros, A.float(), B.float(), segs)
    assert_close(got, expected, dtype)
    assert torch.equal(got[base].float(), torch.zeros_like(got[base].float()))
    ref = mla_kv_b_lora_q_ref(q_nope, torch.ones_like(q_lat), A, B, segs, accumulate=False)
    assert torch.equal(ref[base], torch.zeros_like(ref[base]))


def test_reference_equals_dense_delta_in_fp64() -> None:
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case("distinct", 11, 8, torch.float64, 4)
    dq, do = _dense_kv_b_delta(A, B, segs, q_nope, o_lat, V)
    q_got = mla_kv_b_lora_q_ref(q_nope, q_lat.clone(), A, B, segs)
    o_got = mla_kv_b_lora_o_ref(o_lat, o.clone(), A, B, segs)
    torch.testing.assert_close(q_got, q_lat + dq, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(o_got, o + do, atol=1e-12, rtol=1e-12)


def test_launchers_reject_mismatched_shapes() -> None:
    segs, A, B, q_nope, q_lat, o_lat, o = _mla_case("distinct", 4, 16, torch.float32, 5)
    with pytest.raises(ValueError, match="latent"):
        mla_kv_b_lora_q(q_nope, q_lat[:, :, :-1], A, B, segs)
    with pytest.raises(ValueError, match="3-D"):
        mla_kv_b_lora_o(o_lat.half(), o, A, B, segs)
    with pytest.raises(ValueError, match="kv_b pool"):
        mla_kv_b_lora_o(o_lat, o, A[:, :8], B, segs)


# ---- GPU (bf16, compiled, DeepSeek-V3 head shapes) -----------------------------------------

V3_DIMS = (128, 128, 64, 128, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", MLA_VARIANTS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens,pool_rank", [(1, 16), (64, 64)])
def test_kv_b_lora_bf16_gpu(popularity, num_tokens, pool_rank, variant) -> None:  # type: ignore[no-untyped-def]
    case = _mla_case(popularity, num_tokens, pool_rank, torch.bfloat16, 6, dims=V3_DIMS)
    segs = build_lora_segments(
        case[0].token_slot[:num_tokens].tolist(), case[0].slot_rank, device="cuda"
    )
    A, B, q_nope, q_lat, o_lat, o = (t.cuda() for t in case[1:])
    f32 = [t.float() for t in (A, B, q_nope, q_lat, o_lat, o)]
    expected_q = mla_kv_b_lora_q_ref(f32[2], f32[3].clone(), f32[0], f32[1], segs)
    expected_o = mla_kv_b_lora_o_ref(f32[4], f32[5].clone(), f32[0], f32[1], segs)
    got_q = mla_kv_b_lora_q(q_nope, q_lat, A, B, segs, variant=variant)
    assert_close(got_q, expected_q, torch.bfloat16)
    got_o = mla_kv_b_lora_o(o_lat, o, A, B, segs, variant=variant)
    assert_close(got_o, expected_o, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("variant", MLA_VARIANTS)
def test_kv_b_lora_cuda_graph_replay_with_more_segments(variant, accumulate) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(7)
    heads, nope, _, v_dim, lat = V3_DIMS
    max_tokens, num_slots, pool_rank = 32, 8, 16
    ranks = mixed_ranks(num_slots, pool_rank, gen)
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens, num_slots), "cuda")
    A = pool_A(ranks, 1, pool_rank, lat).to("cuda", torch.bfloat16)
    B = pool_B(ranks, heads * (nope + v_dim), pool_rank).to("cuda", torch.bfloat16)
    q_nope = torch.randn(max_tokens, heads, nope, generator=gen).to("cuda", torch.bfloat16)
    o_lat = torch.randn(max_tokens, heads, lat, generator=gen).to("cuda", torch.bfloat16)
    q_lat = torch.zeros(max_tokens, heads, lat, device="cuda")
    o = torch.zeros(max_tokens, heads, v_dim, device="cuda")

    def step() -> None:
        if accumulate:
            q_lat.zero_()
        o.zero_()
        mla_kv_b_lora_q(q_nope, q_lat, A, B, segs, variant=variant, accumulate=accumulate)
        mla_kv_b_lora_o(o_lat, o, A, B, segs, variant=variant)

    build_lora_segments([1] * max_tokens, ranks, out=segs)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    build_lora_segments(popular_slots("distinct", max_tokens, num_slots, gen), ranks, out=segs)
    assert segs.num_live_segments > 1
    q_lat.fill_(float("nan"))  # without accumulate every row must be overwritten
    graph.replay()
    torch.cuda.synchronize()
    f32 = [t.float() for t in (A, B, q_nope, o_lat)]
    expected_q = mla_kv_b_lora_q_ref(f32[2], torch.zeros_like(q_lat), f32[0], f32[1], segs)
    expected_o = mla_kv_b_lora_o_ref(f32[3], torch.zeros_like(o), f32[0], f32[1], segs)
    assert_close(q_lat, expected_q, torch.bfloat16)
    assert_close(o, expected_o, torch.bfloat16)
