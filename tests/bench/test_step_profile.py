"""The profile summary's interval arithmetic: busy unions and how much of the copies ran
under kernels (CPU, synthetic records)."""

from __future__ import annotations

import pytest

from bench.step_profile import busy_unions, interval_union, kernel_class


def test_interval_union_counts_overlaps_once() -> None:
    assert interval_union([]) == 0.0
    assert interval_union([(0.0, 10.0), (5.0, 15.0), (20.0, 25.0)]) == 20.0
    assert interval_union([(0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested
    assert interval_union([(4.0, 6.0), (0.0, 5.0)]) == 6.0  # unsorted


def test_copies_under_kernels_is_their_shared_time() -> None:
    records = [
        ("_grouped_gemm_kernel", 0.0, 10.0),
        ("cublas_gemm", 5.0, 15.0),
        ("memcpy_memset", 12.0, 20.0),  # 3 µs of it beside the GEMM
        ("memcpy_memset", 30.0, 34.0),  # alone: the kernels' stream waited
    ]
    unions = busy_unions(records)
    assert unions["kernels"] == 15.0
    assert unions["copies"] == 12.0
    assert unions["all"] == 24.0
    assert unions["copies_under_kernels"] == pytest.approx(3.0)


def test_copies_fully_hidden_under_kernels() -> None:
    unions = busy_unions([("_silu_mul_kernel", 0.0, 50.0), ("memcpy_memset", 10.0, 40.0)])
    assert unions["copies_under_kernels"] == unions["copies"] == 30.0


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("Memcpy HtoD (Pinned -> Device)", "memcpy_memset"),
        ("Memset (Device)", "memcpy_memset"),
        (
            "void at::native::elementwise_kernel<direct_copy_kernel_cuda>",
            "torch_cat_copy",
        ),
        ("_moe_lora_pair_kernel", "_moe_lora_pair_kernel"),
    ],
)
def test_host_transfers_are_the_copy_class(name: str, label: str) -> None:
    """A slot load's transfers count as copies; its scatter kernels, which use SMs, do not."""
    assert kernel_class(name) == label
