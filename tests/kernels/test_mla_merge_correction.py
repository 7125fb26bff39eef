"""kv_b's absorbed output correction written by the MLA decode's split merge
(`kernels.mla_lora.OutputCorrection`) against `mla_decode_ref` + `mla_kv_b_lora_o_ref`.

The merge writes o = (o_lat · A[slot]ᵀ) · B_v[slot, h]ᵀ over whatever o held (zeros for
tokens without the adapter) from the o_lat row it has just rounded; the caller then adds
o_lat · W_UVᵀ onto it. Runs under the interpreter on the CPU and compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels import mla_attention as mla
from kernels import mla_decode_v3 as v3
from kernels.lora_segments import build_lora_segments
from kernels.mla_lora import OutputCorrection, mla_kv_b_lora_o_ref
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    pool_A,
    pool_B,
    popular_slots,
)
from tests.kernels.test_mla_decode_v3 import decode_inputs

DEVICE = kernel_device()


def _case(popularity, heads, nope, v_dim, latent, pool_rank, lens, dtype, seed, poison=0.0):  # type: ignore[no-untyped-def]
    """Decode inputs of len(lens) sequences, a 5-slot kv_b pool with mixed ranks, and the
    sequences' slots, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    inputs = decode_inputs(heads, latent, 16, 16, lens, dtype, seed)
    ranks = mixed_ranks(5, pool_rank, gen)
    slots = popular_slots(popularity, len(lens), 5, gen)
    segs = build_lora_segments(slots, ranks, device=DEVICE)
    A = pool_A(ranks, 1, pool_rank, latent, poison).to(DEVICE, dtype)  # [slots, R, C]
    B = pool_B(ranks, heads * (nope + v_dim), pool_rank, poison).to(DEVICE, dtype)
    return tuple(t.to(DEVICE) for t in inputs), segs, A, B


def _check(inputs, segs, A, B, v_dim, dtype, **decode_kwargs) -> None:  # type: ignore[no-untyped-def]
    heads, latent = inputs[0].shape[1:]
    scale = latent**-0.5
    # NaN where o starts: every row must be written, base tokens' with zeros.
    o = torch.full((len(segs.token_slot[: inputs[0].shape[0]]), heads, v_dim), float("nan"))
    o = o.to(DEVICE, dtype)
    plain = mla.mla_decode(*inputs, scale, **decode_kwargs)
    o_lat = mla.mla_decode(
        *inputs, scale, correction=OutputCorrection(o, A, B, segs), **decode_kwargs
    )
    if inputs[0].shape[0] * heads >= mla.MERGE_MIN_PROGRAMS:
        assert torch.equal(o_lat, plain), "the correction changed the merged o_lat"
    else:  # whole rows instead of column blocks: the splits sum in another order
        assert_close(o_lat, plain, dtype)
    expected = mla_kv_b_lora_o_ref(
        o_lat.float(), torch.zeros_like(o, dtype=torch.float32), A.float(), B.float(), segs
    )
    assert_close(o, expected, dtype)
    base = segs.token_slot[: o.shape[0]] == -1
    assert torch.equal(o[base].float(), torch.zeros_like(o[base].float()))


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", mla.MLA_DECODE_VARIANTS)
def test_merge_writes_the_output_correction(popularity, dtype, variant) -> None:  # type: ignore[no-untyped-def]
    """Odd sizes: 3 heads, V 20, C 48 (a masked column tail in the 64-wide row), 11
    sequences (one with no context), pool rank 16 with slots below it and an empty one."""
    lens = [5, 0, 17, 33, 1, 9, 16, 2, 40, 7, 3]
    inputs, segs, A, B = _case(popularity, 3, 24, 20, 48, 16, lens, dtype, seed=3)
    _check(inputs, segs, A, B, 20, dtype, variant=variant, num_splits=3)


@pytest.mark.parametrize("pool_rank", [40, 20, 64])
def test_ranks_past_one_chunk_and_never_past_a_slot_rank(pool_rank) -> None:  # type: ignore[no-untyped-def]
    """Pool ranks over the 16-row chunk (20: not a multiple of the vector width), NaN in
    the pool past each slot's rank: a read past it would reach the result."""
    lens = [12, 30, 7, 19, 1, 25]
    inputs, segs, A, B = _case(
        "distinct", 4, 16, 24, 64, pool_rank, lens, torch.float32, 5, poison=float("nan")
    )
    _check(inputs, segs, A, B, 24, torch.float32, variant="v3", num_splits=2)


def test_whole_rows_at_small_batches() -> None:
    """Few programs make the merge cut rows into column blocks; with the correction it
    takes whole rows (C 512 here, over MERGE_NARROW_BLOCK_C)."""
    inputs, segs, A, B = _case("zipf", 2, 16, 16, 512, 16, [9, 20], torch.float32, 7)
    assert mla.MERGE_MIN_PROGRAMS > 2 * 2 and mla.MERGE_NARROW_BLOCK_C < 512
    _check(inputs, segs, A, B, 16, torch.float32, variant="v3", num_splits=4)


def test_refused_where_the_decode_has_no_merge() -> None:
    inputs, segs, A, B = _case("distinct", 3, 8, 8, 32, 16, [4, 4], torch.float32, 9)
    o = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="no merge"):
        mla.mla_decode(
            *inputs, 0.1, variant="v3", num_splits=1, correction=OutputCorrection(o, A, B, segs)
        )
    with pytest.raises(ValueError, match="does not fit"):
        mla.mla_decode(
            *inputs, 0.1, variant="v3", num_splits=2,
            correction=OutputCorrection(torch.zeros(2, 3, 40, device=DEVICE), A, B, segs),
        )  # fmt: skip


def test_decode_merges_follows_the_split_rule() -> None:
    """V2-Lite's 16 heads (v3): split, and so merged, until a batch fills the GPU with one
    split; DeepSeek-V3's 128 heads (v2) always merge."""
    one_split = v3.TARGET_PROGRAMS // 2 + 1
    assert mla.decode_merges(64, 16, 512)
    assert not mla.decode_merges(one_split, 16, 512)
    assert mla.decode_merges(one_split, 128, 512)


# ---- GPU (bf16, compiled) ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize(
    "heads,pool_rank,batch", [(16, 16, 64), (16, 64, 17), (128, 16, 8), (16, 16, 2)]
)
def test_merge_correction_bf16_gpu(popularity, heads, pool_rank, batch) -> None:  # type: ignore[no-untyped-def]
    """V2-Lite (16 heads) and DeepSeek-V3 (128) head shapes, C 512, V 128, with the
    default variant and split count (`decode_merges`)."""
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 700, (batch,), generator=gen).tolist()
    inputs, segs, A, B = _case(
        popularity, heads, 128, 128, 512, pool_rank, lens, torch.bfloat16, batch
    )
    assert mla.decode_merges(batch, heads, 512)
    _check(inputs, segs, A, B, 128, torch.bfloat16)
