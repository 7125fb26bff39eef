"""Weight quantization methods: how a linear or expert weight is stored and multiplied.

A quant method creates a layer's weight parameters, loads checkpoint tensors into them and
describes them to the kernels as a `QuantInfo`. `bf16` stores the weight in the activation
dtype (bf16 on GPU, float32 on CPU); `fp8_block` keeps DeepSeek-V3's e4m3 weights with one
float32 `weight_scale_inv` per 128×128 block. `int8_channel` (w8a8) and `int4_group`
(4-bit weight-only, groups of 128 along K) are for the routed experts only: their layouts are
described in `kernels.int_quant`, and a dense `Linear` refuses them at construction.
`fp8_block_a8` (routed experts only) stores what `fp8_block` stores and also quantizes the
activations per row and 128-group to e4m3 (DeepSeek-V3's "dynamic" activation scheme), so
the expert GEMMs multiply e4m3 by e4m3.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from kernels.fp8 import FP8_DTYPE
from kernels.int_quant import INT4_GROUP


@dataclass(frozen=True)
class QuantInfo:
    """What a GEMM needs to multiply by a stored weight.

    weight: [..., N, K] (a leading expert dim E for MoE), float or float8_e4m3fn; int8
        for "w8a8"; uint8 [..., N, ceil(K/2)] (two nibbles per byte) for "int4_group".
    scale:  [..., ceil(N/block_n), ceil(K/block_k)] float32 (dequant = weight · scale), or None.
    scheme: how the GEMM reads them (`kernels.fused_moe.WEIGHT_SCHEMES`); None means
        "float" without a scale and "block" with one.
    """

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    scheme: str | None = None


class QuantMethod(abc.ABC):
    """Interface every weight format implements; an incomplete subclass cannot be built."""

    name: str
    # False: only the routed-expert GEMM reads this format; a dense Linear refuses it.
    dense_linear: bool = True

    @abc.abstractmethod
    def create_weights(
        self, module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Register the parameters of a weight of logical `shape` ([..., N, K]) on `module`."""

    @abc.abstractmethod
    def check_slices(self, output_sizes: list[int]) -> None:
        """Raise if fused slices of these output widths cannot share one stored weight."""

    @abc.abstractmethod
    def quant_info(self, module: nn.Module) -> QuantInfo:
        """The stored weight as the kernels take it."""

    @abc.abstractmethod
    def load(
        self, module: nn.Module, kind: str, tensor: torch.Tensor, row: int, expert: int | None
    ) -> None:
        """Copy a checkpoint tensor (`kind` "weight" or "scale") to output rows from `row`."""


def _rows(param: torch.Tensor, expert: int | None) -> torch.Tensor:
    return param if expert is None else param[expert]


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, row: int, what: str) -> None:
    """dst[row:row+n] = src, with the shape checked so a wrong checkpoint fails loudly."""
    if src.dim() != dst.dim() or src.shape[1:] != dst.shape[1:] or row + src.shape[0] > len(dst):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(src.shape)} does not fit {tuple(dst.shape)}"
        )
    dst[row : row + src.shape[0]].copy_(src)


class UnquantizedMethod(QuantMethod):
    """The weight in the activation dtype (`bf16` on GPU, float32 on CPU)."""

    name = "bf16"

    def create_weights(self, module, shape, dtype, device) -> None:
        module.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), False)

    def check_slices(self, output_sizes: list[int]) -> None:
        return None

    def quant_info(self, module: nn.Module) -> QuantInfo:
        return QuantInfo(weight=module.weight)

    def load(self, module, kind, tensor, row, expert) -> None:
        if kind != "weight":
            raise ValueError(f"{type(module).__name__} is unquantized but got a {kind} tensor")
        _copy_rows(_rows(module.weight, expert), tensor, row, "weight")


