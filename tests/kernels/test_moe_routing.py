"""Expert selection in one launch (`kernels.moe_routing`) against its torch reference:
DeepSeek-V2-Lite (greedy), Kimi-K2 (noaux_tc, 384 experts, one group), DeepSeek-V3
(noaux_tc, 8 groups of 32) and a group-limited greedy router in power-of-two groups; which
routers the model sends to the kernel."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_routing
from kernels.moe_routing import kernel_selects, select_experts, select_experts_ref
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()

# (name, experts, top_k, method, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
ROUTERS = [
    ("v2_lite", 64, 6, "greedy", 1, 1, False, 1.0),
    ("v3_without_groups", 256, 8, "noaux_tc", 1, 1, True, 2.5),
    ("v3", 256, 8, "noaux_tc", 8, 4, True, 2.5),
    ("group_limited_greedy", 64, 6, "group_limited_greedy", 8, 3, False, 16.0),
    ("kimi_k2", 384, 8, "noaux_tc", 1, 1, True, 2.827),
    ("greedy_normalised", 16, 3, "greedy", 1, 1, True, 1.0),
    ("one_expert", 8, 1, "greedy", 1, 1, True, 0.5),
]


def _case(experts: int, tokens: int, noaux: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.1 if noaux else None
    return logits, bias


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("tokens", [0, 1, 37])
@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_select_experts_matches_ref(router, tokens):
    """The same experts per token (as a set: the order is not part of the result) and the
    same weights up to float32 rounding (the softmax and the sums run in another order)."""
    _, experts, top_k, method, n_group, topk_group, norm, scaling = router
    logits, bias = _case(experts, tokens, method == "noaux_tc", seed=experts + tokens)
    args = (top_k, method, n_group, topk_group, norm, scaling)
    weights, ids = select_experts(
        logits.to(DEVICE), *args, None if bias is None else bias.to(DEVICE)
    )
    assert weights.shape == ids.shape == (tokens, top_k) and ids.dtype == torch.int64
    want_w, want_ids = _sorted_by_id(*select_experts_ref(logits, *args, bias))
    got_w, got_ids = _sorted_by_id(weights.cpu(), ids.cpu())
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    if tokens and norm and (top_k > 1 or method == "noaux_tc"):
        torch.testing.assert_close(
            got_w.sum(-1),
            torch.full((tokens,), scaling if method == "noaux_tc" else 1.0),
            atol=1e-5,
            rtol=1e-5,
        )


def test_groups_limit_the_choice():
    """A token whose best single expert sits in a group that loses on its two best:
    noaux_tc picks only from the kept groups (a plain top-k would not)."""
    experts, n_group = 16, 4  # groups of 4
    logits = torch.full((1, experts), -4.0)
    logits[0, 0] = 6.0  # group 0: one strong expert (top-2 sum ~1.0)
    logits[0, 4:6] = 2.0  # group 1: two good ones (top-2 sum ~1.76)
    logits[0, 8:10] = 1.5  # group 2: two fair ones (~1.64)
    bias = torch.zeros(experts)
    _, ids = select_experts_ref(logits, 2, "noaux_tc", n_group, 2, True, 1.0, bias)
    assert sorted(ids[0].tolist()) == [4, 5]
    _, kernel_ids = select_experts(
        logits.to(DEVICE), 2, "noaux_tc", n_group, 2, True, 1.0, bias.to(DEVICE)
    )
    assert sorted(kernel_ids[0].tolist()) == [4, 5]
    _, greedy = select_experts_ref(logits, 2, "noaux_tc", 1, 1, True, 1.0, bias)
    assert 0 in greedy[0].tolist(), "without groups expert 0 is picked"


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unknown routing method"):
        select_experts(logits, 2, "topk")
    with pytest.raises(ValueError, match="correction bias"):
        select_experts(logits, 2, "noaux_tc")
    with pytest.raises(ValueError, match="float32"):
        select_experts(logits.half(), 2, "greedy")
    wide = torch.zeros(2, 160, device=DEVICE)  # DeepSeek-V2: 8 groups of 20
    with pytest.raises(ValueError, match="power-of-two groups"):
        select_experts(wide, 6, "group_limited_greedy", 8, 3)


def test_which_routers_the_model_sends_to_the_kernel(monkeypatch):
    """Routers without groups always; grouped ones while GROUPED_IN_KERNEL is set (the bench
    patch "grouped_selection" clears it), and only in power-of-two groups."""
    assert kernel_selects("greedy", 64, 1) and kernel_selects("noaux_tc", 384, 1)
    assert kernel_selects("noaux_tc", 256, 8)
    assert not kernel_selects("group_limited_greedy", 160, 8)
    monkeypatch.setattr(moe_routing, "GROUPED_IN_KERNEL", False)
    assert not kernel_selects("noaux_tc", 256, 8)
    assert kernel_selects("greedy", 64, 1)


def _nan_rows_case(experts: int, noaux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """5 tokens: rows 1 and 3 all NaN, row 2 one NaN score, rows 0 and 4 finite."""
    logits, bias = _case(experts, 5, noaux, seed=experts)
    logits[1] = logits[3] = float("nan")
    logits[2, experts // 2] = float("nan")
    return logits, bias


def _check_nan_rows(router, device: str) -> None:
    """Every row gets distinct expert ids in [0, E); the finite rows the reference's."""
    _, experts, top_k, method, n_group, topk_group, norm, scaling = router
    logits, bias = _nan_rows_case(experts, method == "noaux_tc")
    args = (top_k, method, n_group, topk_group, norm, scaling)
    _, ids = select_experts(logits.to(device), *args, None if bias is None else bias.to(device))
    ids = ids.cpu()
    assert bool(((ids >= 0) & (ids < experts)).all()), ids
    assert all(len(set(row.tolist())) == top_k for row in ids), ids
    finite = torch.tensor([0, 4])
    want_ids = select_experts_ref(logits[finite], *args, bias)[1]
    assert torch.equal(ids[finite].sort(-1).values, want_ids.sort(-1).values)


@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_rows_of_nan_scores_get_expert_ids_in_range(router):
    """A NaN row must not index past the experts: the ids feed the alignment's counts and
    the grouped GEMM's weight reads. (The interpreter's argmax ranks NaN first by itself;
    the compiled reduction does not, which the GPU twin below checks.)"""
    _check_nan_rows(router, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_rows_of_nan_scores_get_expert_ids_in_range_on_gpu(router):
    _check_nan_rows(router, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_select_experts_on_gpu(router, tokens):
    """The compiled kernel on CUDA against the CPU reference."""
    _, experts, top_k, method, n_group, topk_group, norm, scaling = router
    logits, bias = _case(experts, tokens, method == "noaux_tc", seed=tokens)
    args = (top_k, method, n_group, topk_group, norm, scaling)
    weights, ids = select_experts(logits.cuda(), *args, None if bias is None else bias.cuda())
    want_w, want_ids = _sorted_by_id(*select_experts_ref(logits, *args, bias))
    got_w, got_ids = _sorted_by_id(weights.cpu(), ids.cpu())
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
