"""The grouped GEMM with SiLU·mul in its epilogue (`gated_out`) equals the gate_up GEMM then
`silu_mul`, bit for bit on the GPU, for every weight scheme that takes bf16 activations,
over the alignment's row tiles, over PairTiles and with the launch selecting one token's
experts; and the reference with `gated_out` is silu_mul_ref of the product.

Under the CPU interpreter tl.dot is NumPy's matmul, and its BLAS may order a float32 sum
differently for the gated launch's interleaved column tile than for the plain one (OpenBLAS
0.3.31 on an AMD EPYC did, by an ulp or two, where earlier CI machines gave equal bits):
there the two launches agree to a few units in the last place of the output's dtype
(`_assert_launches_agree`)."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe as fm
from kernels.moe_lora import MoeLoraEpilogue
from kernels.moe_routing import selection_constexprs
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.test_fused_moe import DTYPES, TOLERANCE, make_experts, routing
from tests.kernels.test_quant_moe import quantize_experts

DEVICE = kernel_device()
HIDDEN = 72
# (scheme, quantization group / FP8 block): bf16 / fp16 / fp32 weights, FP8 block-scaled
# (e4m3 weights, bf16 activations), INT8 per channel with int8 activations, 4-bit groups.
SCHEMES = [("float", None), ("block", (16, 32)), ("w8a8", 32), ("int4_group", 32)]


def _experts(scheme, group, experts, inter, dtype):
    """gate ⊕ up weights [E, 2I, HIDDEN] of `scheme`: (weight, scale, block)."""
    if scheme == "float":
        return make_experts(experts, 2 * inter, HIDDEN, dtype, 3)[0], None, None
    if scheme == "block":
        w, s = make_experts(experts, 2 * inter, HIDDEN, dtype, 3, group)
        return w, s, group
    w = torch.randn(experts, 2 * inter, HIDDEN, generator=torch.Generator().manual_seed(3))
    return quantize_experts(w * 0.1, scheme, group)


def _both(x, experts, align, top_k, scheme, tiles=None, selection=None):
    """(the gated launch, gate_up then silu_mul), on the device."""
    w, s, block = (None if t is None else t.to(DEVICE) if torch.is_tensor(t) else t
                   for t in experts)  # fmt: skip
    args = (x, w, align, top_k, s, block, scheme, tiles)
    gated = fm.grouped_gemm(*args, selection=selection, gated_out=True)
    return gated, fm.silu_mul(fm.grouped_gemm(*args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("inter", [40, 48])  # a partial output tile; whole ones
@pytest.mark.parametrize("block_m", [16, 64])
def test_gated_launch_equals_gate_up_then_silu_mul(dtype, scheme, group, inter, block_m):
    _check_aligned_tiles(dtype, scheme, group, inter, block_m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n", [2, 32, 128])  # one output column a program; more
def test_gated_pair_tiles_and_selection_equal_the_two_launches(dtype, block_n):
    _check_pair_tiles(dtype, block_n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_gated_launches_in_bf16_on_gpu(scheme, group):
    for inter, block_m in ((40, 16), (48, 64)):
        _check_aligned_tiles(torch.bfloat16, scheme, group, inter, block_m)
    _check_pair_tiles(torch.bfloat16, 64)


def _assert_launches_agree(gated, two_launches):
    """Bit for bit on the GPU; under the interpreter (module docstring) within a few units
    of the dtype's last place at the outputs' scale: 2 for 16-bit outputs, 16 for float32
    (sums of 72 products in another order). A swapped gate/up column or a missing SiLU is
    off by orders of magnitude more."""
    if DEVICE == "cuda":
        assert torch.equal(gated, two_launches)
        return
    ulps = 16 if gated.dtype == torch.float32 else 2
    tol = ulps * torch.finfo(gated.dtype).eps
    scale = two_launches.float().abs().max().item()
    torch.testing.assert_close(gated, two_launches, rtol=tol, atol=tol * scale)


def _check_aligned_tiles(dtype, scheme, group, inter, block_m):
    tokens, experts, top_k = 13, 8, 3
    ids, _ = routing(tokens, experts, top_k, "uniform", seed=inter + block_m)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights = _experts(scheme, group, experts, inter, dtype)
    align = fm.moe_align(ids.to(DEVICE), experts, block_m)
    gated, two_launches = _both(x.to(DEVICE), weights, align, top_k, scheme)
    assert gated.shape == (tokens * top_k, inter)
    _assert_launches_agree(gated, two_launches)
    ref = fm.grouped_gemm_ref(x, weights[0], fm.moe_align_ref(ids, experts, block_m), top_k,
                              weights[1], weights[2], scheme, gated_out=True)  # fmt: skip
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(gated.float().cpu(), ref.float(), atol=atol * 4, rtol=rtol * 4)


def _check_pair_tiles(dtype, block_n):
    experts, top_k, inter = 16, 4, 40
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    weights = _experts("float", None, experts, inter, dtype)
    tiles = fm.GemmTiles(block_n=block_n, block_k=32)
    ids = torch.tensor([[11, 2, 7, 5]], device=DEVICE)
    gated, two_launches = _both(x, weights, fm.PairTiles(ids, 16), top_k, "float", tiles)
    _assert_launches_agree(gated, two_launches)

    logits = torch.randn(1, experts, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    chosen = torch.full((1, top_k), -1, dtype=torch.int64, device=DEVICE)
    constexprs = selection_constexprs(experts, top_k, "greedy", 1, 1, True)
    selection = fm.TokenSelection(logits, None, 1.0, constexprs, torch.empty(1, top_k).to(DEVICE))
    tiles_of_choice = fm.PairTiles(chosen, 16)
    selected, _ = _both(x, weights, tiles_of_choice, top_k, "float", tiles, selection)
    assert torch.equal(chosen, logits.topk(top_k).indices)
    _assert_launches_agree(selected, _both(x, weights, tiles_of_choice, top_k, "float", tiles)[1])


def test_what_a_gated_launch_cannot_do_is_refused():
    experts, top_k, inter = 8, 2, 24
    ids = torch.tensor([[1, 4]], device=DEVICE)
    x = torch.randn(1, HIDDEN, device=DEVICE)
    align = fm.moe_align(ids, experts, 16)
    odd = torch.randn(experts, 2 * inter + 1, HIDDEN, device=DEVICE)
    with pytest.raises(ValueError, match="even width"):
        fm.grouped_gemm(x, odd, align, top_k, gated_out=True)
    w13 = torch.randn(experts, 2 * inter, HIDDEN, device=DEVICE)
    with pytest.raises(ValueError, match="column tiles of 2"):
        fm.grouped_gemm(x, w13, align, top_k, tiles=fm.GemmTiles(block_n=1), gated_out=True)
    lora = MoeLoraEpilogue(
        y=torch.zeros(2, 32, device=DEVICE),
        b=torch.zeros(1, experts, 2 * inter, 16, device=DEVICE),
        pair_token=torch.zeros(2, dtype=torch.int32, device=DEVICE),
        token_slot=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        slot_rank=torch.full((1,), 16, dtype=torch.int32, device=DEVICE),
    )
    with pytest.raises(ValueError, match="no LoRA"):
        fm.grouped_gemm(x, w13, align, top_k, lora=lora, gated_out=True)
