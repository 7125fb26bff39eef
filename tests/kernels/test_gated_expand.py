"""gate_up's LoRA expand with SiLU·mul in one launch: the Triton kernel (interpreted on the
CPU in fp32/fp16, compiled in bf16 with `-m gpu`) against the two references in turn."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import silu_mul_ref
from kernels.gated_expand import ExpandSiluPlan, sgmv_expand_silu_mul, sgmv_expand_silu_mul_ref
from kernels.lora_segments import build_lora_segments
from kernels.sgmv import sgmv_expand_ref
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    pool_B,
    popular_slots,
)

NUM_SLOTS = 5
# Small column blocks and few programs (each walks several items); consecutive segments
# per item, whose B tiles stay while the slot does.
PLANS = {
    "one_segment": ExpandSiluPlan(block_n=16, programs_per_sm=3),
    "three_segments": ExpandSiluPlan(block_n=16, programs_per_sm=2, segments_per_item=3),
}


def _case(popularity, num_tokens, inter, pool_rank, dtype, seed, device, poison=0.0):  # type: ignore[no-untyped-def]
    """(segs, y [T, 2R] float32, B [S, 2I, R], gate_up [T, 2I]); B past each slot's rank
    holds `poison`; the last slot's adapter does not target the module (rank 0)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ranks = mixed_ranks(NUM_SLOTS, pool_rank, gen)
    ranks[-1] = 0
    segs = build_lora_segments(popular_slots(popularity, num_tokens, NUM_SLOTS, gen), ranks)
    y = torch.randn(num_tokens, 2 * pool_rank, generator=gen)
    b = pool_B(ranks, 2 * inter, pool_rank, poison).to(dtype)
    gate_up = (torch.randn(num_tokens, 2 * inter, generator=gen) * 2).to(dtype)
    moved = build_lora_segments(segs.token_slot[:num_tokens].tolist(), ranks, device=device)
    return moved, y.to(device), b.to(device), gate_up.to(device)


def _expected(segs, y, b, gate_up):  # type: ignore[no-untyped-def]
    """float32 reference on the case's values (as the other kernels' tests compare)."""
    return sgmv_expand_silu_mul_ref(y, b.float(), gate_up.float(), segs)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(popularity, dtype, plan) -> None:  # type: ignore[no-untyped-def]
    """A width 16-column blocks do not divide (I = 40), 16-token segments and shorter ones,
    mixed ranks next to the pool's, an untargeted slot and base tokens (their activation
    without a delta); gate_up is left as it was."""
    case = _case(popularity, 37, 40, 16, dtype, seed=3, device=kernel_device())
    segs, y, b, gate_up = case
    before = gate_up.clone()
    got = sgmv_expand_silu_mul(y, b, gate_up, segs, plan=PLANS[plan])
    assert_close(got.float(), _expected(*case).cpu(), dtype)
    assert torch.equal(gate_up, before)


@pytest.mark.parametrize("segments_per_item", [1, 4])
@pytest.mark.parametrize("pool_rank", [8, 64, 96])
def test_pool_ranks_below_and_above_one_rank_block(pool_rank, segments_per_item) -> None:  # type: ignore[no-untyped-def]
    """B past each slot's rank holds NaN: nothing past a slot's rank reaches the result,
    also when the pool rank spans two rank blocks (96 = 64 + 32, one segment an item)."""
    case = _case("zipf", 50, 24, pool_rank, torch.float32, 4, kernel_device(), float("nan"))
    segs, y, b, gate_up = case
    plan = ExpandSiluPlan(block_n=32, segments_per_item=segments_per_item)
    got = sgmv_expand_silu_mul(y, b, gate_up, segs, plan=plan)
    want = _expected(segs, y, torch.nan_to_num(b), gate_up)
    assert not got.isnan().any()
    assert_close(got.cpu(), want.cpu(), torch.float32)


def test_reference_is_the_expand_then_the_activation() -> None:
    """The reference in float64 on dense per-token deltas: silu(g + Δg) · (u + Δu)."""
    segs, y, b, gate_up = _case("distinct", 13, 12, 8, torch.float64, 5, "cpu")
    got = sgmv_expand_silu_mul_ref(y.double(), b, gate_up, segs)
    want = gate_up.clone()
    for t, slot in enumerate(segs.token_slot[:13].tolist()):
        if slot >= 0:
            rank = int(segs.slot_rank[slot])
            gate_delta = b[slot, :12, :rank] @ y[t, :rank].double()
            up_delta = b[slot, 12:, :rank] @ y[t, 8 : 8 + rank].double()
            want[t] += torch.cat([gate_delta, up_delta])
    torch.testing.assert_close(got, silu_mul_ref(want), atol=1e-12, rtol=1e-12)
    expanded = sgmv_expand_ref(y.double(), b, gate_up.clone(), segs, [0, 12, 24])
    torch.testing.assert_close(expanded, want, atol=1e-12, rtol=1e-12)


def test_launcher_rejects_what_it_cannot_take() -> None:
    segs, y, b, gate_up = _case("zipf", 6, 8, 8, torch.float32, 6, "cpu")
    with pytest.raises(ValueError, match="gate_up"):
        sgmv_expand_silu_mul(y, b, gate_up[:, :-1], segs)
    with pytest.raises(ValueError, match="B "):
        sgmv_expand_silu_mul(y, b[:, :-2], gate_up, segs)
    with pytest.raises(ValueError, match="B "):
        sgmv_expand_silu_mul(y, b.half(), gate_up, segs)
    with pytest.raises(ValueError, match="y "):
        sgmv_expand_silu_mul(y[:, :8], b, gate_up, segs)
    with pytest.raises(ValueError, match="tokens"):
        sgmv_expand_silu_mul(y[:5], b, gate_up[:5], segs)


@pytest.mark.gpu
@pytest.mark.parametrize("segments_per_item", [1, 4])
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens,inter,pool_rank", [(300, 1408, 16), (2048, 2816, 64)])
def test_bf16_gpu(popularity, num_tokens, inter, pool_rank, segments_per_item) -> None:  # type: ignore[no-untyped-def]
    case = _case(popularity, num_tokens, inter, pool_rank, torch.bfloat16, 7, "cuda")
    segs, y, b, gate_up = case
    plan = ExpandSiluPlan(segments_per_item=segments_per_item)
    got = sgmv_expand_silu_mul(y, b, gate_up, segs, plan=plan)
    assert_close(got.float(), _expected(*case), torch.bfloat16)
