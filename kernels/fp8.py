"""FP8 block quantization (DeepSeek-V3 checkpoint format): dequantization and GEMM.

A weight W [N, K] is stored as e4m3 `w` plus float32 `scale` [ceil(N/bn), ceil(K/bk)]
(`weight_scale_inv` in the checkpoint): W[n, k] = w[n, k] · scale[n // bn, k // bk].
The GEMM keeps activations in their dtype and dequantizes weight tiles in registers, so a
decode step reads 1 byte per weight instead of 2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv
from kernels.launch import fast
from kernels.pdl import grid_dependency_control

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A group of zeros gets this amax (scale 2.2e-15) so it quantizes to zeros, not 0 / 0.
ACT_SCALE_MIN_AMAX = 1e-12


def _expand_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., N/bn, K/bk] → [..., N, K] by repeating each block's scale."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def block_dequant_ref(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Semantics: W[..., n, k] = w[..., n, k] · scale[..., n // bn, k // bk] (float32 math).

    Args:
        w: [..., N, K] float8_e4m3fn (any float dtype works).
        scale: [..., ceil(N/bn), ceil(K/bk)] float32.
    Returns: [..., N, K] in `dtype`.
    """
    n, k = w.shape[-2:]
    return (w.float() * _expand_scale(scale.float(), n, k, block)).to(dtype)


def block_quant_ref(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [N, K] to (e4m3 [N, K], scale [N/bn, K/bk]) with amax/448 per block.

    The inverse of `block_dequant_ref` up to e4m3 rounding; used to build test checkpoints.
    """
    n, k = weight.shape
    bn, bk = block
    pad_n, pad_k = -n % bn, -k % bk
    padded = torch.nn.functional.pad(weight.float(), (0, pad_k, 0, pad_n))
    blocks = padded.view((n + pad_n) // bn, bn, (k + pad_k) // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [N/bn, K/bk]
    scale = amax / torch.finfo(FP8_DTYPE).max
    q = (blocks / scale[:, None, :, None]).to(FP8_DTYPE).view(padded.shape)[:n, :k]
    return q.contiguous(), scale


def group_quant_fp8_ref(a: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's dynamic activation quantization ("activation_scheme": "dynamic"): each
    row's runs of `group` values along K to e4m3 with scale amax / 448 (float32 math, a
    correctly rounded division, as the kernels do).

    Args:
        a: [M, K] float.
    Returns: (q [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32); a ≈ q · scale.
    """
    m, k = a.shape
    num_groups = cdiv(k, group)
    groups = torch.nn.functional.pad(a.float(), (0, num_groups * group - k))
    groups = groups.view(m, num_groups, group)
    scale = groups.abs().amax(dim=-1).clamp(min=ACT_SCALE_MIN_AMAX) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, num_groups * group)[:, :k].contiguous(), scale


# e4m3 keeps 3 of float32's 23 mantissa bits; below its smallest normal (2⁻⁶) the step is
# fixed at 2⁻⁹.
_E4M3_DROPPED_BITS = tl.constexpr(20)
_E4M3_HALF_STEP_LESS_ONE = tl.constexpr((1 << 19) - 1)
_E4M3_KEPT_BITS_MASK = tl.constexpr(-(1 << 20))  # 0xFFF00000 as int32
_SIGN_BIT = tl.constexpr(-(1 << 31))  # 0x80000000 as int32
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEPS = tl.constexpr(2.0**9)
# x + c - c rounds |x| < 2²² to an integer, ties to even.
_ROUND_TO_INTEGER = tl.constexpr(1.5 * 2.0**23)


@triton.jit
def _round_to_e4m3(y):
    """float32 y (|y| ≤ 448) rounded to the nearest e4m3 value, ties to even, still float32.

    The cast to e4m3 rounds the same on the GPU; rounding first makes the cast exact, which
    the CPU interpreter needs (its cast does not carry a rounded-up mantissa into the
    exponent)."""
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> _E4M3_DROPPED_BITS) & 1
    kept = (bits + _E4M3_HALF_STEP_LESS_ONE + lsb) & _E4M3_KEPT_BITS_MASK
    normal = kept.to(tl.float32, bitcast=True)
    steps = tl.abs(y) * _E4M3_SUBNORMAL_STEPS
    subnormal = ((steps + _ROUND_TO_INTEGER) - _ROUND_TO_INTEGER) / _E4M3_SUBNORMAL_STEPS
    # y's sign bit back on (`-x` is 0 - x in Triton, which would turn -0 into +0).
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & _SIGN_BIT)).to(
        tl.float32, bitcast=True
    )
    return tl.where(tl.abs(y) < _E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def quantize_row_groups(x, MIN_AMAX: tl.constexpr, QMAX: tl.constexpr):
    """x [rows, GROUP] float32 (masked lanes 0) → (x / scale on the e4m3 grid, still float32;
    scale [rows] = amax / QMAX)."""
    # Correctly rounded divisions, as the torch reference (Triton's `/` is div.full.f32).
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), QMAX)
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -QMAX, QMAX)
    return _round_to_e4m3(y), scale


@triton.jit
def row_group_tile(M, K, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's tile of a row-group quantizer (one program per BLOCK_M rows and one
    K-group): rows [BLOCK_M] int64, columns [GROUP] and their mask [BLOCK_M, GROUP]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    return rows.to(tl.int64), cols, (rows[:, None] < M) & (cols[None, :] < K)


