"""SGMV shrink/expand: Triton kernels vs the torch reference, and the reference vs fp64 ΔW.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py) in fp32/fp16; the
`gpu` tests run them compiled in bf16, including CUDA-graph replay.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.host_math import cdiv
from kernels.lora_segments import (
    LoraSegmentsConfig,
    allocate_lora_segments,
    build_lora_segments,
    live_rank_columns,
)
from kernels.sgmv import (
    DEFAULT_VARIANT,
    EXPAND_VARIANTS,
    LONG_STEP_EXPAND,
    LONG_STEP_TOKENS,
    SHRINK_VARIANTS,
    expand_variant,
    plan_split_k,
    planned_split,
    sgmv_expand,
    sgmv_expand_ref,
    sgmv_shrink,
    sgmv_shrink_ref,
    shrink_rank_tile,
)
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    pool_A,
    pool_B,
    popular_slots,
    sgmv_case,
)

# Unequal stacked slices like attn.qkv_a (q_lora_rank | kv_lora_rank + rope), odd widths.
QKV_A_SLICES = [0, 37, 37 + 45]
DENSE_SLICES = [0, 53]
# (shrink, expand) variant pairs: every variant of both tables is covered (the shorter
# table's last variant pairs with the longer one's rest).
VARIANTS = list(
    itertools.zip_longest(SHRINK_VARIANTS, EXPAND_VARIANTS, fillvalue=list(EXPAND_VARIANTS)[-1])
)


def _dense_delta(x, A, B, segs, slice_offsets):  # type: ignore[no-untyped-def]
    """fp64 ΔW = B_i·A_i per token's slot, applied densely: the semantics, not the method."""
    num_slices = len(slice_offsets) - 1
    pool_rank = B.shape[2]
    delta = torch.zeros(x.shape[0], slice_offsets[-1], dtype=torch.float64)
    for t, slot in enumerate(segs.token_slot[: x.shape[0]].tolist()):
        if slot < 0:
            continue
        rank = int(segs.slot_rank[slot])
        for i in range(num_slices):
            lo, hi = slice_offsets[i], slice_offsets[i + 1]
            a = A[slot, i * pool_rank : i * pool_rank + rank].double()  # [rank, in]
            b = B[slot, lo:hi, :rank].double()  # [out_i, rank]
            delta[t, lo:hi] = (b @ a) @ x[t].double()
    return delta


