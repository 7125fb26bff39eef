"""`kernels.gemv`: the one-token matmul equals x @ Wᵀ (with x's RMSNorm or silu·mul fused
in, and per head for strided per-head weights); what it does not take it refuses.

CPU: under the Triton interpreter in fp32/fp16. GPU: bf16 against float32, and a chain of
dependent launches replayed from a CUDA graph (its weight loads run before the wait on the
previous kernel, so only x may wait: the chain checks x is never read early).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import gemv as gemv_module
from kernels.fused_moe import silu_mul, silu_mul_ref
from kernels.gemv import (
    MAX_K,
    GemvLora,
    ResidualAdd,
    gemv,
    gemv_fits,
    gemv_lora_shrink,
    gemv_per_head,
    gemv_per_head_fits,
)
from kernels.lora_segments import build_lora_segments
from kernels.mla_lora import mla_kv_b_lora_o_ref, mla_kv_b_lora_q_ref
from kernels.rms_norm import RoutedPairs, add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_dim, k_dim", [(37, 53), (130, 300), (1, 16), (65, 1), (9, MAX_K)])
def test_equals_the_matmul(n_dim: int, k_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n_dim * 1000 + k_dim)
    x = torch.randn(1, k_dim, generator=gen).to(dtype)
    w = (torch.randn(n_dim, k_dim, generator=gen) / k_dim**0.5).to(dtype)
    expected = (x.double() @ w.double().T).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(gemv(x, w), expected, rtol=tol, atol=tol)


def test_a_router_shaped_float32_weight_is_spread_over_programs() -> None:
    """64 float32 rows of 2048 (a V2-Lite router) narrow the tile to one row per program."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 2048, generator=gen)
    w = torch.randn(64, 2048, generator=gen) / 2048**0.5
    torch.testing.assert_close(gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_dim, k_dim", [(37, 53), (70, 1536)])
def test_fused_norm_equals_the_norm_kernel_then_the_matmul(
    n_dim: int, k_dim: int, dtype: torch.dtype
) -> None:
    """x̂ is rounded to x's dtype by the same jitted row function kernels.rms_norm stores it
    with, so the fused launch equals the two launches (bit for bit under the interpreter).
    x is a strided row view, as MLA's q_a is a slice of qkv_a's output."""
    gen = torch.Generator().manual_seed(n_dim + k_dim)
    wide = (torch.randn(1, k_dim + 9, generator=gen) * 3).to(dtype)
    x = wide[:, :k_dim]
    norm_w = (1 + 0.1 * torch.randn(k_dim, generator=gen)).to(dtype)
    w = (torch.randn(n_dim, k_dim, generator=gen) / k_dim**0.5).to(dtype)
    eps = 1e-6
    fused = gemv(x, w, norm_w, eps)
    torch.testing.assert_close(fused, gemv(rms_norm(x, norm_w, eps), w), rtol=0, atol=0)
    expected = (rms_norm_ref(x, norm_w, eps).double() @ w.double().T).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)
    assert not torch.allclose(gemv(x, w), expected, rtol=tol, atol=tol)  # the norm mattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_dim, k_dim", [(29, 45), (64, 1408)])
def test_gated_input_equals_silu_mul_then_the_matmul(
    n_dim: int, k_dim: int, dtype: torch.dtype
) -> None:
    """x = gate ⊕ up; the activation is rounded by the same jitted function silu_mul
    stores with, so the fused launch equals the two launches (under the interpreter)."""
    gen = torch.Generator().manual_seed(n_dim * 7 + k_dim)
    x = (torch.randn(1, 2 * k_dim, generator=gen) * 2).to(dtype)
    w = (torch.randn(n_dim, k_dim, generator=gen) / k_dim**0.5).to(dtype)
    fused = gemv(x, w, gated=True)
    torch.testing.assert_close(fused, gemv(silu_mul(x), w), rtol=0, atol=0)
    expected = (silu_mul_ref(x).double() @ w.double().T).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)
    assert not gemv_fits(x[:, :k_dim], w, gated=True)  # gated input is twice K wide
    assert not gemv_fits(x, w)  # and ungated it must be K wide
    with pytest.raises(ValueError, match="then no norm"):
        gemv(x, w, torch.ones(k_dim, dtype=dtype), 1e-6, gated=True)


