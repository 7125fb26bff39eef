"""Fused-MoE stages: alignment invariants, and each Triton stage against its reference."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe as fm
from kernels.fp8 import block_quant_ref
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
# bf16 loads are wrong in the interpreter: bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def routing(tokens: int, experts: int, top_k: int, pattern: str, seed: int = 0):
    """topk_ids [T, k] (distinct per token) and weights for a popularity pattern."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "one_expert_per_slot":  # every token's j-th choice is expert j
        ids = torch.arange(top_k).repeat(tokens, 1)
    elif pattern == "skewed":  # experts [0, k+1) only: most experts empty
        few = min(top_k + 1, experts)
        ids = torch.stack([torch.randperm(few, generator=g)[:top_k] for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return ids, weights


PATTERNS = ["uniform", "skewed", "one_expert_per_slot"]


ALIGNERS = {"triton": fm.moe_align, "torch": fm.moe_align_ref}
ALIGN_FIELDS = ("sorted_pair_ids", "block_expert_ids", "expert_offsets", "expert_counts")


@pytest.mark.parametrize("aligner", sorted(ALIGNERS))
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m", [(1, 8, 2, 16), (37, 12, 3, 16), (5, 4, 4, 32), (9, 64, 6, 64)]
)
def test_align_invariants(aligner, pattern, tokens, experts, top_k, block_m):
    ids, _ = routing(tokens, experts, top_k, pattern)
    align = ALIGNERS[aligner](ids.to(DEVICE), experts, block_m)
    align = fm.MoEAlignment(
        *(t.cpu() for t in (align.sorted_pair_ids, align.block_expert_ids,
                            align.expert_offsets, align.expert_counts)),
        align.block_m, align.num_pairs,
    )  # fmt: skip
    pairs = tokens * top_k
    sorted_ids = align.sorted_pair_ids.long()
    offsets = align.expert_offsets.long().tolist()
    counts = align.expert_counts.tolist()
    assert counts == torch.bincount(ids.flatten(), minlength=experts).tolist()
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs)), "each pair exactly once"
    assert sorted_ids.numel() == fm.max_padded_pairs(pairs, experts, block_m)
    assert offsets[-1] <= sorted_ids.numel()
    flat = ids.flatten()
    for e in range(experts):
        run = sorted_ids[offsets[e] : offsets[e + 1]]
        assert (offsets[e + 1] - offsets[e]) % block_m == 0
        assert run[: counts[e]].tolist() == sorted(run[: counts[e]].tolist()), "stable order"
        assert (flat[run[: counts[e]]] == e).all()
        assert (run[counts[e] :] == pairs).all(), "padding holds the sentinel"
    tile_experts = align.block_expert_ids.long()
    for tile, expert in enumerate(tile_experts.tolist()):
        start = tile * block_m
        if expert < 0:
            assert start >= offsets[-1]
        else:
            assert offsets[expert] <= start < offsets[expert + 1]


def assert_align_equals_ref(ids, experts, block_m):
    """Every output of the Triton alignment equal to the torch ops' (dtype included), with
    int64 and int32 ids as input."""
    for dtype in (torch.int64, torch.int32):
        ours = fm.moe_align(ids.to(dtype).to(DEVICE), experts, block_m)
        ref = fm.moe_align_ref(ids, experts, block_m)
        for name in ALIGN_FIELDS:
            got, want = getattr(ours, name).cpu(), getattr(ref, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(3, 8, 2, 16), (64, 64, 6, 16)])
def test_triton_align_equals_ref_exactly(pattern, tokens, experts, top_k, block_m):
    """Every output tensor equal, sentinels and -1 tiles included (int32 ids as input too)."""
    ids, _ = routing(tokens, experts, top_k, pattern, seed=tokens)
    assert_align_equals_ref(ids, experts, block_m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "tokens,experts,top_k",
    [(1, 64, 6), (256, 64, 6), (512, 256, 8), (700, 64, 6), (8192, 64, 6), (8300, 256, 8)],
)
def test_triton_align_equals_ref_on_gpu(tokens, experts, top_k):
    """V2-Lite and V3 on CUDA: decode-sized batches (one program) and prefill-sized steps
    (the chunked path)."""
    ids, _ = routing(tokens, experts, top_k, "uniform", seed=tokens)
    ids = ids.cuda()
    block_m = fm.moe_block_m(ids.numel(), experts)
    ours, ref = fm.moe_align(ids, experts, block_m), fm.moe_align_ref(ids, experts, block_m)
    for name in ALIGN_FIELDS:
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "one_expert"])
@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m", [(33, 8, 2, 16), (100, 8, 2, 64), (70, 12, 3, 32)]
)
def test_chunked_align_equals_ref_exactly(monkeypatch, pattern, tokens, experts, top_k, block_m):
    """Above one program's pairs the alignment runs in chunks (made small here: 64 pairs,
    so 2-5 chunks whose last one is partial); every output equals the torch ops'."""
    monkeypatch.setattr(fm, "MAX_SINGLE_PROGRAM_PAIRS", 64)
    monkeypatch.setattr(fm, "ALIGN_DECODE_CHUNK_PAIRS", 64)
    monkeypatch.setattr(fm, "ALIGN_MAX_CHUNK_PAIRS", 64)
    ids, _ = routing(tokens, experts, top_k, pattern, seed=tokens)
    assert_align_equals_ref(ids, experts, block_m)


