"""Where the routed experts' LoRA expand runs (`apply.moe_lora_in_gemm`): in the grouped
GEMM's epilogue only for long steps whose (expert, adapter) keys have enough rows."""

from __future__ import annotations

import pytest

from inference_svc.lora import apply
from kernels.lora_segments import build_lora_segments
from kernels.moe_lora import PAIRS_MAX_PAIRS

TOP_K, EXPERTS = 6, 64


def _segs(runs: int, tokens: int, base_tokens: int = 0):  # type: ignore[no-untyped-def]
    """`tokens` adapter tokens in `runs` equal runs (sorted, as the scheduler orders them)."""
    slots = [-1] * base_tokens + [i * runs // tokens for i in range(tokens)]
    return build_lora_segments(slots, [16] * max(runs, 1))


@pytest.mark.parametrize(
    "runs,tokens,quantized,expected",
    [
        (1, 8192, False, True),  # 768 rows per key
        (32, 8192, False, True),  # 24
        (32, 2048, False, True),  # 6
        (64, 1024, False, False),  # 1.5: the per-adapter epilogue MMAs cost more
        (32, 2048, True, False),  # 6: FP8's 128-column tiles, twice the epilogues
        (16, 2048, True, True),  # 12
        (8, 8192, True, True),  # 96
        (1, 128, False, False),  # decode-sized: the "pairs" kernel after the GEMM
    ],
)
def test_auto_placement(runs, tokens, quantized, expected) -> None:  # type: ignore[no-untyped-def]
    assert apply.moe_lora_in_gemm(_segs(runs, tokens), TOP_K, EXPERTS, quantized) is expected


def test_base_tokens_do_not_count_as_rows_and_a_base_only_step_stays_after() -> None:
    long = PAIRS_MAX_PAIRS // TOP_K + 1
    assert not apply.moe_lora_in_gemm(_segs(0, 0, base_tokens=long), TOP_K, EXPERTS, False)
    # 1000 base tokens and 700 adapter tokens in 32 runs: 700·6 / (64·32) ≈ 2 rows per key.
    assert not apply.moe_lora_in_gemm(_segs(32, 700, base_tokens=1000), TOP_K, EXPERTS, False)


def test_decodes_beside_long_prompts_do_not_hide_the_long_runs() -> None:
    """A serving prefill step: 96 one-token decodes of 32 adapters, then 16 prompts of 512
    tokens of 16 adapters. Per run that is 8288 / 112 = 74 tokens (7 rows per key, "after"
    for FP8 experts); token-weighted 506 (47 rows per key): the prompts' tiles see one
    adapter each."""
    decodes = [i % 32 for i in range(96)]
    slots = sorted(decodes) + [32 + i // 512 for i in range(16 * 512)]
    segs = build_lora_segments(slots, [16] * 48)
    assert apply.moe_lora_in_gemm(segs, TOP_K, EXPERTS, quantized=True)
    assert apply.moe_lora_in_gemm(segs, TOP_K, EXPERTS, quantized=False)


def test_forced_placements_and_the_context_manager(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    short = _segs(1, 16)
    with apply.moe_lora_placement("always"):
        assert apply.moe_lora_in_gemm(short, TOP_K, EXPERTS, False)
    assert apply.MOE_LORA_IN_GEMM == "auto"
    monkeypatch.setattr(apply, "MOE_LORA_IN_GEMM", "never")
    assert not apply.moe_lora_in_gemm(_segs(1, 8192), TOP_K, EXPERTS, False)
