"""`kernels.gemv`: the one-token matmul equals x @ Wᵀ; what it does not take it refuses.

CPU: under the Triton interpreter in fp32/fp16. GPU: bf16 against float32, and a chain of
dependent launches replayed from a CUDA graph (its weight loads run before the wait on the
previous kernel, so only x may wait: the chain checks x is never read early).
"""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import MAX_K, gemv, gemv_fits
from kernels.rms_norm import rms_norm, rms_norm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_dim, k_dim", [(37, 53), (130, 300), (1, 16), (65, 1), (9, MAX_K)])
def test_equals_the_matmul(n_dim: int, k_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n_dim * 1000 + k_dim)
    x = torch.randn(1, k_dim, generator=gen).to(dtype)
    w = (torch.randn(n_dim, k_dim, generator=gen) / k_dim**0.5).to(dtype)
    expected = (x.double() @ w.double().T).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(gemv(x, w), expected, rtol=tol, atol=tol)


def test_weight_with_padded_rows() -> None:
    """A weight whose rows are strided (a view into a wider buffer) is read by its stride."""
    wide = torch.randn(24, 80)
    w = wide[:, :50]
    x = torch.randn(1, 50)
    torch.testing.assert_close(gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_what_it_does_not_take_is_refused() -> None:
    w = torch.randn(8, 32)
    assert gemv_fits(torch.randn(1, 32), w)
    refused = {
        "two rows": torch.randn(2, 32),
        "other dtype": torch.randn(1, 32, dtype=torch.float16),
        "strided row": torch.randn(1, 64)[:, ::2],
    }
    for why, x in refused.items():
        assert not gemv_fits(x, w), why
        with pytest.raises(ValueError, match="one row"):
            gemv(x, w)
    assert not gemv_fits(torch.randn(1, MAX_K + 1), torch.randn(4, MAX_K + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("n_dim, k_dim", [(2112, 2048), (3072, 1536), (2048, 1408), (77, 4096)])
def test_bf16_equals_float32_matmul(n_dim: int, k_dim: int) -> None:
    x = torch.randn(1, k_dim, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n_dim, k_dim, device="cuda") / k_dim**0.5).to(torch.bfloat16)
    expected = x.float() @ w.float().T
    torch.testing.assert_close(gemv(x, w).float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_chain_in_a_graph_reads_each_predecessor_output() -> None:
    """x ← rms_norm(W·x) 40 times, replayed from a graph: each gemv follows a Triton kernel
    that lets it launch early (kernels.pdl), and must still read that kernel's output."""
    torch.manual_seed(0)
    w = (torch.randn(1024, 1024, device="cuda") / 32).to(torch.bfloat16)
    ones = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

    def chain(mm, norm, start):  # type: ignore[no-untyped-def]
        h = start
        for _ in range(40):
            h = norm(mm(h, w), ones, 1e-6)
        return h

    def torch_mm(a, b):  # type: ignore[no-untyped-def]
        return (a.float() @ b.float().T).to(a.dtype)

    expected = chain(torch_mm, rms_norm_ref, x)
    chain(gemv, rms_norm, x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        out = chain(gemv, rms_norm, static_x)
    graph.replay()
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2)
