"""INT8 w8a8, 4-bit group-quantized and FP8 w8a8 (block_a8) routed experts: quantizer error
bounds, the grouped GEMM (Triton vs reference vs dequantized weights), the quant-method
seam, and MoE LoRA on quantized experts (the LoRA delta does not depend on how the base
experts are stored)."""

from __future__ import annotations

import pytest
import torch

from inference_svc.layers.linear import Linear
from inference_svc.layers.moe import MoE, RoutedExperts
from inference_svc.layers.quant import (
    Fp8BlockA8Method,
    Int4GroupMethod,
    Int8ChannelMethod,
    QuantMethod,
    UnquantizedMethod,
    make_quant_method,
)
from inference_svc.model.config import RoutingConfig
from kernels import fused_moe as fm
from kernels import int_quant as iq
from kernels.fp8 import (
    FP8_DTYPE,
    block_dequant_ref,
    block_quant_ref,
    group_dequant_fp8_ref,
    group_quant_fp8,
    group_quant_fp8_ref,
)
from kernels.lora_segments import build_lora_segments
from kernels.moe_lora import (
    moe_lora_down,
    moe_lora_down_ref,
    moe_lora_gate_up,
    moe_lora_gate_up_ref,
)
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.lora_cases import mixed_ranks, pool_A, pool_B, popular_slots
from tests.kernels.test_fused_moe import PATTERNS, routing

DEVICE = kernel_device()
# bf16 loads are wrong in the interpreter: bf16 runs on the GPU only (test_*_on_gpu).
DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}
SCHEMES = ["w8a8", "int4_group", "block_a8"]
# Schemes that round the activations too (the rest are weight-only), and how far their
# outputs may stray from the GEMM on unrounded activations, as a fraction of the largest
# output: int8 has 127 steps per row, e4m3 3 mantissa bits (a half step is ≤ 2⁻⁴ of the
# value), and the MoE rounds twice (gate_up's and down's inputs).
ACTIVATION_ERROR = {"w8a8": 0.02, "block_a8": 0.06}
ACTIVATION_SCHEMES = tuple(ACTIVATION_ERROR)


def quant_method(scheme: str, group: int) -> QuantMethod:
    if scheme == "w8a8":
        return Int8ChannelMethod()
    if scheme == "block_a8":
        return Fp8BlockA8Method(group, group)
    return Int4GroupMethod(group)


def quantize_experts(w: torch.Tensor, scheme: str, group: int):
    """[E, N, K] float → (stored weight, scale, block) of `scheme` (block, block_a8: square
    e4m3 blocks of `group`)."""
    if scheme in fm.FP8_BLOCK_SCHEMES:
        q, scale = zip(*(block_quant_ref(we, (group, group)) for we in w), strict=True)
        return torch.stack(q), torch.stack(scale), (group, group)
    if scheme == "w8a8":
        q, scale = iq.int8_channel_quant_ref(w)
        return q, scale, (1, w.shape[-1])
    packed, scale = iq.int4_group_quant_ref(w, group)
    return packed, scale, (1, group)


