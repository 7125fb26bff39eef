"""Integer helpers for planning launches on the host.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.6: called
from Python they go through Triton's JIT call machinery, ~3 µs each against ~0.2 µs for
plain integer arithmetic. An eager prefill step plans about a thousand launches with
several of each (bench/triton_launch.py has the per-launch host cost).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0 (what `triton.cdiv` gives)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n for n ≥ 1, 0 for n = 0 (what `triton.next_power_of_2`
    gives)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
