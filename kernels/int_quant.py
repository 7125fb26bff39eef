"""Integer weight formats for the routed experts: INT8 per-channel (w8a8) and 4-bit groups.

int8_channel: W[n, k] = q[n, k] · scale[n, 0], q int8 in [-127, 127], scale float32
    [..., N, 1] = amax(|W[n, :]|) / 127. The GEMM also quantizes each activation row to
    int8 with its own scale (amax / 127, `per_token_quant_int8`), multiplies int8 × int8
    into int32 and applies both scales once at the end (w8a8).
int4_group: W[n, k] = (nibble(n, k) − 8) · scale[n, k // G], symmetric: the nibble holds
    q + 8 for q in [-7, 7] = round(W / scale), scale = amax over the group / 7, groups of
    G (128) along K. Two nibbles per byte along K: byte [n, k // 2] holds even k in its low
    and odd k in its high nibble, so `packed` is uint8 [..., N, ceil(K/2)]. Weight-only:
    the GEMM dequantizes the nibbles in registers and keeps activations in their dtype.

Rounding is half away from zero everywhere (same in torch and Triton), and the Triton
activation quantizer divides with correct rounding, so it reproduces
`per_token_quant_int8_ref` exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control

INT8_QMAX = 127
INT4_QMAX = 7
INT4_OFFSET = 8  # a nibble stores q + 8, so q in [-8, 7] is an unsigned 0..15
INT4_GROUP = 128


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def int8_channel_quant_ref(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] to (int8 [..., N, K], float32 scale [..., N, 1]), one per row."""
    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_QMAX  # [..., N, 1]
    q = _round_half_away(w / scale).clamp(-INT8_QMAX, INT8_QMAX)
    return q.to(torch.int8), scale


def int8_channel_dequant_ref(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Semantics: W[..., n, k] = q[..., n, k] · scale[..., n, 0] (float32 math)."""
    return (q.float() * scale.float()).to(dtype)


def per_token_quant_int8_ref(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: q[m] = round(a[m] / s[m]), s[m] = amax(|a[m, :]|) / 127 (per row).

    Args:
        a: [M, K] float activations. Returns (int8 [M, K], float32 scale [M]).
    """
    x = a.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-12) / INT8_QMAX  # [M]
    q = _round_half_away(x / scale[:, None]).clamp(-INT8_QMAX, INT8_QMAX)
    return q.to(torch.int8), scale


@triton.jit
def _per_token_quant_int8_kernel(a_ptr, q_ptr, s_ptr, K, stride_a, stride_q, BLOCK: tl.constexpr):
    # One program per row; the row is read twice (amax, then quantize) in BLOCK chunks.
    grid_dependency_control()
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(a_ptr + row * stride_a + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # Correctly rounded divisions (Triton's `/` is div.full.f32, off by up to 2 ulp): a
    # value on a half step must round as in the torch reference (the H100 found 49 of 3.1M
    # outputs a whole int8 step apart with `/`).
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 127.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(a_ptr + row * stride_a + k, mask=k < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + row * stride_q + k, q.to(tl.int8), mask=k < K)


def per_token_quant_int8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `per_token_quant_int8_ref` (same arguments and result)."""
    if a.dim() != 2 or a.stride(-1) != 1:
        raise ValueError(f"activations {tuple(a.shape)} must be [M, K] with unit stride in K")
    rows, k = a.shape
    q = torch.empty((rows, k), dtype=torch.int8, device=a.device)
    scale = torch.empty(rows, dtype=torch.float32, device=a.device)
    if rows:
        block = min(1024, next_power_of_2(k))
        fast(_per_token_quant_int8_kernel)[(rows,)](a, q, scale, k, a.stride(0), q.stride(0), block)
    return q, scale


def int4_group_quant_ref(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] to (packed uint8 [..., N, ceil(K/2)], scale [..., N, ceil(K/G)]).

    The last group may be shorter than G; an odd K gets a zero high nibble in its last byte.
    """
    *lead, n, k = weight.shape
    pad = -k % group
    w = torch.nn.functional.pad(weight.float(), (0, pad)).view(*lead, n, -1, group)
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / INT4_QMAX  # [..., N, K/G]
    q = _round_half_away(w / scale[..., None]).clamp(-INT4_QMAX, INT4_QMAX)
    nibbles = (q.view(*lead, n, -1)[..., :k] + INT4_OFFSET).to(torch.uint8)  # [..., N, K]
    if k % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=INT4_OFFSET)
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return packed.contiguous(), scale


def int4_unpack_ref(packed: torch.Tensor, k: int) -> torch.Tensor:
    """[..., N, ceil(K/2)] uint8 → int8 q [..., N, K] in [-8, 7]."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    nibbles = torch.stack([low, high], dim=-1).flatten(-2)[..., :k]
    return nibbles - INT4_OFFSET


def int4_group_dequant_ref(
    packed: torch.Tensor,
    scale: torch.Tensor,
    k: int,
    group: int = INT4_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Semantics: W[..., n, k] = (nibble[..., n, k] − 8) · scale[..., n, k // G].

    Args:
        packed: [..., N, ceil(K/2)] uint8; scale: [..., N, ceil(K/G)] float.
        k: the logical K (the packing hides whether K is odd).
    Returns: [..., N, K] in `dtype`.
    """
    q = int4_unpack_ref(packed, k).float()  # [..., N, K]
    expanded = scale.float().repeat_interleave(group, dim=-1)[..., :k]
    return (q * expanded).to(dtype)
