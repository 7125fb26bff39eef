"""The v3 absorbed MLA decode (`kernels/mla_decode_v3.py`) against `mla_decode_ref`."""

from __future__ import annotations

import pytest
import torch

from kernels import mla_attention as mla
from kernels import mla_decode_v3 as v3
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.test_mla_attention import DTYPES, TOLERANCE, paged_cache

DEVICE = kernel_device()


def decode_inputs(heads, latent, rope, page_size, lens, dtype, seed):
    """q_lat, q_rope, pool, page table (shuffled pages), context lengths; on the CPU."""
    g = torch.Generator().manual_seed(seed)
    pool, table = paged_cache([max(n, 1) for n in lens], page_size, latent + rope, dtype, seed)
    q_lat = torch.randn(len(lens), heads, latent, generator=g).to(dtype)
    q_rope = torch.randn(len(lens), heads, rope, generator=g).to(dtype)
    return q_lat, q_rope, pool, table, torch.tensor(lens, dtype=torch.int32)


def check_against_ref(inputs, scale, dtype, **kwargs) -> torch.Tensor:
    q_lat, q_rope, pool, table, ctx = inputs
    ours = mla.mla_decode(*(t.to(DEVICE) for t in inputs), scale, variant="v3", **kwargs)
    ref = mla.mla_decode_ref(q_lat.float(), q_rope.float(), pool.float(), table, ctx, scale)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float().cpu(), ref, atol=atol, rtol=rtol)
    return ours


