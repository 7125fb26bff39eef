"""Varlen MLA prefill attention against its per-sequence torch reference.

CPU: the Triton kernel under the interpreter in fp32/fp16; GPU (`-m gpu`): bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels import mla_prefill as mp
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def group_inputs(query_lens, context_lens, heads, nope, rope, v_dim, dtype, seed, decodes=0):
    """Inputs of one group of prefill sequences that follows `decodes` decode rows, with
    k/v as strided views of one expanded tensor (as the model passes them)."""
    g = torch.Generator().manual_seed(seed)
    rows = decodes + sum(query_lens)
    q = torch.randn(rows, heads, nope + rope, generator=g).to(dtype)
    q_nope, q_rope = q.split([nope, rope], dim=-1)
    keys = sum(context_lens)
    kv = torch.randn(keys, heads, nope + v_dim, generator=g).to(dtype)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    latent_rows = torch.randn(keys, 24 + rope, generator=g).to(dtype)
    k_rope = latent_rows[:, 24:]  # the rope columns of the gathered cache rows
    # Decode sequences (1 token, no context rows here) come first in the batch.
    query_start = torch.tensor([0, *range(1, decodes + 1)], dtype=torch.int32)
    query_start = torch.cat([query_start, decodes + torch.tensor(query_lens).cumsum(0)])
    context_start = torch.tensor([0] * (decodes + 1) + list(context_lens)).cumsum(0)
    all_contexts = torch.tensor([5] * decodes + list(context_lens), dtype=torch.int32)
    tensors = [t.to(DEVICE) for t in (q_nope, q_rope, k_nope, k_rope, v)]
    meta = [
        query_start.to(torch.int32).to(DEVICE),
        context_start.to(torch.int32).to(DEVICE),
        all_contexts.to(DEVICE),
    ]
    return tensors, meta, rows


# (query lens, context lens, heads, nope, rope, v): contexts ≥ queries (cached prefixes).
CASES = [
    ([7], [7], 2, 16, 16, 16),
    ([1, 70, 3], [9, 70, 3], 3, 12, 8, 10),  # odd head dims, a 1-token chunk on a prefix
    ([130, 64], [200, 64], 2, 32, 16, 24),  # several query blocks, chunked prefill offset
    ([65], [65], 1, 128, 64, 128),  # the DeepSeek head dims, one row past a block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("decodes", [0, 3])
def test_varlen_prefill_matches_ref(case, dtype, decodes) -> None:  # type: ignore[no-untyped-def]
    check_against_ref(case, dtype, decodes)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [([512] * 16, [512] * 16, 16, 128, 64, 128)])
def test_varlen_prefill_bf16_gpu(case) -> None:  # type: ignore[no-untyped-def]
    check_against_ref(case, torch.bfloat16, decodes=5)


def check_against_ref(case, dtype, decodes) -> None:  # type: ignore[no-untyped-def]
    query_lens, context_lens, heads, nope, rope, v_dim = case
    (q_nope, q_rope, k_nope, k_rope, v), meta, rows = group_inputs(
        query_lens,
        context_lens,
        heads,
        nope,
        rope,
        v_dim,
        dtype,
        seed=len(query_lens),
        decodes=decodes,
    )
    first, end = decodes, decodes + len(query_lens)
    scale = (nope + rope) ** -0.5
    ours = torch.full((rows, heads, v_dim), 7.0, dtype=dtype, device=DEVICE)
    ref = ours.clone()
    args = (q_nope, q_rope, k_nope, k_rope, v)
    mp.mla_prefill_varlen(*args, ours, *meta, first, end, scale, max_query_len=max(query_lens))
    mp.mla_prefill_varlen_ref(*args, ref, *meta, first, end, scale, max_query_len=max(query_lens))
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol)
    # The decode rows before the group are not the kernel's to write.
    assert bool((ours[:decodes] == 7.0).all())


def test_group_offsets_select_the_right_keys() -> None:
    """A second group's sequences read their keys relative to that group's first row:
    running the groups separately equals one group holding all of them."""
    case = ([5, 9, 4], [5, 12, 4], 2, 16, 16, 16)
    (q_nope, q_rope, k_nope, k_rope, v), (q_start, k_start, contexts), rows = group_inputs(
        *case, torch.float32, seed=4
    )
    scale = 0.25
    whole = torch.zeros(rows, 2, 16, device=DEVICE)
    args = (q_nope, q_rope, k_nope, k_rope, v)
    mp.mla_prefill_varlen(*args, whole, q_start, k_start, contexts, 0, 3, scale, max_query_len=9)
    split = torch.zeros_like(whole)
    mp.mla_prefill_varlen(*args, split, q_start, k_start, contexts, 0, 1, scale, max_query_len=5)
    tail = (q_nope, q_rope, k_nope[5:], k_rope[5:], v[5:])
    mp.mla_prefill_varlen(*tail, split, q_start, k_start, contexts, 1, 3, scale, max_query_len=9)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)


def test_varlen_prefill_is_causal() -> None:
    """Changing a later key/value must not change earlier queries' outputs."""
    case = ([6], [6], 2, 16, 16, 16)
    (q_nope, q_rope, k_nope, k_rope, v), meta, rows = group_inputs(*case, torch.float32, seed=2)
    before = torch.zeros(rows, 2, 16, device=DEVICE)
    mp.mla_prefill_varlen(
        q_nope, q_rope, k_nope, k_rope, v, before, *meta, 0, 1, 0.3, max_query_len=6
    )
    k_nope[4:], v[4:] = 0.0, 5.0
    after = torch.zeros_like(before)
    mp.mla_prefill_varlen(
        q_nope, q_rope, k_nope, k_rope, v, after, *meta, 0, 1, 0.3, max_query_len=6
    )
    torch.testing.assert_close(before[:4], after[:4])
    assert not torch.allclose(before[4:], after[4:])


def test_ref_refuses_a_query_longer_than_the_grid() -> None:
    (q_nope, q_rope, k_nope, k_rope, v), meta, rows = group_inputs(
        [3, 8], [3, 8], 1, 16, 16, 16, torch.float32, seed=5
    )
    out = torch.zeros(rows, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sequence 1 has 8 query rows > 7"):
        mp.mla_prefill_varlen_ref(
            q_nope, q_rope, k_nope, k_rope, v, out, *meta, 0, 2, 0.3, max_query_len=7
        )


def test_ref_query_chunks_give_the_same_rows(monkeypatch) -> None:
    """The reference bounds its score matrix by running long queries in chunks."""
    case = ([70, 3], [200, 3], 2, 16, 16, 16)
    (q_nope, q_rope, k_nope, k_rope, v), meta, rows = group_inputs(*case, torch.float32, seed=6)
    args = (q_nope, q_rope, k_nope, k_rope, v)
    whole = torch.zeros(rows, 2, 16, device=DEVICE)
    mp.mla_prefill_varlen_ref(*args, whole, *meta, 0, 2, 0.3, max_query_len=70)
    monkeypatch.setattr(mp, "REF_QUERY_CHUNK", 16)
    chunked = torch.zeros_like(whole)
    mp.mla_prefill_varlen_ref(*args, chunked, *meta, 0, 2, 0.3, max_query_len=70)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
