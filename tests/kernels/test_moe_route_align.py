"""Selection and alignment in one launch (`kernels.moe_route_align`) equal the two launches
it replaces, `select_experts` then `moe_align`, exactly: for every router of the selection
tests, at 1 token and at the most tokens one program selects for; and it refuses more."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe as fm
from kernels.moe_route_align import select_and_align, select_and_align_fits
from kernels.moe_routing import select_experts, selection_rows_per_program
from tests.fixtures.triton_interpret import kernel_device
from tests.kernels.test_moe_routing import ROUTERS, _case

DEVICE = kernel_device()
ALIGN_FIELDS = ("sorted_pair_ids", "block_expert_ids", "expert_offsets", "expert_counts")


def _assert_equals_the_two_launches(router, tokens: int, block_m: int, device: str) -> None:
    _, experts, top_k, method, n_group, topk_group, norm, scaling = router
    logits, bias = _case(experts, tokens, method == "noaux_tc", seed=3 * experts + tokens)
    logits, bias = logits.to(device), None if bias is None else bias.to(device)
    args = (top_k, method, n_group, topk_group, norm, scaling, bias)
    want_w, want_ids = select_experts(logits, *args)
    want_align = fm.moe_align(want_ids, experts, block_m)
    weights, ids, align = select_and_align(logits, *args, block_m)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_w)
    for field in ALIGN_FIELDS:
        assert torch.equal(getattr(align, field), getattr(want_align, field)), field
    assert (align.block_m, align.num_pairs) == (block_m, tokens * top_k)


@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_equals_selection_then_alignment(router) -> None:
    experts = router[1]
    for tokens, block_m in ((1, 16), (selection_rows_per_program(experts), 32)):
        _assert_equals_the_two_launches(router, tokens, block_m, DEVICE)


def test_what_one_program_cannot_do_is_refused() -> None:
    assert select_and_align_fits(16, 64, 6, 1)
    assert not select_and_align_fits(17, 64, 6, 1)  # selection rows of one program
    assert not select_and_align_fits(0, 64, 6, 1)
    assert select_and_align_fits(16, 256, 8, 8)
    assert not select_and_align_fits(1, 160, 6, 8)  # groups that are not powers of two
    logits = torch.zeros(17, 64, device=DEVICE)
    with pytest.raises(ValueError, match="more than one program"):
        select_and_align(logits, 6, "greedy", 1, 1, False, 1.0, None, 16)
    with pytest.raises(ValueError, match="float32"):
        select_and_align(logits[:2].half(), 6, "greedy", 1, 1, False, 1.0, None, 16)
    with pytest.raises(ValueError, match="correction bias"):
        select_and_align(logits[:2], 6, "noaux_tc", 1, 1, False, 1.0, None, 16)
    with pytest.raises(ValueError, match="unknown routing method"):
        select_and_align(logits[:2], 6, "topk", 1, 1, False, 1.0, None, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("router", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_equals_selection_then_alignment_on_gpu(router) -> None:
    experts = router[1]
    for tokens, block_m in ((1, 16), (selection_rows_per_program(experts), 16)):
        _assert_equals_the_two_launches(router, tokens, block_m, "cuda")