def test_chunks_grow_to_fit_the_offsets_program_then_torch_ops(monkeypatch):
    # V2-Lite (64 experts: 128 bins, 128 chunks) and V3 (256 experts: 512 bins, 32 chunks).
    assert fm._align_chunk(8192 * 6, 64) == 1024
    assert fm._align_chunk(8192 * 8, 256) == 2048
    assert fm._align_chunk(32 * 4096 + 1, 256) is None
    # Decode batches past one program: 512-pair chunks (V2-Lite B=256: three).
    assert fm._align_chunk(256 * 6, 64) == 512
    assert 256 * 6 > fm.MAX_SINGLE_PROGRAM_PAIRS >= 64 * 6
    monkeypatch.setattr(fm, "MAX_SINGLE_PROGRAM_PAIRS", 16)
    monkeypatch.setattr(fm, "ALIGN_DECODE_CHUNK_PAIRS", 8)
    monkeypatch.setattr(fm, "ALIGN_MAX_CHUNK_PAIRS", 16)
    monkeypatch.setattr(fm, "ALIGN_CELLS", 32)  # 16 bins for 8 experts: 2 chunks at most
    assert fm._align_chunk(30, 8) == 16
    ids, _ = routing(17, 8, 2, "uniform")  # 34 pairs: 3 chunks even of 16
    launched = []
    monkeypatch.setattr(fm, "_moe_align_chunked", lambda *args: launched.append(args))
    ours, ref = fm.moe_align(ids, 8, 16), fm.moe_align_ref(ids, 8, 16)
    assert not launched
    assert torch.equal(ours.sorted_pair_ids, ref.sorted_pair_ids)


def test_block_m_grows_with_pairs_per_expert():
    # V2-Lite decode (64 experts, top-6): one 16-row tile per expert up to B=64.
    assert [fm.moe_block_m(b * 6, 64) for b in (1, 8, 64, 128, 256)] == [16, 16, 16, 32, 64]
    assert fm.moe_block_m(256 * 8, 256) == 16  # V3 decode B=256: 8 pairs per expert
    # FP8 block-scaled experts take half the row tile at decode batches only.
    fp8 = [fm.moe_block_m(b * 6, 64, "block") for b in (1, 64, 128, 256, 512)]
    assert fp8 == [16, 16, 16, 32, 64]
    assert fm.moe_block_m(256 * 6, 64, "w8a8") == 64
    # Prefill: 64 rows up to ~85 pairs per expert, then 128 (with the long-prefill tiles).
    assert [fm.moe_block_m(t * 6, 64) for t in (512, 900, 911, 8192)] == [64, 64, 128, 128]
    # Long prefills: each scheme's plan per GEMM with the MoE LoRA epilogue, and without it
    # where a plan of its own measured faster.
    for scheme, plans in fm.PREFILL_TILES.items():
        for role in fm.GEMM_ROLES:
            assert fm.default_tiles(128, scheme, role, with_lora=True) == plans[role]
            without = fm.PREFILL_TILES_WITHOUT_LORA.get(scheme, {}).get(role, plans[role])
            assert fm.default_tiles(128, scheme, role) == without
    # FP8's gate_up: 256-wide column tiles halve the epilogues; 128-wide without them.
    assert fm.default_tiles(128, "block", with_lora=True).block_n == 256
    assert fm.default_tiles(128, "block").block_n == 128
    assert fm.default_tiles(128, "block", "down") == fm.default_tiles(128, "block", "down", True)
    assert fm.default_tiles(128, "float") == fm.default_tiles(128, "float", with_lora=True)
    assert fm.default_tiles(64, "block") == fm.default_tiles(64, "block", with_lora=True)
    with pytest.raises(ValueError, match="role 'up'"):
        fm.default_tiles(128, "float", "up")
    assert fm.default_tiles(64, "float") == fm.default_tiles(128, "w8a8") == fm.GemmTiles()
    # Decode row tiles take the per-scheme plans measured faster, others the default.
    assert fm.default_tiles(16, "block") == fm.DECODE_TILES["block"][16]
    assert fm.default_tiles(32, "float").block_k == 128
    assert fm.default_tiles(16, "w8a8") == fm.default_tiles(16, "int4_group") == fm.GemmTiles()
    # e4m3 activations: FP8's row tiles, their own prefill and decode plans.
    a8 = [fm.moe_block_m(b * 6, 64, "block_a8") for b in (1, 64, 128, 256, 512)]
    assert a8 == fp8
    a8_plan, fp8_lora_plan = (
        fm.default_tiles(128, "block_a8"),
        fm.default_tiles(128, "block", "gate_up", True),
    )
    assert a8_plan.block_n < fp8_lora_plan.block_n
    assert fm.default_tiles(16, "block_a8") == fm.DECODE_TILES["block_a8"][16]


