"""One-launch RMSNorm and RoPE kernels, and the launches that fuse them with their
neighbours (residual adds; the latent cache write), against the forms the model used before."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import moe_combine
from kernels.latent_cache import write_latent_cache, write_latent_cache_ref
from kernels.rms_norm import (
    RoutedPairs,
    add_rms_norm,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from kernels.rope import rope, rope_cos_sin, rope_cos_sin_ref, rope_ref
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


@pytest.mark.parametrize(
    "on_gpu", [False, pytest.param(True, marks=[pytest.mark.gpu, _needs_cuda])]
)
@pytest.mark.parametrize(
    "tokens,half,scale", [(1, 32, 1.0), (70, 32, 1.3), (33, 24, 0.7), (0, 32, 1.0)]
)
def test_rope_cos_sin_matches_ref(on_gpu, tokens, half, scale):
    """One launch for the step's cos/sin tables: the torch form's fp32 ops, so within an ulp
    or two of its values and of cos/sin of the same fp32 angles in float64, out to the
    positions of a 160k context (an approximate cos loses its range reduction there)."""
    if on_gpu and DEVICE != "cuda":
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(tokens + half)
    positions = torch.randint(0, 163_840, (tokens,), generator=g)
    positions[: min(tokens, 3)] = torch.tensor([0, 1, 163_839])[: min(tokens, 3)]
    inv_freq = 10_000.0 ** -(torch.arange(half, dtype=torch.float32) / half)
    cos, sin = rope_cos_sin(positions.to(DEVICE), inv_freq.to(DEVICE), scale)
    ref_cos, ref_sin = rope_cos_sin_ref(positions, inv_freq, scale)
    assert cos.shape == sin.shape == (tokens, half) and cos.dtype == sin.dtype == torch.float32
    angles = (positions.float()[:, None] * inv_freq[None, :]).double()
    for ours, ref, exact in ((cos, ref_cos, angles.cos()), (sin, ref_sin, angles.sin())):
        torch.testing.assert_close(ours.cpu(), ref, atol=1e-6 * scale, rtol=0)
        assert ((ours.cpu().double() - exact * scale).abs() <= 1e-6 * scale).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("addends", [1, 2])
@pytest.mark.parametrize("rows,dim", [(5, 64), (3, 48), (1, 2048), (0, 8)])
def test_add_rms_norm_equals_the_adds_then_the_norm(dtype, addends, rows, dim):
    """The fused launch gives the torch adds' sum bit for bit and the one-launch norm of it;
    against the fp32-reduction reference within one rounding step."""
    g = torch.Generator().manual_seed(rows * dim + addends)
    residual, *parts = [
        (torch.randn(rows, dim, generator=g) * 3).to(dtype).to(DEVICE) for _ in range(1 + addends)
    ]
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype).to(DEVICE)
    h, y = add_rms_norm(residual, tuple(parts), weight, 1e-6)
    total = parts[0] if addends == 1 else parts[0] + parts[1]
    unfused_h = residual + total
    assert torch.equal(h, unfused_h)
    if DEVICE == "cuda":  # the two kernels' reductions may be scheduled apart: one rounding
        torch.testing.assert_close(y, rms_norm(unfused_h, weight, 1e-6), atol=0, rtol=8e-3)
    else:
        assert torch.equal(y, rms_norm(unfused_h, weight, 1e-6))
    ref_h, ref_y = add_rms_norm_ref(residual.cpu(), tuple(p.cpu() for p in parts),
                                    weight.cpu(), 1e-6)  # fmt: skip
    assert torch.equal(h.cpu(), ref_h)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rows,dim,top_k", [(5, 64, 3), (2, 48, 1), (0, 8, 2)])
def test_add_rms_norm_folds_in_the_moe_combine(dtype, shared, rows, dim, top_k):
    """A RoutedPairs addend is the combine kernel's sum bit for bit: h equals
    residual + (moe_combine(pairs) [+ shared]) added by launches one by one."""
    g = torch.Generator().manual_seed(rows + dim + top_k)
    residual, shared_out = [(torch.randn(rows, dim, generator=g) * 3).to(dtype) for _ in "ab"]
    pair_out = (torch.randn(rows * top_k, dim + 5, generator=g) * 3).to(dtype)[:, 5:]
    topk_weights = torch.rand(rows, top_k, generator=g)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    routed = RoutedPairs(pair_out.to(DEVICE), topk_weights.to(DEVICE))
    addends = (routed, shared_out.to(DEVICE)) if shared else (routed,)
    y_float = torch.full((rows, dim), float("nan"), device=DEVICE)
    h, y = add_rms_norm(residual.to(DEVICE), addends, weight.to(DEVICE), 1e-6, y_float)
    assert torch.equal(y_float, y.float()), "the router's float32 copy of y"
    total = moe_combine(*routed)
    if shared:
        total = total + addends[1]
    unfused_h = residual.to(DEVICE) + total
    assert torch.equal(h, unfused_h)
    if DEVICE != "cuda":
        assert torch.equal(y, rms_norm(unfused_h, weight, 1e-6))
    ref_h, ref_y = add_rms_norm_ref(
        residual, (RoutedPairs(pair_out, topk_weights), shared_out)[: 1 + shared], weight, 1e-6
    )
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(h.cpu().float(), ref_h.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), atol=tol, rtol=tol)


def test_add_rms_norm_refuses_mismatched_inputs():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="share shape and dtype"):
        add_rms_norm(x, (torch.zeros(2, 4),), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="one or two addends"):
        add_rms_norm(x, (x, x, x), torch.ones(8), 1e-6)
    routed = RoutedPairs(torch.zeros(5, 8), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="only the first routed pairs"):
        add_rms_norm(x, (x, routed), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="routed pair_out"):
        add_rms_norm(x, (routed,), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="y_float"):
        add_rms_norm(x, (x,), torch.ones(8), 1e-6, torch.zeros(2, 8, dtype=torch.float16))


def _latent_case(dtype, tokens, latent_dim, rope_dim, seed, heads=3):
    """kv_a as a strided view inside a wider qkv_a output, q_rope inside q, a cache of random
    rows, and distinct slots for the tokens."""
    g = torch.Generator().manual_seed(seed)
    qkv_a = (torch.randn(tokens, 40 + latent_dim + rope_dim, generator=g) * 2).to(dtype)
    kv_a = qkv_a[:, 40:]
    q_rope = (torch.randn(tokens, heads, 24 + rope_dim, generator=g) * 2).to(dtype)[..., 24:]
    weight = (torch.rand(latent_dim, generator=g) + 0.5).to(dtype)
    angles = torch.rand(tokens, rope_dim // 2, generator=g) * 50
    cache = torch.randn(3 * tokens + 5, latent_dim + rope_dim, generator=g).to(dtype)
    slots = torch.randperm(cache.shape[0], generator=g)[:tokens]
    return kv_a, weight, angles.cos() * 1.1, angles.sin() * 1.1, cache, slots, q_rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(
    "tokens,latent_dim,rope_dim,heads",
    [(7, 64, 16, 3), (3, 48, 8, 20), (2, 512, 64, 16), (0, 16, 4, 2)],
)
def test_write_latent_cache_equals_norm_rope_and_scatter(
    dtype, interleave, tokens, latent_dim, rope_dim, heads
):
    """The fused launch equals the one-launch norm and rope kernels, the cache rows
    scattered by index (bit for bit under the interpreter), and the torch forms within their
    rounding; rows no token maps to are untouched. 20 heads: more than one block of heads."""
    kv_a, weight, cos, sin, cache, slots, q_rope = _latent_case(
        dtype, tokens, latent_dim, rope_dim, seed=tokens + latent_dim, heads=heads
    )
    args = [t.to(DEVICE) for t in (kv_a, weight)] + [1e-6, cos.to(DEVICE), sin.to(DEVICE)]
    ours = cache.to(DEVICE)
    ours_q = write_latent_cache(*args, interleave, ours, slots.to(DEVICE), q_rope.to(DEVICE))
    ours, ours_q = ours.cpu(), ours_q.cpu()

    kernels = cache.clone()
    kernels_q = rope(q_rope.to(DEVICE), args[3], args[4], interleave).cpu()
    if tokens:
        latent = rms_norm(args[0][:, :latent_dim], args[1], 1e-6)
        k_rope = rope(args[0][:, latent_dim:], args[3], args[4], interleave)
        kernels[slots] = torch.cat([latent, k_rope], -1).cpu()
    ref = cache.clone()
    ref_q = write_latent_cache_ref(kv_a, weight, 1e-6, cos, sin, interleave, ref, slots, q_rope)

    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(ours[untouched], cache[untouched])
    assert ours_q.shape == (tokens, heads, rope_dim)
    if DEVICE == "cuda":  # reductions and FMA contraction (a·cos − b·sin) differ by kernel
        atol, rtol = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-2, 1e-2)}[dtype]
        torch.testing.assert_close(ours, kernels, atol=atol, rtol=rtol)
        torch.testing.assert_close(ours_q, kernels_q, atol=atol, rtol=rtol)
    else:
        assert torch.equal(ours, kernels) and torch.equal(ours_q, kernels_q)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(ours_q.float(), ref_q.float(), atol=tol, rtol=tol)


def test_write_latent_cache_refuses_mismatched_widths():
    kv_a, weight, cos, sin, cache, slots, q_rope = _latent_case(torch.float32, 3, 16, 4, seed=1)
    with pytest.raises(ValueError, match="C \\+ R"):
        write_latent_cache(kv_a, weight, 1e-6, cos, sin, True, cache[:, :-2], slots, q_rope)
    with pytest.raises(ValueError, match="one row per token"):
        write_latent_cache(kv_a, weight, 1e-6, cos, sin, True, cache, slots[:2], q_rope)
    with pytest.raises(ValueError, match="q_rope"):
        write_latent_cache(kv_a, weight, 1e-6, cos, sin, True, cache, slots, q_rope[..., :2])
