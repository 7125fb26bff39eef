"""The host-side launch arithmetic gives what Triton's constexpr helpers give."""

from __future__ import annotations

import numpy as np
import triton

from kernels.host_math import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_equal_triton_s() -> None:
    for a in [*range(0, 300), 1023, 1024, 1025, 8191, 8192, 8193, 10**9 + 7]:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_numpy_integers_are_accepted() -> None:
    assert next_power_of_2(np.int64(17)) == 32 and cdiv(np.int64(17), 16) == 2
