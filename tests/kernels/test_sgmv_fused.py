"""Fused SGMV (shrink + expand in one launch) vs the torch reference and the two-launch path.

CPU: the kernel under TRITON_INTERPRET=1 (conftest.py) in fp32/fp16, where `num_sms` is 1
so each program walks several items and the device-side column grouping is exercised.
GPU (`-m gpu`): bf16 at DeepSeek shapes and a CUDA-graph replay with other live segments
than at capture.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora_segments import LoraSegmentsConfig, allocate_lora_segments, build_lora_segments
from kernels.sgmv import sgmv_expand, sgmv_shrink
from kernels.sgmv_fused import FUSED_PLANS, sgmv_fused, sgmv_fused_ref
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    pool_A,
    pool_B,
    popular_slots,
    sgmv_case,
)

QKV_A_SLICES = [0, 37, 37 + 45]
THREE_SLICES = [0, 24, 24 + 72, 24 + 72 + 40]


def _expected(x, A, B, out, segs, slices):  # type: ignore[no-untyped-def]
    """The reference in float32 on a copy of `out` (the caller's `out` stays the base)."""
    return sgmv_fused_ref(x.float(), A.float(), B.float(), out.float().clone(), segs, slices)


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize(
    "slices", [[0, 53], QKV_A_SLICES, THREE_SLICES], ids=["1slice", "qkv_a", "3slices"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_matches_reference(popularity, slices, dtype) -> None:  # type: ignore[no-untyped-def]
    # K = 300 spans several K blocks; pool rank 32 with ranks 1..32.
    segs, x, A, B, out = sgmv_case(popularity, 23, 300, slices, 32, dtype, seed=11)
    expected = _expected(x, A, B, out, segs, slices)
    got = sgmv_fused(x, A, B, out.clone(), segs, slices)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("plan", list(FUSED_PLANS))
def test_every_plan_matches_reference(plan) -> None:  # type: ignore[no-untyped-def]
    segs, x, A, B, out = sgmv_case("zipf", 37, 300, QKV_A_SLICES, 16, torch.float32, seed=18)
    got = sgmv_fused(x, A, B, out.clone(), segs, QKV_A_SLICES, plan=plan)
    assert_close(got, _expected(x, A, B, out, segs, QKV_A_SLICES), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_equals_two_launch_path_on_prefill_runs(dtype) -> None:  # type: ignore[no-untyped-def]
    """70 tokens in long runs (several 16-token segments of one slot), rank 16."""
    segs, x, A, B, out = sgmv_case("skewed", 70, 130, QKV_A_SLICES, 16, dtype, seed=12)
    two_launch = sgmv_expand(sgmv_shrink(x, A, segs, 2), B, out.clone(), segs, QKV_A_SLICES)
    fused = sgmv_fused(x, A, B, out.clone(), segs, QKV_A_SLICES)
    assert_close(fused, two_launch, dtype)
    assert_close(fused, _expected(x, A, B, out, segs, QKV_A_SLICES), dtype)


@pytest.mark.parametrize("live", [[2], [0, 0, 2, -1, 1, 1, 1], list(range(3)) * 5])
def test_grid_sized_for_capacity_with_other_live_segments(live, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What a CUDA-graph replay sees: a grid planned for 48 segments of capacity and 1, 4 or
    15 live ones; the column groups are re-planned on the device from the live count."""
    ranks = [3, 16, 7]
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens=48, num_slots=3), "cpu")
    build_lora_segments(live, ranks, out=segs)
    monkeypatch.setattr(type(segs), "grid_segments", lambda self: self.max_segments)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(len(live), 200, generator=gen)
    A, B = pool_A(ranks, 2, 16, 200), pool_B(ranks, 300, 16)
    out = torch.randn(len(live), 300, generator=gen)
    got = sgmv_fused(x, A, B, out.clone(), segs, [0, 130, 300])
    assert_close(got, _expected(x, A, B, out, segs, [0, 130, 300]), torch.float32)


def test_never_reads_past_a_slot_rank() -> None:
    """NaN in every unused rank row of A and column of B: touching one gives NaN."""
    segs, x, A, B, out = sgmv_case(
        "zipf", 19, 67, QKV_A_SLICES, 16, torch.float32, 14, poison=float("nan")
    )
    got = sgmv_fused(x, A, B, out.clone(), segs, QKV_A_SLICES)
    assert torch.isfinite(got).all()
    clean_A, clean_B = torch.nan_to_num(A), torch.nan_to_num(B)
    assert_close(got, _expected(x, clean_A, clean_B, out, segs, QKV_A_SLICES), torch.float32)


def test_base_tokens_untouched_and_adapter_tokens_changed() -> None:
    segs, x, A, B, out = sgmv_case("distinct", 21, 40, QKV_A_SLICES, 8, torch.float32, 15)
    got = sgmv_fused(x, A, B, out.clone(), segs, QKV_A_SLICES)
    base = segs.token_slot[:21] < 0
    assert base.any() and (~base).any()
    torch.testing.assert_close(got[base], out[base], atol=0, rtol=0)
    assert ((got[~base] - out[~base]).abs().amax(dim=1) > 1e-4).all()


def test_launcher_rejects_bad_shapes_and_wide_pools() -> None:
    segs = build_lora_segments([0, 0], [4])
    x, out = torch.randn(2, 8), torch.zeros(2, 10)
    A, B = torch.randn(1, 16, 8), torch.randn(1, 10, 16)
    with pytest.raises(ValueError, match="pool rank 128"):
        sgmv_fused(x, torch.randn(1, 128, 8), torch.randn(1, 10, 128), out, segs, [0, 10])
    with pytest.raises(ValueError, match="does not fit"):
        sgmv_fused(x, torch.randn(1, 16, 9), B, out, segs, [0, 10])
    with pytest.raises(ValueError, match="span"):
        sgmv_fused(x, A, B, out, segs, [0, 9])
    with pytest.raises(ValueError, match="segments describe"):
        sgmv_fused(torch.randn(3, 8), A, B, torch.zeros(3, 10), segs, [0, 10])


# ---- GPU (bf16, compiled) ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("plan", list(FUSED_PLANS))
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize(
    "num_tokens,in_dim,pool_rank", [(1, 7168, 16), (64, 7168, 64), (300, 2048, 16)]
)
def test_fused_bf16_gpu(popularity, num_tokens, in_dim, pool_rank, plan) -> None:  # type: ignore[no-untyped-def]
    slices = [0, 1536, 1536 + 576]
    segs, x, A, B, out = sgmv_case(
        popularity, num_tokens, in_dim, slices, pool_rank, torch.bfloat16, 16
    )
    segs = build_lora_segments(
        segs.token_slot[: segs.num_tokens].tolist(), segs.slot_rank, device="cuda"
    )
    x, A, B, out = (t.cuda() for t in (x, A, B, out))
    expected = _expected(x, A, B, out, segs, slices)
    got = sgmv_fused(x, A, B, out.clone(), segs, slices, plan=plan)
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("capture_slots", ["one", "many"])
def test_fused_cuda_graph_replay_with_other_segments_than_at_capture(capture_slots) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(17)
    num_slots, pool_rank, hidden, max_tokens = 8, 16, 1024, 64
    ranks = mixed_ranks(num_slots, pool_rank, gen)
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens, num_slots), "cuda")
    A = pool_A(ranks, 1, pool_rank, hidden).to("cuda", torch.bfloat16)
    B = pool_B(ranks, hidden, pool_rank).to("cuda", torch.bfloat16)
    x = torch.randn(max_tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    out = torch.zeros(max_tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        out.zero_()
        sgmv_fused(x, A, B, out, segs, [0, hidden])

    many = sorted(popular_slots("distinct", max_tokens, num_slots, gen))
    one = [1] * max_tokens
    capture, replay = (one, many) if capture_slots == "one" else (many, one)
    captured_segments = build_lora_segments(capture, ranks, out=segs).num_live_segments
    for _ in range(2):  # compile outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    build_lora_segments(replay, ranks, out=segs)
    assert segs.num_live_segments != captured_segments
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = _expected(x, A, B, torch.zeros_like(out), segs, [0, hidden])
    assert_close(out, expected, torch.bfloat16)
