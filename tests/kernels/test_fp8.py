"""FP8 block dequantization and the block-scaled GEMM."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
# bf16 loads are wrong in the interpreter: bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def quantized(n: int, k: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    q, scale = fp8.block_quant_ref(w, block)
    return w, q, scale


@pytest.mark.parametrize("n,k,block", [(40, 72, (16, 32)), (128, 256, (128, 128)), (5, 7, (4, 4))])
def test_block_dequant_ref_is_the_direct_formula(n, k, block):
    _, q, scale = quantized(n, k, block, seed=n)
    ours = fp8.block_dequant_ref(q, scale, block)
    bn, bk = block
    direct = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            direct[i, j] = q[i, j].float() * scale[i // bn, j // bk]
    assert torch.equal(ours, direct)


def test_block_quant_roundtrip_is_within_e4m3_precision():
    w, q, scale = quantized(96, 160, (32, 32), seed=1)
    back = fp8.block_dequant_ref(q, scale, (32, 32))
    blocks_amax = fp8._expand_scale(scale, 96, 160, (32, 32)) * 448
    # e4m3 has 3 mantissa bits: relative error ≤ 2^-4 of each value, plus subnormal steps.
    assert ((back - w).abs() <= w.abs() / 16 + blocks_amax * 2**-9).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_dequant_matches_ref(dtype):
    _, q, scale = quantized(50, 70, (16, 32), seed=2)
    ours = fp8.fp8_block_dequant(q.to(DEVICE), scale.to(DEVICE), (16, 32), dtype).cpu()
    assert torch.equal(ours, fp8.block_dequant_ref(q, scale, (16, 32)).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,block", [(1, 48, 64, (16, 32)), (37, 80, 96, (16, 16))])
def test_block_linear_matches_ref(dtype, m, n, k, block):
    _, q, scale = quantized(n, k, block, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    ours = fp8.fp8_block_linear(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), block).cpu()
    ref = fp8.fp8_block_linear_ref(x.float(), q, scale, block)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(ours.float(), ref, atol=tol * 10, rtol=tol)
