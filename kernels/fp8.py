"""FP8 block quantization (DeepSeek-V3 checkpoint format): dequantization and GEMM.

A weight W [N, K] is stored as e4m3 `w` plus float32 `scale` [ceil(N/bn), ceil(K/bk)]
(`weight_scale_inv` in the checkpoint): W[n, k] = w[n, k] · scale[n // bn, k // bk].
The GEMM keeps activations in their dtype and dequantizes weight tiles in registers, so a
decode step reads 1 byte per weight instead of 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import cdiv

FP8_DTYPE = torch.float8_e4m3fn


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


@triton.jit
def _fp8_block_dequant_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_sn,
    BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
    _fp8_block_dequant_kernel[grid](
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
    _fp8_block_gemm_kernel[grid](
        x2, w, scale, y, m, n, k, x2.stride(0), w.stride(0), scale.stride(0), y.stride(0),
        BN=bn, BK=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