def make_experts(experts, n, k, dtype, seed, fp8_block=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, n, k, generator=g) * 0.2
    if fp8_block is None:
        return w.to(dtype), None
    quantized = [block_quant_ref(w[e], fp8_block) for e in range(experts)]
    return torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("fp8_block", [None, (16, 32)])
@pytest.mark.parametrize("block_m", [16, 128])  # decode tiles; long-prefill tiles
def test_grouped_gemm_matches_ref(dtype, pattern, fp8_block, block_m):
    tokens, experts, top_k, hidden, inter = 19, 8, 2, 64, 48
    ids, _ = routing(tokens, experts, top_k, pattern, seed=1)
    align = fm.moe_align(ids.to(DEVICE), experts, block_m)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    w13, s13 = make_experts(experts, 2 * inter, hidden, dtype, 3, fp8_block)
    gate_up = fm.grouped_gemm(x.to(DEVICE), w13.to(DEVICE), align, top_k,
                              None if s13 is None else s13.to(DEVICE), fp8_block)  # fmt: skip
    align_cpu = fm.moe_align_ref(ids, experts, block_m)
    ref = fm.grouped_gemm_ref(x.float(), w13, align_cpu, top_k, s13, fp8_block)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(gate_up.float().cpu(), ref, atol=atol, rtol=rtol)

    # Down projection: rows are pairs (rows_per_a = 1).
    act = fm.silu_mul_ref(ref).to(dtype)
    w2, s2 = make_experts(experts, hidden, inter, dtype, 4, fp8_block)
    s2_dev = None if s2 is None else s2.to(DEVICE)
    down = fm.grouped_gemm(act.to(DEVICE), w2.to(DEVICE), align, 1, s2_dev, fp8_block, role="down")
    down_ref = fm.grouped_gemm_ref(act.float(), w2, align_cpu, 1, s2, fp8_block, role="down")
    torch.testing.assert_close(down.float().cpu(), down_ref, atol=atol * 4, rtol=rtol * 4)


def record_default_tiles(monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """The plans `fm.default_tiles` returns from here on, in call order."""
    plans = []
    default_tiles = fm.default_tiles

    def recorded(*args):  # type: ignore[no-untyped-def]
        plans.append(default_tiles(*args))
        return plans[-1]

    monkeypatch.setattr(fm, "default_tiles", recorded)
    return plans


def test_long_prefill_without_lora_takes_its_own_plan(monkeypatch):
    """A GEMM without the MoE LoRA epilogue asks `default_tiles` for the plan without it
    (FP8's gate_up: 128-wide column tiles), and computes the same product with it."""
    default_tiles = fm.default_tiles
    plans = record_default_tiles(monkeypatch)
    ids, _ = routing(21, 8, 2, "uniform", seed=3)
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(4))
    w, scale = make_experts(8, 96, 64, torch.float32, 5, (16, 32))
    align = fm.moe_align(ids.to(DEVICE), 8, 128)
    ours = fm.grouped_gemm(x.to(DEVICE), w.to(DEVICE), align, 2, scale.to(DEVICE), (16, 32))
    assert plans == [default_tiles(128, "block", "gate_up", False)]
    assert plans[0] != default_tiles(128, "block", "gate_up", True)
    ref = fm.grouped_gemm_ref(x, w, fm.moe_align_ref(ids, 8, 128), 2, scale, (16, 32))
    atol, rtol = TOLERANCE[torch.float32]
    torch.testing.assert_close(ours.float().cpu(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(7, 48), (1, 1000), (0, 16)])
def test_silu_mul_matches_ref(dtype, rows, inter):
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    ours = fm.silu_mul(x.to(DEVICE)).cpu()
    torch.testing.assert_close(ours.float(), fm.silu_mul_ref(x).float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,hidden", [(9, 3, 40), (1, 8, 1100)])
def test_combine_matches_ref(dtype, tokens, top_k, hidden):
    g = torch.Generator().manual_seed(tokens)
    y = torch.randn(tokens * top_k, hidden, generator=g).to(dtype)
    w = torch.rand(tokens, top_k, generator=g)
    ours = fm.moe_combine(y.to(DEVICE), w.to(DEVICE)).cpu()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), fm.moe_combine_ref(y, w).float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_staged_refs_equal_per_expert_loop(pattern):
    """align → gemm → silu·mul → gemm → combine equals the independent per-expert loop."""
    tokens, experts, top_k, hidden, inter = 23, 8, 3, 32, 24
    ids, weights = routing(tokens, experts, top_k, pattern, seed=5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6))
    w13, _ = make_experts(experts, 2 * inter, hidden, torch.float32, 7)
    w2, _ = make_experts(experts, hidden, inter, torch.float32, 8)
    align = fm.moe_align_ref(ids, experts, 16)
    act = fm.silu_mul_ref(fm.grouped_gemm_ref(x, w13, align, top_k))
    staged = fm.moe_combine_ref(fm.grouped_gemm_ref(act, w2, align, 1), weights)
    direct = fm.fused_moe_ref(x, w13, w2, ids, weights)
    torch.testing.assert_close(staged, direct, atol=1e-5, rtol=1e-5)
