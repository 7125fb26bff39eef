"""MoE LoRA inside the grouped GEMM (`grouped_gemm(lora=moe_lora_epilogue(...))`): the
fused tile equals the base GEMM followed by the separate LoRA reference, for gate_up
(tokens, two slices, column tiles straddling gate | up) and down (pairs), mixed ranks,
shared-outer layouts, FP8 block-scaled experts and every adapter popularity."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe as fm
from kernels import moe_lora
from kernels.lora_segments import build_lora_segments
from kernels.moe_lora import (
    NO_KEY,
    MoeLoraEpilogue,
    moe_lora_down_ref,
    moe_lora_epilogue,
    moe_lora_epilogue_ref,
    moe_lora_gate_up_ref,
    shrink_keys,
    sorted_row_slots,
)
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.lora_cases import POPULARITIES, assert_close, mixed_ranks, popular_slots
from tests.kernels.test_fused_moe import make_experts, record_default_tiles, routing
from tests.kernels.test_quant_moe import quantize_experts

DEVICE = kernel_device()
# bf16 loads are wrong in the interpreter: bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOKENS, EXPERTS, TOP_K, HIDDEN, INTER, SLOTS = 21, 6, 2, 64, 24, 5


def _pool(ranks, experts, rows, cols, dtype, gen):  # type: ignore[no-untyped-def]
    """[slots, experts, rows, cols] with each slot's dead rank rows/columns zero (as the
    pool keeps them); rank is dim 2 for A (rows = S·R) and dim 3 for B (cols = R)."""
    return torch.randn(len(ranks), experts, rows, cols, generator=gen).to(dtype) / cols**0.5


def _zero_dead_ranks(A, B, ranks, pool_rank, slices):  # type: ignore[no-untyped-def]
    live = torch.arange(pool_rank)[None, :] < torch.tensor(ranks)[:, None]  # [slots, R]
    A = torch.where(live.repeat(1, slices)[:, None, :, None], A, 0)
    B = torch.where(live[:, None, None, :], B, 0)
    return A, B


def _lora_pools(ranks, experts, outer, pool_rank, hidden, inter, slices, gen):  # type: ignore[no-untyped-def]
    """float32 (A_gu, B_gu, A_d, B_d) pools with dead ranks zero; `outer` experts on the
    shared-outer sides (gate_up's A, down's B): 1 for a shared-outer adapter."""
    a_gu, b_gu = _zero_dead_ranks(
        _pool(ranks, outer, slices * pool_rank, hidden, torch.float32, gen),
        _pool(ranks, experts, slices * inter, pool_rank, torch.float32, gen),
        ranks, pool_rank, slices,
    )  # fmt: skip
    a_d, b_d = _zero_dead_ranks(
        _pool(ranks, experts, pool_rank, inter, torch.float32, gen),
        _pool(ranks, outer, hidden, pool_rank, torch.float32, gen),
        ranks, pool_rank, 1,
    )  # fmt: skip
    return a_gu, b_gu, a_d, b_d


def _case(popularity, dtype, seed, *, pool_rank=16, gated=True, shared_outer=False):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    ranks = mixed_ranks(SLOTS, pool_rank, gen)
    ranks[-1] = 0  # an adapter that does not target the routed experts
    slots = popular_slots(popularity, TOKENS, SLOTS, gen)
    if popularity == "distinct":  # unsorted tokens: the walk must not rely on the order
        slots = [slots[i] for i in torch.randperm(TOKENS, generator=gen).tolist()]
    segs = (build_lora_segments(slots, ranks), build_lora_segments(slots, ranks, device=DEVICE))
    ids, _ = routing(TOKENS, EXPERTS, TOP_K, "uniform", seed=seed)
    slices = 2 if gated else 1
    outer = 1 if shared_outer else EXPERTS
    a_gu, b_gu, a_d, b_d = _lora_pools(
        ranks, EXPERTS, outer, pool_rank, HIDDEN, INTER, slices, gen
    )  # fmt: skip
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    weights = {"A_gu": a_gu, "B_gu": b_gu, "A_d": a_d, "B_d": b_d, "x": x}
    return segs, ids, slices, {k: v.to(dtype) for k, v in weights.items()}


def _to(device, *tensors):  # type: ignore[no-untyped-def]
    return [t.to(device) for t in tensors]


def _experts(n, k, dtype, seed, quant):  # type: ignore[no-untyped-def]
    """(weight, scale, block, scheme) of [E, n, k] experts: bf16/fp32/fp16 ("float"), FP8
    block-scaled ("fp8"), or the integer schemes of test_quant_moe."""
    if quant in ("float", "fp8"):
        block = (16, 32) if quant == "fp8" else None
        w, scale = make_experts(EXPERTS, n, k, dtype, seed, block)
        return w, scale, block, None
    g = torch.Generator().manual_seed(seed)
    w, scale, block = quantize_experts(torch.randn(EXPERTS, n, k, generator=g) * 0.2, quant, 32)
    return w, scale, block, quant


def _check(both_segs, ids, slices, t, dtype, *, quant="float", block_m=16, tiles=None, lora_t=None):  # type: ignore[no-untyped-def]
    """Triton GEMM with the epilogue vs float32 base GEMM + the separate LoRA reference;
    `lora_t`: other LoRA weights for the Triton side only (dead ranks poisoned)."""
    lora_t = t if lora_t is None else lora_t
    segs, dev_segs = both_segs
    num_pairs = ids.numel()
    pair_token = (torch.arange(num_pairs) // TOP_K).int()
    pair_expert = ids.flatten().int()
    w13, s13, b13, scheme = _experts(slices * INTER, HIDDEN, dtype, 3, quant)
    w2, s2, b2, _ = _experts(HIDDEN, INTER, dtype, 4, quant)
    align_ref = fm.moe_align_ref(ids, EXPERTS, block_m)
    f32 = {k: v.float() for k, v in t.items()}

    base_gu = fm.grouped_gemm_ref(f32["x"], w13, align_ref, TOP_K, s13, b13, scheme)
    want_gu = moe_lora_gate_up_ref(
        f32["x"], base_gu, f32["A_gu"], f32["B_gu"], pair_token, pair_expert, segs
    )
    act = fm.silu_mul_ref(want_gu) if slices == 2 else torch.nn.functional.silu(want_gu)
    act = act.to(dtype)
    base_d = fm.grouped_gemm_ref(act.float(), w2, align_ref, 1, s2, b2, scheme)
    want_d = moe_lora_down_ref(
        act.float(), base_d, f32["A_d"], f32["B_d"], pair_token, pair_expert, segs
    )

    pt, pe, x, act_d = _to(DEVICE, pair_token, pair_expert, t["x"], act)
    align = fm.moe_align(ids.to(DEVICE), EXPERTS, block_m)

    def fused(a, lora_a, lora_b, w, scale, block, rows_per_a):  # type: ignore[no-untyped-def]
        lora = moe_lora_epilogue(
            a, *_to(DEVICE, lora_a, lora_b), pt, pe, dev_segs, x_per_pair=rows_per_a == 1,
            pair_order=align.sorted_pair_ids,
        )  # fmt: skip
        scale = None if scale is None else scale.to(DEVICE)
        return fm.grouped_gemm(
            a, w.to(DEVICE), align, rows_per_a, scale, block, scheme, tiles=tiles, lora=lora
        )

    got_gu = fused(x, lora_t["A_gu"], lora_t["B_gu"], w13, s13, b13, TOP_K)
    assert_close(got_gu.float().cpu(), want_gu, dtype)
    got_d = fused(act_d, lora_t["A_d"], lora_t["B_d"], w2, s2, b2, 1)
    assert_close(got_d.float().cpu(), want_d, dtype)


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_epilogue_matches_gemm_then_lora(popularity, dtype) -> None:  # type: ignore[no-untyped-def]
    segs, ids, slices, t = _case(popularity, dtype, seed=1)
    # 16-column tiles: tile [16, 32) straddles the gate | up boundary at 24.
    _check(segs, ids, slices, t, dtype, tiles=fm.GemmTiles(block_n=16, block_k=32))


@pytest.mark.parametrize("popularity", ["zipf", "skewed"])
def test_epilogue_never_uses_b_past_a_slot_rank(popularity) -> None:  # type: ignore[no-untyped-def]
    """NaN in every dead rank column of B (the pool keeps zeros there), the rank-0 slot's
    whole B included: the epilogue reads whole pool-rank rows of B, so it must zero the
    columns past each slot's rank before its MMA, never multiply them."""
    segs, ids, slices, t = _case(popularity, torch.float32, seed=7)
    ranks = segs[0].slot_rank
    poisoned = dict(t)
    for name in ("B_gu", "B_d"):
        dead = torch.arange(t[name].shape[3])[None, :] >= ranks[:, None]  # [slots, R]
        poisoned[name] = torch.where(dead[:, None, None, :], float("nan"), t[name])
    _check(segs, ids, slices, t, torch.float32, lora_t=poisoned)


