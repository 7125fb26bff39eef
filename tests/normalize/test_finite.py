"""`all_finite` reads finiteness from the bits: it must agree with torch.isfinite on every
value, for every float dtype an upload may hold."""

from __future__ import annotations

import pytest
import torch

from adapter_store.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_agrees_with_isfinite(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    disagreeing = [
        int(patterns[i : i + 1].view(torch.int16))
        for i in range(patterns.numel())
        if all_finite(patterns[i : i + 1]) != bool(finite[i])
    ]
    assert disagreeing == []
    assert not all_finite(patterns)  # the whole range holds infs and NaNs


def test_float32_specials_and_ordinary_values() -> None:
    info = torch.finfo(torch.float32)
    finite = [0.0, -0.0, 1.0, -2.5, info.max, -info.max, info.tiny, info.tiny / 8]
    for value in finite:
        assert all_finite(torch.tensor([value, 3.0]))
    for value in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        assert not all_finite(torch.tensor([1.0, value]))
    nan_bits = torch.tensor([0x7F80_0001, 0x7FFF_FFFF, -1], dtype=torch.int32)
    payload_nans = nan_bits.view(torch.float32)
    assert not any(all_finite(payload_nans[i : i + 1]) for i in range(3))


def test_shapes_views_and_other_dtypes() -> None:
    grid = torch.randn(6, 5, dtype=torch.bfloat16)
    assert all_finite(grid) and all_finite(torch.empty(0, 3)) and all_finite(torch.tensor(1.0))
    grid[4, 1] = float("inf")
    assert not all_finite(grid.t())  # a transposed view
    assert not all_finite(grid[4])
    assert all_finite(grid[:4])
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64))
    assert all_finite(torch.tensor([1.0, 2.0], dtype=torch.float64))