def _residual_addends(case: str, k_dim: int, dtype: torch.dtype, gen) -> tuple:
    """The addends a decoder layer's input norm sees (MoE with shared experts, MoE alone,
    a dense MLP) and two tensors."""
    top_k = 6
    pairs = RoutedPairs(torch.randn(top_k, k_dim, generator=gen).to(dtype),
                        torch.rand(1, top_k, generator=gen))  # fmt: skip
    shared = torch.randn(1, k_dim, generator=gen).to(dtype)
    other = torch.randn(1, k_dim, generator=gen).to(dtype)
    return {"pairs_and_shared": (pairs, shared), "pairs": (pairs,), "tensor": (shared,),
            "two_tensors": (shared, other)}[case]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["pairs_and_shared", "pairs", "tensor", "two_tensors"])
def test_residual_add_equals_add_rms_norm_then_the_matmul(case: str, dtype: torch.dtype) -> None:
    """The decoder's residual add (with the MoE combine) and norm in the prologue: the h the
    launch stores and its product equal add_rms_norm's h and the product of its y, bit for
    bit under the interpreter (the same jitted row functions), over many programs."""
    gen = torch.Generator().manual_seed(len(case))
    n_dim, k_dim, eps = 37, 300, 1e-6
    residual = (torch.randn(1, k_dim, generator=gen) * 2).to(dtype)
    addends = _residual_addends(case, k_dim, dtype, gen)
    norm_w = (1 + 0.1 * torch.randn(k_dim, generator=gen)).to(dtype)
    w = (torch.randn(n_dim, k_dim, generator=gen) / k_dim**0.5).to(dtype)
    h = torch.full_like(residual, float("nan"))
    fused = gemv(residual, w, norm_w, eps, residual=ResidualAdd(addends, h))
    want_h, want_y = add_rms_norm(residual, addends, norm_w, eps)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(fused, gemv(want_y, w), rtol=0, atol=0)
    ref_h, ref_y = add_rms_norm_ref(residual, addends, norm_w, eps)
    expected = (ref_y.double() @ w.double().T).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(h, ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)
    unadded = gemv(residual, w, norm_w, eps)
    assert not torch.allclose(unadded, expected, rtol=tol, atol=tol)  # the addends mattered