@triton.jit
def store_row_groups(
    x, q_ptr, s_ptr, rows, cols, mask, M, stride_qm, stride_sm,
    MIN_AMAX: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    """Quantize the tile x [BLOCK_M, GROUP] float32 and store its e4m3 values and the rows'
    scales of this K-group. Shared by every activation quantizer, so they all round alike."""
    q, scale = quantize_row_groups(x, MIN_AMAX, QMAX)
    q_ptrs = q_ptr + rows[:, None] * stride_qm + cols[None, :]
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1), scale, mask=rows < M)


# Per-step row counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["M"])
def _group_quant_fp8_kernel(
    a_ptr, q_ptr, s_ptr, M, K, stride_am, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, MIN_AMAX: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    rows, cols, mask = row_group_tile(M, K, GROUP, BLOCK_M)
    x = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=mask, other=0.0)
    store_row_groups(
        x.to(tl.float32), q_ptr, s_ptr, rows, cols, mask, M, stride_qm, stride_sm, MIN_AMAX, QMAX
    )


class QuantizedRows(NamedTuple):
    """Activations already quantized per row and K-group (`group_quant_fp8`'s result) for a
    GEMM that takes them so: q [M, K] e4m3, scale [M, ceil(K/group)] float32, and `dtype`
    the activations had (the GEMM's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def launch_row_group_quant(
    kernel: triton.JITFunction, source: torch.Tensor, k: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a row-group quantizer `kernel` (the arguments of `_group_quant_fp8_kernel`) over
    `source`'s rows: (q [M, k] e4m3, scale [M, ceil(k/group)] float32)."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"activation group {group} must be a power of two ≥ 16")
    m = source.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=source.device)
    scale = torch.empty((m, cdiv(k, group)), dtype=torch.float32, device=source.device)
    if m:
        block_m = 16 if group <= 128 else 4
        fast(kernel)[(cdiv(m, block_m), cdiv(k, group))](
            source, q, scale, m, k, source.stride(0), q.stride(0), scale.stride(0),
            GROUP=group, BLOCK_M=block_m, MIN_AMAX=ACT_SCALE_MIN_AMAX, QMAX=FP8_MAX,
        )  # fmt: skip
    return q, scale


def group_quant_fp8(a: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `group_quant_fp8_ref` (same arguments and result, bit for bit)."""
    if a.dim() != 2 or a.stride(-1) != 1:
        raise ValueError(f"activations {tuple(a.shape)} must be [M, K] with unit stride in K")
    return launch_row_group_quant(_group_quant_fp8_kernel, a, a.shape[1], group)


def group_dequant_fp8_ref(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [M, K] = q · scale of `group_quant_fp8_ref`."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, : q.shape[-1]]


@triton.jit
def _fp8_block_dequant_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_sn,
    BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + (offs_n[:, None] // BN) * stride_sn + offs_k[None, :] // BK, mask=mask)
    out = w.to(tl.float32) * s
    tl.store(
        out_ptr + offs_n[:, None] * K + offs_k[None, :], out.to(out_ptr.dtype.element_ty), mask
    )


def fp8_block_dequant(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Triton version of `block_dequant_ref` for a 2-D weight [N, K]."""
    n, k = w.shape
    bn, bk = block
    if scale.shape != (cdiv(n, bn), cdiv(k, bk)):
        raise ValueError(f"scale {tuple(scale.shape)} does not match weight {(n, k)} / {block}")
    w, scale = w.contiguous(), scale.float().contiguous()
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    grid = (cdiv(n, 32), cdiv(k, 32))
    fast(_fp8_block_dequant_kernel)[grid](
        w, scale, out, n, k, scale.stride(0), BN=bn, BK=bk, BLOCK_N=32, BLOCK_K=32
    )
    return out


def fp8_block_linear_ref(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Semantics: y[M, N] = x[M, K] @ dequant(w, scale)ᵀ, float32 accumulate, x's dtype out."""
    return (x.float() @ block_dequant_ref(w, scale, block).T).to(x.dtype)


# Per-step counts unspecialised: no compile per count class mid-serving (ARCHITECTURE.md).
@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BN: tl.constexpr, BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # BLOCK_K divides BK, so one K-tile lies in one scale block: scale the tile's dot product.
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=(offs_m[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + k[:, None],
            mask=(offs_n[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        s = tl.load(s_ptr + (offs_n // BN) * stride_sn + k0 // BK, mask=offs_n < N, other=0.0)
        acc += tl.dot(a, b.to(a.dtype)) * s[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )  # fmt: skip


def _gemm_tiles(m: int, block_k: int) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, min(64, block_k)


def fp8_block_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Triton version of `fp8_block_linear_ref`. x [..., K] (bf16/fp16/fp32), w [N, K]."""
    n, k = w.shape
    bn, bk = block
    if x.shape[-1] != k or scale.shape != (cdiv(n, bn), cdiv(k, bk)):
        raise ValueError(f"x {tuple(x.shape)}, w {(n, k)}, scale {tuple(scale.shape)} mismatch")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w, scale = w.contiguous(), scale.float().contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _gemm_tiles(m, bk)
    if bk % block_k:
        raise ValueError(f"fp8 block_k {bk} must be a multiple of {block_k}")
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    fast(_fp8_block_gemm_kernel)[grid](
        x2, w, scale, y, m, n, k, x2.stride(0), w.stride(0), scale.stride(0), y.stride(0),
        BN=bn, BK=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
