"""One-launch RMSNorm and RoPE kernels against the torch forms the model used before."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rope import rope, rope_ref
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
_needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
# Interpreter dtypes (bf16 loads are wrong there), plus GPU cases that `make gpu-test` runs.
DTYPES = [torch.float32, torch.float16] + [
    pytest.param(d, marks=[pytest.mark.gpu, _needs_cuda], id=f"gpu-{d}".replace("torch.", ""))
    for d in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,dim,row_stride", [(5, 64, 64), (3, 48, 80), (1, 2048, 2048), (0, 8, 8)]
)
def test_rms_norm_matches_ref(dtype, rows, dim, row_stride):
    """Rows may be a strided view (the latent half of kv_a); odd widths are masked."""
    g = torch.Generator().manual_seed(dim)
    base = (torch.randn(rows, row_stride, generator=g) * 3).to(dtype)
    x = base[:, :dim]
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    ours = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6).cpu()
    ref = rms_norm_ref(x, weight, 1e-6)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    # Only the fp32 reduction order differs; at most one rounding step of the dtype.
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("shape", [(7, 4, 16), (3, 16), (2, 20, 64)])
def test_rope_matches_ref_bitwise(dtype, interleave, shape):
    """Same per-element operations and roundings as the torch form: equal bit for bit.

    Inputs are strided views, as in MLA (q_rope inside q, k_rope inside kv_a).
    """
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    tokens, dim = shape[0], shape[-1]
    wide = torch.randn(*shape[:-1], dim + 24, generator=g).to(dtype)
    x = wide[..., 24:]
    angles = torch.rand(tokens, dim // 2, generator=g) * 50
    cos, sin = angles.cos() * 1.1, angles.sin() * 1.1
    ours = rope(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), interleave).cpu()
    ref = rope_ref(x, cos, sin, interleave)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    if dtype == torch.bfloat16:  # CUDA's bf16 product may fuse differently: one ulp
        torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=1e-2)
    elif DEVICE == "cuda":  # the compiler contracts x·cos − y·sin into an FMA: ~1 ulp
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(ours, ref)