def test_a_residual_add_needs_its_norm_and_no_lora() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 32, generator=gen), torch.randn(8, 32, generator=gen)
    residual = ResidualAdd((torch.randn(1, 32, generator=gen),), torch.empty(1, 32))
    with pytest.raises(ValueError, match="residual add"):
        gemv(x, w, residual=residual)
    wrong_h = ResidualAdd(residual.addends, torch.empty(1, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual add"):
        gemv(x, w, torch.ones(32), 1e-6, residual=wrong_h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_head_products_equal_the_bmm_of_the_absorbed_attention(dtype: torch.dtype) -> None:
    """MLA's one-token absorptions: q_lat[h] = q_nope[h] · W_UK[h] (the weight's unit stride
    along N) and out[h] = o_lat[h] · W_UV[h]ᵀ (along K), with strided rows as the model
    passes them; 5 heads, odd widths."""
    gen = torch.Generator().manual_seed(11)
    heads, nope, rope_dim, v, c = 5, 24, 8, 20, 40
    kv_b = (torch.randn(heads, nope + v, c, generator=gen) / c**0.5).to(dtype)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [H, n, C], [H, v, C]
    q = torch.randn(1, heads, nope + rope_dim, generator=gen).to(dtype)
    q_nope = q[0, :, :nope]  # [H, n], row stride n + R
    q_lat = torch.full((heads, c), float("nan"), dtype=dtype)
    gemv_per_head(q_nope, w_uk.transpose(1, 2), q_lat)
    expected = torch.bmm(q_nope.double().unsqueeze(1), w_uk.double()).squeeze(1)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q_lat, expected.to(dtype), rtol=tol, atol=tol)

    o_lat = torch.randn(heads, c, generator=gen).to(dtype)
    out = torch.full((2, heads, v), float("nan"), dtype=dtype)[0]
    gemv_per_head(o_lat, w_uv, out)
    expected = torch.bmm(o_lat.double().unsqueeze(1), w_uv.double().transpose(1, 2)).squeeze(1)
    torch.testing.assert_close(out, expected.to(dtype), rtol=tol, atol=tol)


def test_per_head_refuses_what_it_does_not_take() -> None:
    w = torch.randn(4, 6, 8)
    x, out = torch.randn(4, 8), torch.empty(4, 6)
    assert gemv_per_head_fits(x, w, out)
    refused = {
        "no unit stride in the weight": (x, torch.randn(4, 12, 16)[:, ::2, ::2], out),
        "heads differ": (torch.randn(3, 8), w, out),
        "K differs": (torch.randn(4, 9), w, out),
        "N differs": (x, w, torch.empty(4, 7)),
        "strided x": (torch.randn(4, 16)[:, ::2], w, out),
        "other dtype": (x, w, torch.empty(4, 6, dtype=torch.float16)),
    }
    for why, args in refused.items():
        assert not gemv_per_head_fits(*args), why
        with pytest.raises(ValueError, match="gemv_per_head takes"):
            gemv_per_head(*args)


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
def test_v2_lite_one_token_shapes_on_the_gpu() -> None:
    """bf16 q_b with q_a_norm fused, both per-head absorptions (16 heads), the shared
    experts' down with silu·mul fused, and the float32 router, against float64 products of
    the same rounded inputs."""
    torch.manual_seed(3)
    dev, bf16 = "cuda", torch.bfloat16
    qkv_a = torch.randn(1, 1536 + 576, device=dev).to(bf16)
    q_a, norm_w = qkv_a[:, :1536], (1 + 0.1 * torch.randn(1536, device=dev)).to(bf16)
    w_qb = (torch.randn(3072, 1536, device=dev) / 1536**0.5).to(bf16)
    normed = rms_norm(q_a, norm_w, 1e-6)
    expected = normed.double() @ w_qb.double().T
    torch.testing.assert_close(
        gemv(q_a, w_qb, norm_w, 1e-6).double(), expected, rtol=1e-2, atol=1e-2
    )

    kv_b = (torch.randn(16, 256, 512, device=dev) / 512**0.5).to(bf16)
    w_uk, w_uv = kv_b[:, :128], kv_b[:, 128:]
    q_nope = torch.randn(1, 16, 192, device=dev).to(bf16)[0, :, :128]
    q_lat = torch.empty(16, 512, device=dev, dtype=bf16)
    gemv_per_head(q_nope, w_uk.transpose(1, 2), q_lat)
    expected = torch.bmm(q_nope.double().unsqueeze(1), w_uk.double()).squeeze(1)
    torch.testing.assert_close(q_lat.double(), expected, rtol=1e-2, atol=1e-2)
    o_lat, out = (
        torch.randn(16, 512, device=dev).to(bf16),
        torch.empty(16, 128, device=dev, dtype=bf16),
    )
    gemv_per_head(o_lat, w_uv, out)
    expected = torch.bmm(o_lat.double().unsqueeze(1), w_uv.double().transpose(1, 2)).squeeze(1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)

    gate_up = torch.randn(1, 2 * 2816, device=dev).to(bf16)  # the shared experts' down
    w_down = (torch.randn(2048, 2816, device=dev) / 53).to(bf16)
    expected = silu_mul(gate_up).double() @ w_down.double().T
    torch.testing.assert_close(
        gemv(gate_up, w_down, gated=True).double(), expected, rtol=1e-2, atol=1e-2
    )

    x, router = torch.randn(1, 2048, device=dev), torch.randn(64, 2048, device=dev) / 45
    torch.testing.assert_close(
        gemv(x, router).double(), x.double() @ router.double().T, rtol=1e-5, atol=1e-5
    )


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


def _poisoned_pool(
    gen: torch.Generator, slots: int, rows: int, cols: int, rank_dim: int, rank: int, dtype
) -> torch.Tensor:
    """[slots, rows, cols] random, NaN along `rank_dim` (1 or 2) from `rank` on: a kernel
    that reads past a slot's rank puts NaN in its result."""
    w = torch.randn(slots, rows, cols, generator=gen) / cols**0.5
    w.narrow(rank_dim, rank, w.shape[rank_dim] - rank).fill_(float("nan"))
    return w.to(dtype)


def _linear_lora_expected(x, w, a, b, slot, rank, slice_offsets):  # type: ignore[no-untyped-def]
    """x̂ @ Wᵀ + Σ_i (x̂ @ A_iᵀ) @ B_iᵀ in float64, slice i of rank `rank`."""
    out = x.double() @ w.double().T
    if slot < 0 or rank == 0:
        return out
    pool_rank = b.shape[2]
    bounds = [0, *slice_offsets, w.shape[0]]
    for i in range(len(bounds) - 1):
        a_i = a[slot, i * pool_rank : i * pool_rank + rank].double()
        b_i = b[slot, bounds[i] : bounds[i + 1], :rank].double()
        out[:, bounds[i] : bounds[i + 1]] += (x.double() @ a_i.T) @ b_i.T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "slot, rank, sizes, how",
    [
        (2, 5, (37, 20), "plain"),  # qkv_a's two unequal slices, a rank below the pool's
        (1, 16, (70,), "norm"),  # q_b: full pool rank, the q_a norm fused
        (0, 3, (29,), "gated"),  # a down projection: silu·mul fused
        (-1, 0, (37, 20), "plain"),  # the base model's token: nothing added
        (2, 0, (37,), "plain"),  # an adapter that does not target the module
    ],
)
def test_one_token_linear_lora_equals_the_base_plus_each_slice_delta(
    slot: int, rank: int, sizes: tuple[int, ...], how: str, dtype: torch.dtype
) -> None:
    """gemv_lora_shrink then gemv with the expand in its epilogue: x̂ Wᵀ + Σ_i (x̂ A_iᵀ) B_iᵀ
    over the slices, reading only the slot's first `rank` rank rows/columns (NaN past
    them), and the shrink's y is zero past the rank."""
    gen = torch.Generator().manual_seed(sum(sizes) + rank + 7 * slot)
    k_dim, pool_rank, slots = 45, 16, 3
    n_dim = sum(sizes)
    x = (torch.randn(1, 2 * k_dim if how == "gated" else k_dim, generator=gen) * 2).to(dtype)
    w = (torch.randn(n_dim, k_dim, generator=gen) / k_dim**0.5).to(dtype)
    a = torch.full((slots, len(sizes) * pool_rank, k_dim), float("nan"), dtype=dtype)
    for i in range(len(sizes)):  # each slice's first `rank` rows are real, the rest NaN
        rows = a[:, i * pool_rank : i * pool_rank + rank]
        rows.copy_(torch.randn(rows.shape, generator=gen).to(dtype) / k_dim**0.5)
    b = _poisoned_pool(gen, slots, n_dim, pool_rank, 2, max(rank, 1), dtype)
    ranks = torch.tensor([rank, rank, rank], dtype=torch.int32)
    token_slot = torch.tensor([slot], dtype=torch.int32)
    norm = {}
    x_hat = x
    if how == "norm":
        norm_w = (1 + 0.1 * torch.randn(k_dim, generator=gen)).to(dtype)
        norm = {"norm_weight": norm_w, "eps": 1e-6}
        x_hat = rms_norm_ref(x, norm_w, 1e-6)
    elif how == "gated":
        norm = {"gated": True}
        x_hat = silu_mul_ref(x)
    y = gemv_lora_shrink(x, a, token_slot, ranks, len(sizes), **norm)
    offsets = tuple(itertools.accumulate(sizes))[:-1]
    lora = GemvLora(token_slot, ranks, b.unsqueeze(1), y=y, slice_offsets=offsets)
    out = gemv(x, w, **norm, lora=lora)
    expected = _linear_lora_expected(x_hat, w, a, b, slot, rank, offsets)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=tol, atol=tol)
    assert torch.isfinite(y).all()
    for i in range(len(sizes)):
        assert (y[0, i * pool_rank + rank : (i + 1) * pool_rank] == 0).all()
    if rank and slot >= 0:  # the delta mattered
        assert not torch.allclose(out, gemv(x, w, **norm), rtol=tol, atol=tol)


