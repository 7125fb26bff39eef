"""The few-row linear of decode steps against F.linear: odd sizes, K splits, repeated
launches (the split counters reset themselves) and a CUDA-graph replay on the GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import skinny_linear as sl
from kernels.skinny_linear import SkinnyTiles, skinny_linear, skinny_linear_ref
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
_needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
_gpu = [pytest.mark.gpu, _needs_cuda]
# Interpreter dtypes (bf16 loads are wrong there), plus the GPU's bf16.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=_gpu, id="gpu-bf16")]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Small tiles so odd sizes cover partial tiles and splits whose K range is empty.
TILES = [SkinnyTiles(16, 16, 32, 1), SkinnyTiles(16, 32, 32, 2), SkinnyTiles(32, 16, 16, 3)]


def _case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 8, generator=g)[:, 3 : 3 + k]  # strided rows
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"m{t.block_m}n{t.block_n}s{t.split_k}")
@pytest.mark.parametrize("rows,n,k", [(1, 40, 72), (5, 100, 48), (33, 24, 100), (16, 16, 16)])
def test_skinny_linear_matches_ref(dtype, tiles, rows, n, k):
    x, w = _case(rows, n, k, dtype, seed=rows * n + k)
    ours = skinny_linear(x, w, tiles)
    ref = skinny_linear_ref(x.float(), w.float())
    assert ours.shape == (rows, n) and ours.dtype == dtype
    torch.testing.assert_close(ours.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # Launched again: the split counters were reset, so the sums are the same bit for bit.
    assert torch.equal(skinny_linear(x, w, tiles), ours)
    if tiles.split_k > 1:
        assert not sl._counters[x.device].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_tiles_at_decode_row_counts(dtype):
    """The plans the model takes (1, 16 and 64 rows), on a V2-Lite-like width."""
    for rows in (1, 16, 64):
        x, w = _case(rows, 96, 512, dtype, seed=rows)
        ours = skinny_linear(x, w)
        torch.testing.assert_close(
            ours.float(), skinny_linear_ref(x.float(), w.float()), atol=TOL[dtype], rtol=TOL[dtype]
        )


def test_skinny_linear_empty_and_refusals():
    x, w = _case(1, 8, 16, torch.float32, seed=0)
    assert skinny_linear(x[:0], w).shape == (0, 8)
    with pytest.raises(ValueError, match="shared K"):
        skinny_linear(x, w[:, :8])
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x, w.half())


def test_model_uses_it_only_for_few_rows_of_16_bit_weights():
    w = torch.empty(8, 16, dtype=torch.bfloat16)
    assert not sl.use_skinny_linear(torch.empty(4, 16, dtype=torch.bfloat16), w)  # on CPU
    if DEVICE == "cuda":
        w = w.cuda()
        assert sl.use_skinny_linear(torch.empty(4, 16, dtype=torch.bfloat16, device="cuda"), w)
        big = torch.empty(sl.SKINNY_MAX_ROWS + 1, 16, dtype=torch.bfloat16, device="cuda")
        assert not sl.use_skinny_linear(big, w)


@pytest.mark.gpu
@_needs_cuda
def test_graph_replay_with_new_inputs():
    """Captured once (after a warm-up that compiles and makes the counters), replayed with
    other inputs: the split sums follow the inputs and the counters stay reset."""
    x, w = _case(64, 2048, 1536, torch.bfloat16, seed=7)
    static_x = x.clone()
    skinny_linear(static_x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = skinny_linear(static_x, w)
    for seed in (1, 2):
        fresh, _ = _case(64, 2048, 1536, torch.bfloat16, seed=seed)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, skinny_linear(fresh, w))
        torch.testing.assert_close(
            static_y.float(), skinny_linear_ref(fresh.float(), w.float()), atol=3e-2, rtol=2e-2
        )
    assert not sl._counters[x.device].any()