def dequantize_experts(q, scale, block, scheme: str, k: int) -> torch.Tensor:
    if scheme in fm.FP8_BLOCK_SCHEMES:
        return block_dequant_ref(q, scale, block)
    if scheme == "w8a8":
        return iq.int8_channel_dequant_ref(q, scale)
    return iq.int4_group_dequant_ref(q, scale, k, block[1])


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 129), (2, 4, 300)])
def test_int8_channel_quant_error_bound(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.3
    w[..., 0, :] = 0.0  # an all-zero row must not divide by zero
    q, scale = iq.int8_channel_quant_ref(w)
    assert q.dtype == torch.int8 and scale.shape == (*shape[:-1], 1)
    assert q.abs().max() <= 127
    assert (q.abs().amax(dim=-1)[..., 1:] == 127).all(), "each nonzero row uses the full range"
    error = (iq.int8_channel_dequant_ref(q, scale) - w).abs()
    assert (error <= scale / 2 + 1e-7).all(), "at most half a step per element"
    assert (iq.int8_channel_dequant_ref(q, scale)[..., 0, :] == 0).all()


@pytest.mark.parametrize("k,group", [(256, 128), (300, 128), (77, 32), (16, 16)])
def test_int4_group_quant_error_bound(k, group):
    w = torch.randn(3, 6, k, generator=torch.Generator().manual_seed(k)) * 0.05
    packed, scale = iq.int4_group_quant_ref(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 6, (k + 1) // 2)
    assert scale.shape == (3, 6, -(-k // group))
    q = iq.int4_unpack_ref(packed, k)
    assert q.abs().max() <= 7, "symmetric: -8 is never produced"
    deq = iq.int4_group_dequant_ref(packed, scale, k, group)
    step = scale.repeat_interleave(group, dim=-1)[..., :k]
    assert ((deq - w).abs() <= step / 2 + 1e-7).all(), "at most half a group step"


def test_int4_nibble_layout():
    """Byte j holds k = 2j in the low nibble and 2j + 1 in the high one, as q + 8."""
    w = torch.tensor([[7.0, -7.0, 1.0, 0.0, -3.0]])  # amax 7 → scale 1, q = w
    packed, scale = iq.int4_group_quant_ref(w, 16)
    assert scale.tolist() == [[1.0]]
    assert packed.tolist() == [[(7 + 8) | (1 << 4), (1 + 8) | (8 << 4), (-3 + 8) | (8 << 4)]]
    assert torch.equal(iq.int4_group_dequant_ref(packed, scale, 5, 16), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", [(7, 48), (1, 1500), (0, 16)])
def test_per_token_quant_int8_matches_ref(dtype, rows, k):
    a = (torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    q, scale = iq.per_token_quant_int8(a.to(DEVICE))
    q_ref, scale_ref = iq.per_token_quant_int8_ref(a)
    # Correctly rounded divisions on every device: the same scales and the same int8 values
    # (with `/` the GPU put values on a half step one int8 step off).
    torch.testing.assert_close(scale.cpu(), scale_ref, atol=0, rtol=0)
    assert torch.equal(q.cpu(), q_ref)
    if rows:
        error = (q_ref.float() * scale_ref[:, None] - a.float()).abs()
        assert (error <= scale_ref[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows,k,group", [(7, 300, 128), (1, 2048, 128), (3, 40, 32), (0, 64, 32)])
def test_group_quant_fp8_error_bound(rows, k, group):
    """Per row and group: scale = amax / 448, values within e4m3's half step (2⁻⁴ relative,
    or the subnormal step 2⁻¹⁰ · scale), each group's largest value at ±448, zeros kept."""
    a = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 5
    if rows:
        a[0, :group] = 0.0  # an all-zero group quantizes to zeros, not 0 / 0
    q, scale = group_quant_fp8_ref(a, group)
    assert q.dtype == FP8_DTYPE and q.shape == (rows, k)
    assert scale.shape == (rows, -(-k // group))
    back = group_dequant_fp8_ref(q, scale, group)
    assert not back.isnan().any()
    step = scale.repeat_interleave(group, dim=-1)[:, :k]
    assert ((back - a).abs() <= torch.maximum(a.abs() / 16, step / 2**10) + 1e-12).all()
    if rows:
        assert (back[0, :group] == 0).all()
        group_amax = q[:, : k - k % group].float().abs().view(rows, -1, group).amax(dim=-1)
        assert group_amax[0, 0] == 0
        group_amax[0, 0] = 448
        assert (group_amax == 448).all(), "each nonzero group uses e4m3's full range"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,group", [(19, 300, 128), (1, 2048, 128), (5, 40, 32), (0, 64, 32)])
def test_group_quant_fp8_matches_ref_bit_for_bit(dtype, rows, k, group):
    """Same scales and the same e4m3 values, ties and subnormals included: values on
    e4m3 half steps (ties to even) and far below a group's amax (subnormal e4m3)."""
    g = torch.Generator().manual_seed(rows + k)
    a = torch.randn(rows, k, generator=g) * 3
    if rows > 1:
        a[1, : min(k, group)] = torch.linspace(-1.0, 1.0, min(k, group)) * 1e-4  # subnormal
        a[1, 0] = 448.0  # scale 1: the rest sits on or near e4m3 steps
        a[1, 1:9] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, -0.5078125, 2**-7 * 1.5, 0.0, -3.0])
    a = a.to(dtype)
    q, scale = group_quant_fp8(a.to(DEVICE), group)
    q_ref, scale_ref = group_quant_fp8_ref(a, group)
    torch.testing.assert_close(scale.cpu(), scale_ref, atol=0, rtol=0)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_quant_fp8_bit_for_bit_on_gpu(dtype):
    """The compiled quantizer (hardware e4m3 cast of pre-rounded values) equals the torch
    reference bit for bit, at a V2-Lite decode and prefill row count."""
    for rows, k in ((64, 2048), (8192, 1408)):
        a = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
        a[0, :128] = torch.linspace(-1.0, 1.0, 128) * 1e-4  # subnormal e4m3 values
        q, scale = group_quant_fp8(a.cuda(), 128)
        q_ref, scale_ref = group_quant_fp8_ref(a, 128)
        torch.testing.assert_close(scale.cpu(), scale_ref, atol=0, rtol=0)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,inter,group", [(19, 300, 128), (1, 1408, 128), (6, 40, 32), (0, 64, 32)]
)
def test_silu_mul_quant_fp8_equals_the_two_launches_bit_for_bit(dtype, rows, inter, group):
    """The fused activation + quantizer = silu_mul, then group_quant_fp8, bit for bit, and
    the reference; its grouped GEMM (QuantizedRows in) = the GEMM that quantizes itself."""
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 3
    gate_up = gate_up.to(dtype).to(DEVICE)
    fused = fm.silu_mul_quant_fp8(gate_up, group)
    q, scale = group_quant_fp8(fm.silu_mul(gate_up), group)
    assert fused.dtype == dtype and fused.q.dtype == FP8_DTYPE
    assert torch.equal(fused.scale, scale)
    assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))
    ref = fm.silu_mul_quant_fp8_ref(gate_up.cpu(), group)
    torch.testing.assert_close(fused.scale.cpu(), ref.scale, atol=0, rtol=0)
    assert torch.equal(fused.q.cpu().view(torch.uint8), ref.q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_silu_mul_quant_fp8_bit_for_bit_on_gpu():
    """bf16 at V2-Lite's decode and prefill pair counts: the fused launch equals the two."""
    for rows in (384, 49152):
        gate_up = torch.randn(rows, 2 * 1408, device="cuda", dtype=torch.bfloat16) * 3
        fused = fm.silu_mul_quant_fp8(gate_up, 128)
        q, scale = group_quant_fp8(fm.silu_mul(gate_up), 128)
        assert torch.equal(fused.scale, scale)
        assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_gemm_takes_quantized_rows(dtype):
    """block_a8's down GEMM on QuantizedRows gives the same output (bit for bit) as on
    the activation it quantizes itself; other schemes refuse quantized rows."""
    ids, _, _, (w2, s2, b2) = _gemm_case("block_a8", dtype, "skewed", 32, seed=5)
    align = fm.moe_align(ids.to(DEVICE), 8, 16)
    gate_up = torch.randn(ids.numel(), 80, generator=torch.Generator().manual_seed(2)) * 2
    gate_up = gate_up.to(dtype).to(DEVICE)
    w2, s2 = w2.to(DEVICE), s2.to(DEVICE)
    quantized = fm.grouped_gemm(fm.silu_mul_quant_fp8(gate_up, 32), w2, align, 1, s2, b2,
                                "block_a8")  # fmt: skip
    itself = fm.grouped_gemm(fm.silu_mul(gate_up), w2, align, 1, s2, b2, "block_a8")
    assert quantized.dtype == dtype and torch.equal(quantized, itself)
    with pytest.raises(ValueError, match="block_a8's input"):
        fm.grouped_gemm(fm.silu_mul_quant_fp8(gate_up, 32), w2, align, 1, s2, b2, "block")


def _gemm_case(scheme, dtype, pattern, group, seed):  # type: ignore[no-untyped-def]
    tokens, experts, top_k, hidden, inter = 19, 8, 2, 96, 40
    ids, _ = routing(tokens, experts, top_k, pattern, seed=seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.1
    return ids, x, quantize_experts(w13, scheme, group), quantize_experts(w2, scheme, group)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_grouped_gemm_matches_ref(scheme, pattern, dtype):
    """Triton vs reference for gate_up (rows = tokens) and down (rows = pairs); K=96 and
    K=40 are not multiples of the 32-group, so the last group and K-tile are partial."""
    ids, x, (w13, s13, b13), (w2, s2, b2) = _gemm_case(scheme, dtype, pattern, 32, seed=3)
    experts, top_k = 8, ids.shape[1]
    align = fm.moe_align(ids.to(DEVICE), experts, 16)
    align_cpu = fm.moe_align_ref(ids, experts, 16)
    dev = [t.to(DEVICE) for t in (w13, s13, w2, s2)]
    atol, rtol = TOLERANCE[dtype]
    gate_up = fm.grouped_gemm(x.to(DEVICE), dev[0], align, top_k, dev[1], b13, scheme)
    ref = fm.grouped_gemm_ref(x, w13, align_cpu, top_k, s13, b13, scheme)
    torch.testing.assert_close(gate_up.cpu().float(), ref.float(), atol=atol, rtol=rtol)
    act = fm.silu_mul_ref(ref)
    down = fm.grouped_gemm(act.to(DEVICE), dev[2], align, 1, dev[3], b2, scheme)
    down_ref = fm.grouped_gemm_ref(act, w2, align_cpu, 1, s2, b2, scheme)
    torch.testing.assert_close(down.cpu().float(), down_ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_a8_prefill_row_tiles_match_ref(dtype):
    """128-row tiles (the long-prefill plan) with e4m3 activations, gate_up and down."""
    ids, x, (w13, s13, b13), (w2, s2, b2) = _gemm_case("block_a8", dtype, "skewed", 32, seed=8)
    align, align_cpu = fm.moe_align(ids.to(DEVICE), 8, 128), fm.moe_align_ref(ids, 8, 128)
    atol, rtol = TOLERANCE[dtype]
    gate_up = fm.grouped_gemm(
        x.to(DEVICE), w13.to(DEVICE), align, 2, s13.to(DEVICE), b13, "block_a8"
    )
    ref = fm.grouped_gemm_ref(x, w13, align_cpu, 2, s13, b13, "block_a8")
    torch.testing.assert_close(gate_up.cpu().float(), ref.float(), atol=atol, rtol=rtol)
    act = fm.silu_mul_ref(ref)
    down = fm.grouped_gemm(
        act.to(DEVICE), w2.to(DEVICE), align, 1, s2.to(DEVICE), b2, "block_a8", role="down"
    )
    down_ref = fm.grouped_gemm_ref(act, w2, align_cpu, 1, s2, b2, "block_a8", role="down")
    torch.testing.assert_close(down.cpu().float(), down_ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["block", "block_a8"])
@pytest.mark.parametrize("role", fm.GEMM_ROLES)
def test_fp8_at_a_prefill_step_on_gpu(scheme, role):
    """2048 tokens of V2-Lite (12288 pairs: 128-row tiles) in bf16, under each GEMM's
    long-prefill plan (FP8 weights with bf16 or e4m3 activations)."""
    tokens, experts, top_k, hidden, inter = 2048, 64, 6, 2048, 1408
    ids, _ = routing(tokens, experts, top_k, "uniform", seed=2)
    g = torch.Generator().manual_seed(3)
    n, k, rows_per_a = (2 * inter, hidden, top_k) if role == "gate_up" else (hidden, inter, 1)
    x = torch.randn(tokens * top_k // rows_per_a, k, generator=g).to(torch.bfloat16)
    q, s, block = quantize_experts(torch.randn(experts, n, k, generator=g) * 0.05, scheme, 128)
    block_m = fm.moe_block_m(ids.numel(), experts, scheme)
    assert block_m == 128
    align = fm.moe_align(ids.cuda(), experts, block_m)
    got = fm.grouped_gemm(x.cuda(), q.cuda(), align, rows_per_a, s.cuda(), block, scheme, role=role)
    align_cpu = fm.moe_align_ref(ids, experts, block_m)
    ref = fm.grouped_gemm_ref(x, q, align_cpu, rows_per_a, s, block, scheme, role=role)
    torch.testing.assert_close(got.float().cpu(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_a8_with_k_blocks_below_32_matches_ref(dtype):
    """e4m3 MMAs take K tiles of 32: 16-wide blocks (the tiny FP8 test checkpoints') take
    the fp16 product of the same e4m3 values."""
    ids, x, (w13, s13, b13), _ = _gemm_case("block_a8", dtype, "uniform", 16, seed=6)
    align = fm.moe_align(ids.to(DEVICE), 8, 16)
    got = fm.grouped_gemm(x.to(DEVICE), w13.to(DEVICE), align, 2, s13.to(DEVICE), b13, "block_a8")
    ref = fm.grouped_gemm_ref(x, w13, fm.moe_align_ref(ids, 8, 16), 2, s13, b13, "block_a8")
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_ref_equals_dequantized_weights(scheme):
    """The reference under a scheme = a float GEMM on the dequantized weights (and, for
    w8a8, on the per-token int8-rounded activations), and stays near the unquantized GEMM."""
    ids, x, (w13, s13, b13), _ = _gemm_case(scheme, torch.float32, "uniform", 128, seed=4)
    align = fm.moe_align_ref(ids, 8, 16)
    got = fm.grouped_gemm_ref(x, w13, align, ids.shape[1], s13, b13, scheme)
    w_float = dequantize_experts(w13, s13, b13, scheme, x.shape[1])
    x_seen = x
    if scheme == "w8a8":
        q, scale = iq.per_token_quant_int8_ref(x)
        x_seen = q.float() * scale[:, None]
    elif scheme == "block_a8":
        x_seen = group_dequant_fp8_ref(*group_quant_fp8_ref(x, b13[1]), b13[1])
    want = fm.grouped_gemm_ref(x_seen, w_float, align, ids.shape[1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Quantization error of the whole product: a few % of the output's scale at most.
    unquantized = fm.grouped_gemm_ref(x, w_float, align, ids.shape[1])
    if scheme in ACTIVATION_SCHEMES:
        bound = ACTIVATION_ERROR[scheme] * unquantized.abs().max()
        assert (got - unquantized).abs().max() <= bound
    else:
        assert torch.equal(got, unquantized), "weight-only: activations are not rounded"


def test_scheme_and_scale_must_agree():
    ids, x, (w13, s13, b13), _ = _gemm_case("int4_group", torch.float32, "uniform", 32, 5)
    align = fm.moe_align_ref(ids, 8, 16)
    with pytest.raises(ValueError, match="scheme"):
        fm.grouped_gemm_ref(x, w13, align, 2, None, b13, "int4_group")
    with pytest.raises(ValueError, match="unknown weight scheme"):
        fm.grouped_gemm(x, w13, align, 2, s13, b13, "int3")
    with pytest.raises(ValueError, match="K mismatch"):
        fm.grouped_gemm(x, w13, align, 2, s13, b13, "w8a8")  # packed width is K/2


def test_quant_method_without_quant_info_cannot_be_built():
    class NoQuantInfo(QuantMethod):
        name = "broken"

        def create_weights(self, module, shape, dtype, device) -> None:
            return None

        def check_slices(self, output_sizes: list[int]) -> None:
            return None

        def load(self, module, kind, tensor, row, expert) -> None:
            return None

    with pytest.raises(TypeError, match="quant_info"):
        NoQuantInfo()


def test_make_quant_method_and_dense_linear_refusal():
    assert isinstance(make_quant_method("int8_channel"), Int8ChannelMethod)
    assert make_quant_method("int4_group").group == iq.INT4_GROUP
    assert make_quant_method("int4_group", (1, 64)).group == 64
    with pytest.raises(ValueError, match="power of two"):
        Int4GroupMethod(100)
    with pytest.raises(ValueError, match="unknown quant method"):
        make_quant_method("int3")
    assert isinstance(make_quant_method("fp8_block_a8", (128, 128)), Fp8BlockA8Method)
    with pytest.raises(ValueError, match="block size"):
        make_quant_method("fp8_block_a8")
    for method in (Int8ChannelMethod(), Int4GroupMethod(32), Fp8BlockA8Method(128, 128)):
        with pytest.raises(ValueError, match="routed experts only"):
            Linear(64, [32], method, torch.float32, "cpu")
    Linear(64, [32], UnquantizedMethod(), torch.float32, "cpu")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_routed_experts_load_and_describe_quantized_weights(scheme):
    """Checkpoint tensors (gate and up separately, per expert and fused) load into the
    method's parameters; quant_info describes them so the GEMM reproduces the reference."""
    # fp8 slices (gate, up) must be whole 32-row scale blocks; 48 leaves int K-groups partial.
    experts, hidden, group = 4, 64, 32
    inter = 64 if scheme == "block_a8" else 48
    method = quant_method(scheme, group)
    layer = RoutedExperts(experts, hidden, inter, method, torch.float32, "cpu")
    g = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(experts, inter, hidden, generator=g) for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=g)
    for slice_index, w in enumerate((gate, up)):
        q, s, _ = quantize_experts(w, scheme, group)
        for e in range(experts):  # per-expert checkpoint layout
            layer.load("w13", "weight", q[e], e, slice_index)
            layer.load("w13", "scale", s[e], e, slice_index)
    q2, s2, _ = quantize_experts(down, scheme, group)
    layer.load("w2", "weight", q2, None, 0)  # fused [E, N, K] layout
    layer.load("w2", "scale", s2, None, 0)
    with pytest.raises(ValueError, match="expected"):
        layer.load("w2", "weight", down[0], 0, 0)  # a float weight into a quantized layer
    info13, info2 = layer.quant_info()
    assert info13.scheme == info2.scheme == scheme
    w13_ref = quantize_experts(torch.cat([gate, up], dim=1), scheme, group)
    assert torch.equal(info13.weight, w13_ref[0]) and torch.equal(info13.scale, w13_ref[1])
    assert info13.block == w13_ref[2] and torch.equal(info2.weight, q2)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_moe_layer_on_quantized_experts_matches_per_expert_loop(scheme):
    """The MoE layer (CPU path) on integer experts = the independent per-expert loop on the
    dequantized weights: exactly up to fp32 sums for weight-only int4, and within the
    activation rounding for w8a8."""
    experts, hidden, tokens = 8, 64, 21
    inter = 64 if scheme == "block_a8" else 48
    method = quant_method(scheme, 32)
    layer = MoE(hidden, inter, RoutingConfig(experts, 3), method, torch.float32, "cpu")
    g = torch.Generator().manual_seed(11)
    layer.gate.weight.copy_(torch.randn(experts, hidden, generator=g))
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.1
    dequantized = []
    for which, w in (("w13", w13), ("w2", w2)):
        q, s, block = quantize_experts(w, scheme, 32)
        layer.experts.load(which, "weight", q, None, 0)
        layer.experts.load(which, "scale", s, None, 0)
        dequantized.append(dequantize_experts(q, s, block, scheme, w.shape[-1]))
    x = torch.randn(tokens, hidden, generator=g)
    with torch.no_grad():
        got = layer(x)
        topk_weights, topk_ids = layer.gate(x)
    want = fm.fused_moe_ref(x, *dequantized, topk_ids, topk_weights)
    if scheme in ACTIVATION_SCHEMES:
        assert (got - want).abs().max() <= ACTIVATION_ERROR[scheme] * want.abs().max()
        assert not torch.equal(got, want), "activations are rounded"
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _lora_case(scheme, dtype, popularity, seed):  # type: ignore[no-untyped-def]
    """A routed batch over quantized experts with a gate_up and down LoRA pool."""
    tokens, experts, top_k, hidden, inter, pool_rank = 13, 6, 2, 64, 32, 8
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ids, weights = routing(tokens, experts, top_k, "uniform", seed=seed)
    ranks = mixed_ranks(3, pool_rank, gen)
    slots = popular_slots(popularity, tokens, 3, gen)
    segs = {dev: build_lora_segments(slots, ranks, device=dev) for dev in {"cpu", DEVICE}}
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    lora = {  # pools [slots, E, ...] from per-expert pool_A / pool_B draws
        "A_gu": torch.stack([pool_A(ranks, 2, pool_rank, hidden) for _ in range(experts)], 1),
        "B_gu": torch.stack([pool_B(ranks, 2 * inter, pool_rank) for _ in range(experts)], 1),
        "A_d": torch.stack([pool_A(ranks, 1, pool_rank, inter) for _ in range(experts)], 1),
        "B_d": torch.stack([pool_B(ranks, hidden, pool_rank) for _ in range(experts)], 1),
    }
    lora = {k: v.to(dtype) for k, v in lora.items()}
    base = (quantize_experts(w13, scheme, 32), quantize_experts(w2, scheme, 32))
    pair_token = (torch.arange(tokens * top_k) // top_k).int()
    return ids, weights, segs, x.to(dtype), base, lora, pair_token, ids.flatten().int()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", ["distinct", "skewed", "all_base"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_moe_lora_on_quantized_experts_is_base_plus_delta(scheme, popularity, dtype):
    """Staged MoE with LoRA between the quantized GEMMs: each stage's output = the
    quantized base stage + the LoRA delta computed on its own (into zeros) — the LoRA
    path never sees the quant method — and the combined output matches the reference
    pipeline built from those parts."""
    ids, weights, all_segs, x, base, lora, pt, pe = _lora_case(scheme, dtype, popularity, 9)
    segs, segs_cpu = all_segs[DEVICE], all_segs["cpu"]
    (w13, s13, b13), (w2, s2, b2) = base
    experts, top_k = 6, ids.shape[1]
    align = fm.moe_align(ids.to(DEVICE), experts, 16)
    d = {k: v.to(DEVICE) for k, v in lora.items()}
    pt_d, pe_d, x_d = pt.to(DEVICE), pe.to(DEVICE), x.to(DEVICE)
    w13_d, s13_d, w2_d, s2_d = (t.to(DEVICE) for t in (w13, s13, w2, s2))

    base_gate_up = fm.grouped_gemm(x_d, w13_d, align, top_k, s13_d, b13, scheme)
    gate_up = moe_lora_gate_up(x_d, base_gate_up.clone(), d["A_gu"], d["B_gu"], pt_d, pe_d, segs)
    zeros = torch.zeros_like(base_gate_up)
    delta_gu = moe_lora_gate_up(x_d, zeros, d["A_gu"], d["B_gu"], pt_d, pe_d, segs)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(gate_up, base_gate_up + delta_gu, atol=atol, rtol=rtol)

    act = fm.silu_mul(gate_up)
    base_down = fm.grouped_gemm(act, w2_d, align, 1, s2_d, b2, scheme)
    down = moe_lora_down(act, base_down.clone(), d["A_d"], d["B_d"], pt_d, pe_d, segs)
    delta_d = moe_lora_down(act, torch.zeros_like(base_down), d["A_d"], d["B_d"], pt_d, pe_d, segs)
    torch.testing.assert_close(down, base_down + delta_d, atol=atol, rtol=rtol)
    out = fm.moe_combine(down, weights.to(DEVICE)).cpu()

    # Reference pipeline in float32: quantized base GEMM ref + LoRA ref, stage by stage.
    f32 = {k: v.float() for k, v in lora.items()}
    align_cpu = fm.moe_align_ref(ids, experts, 16)
    ref_gu = fm.grouped_gemm_ref(x.float(), w13, align_cpu, top_k, s13, b13, scheme)
    ref_gu = moe_lora_gate_up_ref(x.float(), ref_gu, f32["A_gu"], f32["B_gu"], pt, pe, segs_cpu)
    ref_act = fm.silu_mul_ref(ref_gu)
    if scheme in ACTIVATION_SCHEMES:
        # These round down's input too: an activation a rounding apart from the reference's
        # can flip a whole int8 / e4m3 step (up to 2⁻³ of an e4m3 value), so gate_up is
        # checked on its own and the reference down stage reads the pipeline's activation.
        torch.testing.assert_close(gate_up.cpu().float(), ref_gu, atol=atol, rtol=rtol)
        ref_act = act.cpu().float()
    ref_down = fm.grouped_gemm_ref(ref_act, w2, align_cpu, 1, s2, b2, scheme)
    ref_down = moe_lora_down_ref(ref_act, ref_down, f32["A_d"], f32["B_d"], pt, pe, segs_cpu)
    ref = fm.moe_combine_ref(ref_down, weights)
    loose = 4 if dtype != torch.float32 else 1
    torch.testing.assert_close(out.float(), ref, atol=atol * loose, rtol=rtol * loose)
    if popularity == "all_base":
        torch.testing.assert_close(delta_gu, zeros, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [(1, 64, 6, 2048, 1408), (256, 64, 6, 2048, 1408), (64, 256, 8, 1024, 256)],
)
def test_quantized_grouped_gemm_bf16_on_gpu(scheme, tokens, experts, top_k, hidden, inter):
    """bf16 activations at V2-Lite layer shapes (and a V3-like expert count) on CUDA."""
    ids, _ = routing(tokens, experts, top_k, "uniform", seed=tokens)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05
    q, s, block = quantize_experts(w13, scheme, iq.INT4_GROUP)
    block_m = fm.moe_block_m(ids.numel(), experts)
    align = fm.moe_align(ids.cuda(), experts, block_m)
    got = fm.grouped_gemm(x.cuda(), q.cuda(), align, top_k, s.cuda(), block, scheme)
    align_cpu = fm.moe_align_ref(ids, experts, block_m)
    ref = fm.grouped_gemm_ref(x, q, align_cpu, top_k, s, block, scheme)
    torch.testing.assert_close(got.float().cpu(), ref.float(), atol=3e-2, rtol=3e-2)
    act = fm.silu_mul(got)
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.05
    q2, s2, block2 = quantize_experts(w2, scheme, iq.INT4_GROUP)
    down = fm.grouped_gemm(act, q2.cuda(), align, 1, s2.cuda(), block2, scheme)
    down_ref = fm.grouped_gemm_ref(act.cpu(), q2, align_cpu, 1, s2, block2, scheme)
    torch.testing.assert_close(down.float().cpu(), down_ref.float(), atol=3e-2, rtol=3e-2)