@pytest.mark.parametrize("u_tile", [None, 256], ids=["whole_u_tile", "u_in_pieces"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot, rank", [(1, 16), (0, 5), (-1, 0)])
def test_per_head_absorbed_kv_b_lora_equals_the_correction_references(
    slot: int, rank: int, dtype: torch.dtype, u_tile: int | None, monkeypatch
) -> None:
    """The one-token absorptions with kv_b's LoRA in the epilogue: q_lat[h] = q_nope[h] W_UK[h]
    + (q_nope[h] · B_k[s, h]) · A[s] and out[h] = W_UV[h] o_lat[h] + B_v[s, h] · (A[s] ·
    o_lat[h]), as kernels.mla_lora's references compute them (5 heads, odd widths, NaN past
    the rank in the pool). "u_in_pieces": the u weight tiles (16 × 32, 16 × 64) are over
    the limit and read after the wait, 16 columns at a time (as rank 64's at C = 512)."""
    if u_tile is not None:
        monkeypatch.setattr(gemv_module, "LORA_TILE_ELEMENTS", u_tile)
        assert gemv_module._u_chunk(40, 16) == 16
    gen = torch.Generator().manual_seed(rank * 3 + slot)
    heads, nope, rope_dim, v_dim, c, pool_rank, slots = 5, 24, 8, 20, 40, 16, 2
    kv_b = (torch.randn(heads, nope + v_dim, c, generator=gen) / c**0.5).to(dtype)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    a = _poisoned_pool(gen, slots, pool_rank, c, 1, max(rank, 1), dtype)  # [S, R, C]
    b = _poisoned_pool(gen, slots, heads * (nope + v_dim), pool_rank, 2, max(rank, 1), dtype)
    ranks = torch.tensor([rank, rank], dtype=torch.int32)
    segs = build_lora_segments([slot], ranks)
    token_slot = segs.token_slot
    q = torch.randn(1, heads, nope + rope_dim, generator=gen).to(dtype)
    q_nope = q[0, :, :nope]
    b_heads = b.unflatten(1, (heads, nope + v_dim))  # [S, H, n+v, R]
    a_cols = a.transpose(1, 2).unsqueeze(1)  # [S, 1, C, R]
    q_lora = GemvLora(token_slot, ranks, a_cols, u_weight=b_heads[:, :, :nope])
    q_lat = torch.full((heads, c), float("nan"), dtype=dtype)
    gemv_per_head(q_nope, w_uk.transpose(1, 2), q_lat, q_lora)
    expected = torch.bmm(q_nope.double().unsqueeze(1), w_uk.double()).squeeze(1)
    correction = torch.zeros(1, heads, c, dtype=torch.float64)
    mla_kv_b_lora_q_ref(q_nope.double()[None], correction, a.double(), b.double(), segs)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(q_lat.double(), expected + correction[0], rtol=tol, atol=tol)

    o_lat = torch.randn(heads, c, generator=gen).to(dtype)
    o_lora = GemvLora(token_slot, ranks, b_heads[:, :, nope:], u_weight=a_cols)
    out = torch.full((2, heads, v_dim), float("nan"), dtype=dtype)[0]
    gemv_per_head(o_lat, w_uv, out, o_lora)
    expected = torch.bmm(o_lat.double().unsqueeze(1), w_uv.double().transpose(1, 2))
    mla_kv_b_lora_o_ref(
        o_lat.double()[None], expected.transpose(0, 1), a.double(), b.double(), segs
    )
    torch.testing.assert_close(out.double(), expected.squeeze(1), rtol=tol, atol=tol)
    if rank and slot >= 0:
        assert correction.abs().max() > 10 * tol  # the corrections mattered


def test_lora_of_another_shape_is_refused() -> None:
    x, w = torch.randn(1, 32), torch.randn(8, 32)
    ranks, token_slot = torch.tensor([4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    y = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x, w, lora=GemvLora(token_slot, ranks, torch.randn(1, 1, 9, 4), y=y))
    with pytest.raises(ValueError, match="exactly one of"):
        GemvLora(token_slot, ranks, torch.randn(1, 1, 8, 4))
    with pytest.raises(ValueError, match="does not fit"):  # two slices need y of 2·R
        gemv(
            x, w, lora=GemvLora(token_slot, ranks, torch.randn(1, 1, 8, 4), y=y, slice_offsets=(3,))
        )


@pytest.mark.gpu
@pytest.mark.parametrize("pool_rank, slot_rank", [(16, 16), (16, 8), (64, 64), (64, 24)])
def test_v2_lite_one_token_lora_on_the_gpu(pool_rank: int, slot_rank: int) -> None:
    """bf16, V2-Lite shapes, rank-16 and rank-64 pools: qkv_a's two slices through the
    shrink GEMV and the epilogue, and kv_b's absorbed corrections in the 16-head products
    (at rank 64 the o side's u tile is read in pieces), against float64 products of the same
    bf16 operands."""
    torch.manual_seed(slot_rank)
    dev, bf16, slot = "cuda", torch.bfloat16, 2
    ranks = torch.full((4,), slot_rank, dtype=torch.int32, device=dev)
    token_slot = torch.tensor([slot], dtype=torch.int32, device=dev)
    x = torch.randn(1, 2048, device=dev).to(bf16)
    w = (torch.randn(2112, 2048, device=dev) / 45).to(bf16)
    a = (torch.randn(4, 2 * pool_rank, 2048, device=dev) / 45).to(bf16)
    b = torch.randn(4, 2112, pool_rank, device=dev).to(bf16)
    for i in range(2):  # a pool holds zeros past a slot's rank
        a[:, i * pool_rank + slot_rank : (i + 1) * pool_rank] = 0
    b[:, :, slot_rank:] = 0
    y = gemv_lora_shrink(x, a, token_slot, ranks, 2)
    out = gemv(x, w, lora=GemvLora(token_slot, ranks, b.unsqueeze(1), y=y, slice_offsets=(1536,)))
    expected = _linear_lora_expected(x, w, a, b, slot, slot_rank, (1536,))
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)

    heads, nope, v_dim, c = 16, 128, 128, 512
    kv_b = (torch.randn(heads, nope + v_dim, c, device=dev) / c**0.5).to(bf16)
    a_kv = (torch.randn(4, pool_rank, c, device=dev) / c**0.5).to(bf16)
    b_kv = torch.randn(4, heads * (nope + v_dim), pool_rank, device=dev).to(bf16) / 4
    a_kv[:, slot_rank:] = 0
    b_kv[:, :, slot_rank:] = 0
    segs = build_lora_segments([slot], ranks, device=dev)
    b_heads, a_cols = b_kv.unflatten(1, (heads, -1)), a_kv.transpose(1, 2).unsqueeze(1)
    q_nope = torch.randn(1, heads, nope + 64, device=dev).to(bf16)[0, :, :nope]
    q_lat = torch.empty(heads, c, device=dev, dtype=bf16)
    lora = GemvLora(segs.token_slot, ranks, a_cols, u_weight=b_heads[:, :, :nope])
    gemv_per_head(q_nope, kv_b[:, :nope].transpose(1, 2), q_lat, lora)
    expected = torch.bmm(q_nope.double().unsqueeze(1), kv_b[:, :nope].double()).transpose(0, 1)
    mla_kv_b_lora_q_ref(q_nope.double()[None], expected, a_kv.double(), b_kv.double(), segs)
    torch.testing.assert_close(q_lat.double(), expected[0], rtol=2e-2, atol=2e-2)
    o_lat, out = torch.randn(heads, c, device=dev).to(bf16), torch.empty(heads, v_dim, device=dev)
    out = out.to(bf16)
    lora = GemvLora(segs.token_slot, ranks, b_heads[:, :, nope:], u_weight=a_cols)
    gemv_per_head(o_lat, kv_b[:, nope:], out, lora)
    expected = torch.bmm(o_lat.double().unsqueeze(1), kv_b[:, nope:].double().transpose(1, 2))
    mla_kv_b_lora_o_ref(
        o_lat.double()[None], expected.transpose(0, 1), a_kv.double(), b_kv.double(), segs
    )
    torch.testing.assert_close(out.double(), expected.squeeze(1), rtol=2e-2, atol=2e-2)