@pytest.mark.parametrize(
    "gated,shared_outer",
    [(False, False), (True, True), (False, True)],
    ids=["non_gated", "shared_outer", "non_gated_shared_outer"],
)
def test_epilogue_layouts(gated, shared_outer) -> None:  # type: ignore[no-untyped-def]
    segs, ids, slices, t = _case("zipf", torch.float32, 2, gated=gated, shared_outer=shared_outer)
    _check(segs, ids, slices, t, torch.float32)


def test_epilogue_with_fp8_experts_and_prefill_tiles(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """FP8 block-scaled experts (the scale applied per K tile, then the LoRA term) and
    128-row tiles of the plan for GEMMs with the epilogue (`default_tiles(with_lora=True)`);
    a pool rank above the 64-wide rank tile walks two rank blocks."""
    default_tiles = fm.default_tiles
    plans = record_default_tiles(monkeypatch)
    segs, ids, slices, t = _case("skewed", torch.float32, 3, pool_rank=80)
    _check(segs, ids, slices, t, torch.float32, quant="fp8", block_m=128)
    with_lora = [default_tiles(128, "block", role, True) for role in fm.GEMM_ROLES]
    assert plans == with_lora and plans[0] != default_tiles(128, "block", "gate_up")


@pytest.mark.parametrize("quant", ["w8a8", "int4_group"])
def test_epilogue_with_integer_experts(quant) -> None:  # type: ignore[no-untyped-def]
    """The term is added after w8a8's int32 accumulator is scaled back to float, and after
    int4's in-register dequantisation: LoRA never sees the quant method."""
    segs, ids, slices, t = _case("distinct", torch.float32, 6)
    _check(segs, ids, slices, t, torch.float32, quant=quant)


def test_reference_epilogue_equals_the_reference_lora() -> None:
    """grouped_gemm_ref(lora=moe_lora_epilogue_ref(...)) is the CPU serving path."""
    (segs, _), ids, slices, t = _case("zipf", torch.float32, 4)
    pair_token = (torch.arange(ids.numel()) // TOP_K).int()
    pair_expert = ids.flatten().int()
    w13, _ = make_experts(EXPERTS, slices * INTER, HIDDEN, torch.float32, 3)
    align = fm.moe_align_ref(ids, EXPERTS, 16)
    base = fm.grouped_gemm_ref(t["x"], w13, align, TOP_K)
    weights = (t["A_gu"], t["B_gu"], pair_token, pair_expert, segs)
    want = moe_lora_gate_up_ref(t["x"], base.clone(), *weights)
    lora = moe_lora_epilogue_ref(
        t["x"], t["A_gu"], t["B_gu"], pair_token, pair_expert, segs, x_per_pair=False
    )
    got = fm.grouped_gemm_ref(t["x"], w13, align, TOP_K, lora=lora)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapters changed the output


def test_epilogue_that_does_not_fit_the_gemm_is_refused() -> None:
    (segs, _), ids, slices, t = _case("zipf", torch.float32, 5)
    pair_token = (torch.arange(ids.numel()) // TOP_K).int()
    lora = moe_lora_epilogue_ref(
        t["x"], t["A_gu"], t["B_gu"], pair_token, ids.flatten().int(), segs, x_per_pair=False
    )
    w2, _ = make_experts(EXPERTS, HIDDEN, INTER, torch.float32, 4)  # down: N = hidden ≠ 2·inter
    act = torch.randn(ids.numel(), INTER)
    with pytest.raises(ValueError, match="do not fit the GEMM output"):
        fm.grouped_gemm_ref(act, w2, fm.moe_align_ref(ids, EXPERTS, 16), 1, lora=lora)
    with pytest.raises(ValueError, match="one row per pair"):
        moe_lora_epilogue_ref(
            act[:-1], t["A_d"], t["B_d"], pair_token, ids.flatten().int(), segs, x_per_pair=True
        )


@pytest.mark.parametrize("block_m", [16, 32])
def test_sorted_row_slots_follow_pair_token_slot(block_m) -> None:  # type: ignore[no-untyped-def]
    """The slots the epilogue reads per tile: token_slot[pair_token[p]] of each sorted row,
    -1 for the alignment's padding, for padding pairs and for tokens without an adapter,
    then each tile's least slot, NO_KEY for a tile where no row has one."""
    gen = torch.Generator().manual_seed(11)
    tokens, experts, top_k = 37, 5, 2
    ids, _ = routing(tokens, experts, top_k, "skewed", seed=11)
    # expert 0 only takes tokens without an adapter: its tiles have no slot at all
    token_slot = torch.randint(0, 7, (tokens,), generator=gen, dtype=torch.int32)
    token_slot[(ids == 0).any(1)] = -1
    pair_token = (torch.arange(ids.numel()) // top_k).int()
    pair_token[-3:] = -1  # padding pairs of a captured step
    align = fm.moe_align(ids.to(DEVICE), experts, block_m)
    order = align.sorted_pair_ids.cpu().long()
    y, b = torch.zeros(ids.numel(), 16), torch.zeros(7, experts, 8, 16)  # not read here
    slot_rank = torch.full((7,), 16, dtype=torch.int32)
    lora = MoeLoraEpilogue(y, b, *_to(DEVICE, pair_token, token_slot, slot_rank))

    got = sorted_row_slots(align.sorted_pair_ids, block_m, lora).cpu()

    padded_token = torch.cat([pair_token, torch.tensor([-1], dtype=torch.int32)])  # [P + 1]
    want_rows = moe_lora._pair_slots(padded_token[order.clamp(max=ids.numel())], token_slot)
    tiles = want_rows.view(-1, block_m)
    want_first = torch.where(tiles >= 0, tiles, NO_KEY.value).amin(1)
    assert torch.equal(got[: order.numel()], want_rows.int())
    assert torch.equal(got[order.numel() :], want_first.int())
    assert (want_first == NO_KEY.value).any() and (want_first < NO_KEY.value).any()
    assert (want_rows == -1).any() and (want_rows >= 0).any()


class _NotLaunched:
    """Stands in for the per-key shrink kernel where a test must not reach it."""

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        raise AssertionError("the per-key shrink kernel ran instead of the joint-key one")


def _joint_always(keys: int) -> dict[int, tuple[tuple[float, int], ...]]:
    """SHRINK_KEYS_FROM_ROWS that takes `keys` keys in one loop at every step."""
    return {1: ((0.0, keys),), 2: ((0.0, keys),)}


def _joint_shrink_cases(a_gu, b_gu, a_d, b_d, x, act):  # type: ignore[no-untyped-def]
    """gate_up (x per token, stacked slices) and down (act per pair) shrink arguments."""
    return ((x, a_gu, b_gu, False), (act, a_d, b_d, True))


@pytest.mark.parametrize("keys", [2, 4])
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_joint_key_shrink_equals_the_reference(keys, popularity, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The shrink with a block's first `keys` keys in one K loop (forced for every step;
    the per-key kernel cannot stand in) gives the reference's y, ordered walk and plain pair
    order, blocks with more keys than `keys` (they span experts here), ranks below the pool
    rank and a rank-0 slot beside them, base-model tokens."""
    monkeypatch.setattr(moe_lora, "SHRINK_KEYS_FROM_ROWS", _joint_always(keys))
    monkeypatch.setattr(moe_lora, "_moe_lora_shrink_kernel", _NotLaunched())
    (segs, dev_segs), ids, _, t = _case(popularity, torch.float32, seed=11)
    pair_token = (torch.arange(ids.numel()) // TOP_K).int()
    pair_expert = ids.flatten().int()
    act = torch.randn(ids.numel(), INTER, generator=torch.Generator().manual_seed(12))
    order = fm.moe_align_ref(ids, EXPERTS, 16).sorted_pair_ids
    cases = _joint_shrink_cases(t["A_gu"], t["B_gu"], t["A_d"], t["B_d"], t["x"], act)
    for a, lora_a, lora_b, per_pair in cases:
        want = moe_lora_epilogue_ref(
            a, lora_a, lora_b, pair_token, pair_expert, segs, x_per_pair=per_pair
        ).y
        for pair_order in (order.to(DEVICE), None):
            got = moe_lora_epilogue(
                *_to(DEVICE, a, lora_a, lora_b, pair_token, pair_expert), dev_segs,
                x_per_pair=per_pair, pair_order=pair_order,
            ).y  # fmt: skip
            torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
        tokens = segs.token_slot[segs.token_slot >= 0].long()
        if bool((segs.slot_rank[tokens] > 0).any()):  # not all-base, not the rank-0 slot alone
            assert want.abs().max() > 0.1


def test_joint_keys_follow_the_rows_per_key() -> None:
    """A step's rows per (adapter, expert) key pick how many keys share a K loop: 16
    prompts of 512 tokens over 64 experts, top-6, are 48 rows a key (2 keys for gate_up's
    two stacked slices, a loop per key for down); 32 runs of 256 tokens 24 (4 keys); 6 rows
    a key walk a loop per key."""
    prompts = build_lora_segments([i // 512 for i in range(16 * 512)], [16] * 16)
    assert prompts.rows_per_key(16 * 512 * 6, 64) == pytest.approx(48.0)
    assert shrink_keys(prompts.rows_per_key(16 * 512 * 6, 64), slices=2) == 2
    assert shrink_keys(48.0, slices=1) == 1  # down: level at 48 rows, slower from 192
    assert shrink_keys(24.0, slices=2) == shrink_keys(24.0, slices=1) == 4
    assert shrink_keys(6.0, slices=2) == shrink_keys(6.0, slices=1) == 1
    assert shrink_keys(768.0, slices=2) == 2


# ---- GPU (bf16, compiled, V2-Lite expert shapes, prefill tiles) ----------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("fp8", [False, True])
def test_epilogue_bf16_gpu(popularity, fp8) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, top_k, pool_rank = 1100, 2048, 1408, 64, 6, 16
    ranks = mixed_ranks(8, pool_rank, gen)
    slots = popular_slots(popularity, tokens, 8, gen)
    segs = build_lora_segments(slots, ranks, device="cuda")
    scores = torch.rand(tokens, experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.cuda()
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    a_gu, b_gu = _zero_dead_ranks(
        _pool(ranks, experts, 2 * pool_rank, hidden, torch.float32, gen),
        _pool(ranks, experts, 2 * inter, pool_rank, torch.float32, gen),
        ranks, pool_rank, 2,
    )  # fmt: skip
    a_gu, b_gu = a_gu.to(**bf16), b_gu.to(**bf16)
    block = (128, 128) if fp8 else None
    w13, s13 = make_experts(experts, 2 * inter, hidden, torch.bfloat16, 3, block)
    w13, s13 = w13.cuda(), None if s13 is None else s13.cuda()
    x = torch.randn(tokens, hidden, generator=gen).to(**bf16)
    pair_token = (torch.arange(ids.numel(), device="cuda") // top_k).int()
    pair_expert = ids.flatten().int()
    block_m = fm.moe_block_m(ids.numel(), experts)
    assert block_m == 128  # the prefill tiles (256 or 128 columns: tiles straddle 1408)
    align = fm.moe_align(ids, experts, block_m)
    base = fm.grouped_gemm(x, w13, align, top_k, s13, block)
    want = moe_lora_gate_up_ref(
        x.float(), base.float(), a_gu.float(), b_gu.float(), pair_token, pair_expert, segs
    )
    lora = moe_lora_epilogue(
        x, a_gu, b_gu, pair_token, pair_expert, segs, x_per_pair=False,
        pair_order=align.sorted_pair_ids,
    )  # fmt: skip
    got = fm.grouped_gemm(x, w13, align, top_k, s13, block, lora=lora)
    assert_close(got.float(), want, torch.bfloat16)
    if popularity != "all_base":
        assert not torch.equal(got, base)


@pytest.mark.gpu
@pytest.mark.parametrize("keys", [1, 2, 4])
@pytest.mark.parametrize("adapters", [8, 32])
def test_joint_key_shrink_bf16_gpu(keys, adapters, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The compiled shrink with `keys` keys in one K loop at a prompt step's shapes (4096
    V2-Lite tokens, 96 or 24 rows a key: blocks of 1-3 keys, or up to ~6 and the rest in
    loops of their own) against the float32 reference of the same bf16 values."""
    monkeypatch.setattr(moe_lora, "SHRINK_KEYS_FROM_ROWS", _joint_always(keys))
    gen = torch.Generator().manual_seed(9)
    tokens, hidden, inter, experts, top_k, pool_rank = 4096, 2048, 1408, 64, 6, 16
    ranks = mixed_ranks(adapters, pool_rank, gen)
    segs = build_lora_segments(
        [t * adapters // tokens for t in range(tokens)], ranks, device="cuda"
    )
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.cuda()
    pair_token = (torch.arange(ids.numel(), device="cuda") // top_k).int()
    pair_expert = ids.flatten().int()
    order = fm.moe_align(ids, experts, fm.moe_block_m(ids.numel(), experts)).sorted_pair_ids
    pools = _lora_pools(ranks, experts, experts, pool_rank, hidden, inter, 2, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    act = torch.randn(ids.numel(), inter, generator=gen)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    cases = _joint_shrink_cases(*(w.to(**bf16) for w in (*pools, x, act)))
    for a, lora_a, lora_b, per_pair in cases:
        routed = (pair_token, pair_expert, segs)
        f32 = (a.float(), lora_a.float(), lora_b.float())  # the reference in float32
        want = moe_lora_epilogue_ref(*f32, *routed, x_per_pair=per_pair).y
        got = moe_lora_epilogue(
            a, lora_a, lora_b, *routed, x_per_pair=per_pair, pair_order=order
        ).y  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert want.abs().max() > 0.1
