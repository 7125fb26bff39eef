"""The grouped GEMM over one row tile per pair (`fm.PairTiles`) equals it over the
alignment's tiles, bit for bit; with a `fm.TokenSelection` the launch chooses one token's
experts itself and stores the ids `select_experts` would and its weights (to float32
rounding), for every router of the selection tests; and what the tiles cannot do is
refused."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe as fm
from kernels.moe_lora import MoeLoraEpilogue
from kernels.moe_routing import select_experts, selection_constexprs
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.test_fused_moe import DTYPES, make_experts, routing
from tests.kernels.test_moe_routing import ROUTERS, _case

DEVICE = kernel_device()
HIDDEN, INTER = 64, 48


def _gate_up_and_down(x, w13, w2, align, top_k, selection=None):
    gate_up = fm.grouped_gemm(x, w13, align, top_k, selection=selection)
    return gate_up, fm.grouped_gemm(fm.silu_mul(gate_up), w2, align, 1)


def _assert_pair_tiles_equal_the_aligned_tiles(tokens, experts, top_k, dtype, device):
    ids, _ = routing(tokens, experts, top_k, "uniform", seed=tokens + experts)
    ids = ids.to(device)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    w13, _ = make_experts(experts, 2 * INTER, HIDDEN, dtype, 6)
    w2, _ = make_experts(experts, HIDDEN, INTER, dtype, 7)
    x, w13, w2 = x.to(device), w13.to(device), w2.to(device)
    want = _gate_up_and_down(x, w13, w2, fm.moe_align(ids, experts, 16), top_k)
    got = _gate_up_and_down(x, w13, w2, fm.PairTiles(ids, 16), top_k)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    ref = fm.grouped_gemm_ref(x.float().cpu(), w13.float().cpu(),
                              fm.moe_align_ref(ids.cpu(), experts, 16), top_k)  # fmt: skip
    atol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got[0].float().cpu(), ref, atol=atol, rtol=atol)


def _assert_selecting_launch_equals_selection_then_gemm(router, dtype, device):
    _, experts, top_k, method, n_group, topk_group, norm, scaling = router
    logits, bias = _case(experts, 1, method == "noaux_tc", seed=11 * experts)
    logits, bias = logits.to(device), None if bias is None else bias.to(device)
    want_w, want_ids = select_experts(logits, top_k, method, n_group, topk_group, norm, scaling,
                                      bias)  # fmt: skip
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(8)).to(dtype)
    w13, _ = make_experts(experts, 2 * INTER, HIDDEN, dtype, 9)
    w2, _ = make_experts(experts, HIDDEN, INTER, dtype, 10)
    x, w13, w2 = x.to(device), w13.to(device), w2.to(device)
    # Garbage in the outputs: the launch must overwrite all of them.
    weights = torch.full((1, top_k), float("nan"), device=device)
    ids = torch.full((1, top_k), -7, dtype=torch.int64, device=device)
    constexprs = selection_constexprs(experts, top_k, method, n_group, topk_group, norm)
    selection = fm.TokenSelection(logits, bias, scaling, constexprs, weights)
    got = _gate_up_and_down(x, w13, w2, fm.PairTiles(ids, 16), top_k, selection)
    assert torch.equal(ids, want_ids)
    # Equal to float32 rounding: a softmax's sum may be reduced in another order here.
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)
    want = _gate_up_and_down(x, w13, w2, fm.PairTiles(want_ids, 16), top_k)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 3), (1, 64, 6), (3, 8, 2)])
def test_pair_tiles_equal_the_aligned_tiles(dtype, tokens, experts, top_k):
    """Each pair's rows and expert are the same whichever tiles carry them (more than one
    token too: correct, if wasteful)."""
    _assert_pair_tiles_equal_the_aligned_tiles(tokens, experts, top_k, dtype, DEVICE)


@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_the_selecting_launch_equals_selection_then_the_gemm(router):
    _assert_selecting_launch_equals_selection_then_gemm(router, torch.float32, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_pair_tiles_and_the_selecting_launch_in_bf16_on_gpu(router):
    _, experts, top_k = router[:3]
    _assert_pair_tiles_equal_the_aligned_tiles(1, experts, top_k, torch.bfloat16, "cuda")
    _assert_pair_tiles_equal_the_aligned_tiles(3, experts, top_k, torch.bfloat16, "cuda")
    _assert_selecting_launch_equals_selection_then_gemm(router, torch.bfloat16, "cuda")


def test_what_pair_tiles_cannot_do_is_refused():
    experts, top_k = 8, 2
    ids = torch.tensor([[1, 4]], device=DEVICE)
    x = torch.randn(1, HIDDEN, device=DEVICE)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, device=DEVICE)
    logits = torch.randn(1, experts, device=DEVICE)
    constexprs = selection_constexprs(experts, top_k, "greedy", 1, 1, False)
    selection = fm.TokenSelection(logits, None, 1.0, constexprs, torch.empty(1, top_k))
    align = fm.moe_align(ids, experts, 16)
    with pytest.raises(ValueError, match="not for an alignment"):
        fm.grouped_gemm(x, w13, align, top_k, selection=selection)
    with pytest.raises(ValueError, match="int64"):
        fm.grouped_gemm(x, w13, fm.PairTiles(ids.int(), 16), top_k)
    two = torch.tensor([[1, 4], [2, 3]], device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        fm.grouped_gemm(x.repeat(2, 1), w13, fm.PairTiles(two, 16), top_k, selection=selection)
    epilogue = MoeLoraEpilogue.__new__(MoeLoraEpilogue)
    with pytest.raises(ValueError, match="no LoRA"):
        fm.grouped_gemm(x, w13, fm.PairTiles(ids, 16), top_k, lora=epilogue)