@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("slice_offsets", [DENSE_SLICES, QKV_A_SLICES], ids=["1slice", "qkv_a"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sgmv_matches_reference(popularity, slice_offsets, dtype, variants) -> None:  # type: ignore[no-untyped-def]
    num_slices = len(slice_offsets) - 1
    shrink_v, expand_v = variants
    # in=53 fits one K block: the split-free (plain store) shrink path.
    segs, x, A, B, out = sgmv_case(popularity, 23, 53, slice_offsets, 16, dtype, seed=1)
    y = sgmv_shrink(x, A, segs, num_slices, variant=shrink_v)
    y_ref = sgmv_shrink_ref(x.float(), A.float(), segs, num_slices)
    assert_close(y, y_ref, dtype)
    expected = sgmv_expand_ref(y_ref, B.float(), out.float(), segs, slice_offsets)
    assert_close(sgmv_expand(y, B, out, segs, slice_offsets, variant=expand_v), expected, dtype)


@pytest.mark.parametrize("variant", list(EXPAND_VARIANTS))
@pytest.mark.parametrize("popularity", ["zipf", "distinct", "all_base"])
@pytest.mark.parametrize("slice_offsets", [DENSE_SLICES, QKV_A_SLICES], ids=["1slice", "qkv_a"])
@pytest.mark.parametrize("pool_rank", [16, 96])
def test_expand_reads_each_tokens_own_slot_of_a_product_output(
    popularity, slice_offsets, pool_rank, variant
) -> None:  # type: ignore[no-untyped-def]
    """`y_every_slot`: y is the tail of one product x · [W; A_0; …; A_S-1]ᵀ (every slot's
    shrink of every token, rows strided by the product's width, rounded to the product's
    dtype); each token adds its own slot's columns only. Other slots' columns hold NaN, so
    reading any of them shows."""
    num_slices = len(slice_offsets) - 1
    segs, x, A, B, out = sgmv_case(popularity, 41, 60, slice_offsets, pool_rank, torch.float32, 7)
    num_slots, width = A.shape[0], num_slices * pool_rank
    every = torch.einsum("tk,sjk->tsj", x, A)  # [T, slots, S·R]
    slot = segs.token_slot[: x.shape[0]].long()
    foreign = slot[:, None] != torch.arange(num_slots)[None, :]  # [T, slots]
    every = torch.where(foreign[:, :, None], float("nan"), every)
    product = torch.cat([out, every.reshape(x.shape[0], num_slots * width)], dim=1)
    y = product[:, out.shape[1] :]
    own = sgmv_shrink_ref(x, A, segs, num_slices)
    expected = sgmv_expand_ref(own, B, out.clone(), segs, slice_offsets)
    reference = sgmv_expand_ref(y, B, out.clone(), segs, slice_offsets, y_every_slot=True)
    assert_close(reference, expected, torch.float32)
    sgmv_expand(y, B, product[:, : out.shape[1]], segs, slice_offsets, variant=variant,
                y_every_slot=True)  # fmt: skip
    assert_close(product[:, : out.shape[1]], expected, torch.float32)


@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_prefill_segments_and_rank_below_block(dtype, variants) -> None:  # type: ignore[no-untyped-def]
    """K=300 spans 3 K-blocks (split-K with atomics), 40-token runs span several segments,
    pool rank 32 with ranks 1..32 exercises two rank blocks and masked rank tails."""
    shrink_v, expand_v = variants
    segs, x, A, B, out = sgmv_case("skewed", 70, 300, QKV_A_SLICES, 32, dtype, seed=2)
    y = sgmv_shrink(x, A, segs, 2, variant=shrink_v)
    y_ref = sgmv_shrink_ref(x.float(), A.float(), segs, 2)
    assert_close(y, y_ref, dtype)
    expected = sgmv_expand_ref(y_ref, B.float(), out.float(), segs, QKV_A_SLICES)
    got = sgmv_expand(y, B, out, segs, QKV_A_SLICES, variant=expand_v)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
@pytest.mark.parametrize("slice_offsets", [DENSE_SLICES, QKV_A_SLICES], ids=["1slice", "qkv_a"])
def test_pool_rank_above_one_rank_block(slice_offsets, variants) -> None:  # type: ignore[no-untyped-def]
    """Pool rank 96: the expand's rank loop runs two 64-wide blocks (its first read with the
    item's segment, the second in the loop), beside slots of rank < 64 that stop after one;
    NaN past every slot's rank, so a block that reads there unzeroed shows."""
    shrink_v, expand_v = variants
    num_slices = len(slice_offsets) - 1
    segs, x, A, B, out = sgmv_case(
        "distinct", 37, 90, slice_offsets, 96, torch.float32, seed=5, poison=float("nan")
    )
    used = [int(segs.slot_rank[s]) for s in segs.seg_slot[: segs.num_live_segments] if s >= 0]
    assert max(used) > 64 > min(used)
    y = sgmv_shrink(x, A, segs, num_slices, variant=shrink_v)
    y_ref = sgmv_shrink_ref(x, A, segs, num_slices)
    assert_close(y, y_ref, torch.float32)
    expected = sgmv_expand_ref(y_ref, B, out.clone(), segs, slice_offsets)
    assert_close(
        sgmv_expand(y, B, out, segs, slice_offsets, variant=expand_v), expected, torch.float32
    )


@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
@pytest.mark.parametrize("popularity", ["skewed", "distinct"])
def test_prefill_tiles_of_64_tokens(popularity, variants) -> None:  # type: ignore[no-untyped-def]
    """64-token tiles (`max_seg_len=64`; measured for prefill steps, not used by serving):
    150-token runs cut into 64-token segments, and short runs in mostly empty tiles."""
    shrink_v, expand_v = variants
    case = sgmv_case(popularity, 150, 300, QKV_A_SLICES, 16, torch.float32, 3, max_seg_len=64)
    segs, x, A, B, out = case
    assert segs.max_seg_len == 64
    y = sgmv_shrink(x, A, segs, 2, variant=shrink_v)
    y_ref = sgmv_shrink_ref(x, A, segs, 2)
    assert_close(y, y_ref, torch.float32)
    expected = sgmv_expand_ref(y_ref, B, out.clone(), segs, QKV_A_SLICES)
    got = sgmv_expand(y, B, out, segs, QKV_A_SLICES, variant=expand_v)
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
def test_grid_sized_for_capacity_with_few_live_segments(variants, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What a CUDA-graph replay sees: a grid planned for 48 segments of capacity, 4 live ones
    (the planned kernels read the live count on the device; v1 runs empty programs)."""
    shrink_v, expand_v = variants
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens=48, num_slots=3), "cpu")
    build_lora_segments([0, 0, 2, -1, 1, 1, 1], [3, 16, 7], out=segs)
    monkeypatch.setattr(type(segs), "grid_segments", lambda self: self.max_segments)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, 300, generator=gen)
    A = pool_A([3, 16, 7], 2, 16, 300)
    B = pool_B([3, 16, 7], 300, 16)
    out = torch.randn(7, 300, generator=gen)
    y = sgmv_shrink(x, A, segs, 2, variant=shrink_v)
    assert_close(y, sgmv_shrink_ref(x, A, segs, 2), torch.float32)
    # 4 live segments x 4..6 column blocks: more items than the 16 CPU programs.
    got = sgmv_expand(y, B, out.clone(), segs, [0, 130, 300], variant=expand_v)
    assert_close(got, sgmv_expand_ref(y, B, out, segs, [0, 130, 300]), torch.float32)


@pytest.mark.parametrize("variant", [v for v, plan in EXPAND_VARIANTS.items() if plan.planned])
@pytest.mark.parametrize("popularity", ["zipf", "distinct"])
def test_planned_expand_programs_walking_several_items(popularity, variant) -> None:  # type: ignore[no-untyped-def]
    """More (segment, column block) items than the planned grid's programs (16 or 32 on
    the CPU's one "SM"), so each program walks several, the last ones past the live count."""
    slices = [0, 300, 600]
    segs, _, _, B, out = sgmv_case(popularity, 400, 64, slices, 16, torch.float32, seed=5)
    y = torch.randn(400, 2 * 16)
    plan = EXPAND_VARIANTS[variant]
    items = segs.num_live_segments * 2 * cdiv(300, plan.block)
    assert items > 2 * plan.programs_per_sm
    got = sgmv_expand(y, B, out.clone(), segs, slices, variant=variant)
    assert_close(got, sgmv_expand_ref(y, B, out, segs, slices), torch.float32)


@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
def test_kernels_never_read_past_a_slot_rank(variants) -> None:  # type: ignore[no-untyped-def]
    """NaN in every unused rank row/column: a kernel that touches them returns NaN."""
    shrink_v, expand_v = variants
    segs, x, A, B, out = sgmv_case(
        "zipf", 19, 67, QKV_A_SLICES, 16, torch.float32, 3, poison=float("nan")
    )
    y = sgmv_shrink(x, A, segs, 2, variant=shrink_v)
    got = sgmv_expand(y, B, out.clone(), segs, QKV_A_SLICES, variant=expand_v)
    assert torch.isfinite(got).all()
    assert_close(
        got,
        sgmv_expand_ref(sgmv_shrink_ref(x, A, segs, 2), B, out, segs, QKV_A_SLICES),
        torch.float32,
    )


@pytest.mark.parametrize("variant", list(SHRINK_VARIANTS))
@pytest.mark.parametrize(
    ("popularity", "num_tokens"),
    # The CPU has 1 "SM": the default planned shrink aims at 8 items. The 60 tokens' 6
    # segments (both slices in one tile) store once each (no memset); one adapter's 10
    # tokens (1 segment) split K=300 and add partial sums into zeros.
    [("distinct", 60), ("identical", 10)],
)
def test_shrink_without_zeroing_leaves_only_unread_entries_unset(
    popularity, num_tokens, variant
) -> None:  # type: ignore[no-untyped-def]
    """`zero_unused=False` (the model's linear LoRA): y starts as NaN; its live entries equal
    the reference and the expand (which reads only those) too; the other entries stay NaN
    exactly when the launch stores each live entry once, else they are zeros."""
    segs, x, A, B, out = sgmv_case(popularity, num_tokens, 300, QKV_A_SLICES, 16, torch.float32, 8)
    y = torch.full((num_tokens, 32), float("nan"))
    sgmv_shrink(x, A, segs, 2, out=y, variant=variant, zero_unused=False)
    y_ref = sgmv_shrink_ref(x, A, segs, 2)
    slot = segs.token_slot[:num_tokens].long()
    live = live_rank_columns(segs.slot_rank, slot, 16).repeat(1, 2)  # [T, 32]
    assert (~live).any()
    assert_close(y[live], y_ref[live], torch.float32)
    plan = SHRINK_VARIANTS[variant]
    rank_programs = 1 if shrink_rank_tile(2, 16)[1] else 2  # qkv_a's slices in one tile
    if plan.planned:
        target = plan.programs_per_sm  # × 1 SM
        split = planned_split(segs.num_live_segments * rank_programs, target, cdiv(300, plan.block))
    else:
        split = plan_split_k(300, segs.num_live_segments * rank_programs)[2]
    if variant == "planned":  # both paths covered by the default variant
        assert split == (1 if popularity == "distinct" else 3)
    unread = y[~live]
    assert bool(unread.isnan().all() if split == 1 else (unread == 0).all())
    got = sgmv_expand(y, B, out.clone(), segs, QKV_A_SLICES)
    assert_close(got, sgmv_expand_ref(y_ref, B, out, segs, QKV_A_SLICES), torch.float32)


@pytest.mark.parametrize("half", ["q_a_only", "kv_a_only"])
def test_half_present_qkv_a_adapter_touches_only_its_half(half) -> None:  # type: ignore[no-untyped-def]
    """A q_a-only adapter stores zeros for the kv_a slice of A and B (and vice versa)."""
    segs, x, A, B, out = sgmv_case("identical", 9, 67, QKV_A_SLICES, 16, torch.float32, 4)
    absent = 1 if half == "q_a_only" else 0
    lo, hi = QKV_A_SLICES[absent], QKV_A_SLICES[absent + 1]
    A[:, absent * 16 : (absent + 1) * 16] = 0
    B[:, lo:hi] = 0
    got = sgmv_expand(sgmv_shrink(x, A, segs, 2), B, out.clone(), segs, QKV_A_SLICES)
    torch.testing.assert_close(got[:, lo:hi], out[:, lo:hi], atol=0, rtol=0)
    present = [c for c in range(QKV_A_SLICES[-1]) if not lo <= c < hi]
    assert (got[:, present] - out[:, present]).abs().amax() > 1e-3
    expected = out.double() + _dense_delta(x, A, B, segs, QKV_A_SLICES)
    assert_close(got, expected, torch.float32)


def test_long_steps_expand_with_the_wide_tiles_unless_told() -> None:
    assert expand_variant(1) == expand_variant(LONG_STEP_TOKENS - 1) == DEFAULT_VARIANT
    assert expand_variant(LONG_STEP_TOKENS) == expand_variant(8192) == LONG_STEP_EXPAND
    assert EXPAND_VARIANTS[LONG_STEP_EXPAND].block == 256
    assert EXPAND_VARIANTS[LONG_STEP_EXPAND].segments_per_item > 1


def test_reference_equals_dense_delta_in_fp64() -> None:
    segs, x, A, B, out = sgmv_case("distinct", 17, 29, QKV_A_SLICES, 8, torch.float64, 5)
    y = sgmv_shrink_ref(x, A, segs, 2)
    got = sgmv_expand_ref(y, B, out.clone(), segs, QKV_A_SLICES)
    expected = out + _dense_delta(x, A, B, segs, QKV_A_SLICES)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_preallocated_buffers_larger_than_the_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens=32, num_slots=3), "cpu")
    build_lora_segments([0, 0, 2, -1, 1], [3, 16, 7], out=segs)
    x = torch.randn(5, 40, generator=gen)
    A = pool_A([3, 16, 7], 1, 16, 40)
    B = pool_B([3, 16, 7], 24, 16)
    out = torch.zeros(5, 24)
    y = sgmv_shrink(x, A, segs)
    assert_close(y, sgmv_shrink_ref(x, A, segs), torch.float32)
    got = sgmv_expand(y, B, out.clone(), segs, [0, 24])
    assert_close(got, sgmv_expand_ref(y, B, out, segs, [0, 24]), torch.float32)


def test_launchers_reject_mismatched_shapes() -> None:
    segs = build_lora_segments([0, 0], [4])
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        sgmv_shrink(x, torch.randn(1, 16, 9), segs)
    with pytest.raises(ValueError, match="must be 3-D"):
        sgmv_shrink(x, torch.randn(1, 16, 8, dtype=torch.float16), segs)
    with pytest.raises(ValueError, match="segments describe"):
        sgmv_shrink(torch.randn(3, 8), torch.randn(1, 16, 8), segs)
    with pytest.raises(ValueError, match="span"):
        sgmv_expand(torch.zeros(2, 16), torch.randn(1, 10, 16), torch.zeros(2, 10), segs, [0, 9])


# ---- GPU (bf16, compiled) ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize(
    "num_tokens,in_dim,pool_rank,seg_len",
    [(1, 7168, 16, 16), (64, 7168, 64, 16), (300, 2048, 16, 16), (700, 2048, 16, 64)],
)
def test_sgmv_bf16_gpu(popularity, num_tokens, in_dim, pool_rank, seg_len, variants) -> None:  # type: ignore[no-untyped-def]
    slices = [0, 1536, 1536 + 576]
    segs, x, A, B, out = sgmv_case(
        popularity, num_tokens, in_dim, slices, pool_rank, torch.bfloat16, 7
    )
    segs = build_lora_segments(
        segs.token_slot[: segs.num_tokens].tolist(),
        segs.slot_rank,
        max_seg_len=seg_len,
        device="cuda",
    )
    x, A, B, out = (t.cuda() for t in (x, A, B, out))
    shrink_v, expand_v = variants
    y = sgmv_shrink(x, A, segs, 2, variant=shrink_v)
    y_ref = sgmv_shrink_ref(x.float(), A.float(), segs, 2)
    assert_close(y, y_ref, torch.bfloat16)
    expected = sgmv_expand_ref(y_ref, B.float(), out.float(), segs, slices)
    got = sgmv_expand(y, B, out, segs, slices, variant=expand_v)
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(EXPAND_VARIANTS))
@pytest.mark.parametrize("num_tokens,pool_rank", [(64, 16), (256, 64)])
def test_expand_of_a_carried_product_bf16_gpu(num_tokens, pool_rank, variant) -> None:  # type: ignore[no-untyped-def]
    """`y_every_slot` compiled, in bf16: one cuBLAS product x · [W; A_0; …]ᵀ (qkv_a's
    slices at V2-Lite's width) gives the base output and every slot's shrink, and the
    expand adds each token's own slot's, as the separate shrink and expand do."""
    slices = [0, 1536, 1536 + 576]
    segs, x, A, B, _ = sgmv_case("distinct", num_tokens, 2048, slices, pool_rank, torch.bfloat16, 9)
    segs = build_lora_segments(segs.token_slot[:num_tokens].tolist(), segs.slot_rank, device="cuda")
    x, A, B = (t.cuda() for t in (x, A, B))
    weight = torch.randn(slices[-1], 2048, dtype=torch.bfloat16, device="cuda") / 2048**0.5
    product = x @ torch.cat([weight, A.flatten(0, 1)]).T  # [T, N + S·2R]
    base = product[:, : slices[-1]]
    expected = sgmv_expand_ref(
        sgmv_shrink_ref(x.float(), A.float(), segs, 2), B.float(), base.float(), segs, slices
    )
    sgmv_expand(product[:, slices[-1] :], B, base, segs, slices, variant=variant,
                y_every_slot=True)  # fmt: skip
    assert_close(base, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("variants", VARIANTS, ids="-".join)
@pytest.mark.parametrize("capture_slots", ["one", "many"])
def test_cuda_graph_replay_with_other_segments_than_at_capture(variants, capture_slots) -> None:  # type: ignore[no-untyped-def]
    """Captured with one segment and replayed with many (the planned split must grow
    shorter), and captured with many and replayed with one (it must grow longer)."""
    gen = torch.Generator().manual_seed(8)
    num_slots, pool_rank, hidden, max_tokens = 8, 16, 1024, 64
    ranks = mixed_ranks(num_slots, pool_rank, gen)
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens, num_slots), "cuda")
    A = pool_A(ranks, 1, pool_rank, hidden).to("cuda", torch.bfloat16)
    B = pool_B(ranks, hidden, pool_rank).to("cuda", torch.bfloat16)
    x = torch.randn(max_tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    out = torch.zeros(max_tokens, hidden, device="cuda", dtype=torch.bfloat16)

    shrink_v, expand_v = variants

    def step() -> None:
        out.zero_()
        y = sgmv_shrink(x, A, segs, variant=shrink_v)
        sgmv_expand(y, B, out, segs, [0, hidden], variant=expand_v)

    many = sorted(popular_slots("distinct", max_tokens, num_slots, gen))
    one = [1] * max_tokens
    capture, replay = (one, many) if capture_slots == "one" else (many, one)
    captured_segments = build_lora_segments(capture, ranks, out=segs).num_live_segments
    for _ in range(2):  # compile outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    build_lora_segments(replay, ranks, out=segs)
    assert segs.num_live_segments != captured_segments
    graph.replay()
    torch.cuda.synchronize()
    expected = sgmv_expand_ref(
        sgmv_shrink_ref(x.float(), A.float(), segs),
        B.float(),
        torch.zeros_like(out, dtype=torch.float32),
        segs,
        [0, hidden],
    )
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("pool_rank", [12, 20, 40])
def test_stacked_slices_with_padding_rows_read_and_write_only_their_own(pool_rank) -> None:  # type: ignore[no-untyped-def]
    """Two slices of a pool rank whose S·R (24, 40) is not a power of two share one shrink
    tile of 32 / 64 rows: the padding rows must neither read the next slot's A nor write
    past y's S·R columns (y is one buffer, so a stray column lands in the next token's row).
    At 40 (S·R = 80) the slices take a tile each. NaN past each slot's rank in A."""
    segs, x, A, B, out = sgmv_case("zipf", 29, 67, QKV_A_SLICES, pool_rank, torch.float32, 9,
                                   poison=float("nan"))  # fmt: skip
    assert shrink_rank_tile(2, pool_rank)[1] == (2 if pool_rank < 40 else 0)
    y = sgmv_shrink(x, A, segs, 2)
    assert_close(y, sgmv_shrink_ref(x, A, segs, 2), torch.float32)
    got = sgmv_expand(y, B, out.clone(), segs, QKV_A_SLICES)
    y_ref = sgmv_shrink_ref(x, A, segs, 2)
    assert_close(got, sgmv_expand_ref(y_ref, B, out, segs, QKV_A_SLICES), torch.float32)