# (heads, latent C, rope R, page size, context lens, plan (BLOCK_H, BLOCK_T, BLOCK_CV), splits)
# Small C stands in for 512 so the interpreter stays fast; BLOCK_CV < C exercises the split
# of the output columns, splits None the launch-shape rule (here: many splits, most empty).
CASES = [
    (16, 64, 16, 16, [1, 15, 17, 1000], (16, 32, 32), None),
    (16, 64, 16, 8, [37, 9], (16, 16, 16), 2),  # 4 column blocks
    (20, 48, 16, 16, [0, 33, 5], (16, 16, 32), 3),  # partial head block, C tail, context 0
    (20, 48, 16, 16, [0, 33, 5], (16, 16, 64), 1),  # one launch, whole C in one block
    (128, 64, 16, 16, [3, 70], (64, 32, 32), 2),
    (128, 64, 16, 16, [17, 1], (64, 16, 32), 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,latent,rope,page_size,lens,plan,splits", CASES)
def test_v3_matches_ref(dtype, heads, latent, rope, page_size, lens, plan, splits):
    inputs = decode_inputs(heads, latent, rope, page_size, lens, dtype, seed=heads + latent)
    config = v3.tile_plan(*plan, warps=4, stages=2)
    check_against_ref(inputs, (latent + rope) ** -0.5, dtype, config=config, num_splits=splits)


@pytest.mark.parametrize("name", list(v3.MLA_DECODE_V3_CONFIGS))
@pytest.mark.parametrize("splits", [1, 3])
def test_each_v3_plan_matches_ref_at_deepseek_width(name, splits):
    """The bench's plans at C = 512, R = 64 (DeepSeek), partial token tiles included."""
    heads = 16 if name.startswith("h16") else 128
    inputs = decode_inputs(heads, 512, 64, 16, [1, 40, 17], torch.float32, seed=splits)
    config = v3.MLA_DECODE_V3_CONFIGS[name]
    check_against_ref(inputs, 0.05, torch.float32, config=config, num_splits=splits)


@pytest.mark.parametrize("splits", [64, 37, 13])
def test_merge_of_many_splits_over_several_column_blocks(splits):
    """Batch 1's plan: 64 splits (most of them empty for a short context) in one tile, 37 in
    a partly masked one, and 13 in chunks of MERGE_SPLIT_CHUNK with the last one partial, merged by
    programs of MERGE_NARROW_BLOCK_C latent columns (2 × 16 heads is below
    MERGE_MIN_PROGRAMS)."""
    inputs = decode_inputs(16, 512, 64, 16, [700, 3], torch.float32, seed=splits)
    assert mla.MERGE_MIN_PROGRAMS > 2 * 16 and mla.MERGE_NARROW_BLOCK_C < 512
    assert 64 >= mla.MERGE_WHOLE_TILE_MIN_SPLITS > 13 > mla.MERGE_SPLIT_CHUNK  # both paths
    config = v3.MLA_DECODE_V3_CONFIGS["h16_t32"]
    check_against_ref(inputs, 0.05, torch.float32, config=config, num_splits=splits)


@pytest.mark.parametrize("variant", mla.MLA_DECODE_VARIANTS)
@pytest.mark.parametrize("splits", [1, 4])
def test_rows_without_context_give_zero(variant, splits):
    """A sequence with context 0 attends to nothing: o_lat = 0 as in the reference, not the
    NaN of a 0/0 merge (nor of the empty splits' unwritten partials), and its neighbours
    are unaffected."""
    inputs = decode_inputs(16, 32, 16, 4, [0, 9, 0], torch.float32, seed=splits)
    ours = mla.mla_decode(*(t.to(DEVICE) for t in inputs), 0.2, num_splits=splits, variant=variant)
    ref = mla.mla_decode_ref(*inputs, 0.2)
    assert torch.equal(ours[0].cpu(), torch.zeros_like(ref[0]))
    torch.testing.assert_close(ours.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [5, 40])
def test_merge_never_reads_the_partials_of_empty_splits(splits):
    """Empty splits (lse −inf) leave their partials unwritten: NaN there must not reach
    o_lat. Both merge paths (chunks of MERGE_SPLIT_CHUNK, one whole tile)."""
    g = torch.Generator().manual_seed(splits)
    o_part = torch.randn(2, 3, splits, 24, generator=g)
    lse = torch.randn(2, 3, splits, generator=g)
    empty = torch.rand(2, 3, splits, generator=g) < 0.5
    empty[0, 0] = True  # a row with no tokens at all: o_lat 0
    lse[empty] = float("-inf")
    o_part[empty] = float("nan")
    out = torch.full((2, 3, 24), 7.0)
    ours = out.to(DEVICE)
    mla.merge_splits(o_part.to(DEVICE), lse.to(DEVICE), ours)
    weights = torch.where(empty, 0.0, (lse - lse.amax(-1, keepdim=True)).exp())  # [B, H, s]
    live = torch.where(empty[..., None], 0.0, o_part)
    total = weights.sum(-1, keepdim=True)
    expected = (weights[..., None] * live).sum(-2) / torch.where(total > 0, total, 1.0)
    assert not ours.isnan().any()
    assert torch.equal(ours[0, 0].cpu(), torch.zeros(24))
    torch.testing.assert_close(ours.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_unknown_variant_is_refused():
    inputs = decode_inputs(4, 32, 16, 4, [3], torch.float32, seed=0)
    with pytest.raises(ValueError, match="v7"):
        mla.mla_decode(*inputs, 0.2, variant="v7")


@pytest.mark.parametrize("heads,batch", [(16, 1), (16, 64), (16, 256), (128, 1), (128, 64)])
def test_split_rule_fills_the_gpu_without_exceeding_the_target(heads, batch):
    """Splits depend on the launch shape only; a batch that already gives ≥ the target
    program count gets one split (no merge launch); smaller ones get up to the target,
    within the per-sequence budget of fp32 partials."""
    config = v3.default_v3_config(heads)
    per_split = v3.v3_programs_per_split(batch, heads, 512, config)
    splits = v3.v3_num_splits(batch, heads, 512, config)
    if per_split >= v3.TARGET_PROGRAMS:
        assert splits == 1
    else:
        assert per_split * splits <= v3.TARGET_PROGRAMS
        cap = v3.v3_max_splits(heads, 512)
        assert splits == cap or per_split * (splits + 1) > v3.TARGET_PROGRAMS
        assert heads * splits * 512 * 4 <= v3.PARTIAL_BYTES_PER_SEQUENCE


def test_default_plans_use_wgmma_sized_head_tiles_for_many_heads():
    assert v3.default_v3_config(16).kwargs["BLOCK_H"] == 16
    assert v3.default_v3_config(128).kwargs["BLOCK_H"] == 64


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("name", [None, *v3.MLA_DECODE_V3_CONFIGS])
def test_v3_bf16_on_gpu_and_under_cuda_graph_replay(heads, name):
    """bf16 at DeepSeek widths for each plan (None: the default), then the same launch
    captured in a CUDA graph and replayed on new contents and lengths of the same batch."""
    lens = [300, 17, 64, 1025, 2, 513, 700, 31]
    inputs = decode_inputs(heads, 512, 64, 16, lens, torch.bfloat16, seed=heads)
    config = v3.MLA_DECODE_V3_CONFIGS[name] if name else None
    scale = (128 + 64) ** -0.5
    check_against_ref(inputs, scale, torch.bfloat16, config=config)

    static = [t.cuda() for t in inputs]
    mla.mla_decode(*static, scale, config=config, variant="v3")  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla.mla_decode(*static, scale, config=config, variant="v3")
    # New cache and query contents, new lengths (within each sequence's pages), same batch.
    g = torch.Generator().manual_seed(7)
    q_lat, q_rope, pool, table, _ = (t.clone() for t in inputs)
    for t in (q_lat, q_rope, pool):
        t.copy_(torch.randn(t.shape, generator=g))
    ctx = torch.tensor(
        [min(n, m) for n, m in zip(lens, [1, 1, 5, 1025, 2, 3, 640, 16], strict=True)]
    )
    ctx = ctx.to(torch.int32)
    for buffer, value in zip(static, (q_lat, q_rope, pool, table, ctx), strict=True):
        buffer.copy_(value)
    graph.replay()
    ref = mla.mla_decode_ref(q_lat.float(), q_rope.float(), pool.float(), table, ctx, scale)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,expected", [(16, "v3"), (20, "v3"), (32, "v3"), (128, "v2")])
def test_default_variant_follows_the_head_count(heads, expected):
    """v3 where it measured faster (≤ 32 heads), v2 for V3 / Kimi-K2's 128 heads."""
    assert mla.default_decode_variant(heads) == expected