class Fp8BlockMethod(QuantMethod):
    """e4m3 weight + float32 `weight_scale_inv` per (block_n × block_k) block."""

    name = "fp8_block"

    def __init__(self, block_n: int, block_k: int):
        self.block_n, self.block_k = block_n, block_k

    def create_weights(self, module, shape, dtype, device) -> None:
        *lead, n, k = shape
        blocks = (*lead, -(-n // self.block_n), -(-k // self.block_k))
        module.weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), False)
        module.weight_scale_inv = nn.Parameter(
            torch.empty(blocks, dtype=torch.float32, device=device), False
        )

    def check_slices(self, output_sizes: list[int]) -> None:
        for size in output_sizes[:-1]:
            if size % self.block_n:
                raise ValueError(
                    f"fused slice of width {size} is not a multiple of the fp8 block "
                    f"{self.block_n}: the slices' scale blocks would overlap"
                )

    def quant_info(self, module: nn.Module) -> QuantInfo:
        return QuantInfo(module.weight, module.weight_scale_inv, (self.block_n, self.block_k))

    def load(self, module, kind, tensor, row, expert) -> None:
        if kind == "weight" and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"fp8_block layer got a {tensor.dtype} weight; expected e4m3")
        if kind == "weight":
            _copy_rows(_rows(module.weight, expert), tensor, row, "weight")
        else:
            _copy_rows(_rows(module.weight_scale_inv, expert), tensor, row // self.block_n, "scale")


class Fp8BlockA8Method(Fp8BlockMethod):
    """`fp8_block` weights whose GEMM also quantizes the activations, per row and K-group of
    block_k, to e4m3 (kernels.fused_moe "block_a8"): the numerics of DeepSeek-V3's own
    inference (`act_quant` + `fp8_gemm`), not those of a bf16 GEMM on dequantized weights."""

    name = "fp8_block_a8"
    dense_linear = False

    def quant_info(self, module: nn.Module) -> QuantInfo:
        return QuantInfo(
            module.weight, module.weight_scale_inv, (self.block_n, self.block_k), "block_a8"
        )


def _load_int(module: nn.Module, kind: str, tensor: torch.Tensor, row: int, expert, dtype):
    """Rows of an integer `weight` (checked dtype) or of its per-row `weight_scale`."""
    if kind == "weight":
        if tensor.dtype != dtype:
            raise ValueError(f"{kind}: got {tensor.dtype}, expected {dtype}")
        _copy_rows(_rows(module.weight, expert), tensor, row, "weight")
    elif kind == "scale":
        dst = _rows(module.weight_scale, expert)
        _copy_rows(dst, tensor.float().reshape(-1, dst.shape[-1]), row, "scale")
    else:
        raise ValueError(f"unknown checkpoint tensor kind {kind!r}")


class Int8ChannelMethod(QuantMethod):
    """int8 weight + float32 `weight_scale` [..., N, 1] per output channel; w8a8 GEMM."""

    name = "int8_channel"
    dense_linear = False

    def create_weights(self, module, shape, dtype, device) -> None:
        *lead, n, k = shape
        module.weight = nn.Parameter(torch.empty(shape, dtype=torch.int8, device=device), False)
        module.weight_scale = nn.Parameter(
            torch.empty((*lead, n, 1), dtype=torch.float32, device=device), False
        )

    def check_slices(self, output_sizes: list[int]) -> None:
        return None  # one scale per row: any split of the rows keeps its own scales

    def quant_info(self, module: nn.Module) -> QuantInfo:
        k = module.weight.shape[-1]
        return QuantInfo(module.weight, module.weight_scale, (1, k), "w8a8")

    def load(self, module, kind, tensor, row, expert) -> None:
        _load_int(module, kind, tensor, row, expert, torch.int8)


class Int4GroupMethod(QuantMethod):
    """Packed 4-bit weight uint8 [..., N, ceil(K/2)] + float32 `weight_scale` per group."""

    name = "int4_group"
    dense_linear = False

    def __init__(self, group: int = INT4_GROUP):
        if group < 16 or group & (group - 1):
            raise ValueError(f"int4 group {group} must be a power of two ≥ 16 (GEMM K-tile)")
        self.group = group

    def create_weights(self, module, shape, dtype, device) -> None:
        *lead, n, k = shape
        packed = (*lead, n, -(-k // 2))
        groups = (*lead, n, -(-k // self.group))
        module.weight = nn.Parameter(torch.empty(packed, dtype=torch.uint8, device=device), False)
        module.weight_scale = nn.Parameter(
            torch.empty(groups, dtype=torch.float32, device=device), False
        )

    def check_slices(self, output_sizes: list[int]) -> None:
        return None  # groups run along K: every row has its own scales

    def quant_info(self, module: nn.Module) -> QuantInfo:
        return QuantInfo(module.weight, module.weight_scale, (1, self.group), "int4_group")

    def load(self, module, kind, tensor, row, expert) -> None:
        _load_int(module, kind, tensor, row, expert, torch.uint8)


def make_quant_method(name: str, block: tuple[int, int] | None = None) -> QuantMethod:
    """The quant method called `name`; an unknown name is a start-up error.

    `block` is the fp8 weight block; for int4_group its K entry is the group (default 128).
    """
    if name == UnquantizedMethod.name:
        return UnquantizedMethod()
    if name in (Fp8BlockMethod.name, Fp8BlockA8Method.name):
        if block is None:
            raise ValueError(f"{name} needs a weight block size")
        return (Fp8BlockMethod if name == Fp8BlockMethod.name else Fp8BlockA8Method)(*block)
    if name == Int8ChannelMethod.name:
        return Int8ChannelMethod()
    if name == Int4GroupMethod.name:
        return Int4GroupMethod(block[1] if block is not None else INT4_GROUP)
    raise ValueError(
        f"unknown quant method {name!r} "
        "(known: bf16, fp8_block, fp8_block_a8, int8_channel, int4_group)"
    )
