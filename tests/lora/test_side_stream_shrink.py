"""The linear shrink that runs beside its base matmul (decode-sized steps) uses a planned SGMV
variant with fewer programs an SM than the default, leaving the product room."""

from __future__ import annotations

from inference_svc.lora import apply
from kernels.sgmv import DEFAULT_VARIANT, SHRINK_VARIANTS


def test_side_stream_shrink_variant_is_a_smaller_planned_grid() -> None:
    side = SHRINK_VARIANTS[apply.SIDE_SHRINK_VARIANT]
    default = SHRINK_VARIANTS[DEFAULT_VARIANT]
    assert side.planned and default.planned
    assert side.programs_per_sm < default.programs_per_sm
    assert side.block == default.block  # the same K tile, a smaller grid
