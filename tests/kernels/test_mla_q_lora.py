"""q_b's LoRA expand with kv_b's absorbed query correction in one launch: the Triton kernel
vs the torch reference (the two separate references), and that reference vs the fp64 dense
deltas of both modules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.lora_segments import LoraSegmentsConfig, allocate_lora_segments, build_lora_segments
from kernels.mla_q_lora import (
    MAX_POOL_RANK,
    QueryLora,
    q_b_expand_kv_b_q,
    q_b_expand_kv_b_q_ref,
)
from tests.kernels.lora_cases import (
    POPULARITIES,
    assert_close,
    mixed_ranks,
    pool_A,
    pool_B,
    popular_slots,
)

# Tiny odd MLA: H heads, D = nope, P = rope, V = v_head_dim, C = kv_lora_rank.
DIMS = (3, 24, 8, 20, 40)
NUM_SLOTS = 5
# Slot 2's adapter does not target kv_b, slot 3's does not target q_b (rank 0 there).
NO_KV_B_SLOT, NO_Q_B_SLOT = 2, 3


def _case(popularity, num_tokens, pool_rank, dtype, seed, poison=0.0, dims=DIMS, device="cpu"):  # type: ignore[no-untyped-def]
    """(segs with q_b's ranks, y, qb_B, q, kv_A, kv_B, kv_rank, q_lat full of NaN)."""
    heads, nope, rope, v_dim, lat = dims
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    qb_ranks = mixed_ranks(NUM_SLOTS, pool_rank, gen)
    kv_ranks = mixed_ranks(NUM_SLOTS, pool_rank, gen)
    kv_ranks[NO_KV_B_SLOT], qb_ranks[NO_Q_B_SLOT] = 0, 0
    slots = popular_slots(popularity, num_tokens, NUM_SLOTS, gen)
    segs = build_lora_segments(slots, qb_ranks, device=device)
    y = torch.randn(num_tokens, pool_rank, generator=gen)
    qb_B = pool_B(qb_ranks, heads * (nope + rope), pool_rank, poison).to(dtype)
    kv_A = pool_A(kv_ranks, 1, pool_rank, lat, poison).to(dtype)
    kv_B = pool_B(kv_ranks, heads * (nope + v_dim), pool_rank, poison).to(dtype)
    q = torch.randn(num_tokens, heads * (nope + rope), generator=gen).to(dtype)
    kv_rank = torch.tensor(kv_ranks, dtype=torch.int32)
    q_lat = torch.full((num_tokens, heads, lat), float("nan"), dtype=dtype)
    tensors = (y, qb_B, q, kv_A, kv_B, kv_rank, q_lat)
    return (segs, *(t.to(device) for t in tensors))


def _expected(case, nope):  # type: ignore[no-untyped-def]
    """(q, q_lat) of the float32 reference on the case's values."""
    segs, y, qb_B, q, kv_A, kv_B, kv_rank, q_lat = case
    q, q_lat = q.float().clone(), torch.zeros_like(q_lat, dtype=torch.float32)
    lora = QueryLora(y, qb_B.float(), segs, kv_A.float(), kv_B.float(), kv_rank, nope)
    q_b_expand_kv_b_q_ref(q, q_lat, lora)
    return q, q_lat


def _run(case, nope):  # type: ignore[no-untyped-def]
    segs, y, qb_B, q, kv_A, kv_B, kv_rank, q_lat = case
    q, q_lat = q.clone(), q_lat.clone()
    q_b_expand_kv_b_q(q, q_lat, QueryLora(y, qb_B, segs, kv_A, kv_B, kv_rank, nope))
    return q, q_lat


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(popularity, dtype) -> None:  # type: ignore[no-untyped-def]
    """Both outputs; tokens without an adapter keep q bit for bit and get q_lat zeros (the
    buffer held NaN)."""
    case = _case(popularity, 21, 16, dtype, seed=1)
    got_q, got_lat = _run(case, DIMS[1])
    expected_q, expected_lat = _expected(case, DIMS[1])
    assert_close(got_q, expected_q, dtype)
    assert_close(got_lat, expected_lat, dtype)
    token_slot = case[0].token_slot[:21]
    for slot in (-1, NO_KV_B_SLOT):
        rows = token_slot == slot
        assert torch.equal(got_lat[rows].float(), torch.zeros_like(got_lat[rows].float()))
    base = token_slot == -1
    assert torch.equal(got_q[base], case[3][base])
    if popularity == "distinct":  # every slot's tokens present: both corrections act
        assert not torch.equal(got_q[token_slot == 1], case[3][token_slot == 1])
        assert got_lat[token_slot == NO_Q_B_SLOT].abs().sum() > 0


def test_never_reads_past_a_slot_rank() -> None:
    """Pool entries past each slot's rank (and the untargeted modules' whole slots) hold NaN."""
    case = _case("distinct", 23, 32, torch.float32, seed=2, poison=float("nan"))
    got_q, got_lat = _run(case, DIMS[1])
    assert torch.isfinite(got_q).all() and torch.isfinite(got_lat).all()
    expected_q, expected_lat = _expected(case, DIMS[1])
    assert_close(got_q, expected_q, torch.float32)
    assert_close(got_lat, expected_lat, torch.float32)


def test_long_segments_and_wide_latent() -> None:
    """40 tokens of one adapter span 3 segments; C=300 spans 3 latent blocks; rope 16."""
    dims = (2, 32, 16, 20, 300)
    case = _case("identical", 40, 16, torch.float32, seed=3, dims=dims)
    assert case[0].num_live_segments == 3
    for got, expected in zip(_run(case, dims[1]), _expected(case, dims[1]), strict=True):
        assert_close(got, expected, torch.float32)


def test_grid_sized_for_capacity_with_few_live_segments(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A CUDA-graph replay's view: the grid is planned for 40 segments of capacity while a
    few are live, and the interpreter's one SM makes each program walk several items."""
    case = _case("zipf", 9, 16, torch.float32, seed=4)
    big = allocate_lora_segments(LoraSegmentsConfig(max_tokens=40, num_slots=NUM_SLOTS), "cpu")
    segs = build_lora_segments(case[0].token_slot[:9].tolist(), case[0].slot_rank, out=big)
    monkeypatch.setattr(type(segs), "grid_segments", lambda self: self.max_segments)
    case = (segs, *case[1:])
    for got, expected in zip(_run(case, DIMS[1]), _expected(case, DIMS[1]), strict=True):
        assert_close(got, expected, torch.float32)


def test_reference_equals_dense_deltas_in_fp64() -> None:
    """q += y·B_qᵀ, then q_lat = q_nope · (B·A)_k per head, from dense per-token matrices."""
    heads, nope, rope, _, lat = DIMS
    case = _case("distinct", 11, 8, torch.float64, seed=5)
    segs, y, qb_B, q, kv_A, kv_B, kv_rank, _ = case
    got_q, got_lat = q.clone(), torch.full((11, heads, lat), 7.0, dtype=torch.float64)
    lora = QueryLora(y.double(), qb_B, segs, kv_A, kv_B, kv_rank, nope)
    q_b_expand_kv_b_q_ref(got_q, got_lat, lora)
    for t, slot in enumerate(segs.token_slot[:11].tolist()):
        want_q, want_lat = q[t].clone(), torch.zeros(heads, lat, dtype=torch.float64)
        if slot >= 0:
            rq, rk = int(segs.slot_rank[slot]), int(kv_rank[slot])
            want_q += qb_B[slot, :, :rq] @ y[t, :rq].double()
            delta_w = (kv_B[slot, :, :rk] @ kv_A[slot, :rk]).view(heads, -1, lat)
            q_nope = want_q.view(heads, nope + rope)[:, :nope]
            want_lat = torch.einsum("hd,hdc->hc", q_nope, delta_w[:, :nope])
        torch.testing.assert_close(got_q[t], want_q, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(got_lat[t], want_lat, atol=1e-12, rtol=1e-12)


def test_launcher_rejects_what_it_cannot_take() -> None:
    segs, y, qb_B, q, kv_A, kv_B, kv_rank, q_lat = _case("distinct", 4, 16, torch.float32, 6)
    lora = QueryLora(y, qb_B, segs, kv_A, kv_B, kv_rank, DIMS[1])
    with pytest.raises(ValueError, match="exceed"):
        wide = torch.zeros(NUM_SLOTS, qb_B.shape[1], MAX_POOL_RANK * 2)
        q_b_expand_kv_b_q(q, q_lat, replace(lora, qb_B=wide))
    with pytest.raises(ValueError, match="nope_dim"):
        q_b_expand_kv_b_q(q, q_lat, replace(lora, nope_dim=DIMS[1] + DIMS[2]))
    with pytest.raises(ValueError, match="y "):
        q_b_expand_kv_b_q(q, q_lat, replace(lora, y=y[:, :8]))
    with pytest.raises(ValueError, match="kv_rank"):
        q_b_expand_kv_b_q(q, q_lat, replace(lora, kv_rank=kv_rank.long()))
    with pytest.raises(ValueError, match="latent"):
        q_b_expand_kv_b_q(q, q_lat[:, :, :-1], lora)


# ---- GPU (bf16, compiled, DeepSeek-V3 head shapes) -----------------------------------------

V3_DIMS = (128, 128, 64, 128, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens,pool_rank", [(2, 16), (64, 16), (256, 64)])
def test_bf16_gpu(popularity, num_tokens, pool_rank) -> None:  # type: ignore[no-untyped-def]
    case = _case(popularity, num_tokens, pool_rank, torch.bfloat16, 7, dims=V3_DIMS, device="cuda")
    for got, expected in zip(_run(case, 128), _expected(case, 128), strict=True):
        assert_close(got, expected, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_replay_with_more_segments() -> None:
    """Captured with one segment, replayed with many: every row of q_lat is written (NaN
    before the replay), q gets each token's own adapter."""
    case = _case("distinct", 32, 16, torch.bfloat16, 8, dims=V3_DIMS, device="cuda")
    segs, y, qb_B, q0, kv_A, kv_B, kv_rank, q_lat = case
    big = allocate_lora_segments(LoraSegmentsConfig(32, NUM_SLOTS), "cuda")
    q = q0.clone()
    build_lora_segments([1] * 32, segs.slot_rank, out=big)
    lora = QueryLora(y, qb_B, big, kv_A, kv_B, kv_rank, 128)
    q_b_expand_kv_b_q(q, q_lat, lora)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_b_expand_kv_b_q(q, q_lat, lora)
    build_lora_segments(segs.token_slot[:32].tolist(), segs.slot_rank, out=big)
    assert big.num_live_segments > 1
    q.copy_(q0)
    q_lat.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected_q, expected_lat = _expected(case, 128)
    assert_close(q, expected_q, torch.bfloat16)
    assert_close(q_lat, expected_lat, torch.bfloat16)
